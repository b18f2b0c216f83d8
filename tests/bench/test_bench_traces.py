"""Trace generation: reproducibility, class mix, arrivals, multiturn reuse, persistence."""

from __future__ import annotations

import importlib.util
import io
import math
from collections import Counter

import numpy as np
import pytest
from PIL import Image

from mserve.bench.traces import (
    IMAGE_RESOLUTIONS,
    TRACE_NAMES,
    load_trace,
    make_trace,
    save_trace,
    trace_digest,
)

SMALL = [((64, 48), 1.0), ((96, 96), 1.0)]  # keeps image-heavy tests fast


def test_same_seed_same_digest_and_other_seed_differs() -> None:
    for name in TRACE_NAMES:
        a = make_trace(name, 12, seed=7, rate=5.0, resolutions=SMALL)
        b = make_trace(name, 12, seed=7, rate=5.0, resolutions=SMALL)
        c = make_trace(name, 12, seed=8, rate=5.0, resolutions=SMALL)
        assert len(a) == 12
        assert trace_digest(a) == trace_digest(b), name
        assert trace_digest(a) != trace_digest(c), name


def test_mixed_image_share() -> None:
    trace = make_trace("mixed", 200, seed=1, image_share=0.3, resolutions=SMALL)
    counts = Counter(r.modality for r in trace)
    assert set(counts) <= {"text", "image"}
    assert abs(counts["image"] / 200 - 0.3) < 0.1
    for r in trace:
        assert len(r.images()) == (1 if r.modality == "image" else 0)
        assert len(r.image_sizes) == len(r.images())


def test_modalities_per_trace_name() -> None:
    assert {r.modality for r in make_trace("text", 20, seed=0)} == {"text"}
    image = make_trace("image", 20, seed=0, resolutions=SMALL)
    assert all(r.modality == "image" and len(r.images()) == 1 for r in image)
    multi = make_trace("multi-image", 20, seed=0, resolutions=SMALL)
    assert all(r.modality == "multi-image" and 2 <= len(r.images()) <= 4 for r in multi)


def test_poisson_mean_gap_and_inf_rate() -> None:
    trace = make_trace("text", 2000, seed=3, rate=20.0, prompt_tokens=4)
    arrivals = np.array([r.arrival_s for r in trace])
    assert arrivals[0] > 0.0 and np.all(np.diff(arrivals) >= 0)  # vLLM waits one gap before the first
    assert abs(np.diff(arrivals).mean() - 1 / 20.0) < 0.1 / 20.0
    assert arrivals[-1] == pytest.approx(2000 / 20.0)  # vLLM's rescale to n/rate
    steady = [r.arrival_s for r in make_trace("text", 5, seed=3, rate=2.0, burstiness=math.inf)]
    assert steady == pytest.approx([0.5, 1.0, 1.5, 2.0, 2.5])
    assert all(r.arrival_s == 0.0 for r in make_trace("text", 50, seed=3, rate=math.inf))


def test_burstiness_changes_dispersion_not_mean() -> None:
    gaps = {}
    for b in (0.25, 4.0):
        trace = make_trace("text", 2000, seed=5, rate=10.0, burstiness=b, prompt_tokens=2)
        arr = np.array([r.arrival_s for r in trace])
        gaps[b] = np.diff(arr)
        assert abs(gaps[b].mean() - 0.1) < 0.02
    assert gaps[0.25].std() > 2 * gaps[4.0].std()  # gamma CV = 1/sqrt(shape)


def test_classes_and_prompt_text() -> None:
    trace = make_trace("text", 300, seed=2, interactive_share=0.8, prompt_tokens=40)
    lat = Counter(r.latency_class for r in trace)
    assert abs(lat["interactive"] / 300 - 0.8) < 0.1
    assert {r.priority for r in trace} <= {0, 1, 2} and Counter(r.priority for r in trace)[0] > 150
    text = trace[0].messages[0]["content"][-1]["text"]
    assert len(text.split()) == 40 and text[0].isupper() and text.endswith(".")
    assert trace[0].messages[0]["content"][-1]["text"] != trace[1].messages[0]["content"][-1]["text"]


