"""Tests for mserve.common.serde: frame layout, tensor round-trips, zero-copy, and garbage rejection."""

from __future__ import annotations

import random
import subprocess
import sys
import warnings
from pathlib import Path

import msgpack
import pytest
import torch
import zmq

from mserve.common.serde import (
    INLINE_MAX_BYTES,
    SCHEMA_VERSION,
    WireError,
    decode,
    encode,
    tensor_nbytes,
)

DTYPES = [
    torch.float32,
    torch.float16,
    torch.bfloat16,
    torch.float64,
    torch.int64,
    torch.int32,
    torch.int8,
    torch.uint8,
    torch.bool,
]


def _sample(dtype: torch.dtype, shape: tuple[int, ...], seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.rand(shape, generator=g) > 0.5
    if dtype.is_floating_point:
        return (torch.randn(shape, generator=g) * 100).to(dtype)
    return torch.randint(0, 100, shape, generator=g).to(dtype)


def _roundtrip(body, msg_type: int = 7):
    frames = encode(msg_type, body)
    # bytes() mimics what a peer receives with copy=True.
    got_type, got = decode([bytes(f) for f in frames])
    assert got_type == msg_type
    return got


def _assert_same(a: torch.Tensor, b: torch.Tensor) -> None:
    assert a.dtype == b.dtype and a.shape == b.shape
    assert torch.equal(a, b)


def test_schema_version_and_error_type():
    assert SCHEMA_VERSION == 1
    assert issubclass(WireError, ValueError)


def test_frame_layout_two_large_tensors():
    a = torch.ones(256, dtype=torch.float32)  # 1 KiB
    b = torch.zeros(512, dtype=torch.float16)  # 1 KiB
    frames = encode(3, {"a": a, "b": b})
    assert len(frames) == 4
    assert frames[0] == b"\x03"
    assert memoryview(frames[2]).nbytes == 1024 and memoryview(frames[3]).nbytes == 1024
    mt, body = decode(frames)
    assert mt == 3
    _assert_same(body["a"], a)
    _assert_same(body["b"], b)


def test_tiny_tensor_inlined_and_threshold():
    assert len(encode(1, {"t": torch.arange(4)})) == 2
    at_limit = torch.zeros(INLINE_MAX_BYTES, dtype=torch.uint8)
    over_limit = torch.zeros(INLINE_MAX_BYTES + 1, dtype=torch.uint8)
    assert len(encode(1, at_limit)) == 2
    assert len(encode(1, over_limit)) == 3
    _assert_same(_roundtrip(at_limit), at_limit)
    _assert_same(_roundtrip(over_limit), over_limit)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(3,), (64, 33)], ids=["inline", "frame"])
def test_dtype_roundtrip(dtype, shape):
    t = _sample(dtype, shape)
    _assert_same(_roundtrip({"t": t})["t"], t)


def test_bfloat16_keeps_range_float16_cannot():
    t = torch.tensor([1e30, -3e-30, 65504.0 * 4] * 200, dtype=torch.bfloat16)
    _assert_same(_roundtrip(t), t)


def test_non_contiguous_tensors():
    base = _sample(torch.float32, (40, 30))
    for t in (base.t(), base[::2, 1::3], base[:, 0], torch.ones(3, 1).expand(3, 500)):
        assert not t.is_contiguous()
        got = _roundtrip(t)
        _assert_same(got, t)
        assert got.is_contiguous()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.bool], ids=str)
def test_scalar_and_empty_tensors(dtype):
    scalar = _sample(dtype, ())
    assert scalar.dim() == 0
    for t in (scalar, torch.empty(0, dtype=dtype), torch.empty(3, 0, 5, dtype=dtype)):
        frames = encode(1, t)
        assert len(frames) == 2
        _assert_same(_roundtrip(t), t)


def test_requires_grad_and_views_with_offset():
    w = torch.randn(300, requires_grad=True)
    _assert_same(_roundtrip(w), w.detach())
    big = torch.arange(10000, dtype=torch.int64)
    _assert_same(_roundtrip(big[5000:5100]), big[5000:5100])


