"""Fuzzing the edges (hypothesis, bounded): wire frames, client bodies, images, PDFs and OpenAI requests.

Every case must end in the edge's own explicit error (WireError / ProtocolError / AdmissionError /
ImageError / DocumentError / ApiError with a message), never another exception; a live cluster answers each bad
message with an ERROR and keeps serving the good request running beside them, token for token.
Longer runs: `HYPOTHESIS_PROFILE=long pytest tests/common/test_fuzz.py` (see docs/operations.md).
"""

from __future__ import annotations

import base64
import io
import os
import threading

import msgpack
import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from PIL import Image

from mserve.common import protocol
from mserve.common.documents import DocumentError, render_pdf
from mserve.common.images import ImageError, decode_image, image_size_from_header
from mserve.common.protocol import MsgType, ProtocolError
from mserve.common.protocol.client import FROM_CLIENT
from mserve.common.serde import WireError, decode, encode
from mserve.coordinator.admission import AdmissionError, Limits, admit
from mserve.gateway.openai_api import ApiError, parse_chat_request
from tests.clusters import LLAVA_UNIFIED
from tests.helpers import make_image, make_pdf

settings.register_profile("ci", max_examples=150, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
settings.register_profile("long", max_examples=5000, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

# JSON-ish values msgpack can carry, bytes included
scalars = st.none() | st.booleans() | st.integers(-2**70, 2**70).filter(lambda i: -2**63 <= i < 2**64) \
    | st.floats(allow_nan=True) | st.text(max_size=20) | st.binary(max_size=40)
values = st.recursive(scalars, lambda kids: st.lists(kids, max_size=4) | st.dictionaries(st.text(max_size=8), kids,
                                                                                          max_size=4), max_leaves=12)


def good_images() -> dict[str, bytes]:
    out = {fmt: make_image(40, 30, seed=1, fmt=fmt) for fmt in ("PNG", "JPEG", "BMP", "GIF", "TIFF", "WEBP")}
    frames = [Image.new("RGB", (20, 10), c) for c in ("red", "green", "blue")]
    buf = io.BytesIO()
    frames[0].save(buf, format="GIF", save_all=True, append_images=frames[1:], duration=50, loop=0)
    out["animated-GIF"] = buf.getvalue()
    return out


GOOD = good_images()

# image-ish parts: real images, mutated ones, junk
image_bytes = st.sampled_from(list(GOOD.values())) | st.builds(
    lambda data, cut: data[:cut], st.sampled_from(list(GOOD.values())), st.integers(0, 400)) | st.builds(
    lambda data, i, b: data[:i] + bytes([b]) + data[i + 1:], st.sampled_from(list(GOOD.values())),
    st.integers(0, 300), st.integers(0, 255)) | st.binary(max_size=64)
part = st.fixed_dictionaries({"type": st.sampled_from(["text", "image", "image_url", "video", "audio", 3])},
                             optional={"text": values, "image": image_bytes | values, "image_url": values})
message = st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant", "tool", None]),
                                 "content": st.text(max_size=30) | st.lists(part, max_size=3) | values})
generate_body = st.fixed_dictionaries(
    {"request_id": st.text(min_size=0, max_size=12) | values},
    optional={"messages": st.lists(message, max_size=3) | values, "sampling": st.dictionaries(
        st.sampled_from(["max_tokens", "temperature", "top_k", "top_p", "seed", "stop_token_ids", "ignore_eos",
                         "best_of"]), values, max_size=4) | values,
              "priority": values, "latency_class": values, "stream": values, "v": values})


@pytest.fixture(scope="module")
def builder(tiny_model_dirs):
    from mserve.common.prompt import PromptBuilder

    return PromptBuilder(tiny_model_dirs["llava"])


@given(st.lists(st.binary(max_size=64), max_size=4))
def test_random_frames_raise_only_wire_errors(frames):
    try:
        decode(frames)
    except WireError as exc:
        assert str(exc)


@given(st.integers(0, 255), values)
def test_random_bodies_are_refused_by_the_parse(kind, body):
    frames = [bytes([kind]), msgpack.packb(body, use_bin_type=True)]
    try:
        msg_type, payload = decode(frames)
        protocol.parse_message(msg_type, payload, FROM_CLIENT)
    except (WireError, ProtocolError) as exc:
        assert str(exc)


@given(generate_body)
def test_generate_bodies_end_in_admission_errors_only(builder, body):
    try:
        protocol.check_header(MsgType.GENERATE, body, FROM_CLIENT)  # as the coordinator's socket does
    except ProtocolError:
        return
    try:
        admitted = admit(builder, Limits(), body)
    except AdmissionError as exc:
        assert str(exc) and exc.code in ("bad_request", "too_large")
        return
    assert admitted.prompt_ids and all(isinstance(i, int) for i in admitted.prompt_ids)


