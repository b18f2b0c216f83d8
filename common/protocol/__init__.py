"""The wire protocol: every message a MServe process can receive, grouped by the link it travels on.

* `core`: MsgType, which endpoint accepts which types, `validate()`, `body()`, ErrorCode.
* `to_worker`: typed bodies the coordinator sends workers (ENCODE, PREFILL, DECODE, RUN, CANCEL).
* `to_coordinator`: typed bodies workers send the coordinator (READY, HEARTBEAT, ENCODED,
  PREFILLED, STEP_TOKENS, FAILED, BYE).
* The client link (GENERATE / ABORT / STATUS and their replies) is checked by pydantic at the
  edge (coordinator/admission.py) and assembled by coordinator/client_core.py.
"""

from mserve.common.protocol.core import (CLIENT_TO_COORDINATOR, COORDINATOR_TO_CLIENT, COORDINATOR_TO_WORKER, REQUIRED,
                                         ROLE_ACCEPTS, ROLES, WORKER_TO_COORDINATOR, ErrorCode, MsgType, ProtocolError,
                                         body, validate)

__all__ = ["CLIENT_TO_COORDINATOR", "COORDINATOR_TO_CLIENT", "COORDINATOR_TO_WORKER", "REQUIRED", "ROLE_ACCEPTS", "ROLES",
           "WORKER_TO_COORDINATOR", "ErrorCode", "MsgType", "ProtocolError", "body", "validate"]