def test_nested_structures():
    t1 = _sample(torch.bfloat16, (10, 20))
    t2 = _sample(torch.int64, (2,))
    body = {
        "schema": SCHEMA_VERSION,
        "none": None,
        "flags": [True, False],
        "num": [0, -1, 2**63 - 1, -(2**63), 1.5, float("inf")],
        "text": "héllo ✓",
        "raw": b"\x00\xff",
        "tup": (1, (2, t2), "x"),
        "deep": {"a": [{"b": [t1, {"c": t1}]}]},
        "empty": {"l": [], "d": {}, "s": ""},
    }
    got = _roundtrip(body)
    assert got["none"] is None and got["flags"] == [True, False]
    assert got["num"] == body["num"]
    assert got["text"] == body["text"] and got["raw"] == body["raw"]
    assert got["tup"][0] == 1 and got["tup"][2] == "x"
    assert isinstance(got["tup"], list) and isinstance(got["tup"][1], list)
    _assert_same(got["tup"][1][1], t2)
    _assert_same(got["deep"]["a"][0]["b"][0], t1)
    _assert_same(got["deep"]["a"][0]["b"][1]["c"], t1)
    assert got["empty"] == {"l": [], "d": {}, "s": ""}
    # The same tensor twice gets two frames, one per reference.
    assert len(encode(1, body)) == 4


@pytest.mark.parametrize("msg_type", [0, 1, 255])
def test_msg_type_range(msg_type):
    assert decode(encode(msg_type, None)) == (msg_type, None)


@pytest.mark.parametrize("bad", [-1, 256, 1.0, True, "1"])
def test_bad_msg_type_rejected_at_encode(bad):
    with pytest.raises(ValueError):
        encode(bad, None)


@pytest.mark.parametrize(
    "body", [{1, 2}, object(), torch.zeros(2, dtype=torch.complex64)], ids=["set", "obj", "cplx"]
)
def test_unsupported_values_rejected_at_encode(body):
    with pytest.raises(TypeError):
        encode(1, {"x": body})


def test_encode_is_zero_copy_for_contiguous_tensor():
    t = torch.zeros(1000, dtype=torch.float32)
    frames = encode(1, t)
    t[0] = 42.0  # the frame aliases t: this is why callers must not mutate after send
    assert decode(frames)[1][0].item() == 42.0


def test_decode_is_zero_copy_for_writable_frames():
    t = torch.arange(1000, dtype=torch.int32)
    frames = encode(1, t)
    payload = bytearray(frames[2])
    for frame in (payload, memoryview(payload), zmq.Frame(payload)):
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            got = decode([frames[0], frames[1], frame])[1]
        _assert_same(got, t)
        assert got.data_ptr() == torch.frombuffer(memoryview(frame), dtype=torch.uint8).data_ptr()


def test_decode_copies_readonly_frames_without_warning():
    t = torch.arange(1000, dtype=torch.int32)
    frames = [bytes(f) for f in encode(1, t)]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = decode(frames)[1]
    got += 1  # writable, and must not touch the immutable bytes
    _assert_same(decode(frames)[1], t)


def test_decode_misaligned_buffer():
    t = torch.arange(100, dtype=torch.int64)
    frames = encode(1, t)
    padded = bytearray(1) + bytearray(frames[2])
    _assert_same(decode([frames[0], frames[1], memoryview(padded)[1:]])[1], t)


def test_tensor_nbytes():
    assert tensor_nbytes(torch.zeros(3, 4, dtype=torch.bfloat16)) == 24
    assert tensor_nbytes(torch.zeros(())) == 4


# --------------------------------------------------------------------------- malformed input


def _expect_wire_error(frames, match: str | None = None) -> None:
    with pytest.raises(WireError, match=match):
        decode(frames)


def _big(dtype=torch.float32):
    return encode(5, {"t": torch.ones(100, dtype=dtype)})


def test_structural_errors():
    _expect_wire_error([], "no frames")
    _expect_wire_error([b""], "one type byte")
    _expect_wire_error([b"\x01\x02", msgpack.packb(1)], "one type byte")
    _expect_wire_error([b"\x01"], "no body")
    _expect_wire_error([b"\x01", b"\xc1"], "not valid msgpack")
    _expect_wire_error([b"\x01", msgpack.packb(1) + b"\x00"], "not valid msgpack")
    _expect_wire_error([b"\x01", msgpack.packb({1: 2})], "not valid msgpack")
    _expect_wire_error([b"\x01", 12345], "not a bytes-like")
    _expect_wire_error(None, "sequence")