@given(image_bytes)
# PIL warns as it reads a mangled file (a TIFF's tags past its end, ...); what this checks is that it then decodes
# or raises ImageError.
@pytest.mark.filterwarnings("ignore::UserWarning:PIL")
def test_images_decode_or_raise_image_error(data):
    try:
        w, h = image_size_from_header(data)
    except ImageError as exc:
        assert "cannot read image header" in str(exc)
        return
    try:
        im = decode_image(data, max_pixels=4096 * 4096)
    except ImageError as exc:
        assert str(exc)
        return
    assert im.mode == "RGB" and im.size == (w, h)


def test_image_corner_cases():
    # every mode PIL reads becomes RGB
    for mode in ("1", "L", "LA", "P", "PA", "RGBA", "I;16", "I", "F", "CMYK", "YCbCr"):
        buf = io.BytesIO()
        im = Image.new(mode, (12, 9))
        fmt = "TIFF" if mode in ("I;16", "I", "F", "CMYK", "YCbCr", "PA") else "PNG"
        im.save(buf, format=fmt)
        assert decode_image(buf.getvalue()).mode == "RGB", mode
    # animated: the first frame
    assert decode_image(GOOD["animated-GIF"]).getpixel((0, 0)) == (255, 0, 0)
    # a decompression bomb: a tiny file whose header claims 40000 x 40000 pixels
    bomb = io.BytesIO()
    Image.new("1", (40000, 40000)).save(bomb, format="PNG", optimize=True)
    assert len(bomb.getvalue()) < 1_000_000
    with pytest.raises(ImageError, match="max_image_pixels=16777216"):
        decode_image(bomb.getvalue(), max_pixels=4096 * 4096)
    with pytest.raises(ImageError):  # PIL's own bomb guard still applies with no limit given
        decode_image(bomb.getvalue())


def test_admission_names_the_image_limit(builder):
    bomb = io.BytesIO()
    Image.new("1", (8000, 8000)).save(bomb, format="PNG")
    body = {"request_id": "r", "messages": [{"role": "user", "content": [{"type": "image", "image": bomb.getvalue()},
                                                                          {"type": "text", "text": "hi"}]}]}
    with pytest.raises(AdmissionError, match="max_image_pixels") as info:
        admit(builder, Limits(), body)
    assert info.value.code == "too_large"
    body["messages"][0]["content"][0]["image"] = GOOD["PNG"][:20]  # cut inside the header
    with pytest.raises(AdmissionError, match="image 0: cannot read image header"):
        admit(builder, Limits(), body)


openai_part = st.fixed_dictionaries({"type": st.sampled_from(["text", "image_url", "input_audio", "video_url"])},
                                    optional={"text": values, "image_url": values | st.fixed_dictionaries(
                                        {"url": st.sampled_from(["data:image/png;base64,iVBORw0KGgo=", "data:,",
                                                                 "http://x/y.png", "/etc/passwd", "file:///etc/passwd",
                                                                 "data:image/png;base64,%%%"]) | values})})
openai_body = st.fixed_dictionaries(
    {"model": values | st.just("m"), "messages": st.lists(st.fixed_dictionaries(
        {"role": st.sampled_from(["user", "system", "developer", "assistant", "tool", 1]),
         "content": st.text(max_size=10) | st.lists(openai_part, max_size=3) | values}), max_size=3) | values},
    optional={k: values for k in ("max_tokens", "max_completion_tokens", "temperature", "top_p", "seed", "stop",
                                  "stream", "stream_options", "n", "logprobs", "tools", "priority",
                                  "latency_class", "ignore_eos", "stop_token_ids", "frequency_penalty", "x")})


@given(openai_body | values)
def test_openai_bodies_parse_or_get_a_400(body):
    try:
        req = parse_chat_request(body, media_root=None)
    except ApiError as exc:
        assert exc.status == 400 and exc.message
        return
    assert req.messages and isinstance(req.sampling["max_tokens"], int)


GOOD_PDF = make_pdf([(30, 20), (20, 30)], seed=1)
# PDF-ish bodies: the real one, cut, a byte changed (a digit of a page box, an xref offset, ...), junk after a header
pdf_bytes = st.just(GOOD_PDF) | st.builds(lambda cut: GOOD_PDF[:cut], st.integers(0, len(GOOD_PDF))) | st.builds(
    lambda i, b: GOOD_PDF[:i] + bytes([b]) + GOOD_PDF[i + 1:], st.integers(0, len(GOOD_PDF) - 1),
    st.integers(0, 255)) | st.binary(max_size=200).map(lambda b: b"%PDF-1.4\n" + b) | st.binary(max_size=64)


@pytest.mark.timeout(120)  # no hang: 150 bodies, each parsed and rendered (or refused) in milliseconds
@given(pdf_bytes)
def test_pdfs_render_or_raise_document_error(data):
    pytest.importorskip("pypdfium2")
    try:
        pages = render_pdf(data)
    except DocumentError as exc:
        assert str(exc).startswith("document: ")
        return
    assert 1 <= len(pages) <= 8 and all(p.startswith(b"\x89PNG") for p in pages)


