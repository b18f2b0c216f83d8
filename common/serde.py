"""Wire codec: turns (message type, msgpack body with tensors) into ZeroMQ frames and back.

Frame layout of every message::

    frame 0   one byte, the message type (an int 0..255; the IntEnum lives in mserve.common.protocol)
    frame 1   msgpack body
    frame 2+  raw bytes of the tensors referenced from the body, one frame per tensor

A tensor in the body is a msgpack ext value. Large tensors are ``ext(1, [dtype, shape, frame])``
and their bytes travel out of band (zero-copy with ``send_multipart(frames, copy=False)``);
tensors of at most ``INLINE_MAX_BYTES`` are ``ext(2, [dtype, shape, raw])`` inside the body,
because a separate zmq frame costs more than copying a few bytes.

No pickle: decoding only ever builds plain containers and tensors from a fixed dtype table,
so a hostile or corrupted message can raise ``WireError`` but cannot run code.

Buffer lifetimes and copies (integrators: read this):
* ``encode`` does not copy a tensor that is already contiguous and on the CPU: its frame is a
  memoryview over the tensor's storage. ZeroMQ transmits asynchronously after ``send`` returns,
  so do not modify such a tensor in place after sending it (send a ``.clone()`` if you must,
  or send with ``track=True`` and wait on the tracker). Non-contiguous tensors are copied once
  by ``.contiguous()``; CUDA tensors are copied to host by ``.cpu()``.
* ``decode`` does not copy a tensor whose frame is writable (``zmq.Frame`` from
  ``recv_multipart(copy=False)``, ``bytearray``, writable memoryview): the tensor aliases the
  frame and keeps it alive. Read-only frames (``bytes``) and inline tensors are copied into a
  ``bytearray`` first. We copy rather than silence torch's "non-writable buffer" warning because
  a writable tensor over immutable ``bytes`` would let an in-place op corrupt a Python object.
  Buffers whose address is not a multiple of the element size are copied too, so kernels never
  see misaligned data.
* Decoded tensors are always on the CPU.

torch is imported lazily, the first time a tensor is decoded (or the dtype tables are read):
a process that only exchanges plain bodies (the client) never loads it. Encoding recognises
tensors through ``sys.modules``: if torch was never imported, no value can be a tensor.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import msgpack

if TYPE_CHECKING:
    import torch

__all__ = [
    "SCHEMA_VERSION",
    "INLINE_MAX_BYTES",
    "WireError",
    "encode",
    "decode",
    "tensor_nbytes",
]

SCHEMA_VERSION = 1

# Tensors up to this many bytes are inlined in the msgpack body instead of getting a frame.
INLINE_MAX_BYTES = 256

_EXT_TENSOR_FRAME = 1
_EXT_TENSOR_INLINE = 2
_FIRST_TENSOR_FRAME = 2

# The only dtypes a peer may name (each is the torch attribute of that name). A closed table is
# what keeps decoding free of code execution.
_WIRE_DTYPES = ("float64", "float32", "float16", "bfloat16", "int64", "int32", "int16", "int8", "uint8", "bool")
_tables: tuple[dict[str, torch.dtype], dict[torch.dtype, str]] | None = None


def _dtype_tables() -> tuple[dict[str, torch.dtype], dict[torch.dtype, str]]:
    """(DTYPES, DTYPE_NAMES), built on first use; this is where serde imports torch."""
    global _tables
    if _tables is None:
        import torch

        dtypes = {name: getattr(torch, name) for name in _WIRE_DTYPES}
        _tables = dtypes, {v: k for k, v in dtypes.items()}
    return _tables


def __getattr__(name: str) -> Any:
    # DTYPES (name -> torch.dtype) and DTYPE_NAMES (the reverse) are module attributes built lazily.
    if name == "DTYPES":
        return _dtype_tables()[0]
    if name == "DTYPE_NAMES":
        return _dtype_tables()[1]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


class WireError(ValueError):
    """A received message is malformed; the peer or the transport is at fault, not the caller."""


def tensor_nbytes(t: torch.Tensor) -> int:
    """Bytes the tensor's data occupies on the wire (numel * element size)."""
    return t.numel() * t.element_size()


# --------------------------------------------------------------------------- encode


def _tensor_bytes(t: torch.Tensor) -> memoryview:
    """A flat byte view of ``t``'s data, sharing memory with ``t`` whenever possible."""
    import torch

    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    # reshape(-1) also turns a 0-dim tensor into 1-D, which view(uint8) requires; viewing as
    # uint8 is what lets bfloat16 (unknown to numpy) go through .numpy().
    flat = t.contiguous().reshape(-1).view(torch.uint8)
    return memoryview(flat.numpy())


def encode(msg_type: int, body: Any) -> list[bytes | memoryview]:
    """Serialize one message into frames ``[type_byte, msgpack_body, *tensor_buffers]``.

    Raises ValueError if ``msg_type`` is not in 0..255 and TypeError for values msgpack cannot
    represent (sets, arbitrary objects, unsupported tensor dtypes).
    """
    if isinstance(msg_type, bool) or not isinstance(msg_type, int) or not 0 <= msg_type <= 255:
        raise ValueError(f"msg_type must be an int in 0..255, got {msg_type!r}")
    buffers: list[memoryview] = []

    def default(obj: Any) -> msgpack.ExtType:
        torch = sys.modules.get("torch")
        if torch is None or not isinstance(obj, torch.Tensor):
            raise TypeError(f"cannot serialize object of type {type(obj).__name__}")
        name = _dtype_tables()[1].get(obj.dtype)
        if name is None:
            raise TypeError(f"unsupported tensor dtype {obj.dtype}")
        shape = list(obj.shape)
        data = _tensor_bytes(obj)
        if data.nbytes <= INLINE_MAX_BYTES:
            return msgpack.ExtType(_EXT_TENSOR_INLINE, msgpack.packb([name, shape, data.tobytes()]))
        buffers.append(data)
        index = _FIRST_TENSOR_FRAME + len(buffers) - 1
        return msgpack.ExtType(_EXT_TENSOR_FRAME, msgpack.packb([name, shape, index]))

    packed = msgpack.packb(body, default=default, use_bin_type=True)
    return [bytes((msg_type,)), packed, *buffers]