def test_multiturn_reuses_image_bytes_and_grows_history() -> None:
    trace = make_trace("multiturn", 30, seed=4, image_share=1.0, max_tokens=8, resolutions=SMALL)
    convs: dict[str, list] = {}
    for r in trace:
        convs.setdefault(r.conversation_id, []).append(r)
    assert all(2 <= len(turns) <= 4 for turns in convs.values())
    for turns in convs.values():
        assert [t.turn for t in turns] == list(range(len(turns)))
        assert [t.arrival_s for t in turns] == sorted(t.arrival_s for t in turns)
        first = turns[0].images()
        assert len(first) == 1
        for t in turns:
            assert t.images() == first  # identical bytes every turn
            assert len(t.messages) == 2 * t.turn + 1 and t.messages[-1]["role"] == "user"
            assert t.messages[: len(turns[0].messages)] == turns[0].messages
    # different conversations still get different images
    assert len({turns[0].images()[0] for turns in convs.values()}) == len(convs)


def test_image_sizes_come_from_distribution_and_match_bytes() -> None:
    allowed = {size for size, _ in IMAGE_RESOLUTIONS}
    expected = "JPEG" if importlib.util.find_spec("skimage") is not None else "PNG"  # photos vs fallback
    trace = make_trace("multi-image", 8, seed=11)
    for r in trace:
        for data, size in zip(r.images(), r.image_sizes):
            assert size in allowed
            img = Image.open(io.BytesIO(data))
            assert img.size == size and img.format == expected


def test_synthetic_fallback_is_png_exact_size_and_distinct() -> None:
    trace = make_trace("image", 6, seed=1, photos=False, resolutions=[((200, 100), 1.0)])
    blobs = [r.images()[0] for r in trace]
    assert len(set(blobs)) == 6
    for data in blobs:
        img = Image.open(io.BytesIO(data))
        assert img.format == "PNG" and img.size == (200, 100)
    shared = make_trace("image", 30, seed=1, photos=False, resolutions=[((200, 100), 1.0)], distinct_images=False)
    assert len({r.images()[0] for r in shared}) < 30


def test_save_load_round_trip(tmp_path) -> None:
    trace = make_trace("multiturn", 10, seed=9, rate=2.0, resolutions=SMALL)
    path = save_trace(trace, tmp_path / "t.jsonl")
    loaded = load_trace(path)
    assert trace_digest(loaded) == trace_digest(trace)
    assert [r.image_sizes for r in loaded] == [r.image_sizes for r in trace]
    assert all(isinstance(size, tuple) for r in loaded for size in r.image_sizes)
    assert [r.images() for r in loaded] == [r.images() for r in trace]


def test_bad_arguments() -> None:
    with pytest.raises(ValueError):
        make_trace("nope", 1, seed=0)
    with pytest.raises(ValueError):
        make_trace("text", 3, seed=0, rate=0.0)
    assert make_trace("multiturn", 1, seed=0)[0].turn == 0


def test_video_trace_sends_one_clip_of_4_to_8_frames() -> None:
    from mserve.bench.images import VIDEO_RESOLUTIONS

    trace = make_trace("video", 12, seed=3, photos=False, resolutions=SMALL)
    assert {r.modality for r in trace} == {"video"}
    for r in trace:
        (frames,) = r.videos()
        assert 4 <= len(frames) <= 8 and r.images() == [] and len(r.image_sizes) == 1
        sizes = {Image.open(io.BytesIO(f)).size for f in frames}
        assert sizes == {r.image_sizes[0]} and r.image_sizes[0] in {s for s, _ in SMALL}
        assert len(set(frames)) == len(frames)  # frames of a clip differ (panning, distinct stamps)
    assert len({len(r.videos()[0]) for r in trace}) > 1
    default = make_trace("video", 3, seed=0, photos=False)
    assert all(r.image_sizes[0] in {s for s, _ in VIDEO_RESOLUTIONS} for r in default)
    assert trace_digest(make_trace("video", 12, seed=3, photos=False, resolutions=SMALL)) == trace_digest(trace)


def test_video_trace_round_trip_and_openai_payload(tmp_path) -> None:
    from mserve.bench.http_target import to_openai_messages

    trace = make_trace("video", 3, seed=5, photos=False, resolutions=SMALL)
    loaded = load_trace(save_trace(trace, tmp_path / "v.jsonl"))
    assert [r.videos() for r in loaded] == [r.videos() for r in trace]
    parts = to_openai_messages(trace[0].messages)[0]["content"]
    assert parts[0]["type"] == "video" and len(parts[0]["video"]) == len(trace[0].videos()[0])
    assert all(u.startswith("data:image/png;base64,") for u in parts[0]["video"])
    assert parts[-1]["type"] == "text"


