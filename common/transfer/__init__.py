"""Tensor transfer between worker processes: the engine, its typed descriptor and its handles.

``TransferEngine`` (engine.py) publishes and fetches; ``Descriptor`` (descriptor.py) is what a
receiver needs, carried over the control plane as ``to_wire()``. The sender half lives in
server.py, the receiver half in fetch.py, the byte movers in backends.py, shm_pool.py,
shm_mappings.py, torch_pairs.py and channel.py.
"""

from mserve.common.transfer.descriptor import BACKENDS, Descriptor, TransferError
from mserve.common.transfer.engine import DEFAULT_TTL_S, TransferEngine
from mserve.common.transfer.handles import Allocation, FetchedView

__all__ = [
    "TransferEngine", "TransferError", "Descriptor", "FetchedView", "Allocation", "BACKENDS",
    "DEFAULT_TTL_S",
]
