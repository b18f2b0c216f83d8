"""The wire protocol: every message a MServe process can receive, grouped by the link it travels on.

* `core`: MsgType, which role accepts which types, `body()`, ErrorCode.
* `typed`: the Message base every body is, and `parse_message()`, which a socket calls once per message.
* `client`: client <-> coordinator (GENERATE, ABORT, STATUS; TOKENS, RESULT, ERROR, STATUS_REPLY),
  and the TOKENS a decode worker sends a client itself; `Sampling`, the one shape of sampling parameters.
* `to_worker`: typed bodies the coordinator sends workers (ENCODE, PREFILL, DECODE, RUN, CANCEL, ...),
  and the prefill -> decode hand-off state.
* `to_coordinator`: typed bodies workers send the coordinator (READY, HEARTBEAT, ENCODED,
  PREFILLED, STEP_TOKENS, FAILED, BYE).
"""

from mserve.common.protocol.core import LATENCY_CLASSES, ROLE_ACCEPTS, ROLES, ErrorCode, MsgType, ProtocolError, body
from mserve.common.protocol.typed import Message, check_header, parse_message

__all__ = ["LATENCY_CLASSES", "ROLE_ACCEPTS", "ROLES", "ErrorCode", "Message", "MsgType", "ProtocolError", "body",
           "check_header", "parse_message"]