# --------------------------------------------------------------------------- decode


def _as_bytes_view(frame: Any, what: str) -> memoryview:
    try:
        mv = memoryview(frame)
    except TypeError as exc:
        raise WireError(f"{what} is {type(frame).__name__}, not a bytes-like object") from exc
    if mv.ndim != 1 or mv.format != "B":
        try:
            mv = mv.cast("B")
        except (TypeError, ValueError) as exc:
            raise WireError(f"{what} is not a contiguous byte buffer") from exc
    return mv


def _parse_header(data: bytes, with_index: bool) -> tuple[torch.dtype, list[int], Any]:
    """Validate the ``[dtype, shape, frame_index | raw]`` triple of a tensor ext value."""
    try:
        header = msgpack.unpackb(data, raw=False, use_list=True, strict_map_key=True)
    except Exception as exc:  # msgpack raises a zoo of types on garbage; all mean the same
        raise WireError(f"corrupt tensor header: {exc}") from exc
    if not isinstance(header, list) or len(header) != 3:
        raise WireError("tensor header must be [dtype, shape, frame|data]")
    name, shape, last = header
    if not isinstance(name, str) or name not in _WIRE_DTYPES:
        raise WireError(f"unknown tensor dtype {name!r}")
    if not isinstance(shape, list) or not all(
        isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape
    ):
        raise WireError(f"tensor shape must be a list of non-negative ints, got {shape!r}")
    if with_index:
        if isinstance(last, bool) or not isinstance(last, int):
            raise WireError(f"tensor frame index must be an int, got {last!r}")
    elif not isinstance(last, bytes):
        raise WireError("inline tensor data must be bytes")
    return _dtype_tables()[0][name], shape, last


def _build_tensor(buf: memoryview, dtype: torch.dtype, shape: list[int]) -> torch.Tensor:
    import torch

    itemsize = torch.empty((), dtype=dtype).element_size()
    expected = math.prod(shape) * itemsize
    if buf.nbytes != expected:
        raise WireError(
            f"tensor {dtype} {shape} needs {expected} bytes, frame has {buf.nbytes}"
        )
    try:
        if expected == 0:
            # torch.frombuffer rejects empty buffers.
            return torch.empty(shape, dtype=dtype)
        if buf.readonly:
            buf = memoryview(bytearray(buf))
        flat = torch.frombuffer(buf, dtype=torch.uint8)
        if flat.data_ptr() % itemsize:
            flat = flat.clone()
        return flat.view(dtype).reshape(shape)
    except Exception as exc:  # e.g. absurd ranks; anything here is the message's fault
        raise WireError(f"cannot build tensor {dtype} {shape}: {exc}") from exc


def decode(frames: Sequence[bytes | memoryview | Any]) -> tuple[int, Any]:
    """Inverse of ``encode``: returns ``(msg_type, body)``. Tuples come back as lists.

    Accepts ``bytes``, ``bytearray``, ``memoryview`` or ``zmq.Frame`` items. Raises only
    ``WireError`` on malformed input; every extra frame must be referenced exactly once.
    """
    try:
        frames = list(frames)
    except TypeError as exc:
        raise WireError("frames must be a sequence") from exc
    if not frames:
        raise WireError("message has no frames")
    head = _as_bytes_view(frames[0], "frame 0")
    if head.nbytes != 1:
        raise WireError(f"frame 0 must be exactly one type byte, got {head.nbytes} bytes")
    if len(frames) < 2:
        raise WireError("message has no body frame")
    body_view = _as_bytes_view(frames[1], "frame 1")
    used: set[int] = set()

    def ext_hook(code: int, data: bytes) -> torch.Tensor:
        if code == _EXT_TENSOR_INLINE:
            dtype, shape, raw = _parse_header(data, with_index=False)
            return _build_tensor(memoryview(raw), dtype, shape)
        if code != _EXT_TENSOR_FRAME:
            raise WireError(f"unknown msgpack ext type {code}")
        dtype, shape, index = _parse_header(data, with_index=True)
        if not _FIRST_TENSOR_FRAME <= index < len(frames):
            raise WireError(
                f"tensor refers to frame {index}, message has frames 0..{len(frames) - 1}"
            )
        if index in used:
            raise WireError(f"frame {index} referenced by more than one tensor")
        used.add(index)
        return _build_tensor(_as_bytes_view(frames[index], f"frame {index}"), dtype, shape)

    try:
        body = msgpack.unpackb(
            body_view, raw=False, use_list=True, strict_map_key=True, ext_hook=ext_hook
        )
    except WireError:
        raise
    except Exception as exc:  # ExtraData, FormatError, StackError, UnicodeDecodeError, ...
        raise WireError(f"body is not valid msgpack: {type(exc).__name__}: {exc}") from exc
    unused = set(range(_FIRST_TENSOR_FRAME, len(frames))) - used
    if unused:
        raise WireError(f"frames {sorted(unused)} are not referenced by the body")
    return head[0], body