def test_multiturn_with_fixed_turns() -> None:
    trace = make_trace("multiturn", 10, seed=5, image_share=1.0, max_tokens=4, resolutions=SMALL, turns=4)
    per_conv: dict[str, list[int]] = {}
    for req in trace:
        per_conv.setdefault(req.conversation_id, []).append(req.turn)
    assert sorted(len(t) for t in per_conv.values()) == [2, 4, 4]
    assert all(sorted(t) == list(range(len(t))) for t in per_conv.values())
    with pytest.raises(ValueError, match="turns"):
        make_trace("multiturn", 4, seed=0, turns=0)


def test_document_trace_sends_one_pdf_of_2_to_4_pages_rendered_back_at_their_sizes(tmp_path) -> None:
    pytest.importorskip("pypdfium2")
    from mserve.bench.http_target import to_openai_messages
    from mserve.common.documents import render_pdf

    trace = make_trace("document", 6, seed=2, photos=False, resolutions=SMALL)
    assert {r.modality for r in trace} == {"document"}
    for r in trace:
        (pdf,) = r.documents()
        assert r.images() == [] and 2 <= len(r.image_sizes) <= 4
        pages = render_pdf(pdf)  # as the gateway and the client render it: each page at its image's size
        assert [Image.open(io.BytesIO(p)).size for p in pages] == r.image_sizes
    assert len({len(r.image_sizes) for r in trace}) > 1
    assert trace_digest(make_trace("document", 6, seed=2, photos=False, resolutions=SMALL)) == trace_digest(trace)
    assert [r.documents() for r in load_trace(save_trace(trace, tmp_path / "d.jsonl"))] == [r.documents() for r in trace]
    part = to_openai_messages(trace[0].messages)[0]["content"][0]
    assert part["type"] == "file" and part["file"]["file_data"].startswith("data:application/pdf;base64,")


def test_audio_trace_sends_one_wav_clip_whose_header_admission_counts(tmp_path) -> None:
    """`audio`: one 1-8 s WAV clip per request, distinct and reproducible; admission reads its length from the
    header alone (common/audio.py), and the HTTP target sends it as OpenAI's input_audio part."""
    import base64

    from mserve.bench.http_target import to_openai_messages
    from mserve.bench.traces import AUDIO_RATES, AUDIO_SECONDS
    from mserve.common.audio import read_audio_header

    trace = make_trace("audio", 5, seed=3)
    assert {r.modality for r in trace} == {"audio"}
    clips = [clip for r in trace for clip in r.audio()]
    assert len(clips) == 5 and len(set(clips)) == 5
    for clip in clips:
        info = read_audio_header(clip)
        assert info.sample_rate in AUDIO_RATES and AUDIO_SECONDS[0] - 0.01 <= info.seconds <= AUDIO_SECONDS[1]
    assert trace_digest(make_trace("audio", 5, seed=3)) == trace_digest(trace)
    assert [r.audio() for r in load_trace(save_trace(trace, tmp_path / "a.jsonl"))] == [r.audio() for r in trace]
    (part, _text), = [m["content"] for m in to_openai_messages(trace[0].messages)]
    assert part["type"] == "input_audio" and base64.b64decode(part["input_audio"]["data"]) == clips[0]


def test_mixed_trace_with_an_audio_share_adds_clips_and_is_unchanged_without() -> None:
    plain = make_trace("mixed", 20, seed=4, resolutions=SMALL, photos=False)
    assert trace_digest(make_trace("mixed", 20, seed=4, resolutions=SMALL, photos=False, audio_share=0.0)) == \
        trace_digest(plain)
    mixed = make_trace("mixed", 20, seed=4, resolutions=SMALL, photos=False, audio_share=0.5)
    with_audio = [r for r in mixed if r.audio()]
    assert 3 <= len(with_audio) <= 17 and all(r.modality == "audio" for r in with_audio)
    assert [r.images() for r in mixed] == [r.images() for r in plain]  # the same images, a clip beside some