def test_tensor_reference_errors():
    frames = _big()
    _expect_wire_error(frames[:2], "refers to frame 2")
    _expect_wire_error([*frames, b"extra"], "not referenced")
    _expect_wire_error([frames[0], frames[1], bytes(frames[2])[:-1]], "needs 400 bytes")
    dup = encode(5, [torch.ones(100), torch.ones(100)])
    body = msgpack.unpackb(dup[1], ext_hook=lambda c, d: msgpack.ExtType(c, d))
    body[1] = body[0]  # both references now point at frame 2
    _expect_wire_error([dup[0], msgpack.packb(body), dup[2], dup[3]], "more than one")


def test_unknown_dtype_and_ext():
    frames = _big()
    body = bytes(frames[1]).replace(b"float32", b"float3X")
    _expect_wire_error([frames[0], body, frames[2]], "unknown tensor dtype")
    inline = encode(5, torch.zeros(2, dtype=torch.int64))
    _expect_wire_error([inline[0], bytes(inline[1]).replace(b"int64", b"int65")], "dtype")
    _expect_wire_error([b"\x01", msgpack.packb(msgpack.ExtType(42, b""))], "ext type 42")
    bad_header = msgpack.packb(msgpack.ExtType(1, msgpack.packb(["float32", [-1], 2])))
    _expect_wire_error([b"\x01", bad_header, b""], "shape")


def _random_bytes(rng: random.Random, max_len: int = 64) -> bytes:
    return bytes(rng.getrandbits(8) for _ in range(rng.randrange(max_len)))


def _mutations(rng: random.Random, valid: list[bytes]):
    """Garbage messages: random frames, random bodies, truncated bodies, corrupted bodies and
    truncated tensor frames of a valid message."""
    for _ in range(50):
        yield [_random_bytes(rng) for _ in range(rng.randrange(1, 4))]
    for _ in range(200):
        yield [bytes([rng.randrange(256)]), _random_bytes(rng)]
    for i in range(len(valid[1])):
        yield [valid[0], valid[1][:i], *valid[2:]]
    for _ in range(300):
        body = bytearray(valid[1])
        for _ in range(rng.randrange(1, 4)):
            body[rng.randrange(len(body))] = rng.getrandbits(8)
        tensors = [f[: rng.randrange(len(f) + 1)] if rng.random() < 0.3 else f for f in valid[2:]]
        yield [valid[0], bytes(body), *tensors]


def test_fuzz_only_wire_error():
    rng = random.Random(1234)
    valid = [
        bytes(f)
        for f in encode(
            9,
            {
                "a": torch.ones(100, dtype=torch.bfloat16),
                "b": [torch.arange(3), "s", 1.5, None, b"x"],
                "c": torch.zeros(0, 4),
            },
        )
    ]
    count = 0
    for frames in _mutations(rng, valid):
        count += 1
        try:
            decode(frames)
        except WireError:
            pass
    assert count > 500


def test_torch_is_imported_only_to_decode_a_tensor():
    """Plain bodies never load torch; the first tensor decoded does (same frames, same results)."""
    frames = [bytes(f) for f in encode(5, {"t": torch.arange(300, dtype=torch.int16), "s": "x"})]
    code = (
        "import sys\n"
        "from mserve.common.serde import decode, encode\n"
        "plain = [bytes(f) for f in encode(4, {'a': [1, 2.5, None, b'b'], 's': 'x'})]\n"
        "assert decode(plain) == (4, {'a': [1, 2.5, None, b'b'], 's': 'x'})\n"
        "try:\n"
        "    encode(4, {1, 2})\n"
        "except TypeError:\n"
        "    pass\n"
        "assert 'torch' not in sys.modules, 'torch imported for plain bodies'\n"
        f"kind, body = decode({frames!r})\n"
        "assert 'torch' in sys.modules and kind == 5 and body['s'] == 'x'\n"
        "assert body['t'].tolist() == list(range(300)) and str(body['t'].dtype) == 'torch.int16'\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          cwd=Path(__file__).resolve().parents[2])
    assert proc.returncode == 0, proc.stderr