file_part = st.fixed_dictionaries({"type": st.just("file")}, optional={"file": values | st.fixed_dictionaries(
    {}, optional={"filename": values, "file_id": values, "file_data": values | pdf_bytes.map(
        lambda b: "data:application/pdf;base64," + base64.b64encode(b).decode())})})


@pytest.mark.timeout(120)
@given(st.lists(file_part, min_size=1, max_size=2))
def test_openai_file_parts_parse_or_get_a_400(parts):
    pytest.importorskip("pypdfium2")
    try:
        req = parse_chat_request({"model": "m", "messages": [{"role": "user", "content": parts}]})
    except ApiError as exc:
        assert exc.status == 400 and exc.message and exc.param
        return
    assert req.messages[0]["content"]


# --------------------------------------------------------------------------- a live cluster


@pytest.mark.slow
@pytest.mark.parametrize("shared_cluster", [LLAVA_UNIFIED], ids=str, indirect=True)
def test_a_live_coordinator_answers_every_bad_message_and_keeps_serving(shared_cluster):
    from mserve.coordinator.client import Client

    msgs = [{"role": "user", "content": [{"type": "image", "image": GOOD["PNG"]}, {"type": "text", "text": "Hi"}]}]
    cluster = shared_cluster
    with Client(cluster.address) as c:
        clean = c.generate(msgs, max_tokens=24, ignore_eos=True).token_ids
    streamed: list[int] = []

    def good_request() -> None:
        with Client(cluster.address) as c:
            streamed.extend(c.stream(msgs, max_tokens=24, ignore_eos=True))

    runner = threading.Thread(target=good_request)
    runner.start()
    ctx = zmq.Context()
    bad = ctx.socket(zmq.DEALER)
    bad.connect(cluster.address)
    try:
        cases = bad_messages()
        for frames in cases:
            bad.send_multipart(frames)
        replies = []
        while len(replies) < len(cases):
            assert bad.poll(10_000), f"only {len(replies)} of {len(cases)} bad messages were answered"
            replies.append(decode(bad.recv_multipart()))
    finally:
        bad.close(linger=0)
        ctx.term()
    runner.join(60)
    assert all(kind == MsgType.ERROR and body["code"] in ("bad_message", "bad_request", "too_large")
               and body["message"] for kind, body in replies)
    assert streamed == clean, "a request running beside the bad ones was affected"
    with Client(cluster.address) as c:
        status = c.status()
        assert status["requests_in_flight"] == 0 and status["roles"] == {"unified": 1}


def bad_messages() -> list[list[bytes]]:
    """Bad messages of every kind the issue names; each must get exactly one ERROR reply."""
    gen = int(MsgType.GENERATE).to_bytes(1, "big")
    good_body = {"v": 1, "request_id": "x", "messages": [{"role": "user", "content": "hi"}]}
    frames_of = lambda body: encode(MsgType.GENERATE, body)  # noqa: E731
    cases = [
        [b"\x01"],  # no body frame
        [b"\x01\x02", b"\x80"],  # two-byte type
        [gen, b"\xc1"],  # msgpack's never-used byte
        [gen, msgpack.packb(good_body)[:-3]],  # truncated body
        [gen, msgpack.packb([1, 2, 3])],  # not a map
        [bytes([99]), msgpack.packb(good_body)],  # unknown message type
        [int(MsgType.READY).to_bytes(1, "big"), msgpack.packb({"worker_id": "w"})],  # a worker's message
        [gen, msgpack.packb({**good_body, "request_id": 7})],  # wrong type
        [gen, msgpack.packb({**good_body, "messages": "hi"})],
        [gen, msgpack.packb({**good_body, "sampling": {"max_tokens": -1}})],
        [gen, msgpack.packb({**good_body, "sampling": {"best_of": 3}})],  # unknown sampling field
        [gen, msgpack.packb({**good_body, "sampling": {"max_tokens": 10**9}})],  # over max_tokens
        [gen, msgpack.packb({**good_body, "messages": [{"role": "user", "content": [
            {"type": "image", "image": GOOD["PNG"][:40]}]}]})],  # truncated image
        [gen, msgpack.packb({**good_body, "messages": [{"role": "user", "content": [
            {"type": "image", "image": "/etc/passwd"}]}]})],  # a path: servers never read client paths
        [gen, msgpack.packb(good_body), b"extra frame nobody refers to"],
        [gen, msgpack.ExtType(1, b"\x00\x01").data],  # junk ext
        [gen, b"\x80" * 3],
        [gen, msgpack.packb({**good_body, "x": msgpack.ExtType(9, b"zz")})],  # unknown ext type
        [gen, b"\x80\x03cos\nsystem\n(S'echo pwned'\ntR."],  # a pickle
        [gen, b"\xdb" + (2**31).to_bytes(4, "big")],  # a str header claiming 2 GiB
    ]
    cases += [f for f in (frames_of({"v": 1, "request_id": "", "messages": [{"role": "user", "content": "x"}]}),)]
    return [[bytes(f) for f in c] for c in cases]
