"""Seeded, reproducible request traces (text, image, mixed, multi-image, multiturn, video, document) for
`mserve bench serve`."""

from __future__ import annotations

import base64
import hashlib
import json
import logging
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterable, Sequence

import numpy as np

from mserve.bench.images import IMAGE_RESOLUTIONS, VIDEO_RESOLUTIONS, ImageFactory
from mserve.bench.media_files import pdf_of, wav_of

log = logging.getLogger(__name__)

TRACE_NAMES = ("text", "image", "mixed", "multi-image", "multiturn", "video", "document", "audio")
VIDEO_FRAMES = (4, 8)  # frames per clip of the video trace, drawn uniformly (both ends included)
DOCUMENT_PAGES = (2, 4)  # pages per PDF of the document trace, drawn uniformly (both ends included)
AUDIO_SECONDS = (1.0, 8.0)  # length of the audio trace's clip, drawn uniformly
AUDIO_RATES = (16000, 22050, 44100)  # its sample rate, drawn uniformly (the encode worker resamples)
PRIORITY_LEVELS = ((0, 0.7), (1, 0.2), (2, 0.1))

_VOCAB = (
    "the of and to in is that it was for on are as with his they at be this from have or by one had not but "
    "what all were when we there can an your which their said if do will each about how up out them then she "
    "many some so these would other into has more her two like him see time could no make than first been its "
    "who now people my made over did down only way find use may water long little very after words called just "
    "where most know get through back much before go good new write our used me man too any day same right look "
    "think also around another came come work three word must because does part even place well such here take "
    "why things help put years different away again off went old number great tell men say small every found "
    "still between name should home big give air line set own under read last never us left end along while "
    "might next sound below saw something thought both few those always looked show large often together asked "
    "house world going want school important until form food keep children feet land side without boy once "
    "animals life enough took sometimes four head above kind began almost live page got earth need far hand high "
    "year mother light parts country father let night following picture being study second eyes soon times story"
).split()
# Zipf-like weights so frequent words dominate, as in real English text.
_VOCAB_P = 1.0 / np.arange(1, len(_VOCAB) + 1) ** 0.9
_VOCAB_P /= _VOCAB_P.sum()


@dataclass
class TraceRequest:
    """One request of a trace. `messages` use the OpenAI chat shape with raw image bytes; a video is a
    ``{"type": "video", "video": [frame bytes, ...]}`` part (its frame size in `image_sizes`); a PDF a
    ``{"type": "document", "document": PDF bytes}`` part (its pages' rendered sizes in `image_sizes`)."""

    request_id: str
    arrival_s: float  # offset from trace start; for multiturn a lower bound (see make_trace)
    messages: list[dict[str, Any]]
    max_tokens: int
    modality: str  # "text" | "image" | "multi-image" | "video" | "document"
    priority: int = 0  # 0 = normal, higher = more urgent
    latency_class: str = "interactive"  # "interactive" | "batch"
    conversation_id: str | None = None
    turn: int = 0  # 0-based turn index within conversation_id
    image_sizes: list[tuple[int, int]] = field(default_factory=list)

    def images(self) -> list[bytes]:
        """All image payloads in message order (history included)."""
        return [part["image"] for m in self.messages for part in _parts(m) if part.get("type") == "image"]

    def videos(self) -> list[list[bytes]]:
        """Every video's frames, in message order (history included)."""
        return [part["video"] for m in self.messages for part in _parts(m) if part.get("type") == "video"]

    def documents(self) -> list[bytes]:
        """Every document's PDF bytes, in message order."""
        return [part["document"] for m in self.messages for part in _parts(m) if part.get("type") == "document"]

    def audio(self) -> list[bytes]:
        """Every audio clip's file bytes (WAV), in message order."""
        return [part["audio"] for m in self.messages for part in _parts(m) if part.get("type") == "audio"]


def _parts(message: dict[str, Any]) -> list[dict[str, Any]]:
    content = message.get("content")
    return content if isinstance(content, list) else []


def pseudo_english(rng: np.random.Generator, num_words: int) -> str:
    """Deterministic English-looking text of exactly `num_words` words."""
    if num_words <= 0:
        return ""
    words = [_VOCAB[i] for i in rng.choice(len(_VOCAB), size=num_words, p=_VOCAB_P)]
    out: list[str] = []
    sentence_left = 0
    for i, word in enumerate(words):
        if sentence_left == 0:
            word = word.capitalize()
            sentence_left = int(rng.integers(6, 16))
        sentence_left -= 1
        if sentence_left == 0 or i == num_words - 1:
            word += "."
        out.append(word)
    return " ".join(out)


def arrival_times(n: int, rate: float, burstiness: float, rng: np.random.Generator) -> list[float]:
    """Arrival offsets exactly as vLLM's `bench serve` computes them.

    Gamma gaps with shape=burstiness and mean 1/rate (burstiness 1 = Poisson,
    inf = constant gaps), cumulated from the first gap, then rescaled so the
    last arrival lands at n/rate; vLLM does this so throughput does not drift
    1-2 % between seeds. rate=inf sends everything at 0.
    """
    if n <= 0:
        return []
    if math.isinf(rate):
        return [0.0] * n
    if rate <= 0 or burstiness <= 0:
        raise ValueError("rate and burstiness must be > 0")
    if math.isinf(burstiness):
        gaps = np.full(n, 1.0 / rate)
    else:
        gaps = rng.gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=n)
    delays = np.cumsum(gaps)
    if delays[-1] > 0:
        delays *= (n / rate) / delays[-1]
    return delays.tolist()


def _conversation_lengths(n: int, rng: np.random.Generator, turns: int | None = None) -> list[int]:
    """2-4 turns each (or exactly `turns`, the last conversation shorter if n is not a multiple),
    summing to n; adjusts draws so no 1-turn tail is left (unless n == 1)."""
    if turns is not None:
        return [turns] * (n // turns) + ([n % turns] if n % turns else [])
    lengths: list[int] = []
    left = n
    while left > 0:
        t = int(rng.integers(2, 5))
        if t >= left:
            t = left
        elif left - t == 1:
            t = t + 1 if t < 4 else t - 1
        lengths.append(t)
        left -= t
    return lengths


def _interleave(lengths: list[int], rng: np.random.Generator) -> list[tuple[int, int]]:
    """Random order of (conversation, turn) that keeps each conversation's turns in order."""
    remaining = np.array(lengths, dtype=np.int64)
    next_turn = [0] * len(lengths)
    order: list[tuple[int, int]] = []
    while remaining.sum() > 0:
        # Weight by remaining turns so long conversations do not bunch up at the end.
        c = int(rng.choice(len(lengths), p=remaining / remaining.sum()))
        order.append((c, next_turn[c]))
        next_turn[c] += 1
        remaining[c] -= 1
    return order


def make_trace(
    name: str,
    num_requests: int,
    seed: int,
    *,
    rate: float = math.inf,
    burstiness: float = 1.0,
    image_share: float = 0.5,
    audio_share: float = 0.0,
    max_tokens: int = 64,
    prompt_tokens: int = 64,
    interactive_share: float = 0.5,
    resolutions: Sequence[tuple[tuple[int, int], float]] | None = None,
    photos: bool | None = None,
    distinct_images: bool = True,
    turns: int | None = None,
) -> list[TraceRequest]:
    """Build a reproducible trace of `num_requests` requests, sorted by arrival.

    Independent random streams drive arrivals, classes, text and images, so
    e.g. a rate sweep with one seed sends identical content at every rate.
    `photos=None` uses scikit-image photographs (JPEG) when installed, else
    synthetic PNGs; `resolutions` overrides IMAGE_RESOLUTIONS (VIDEO_RESOLUTIONS
    for the frames of `video`, one clip of 4-8 frames per request; the pages of
    `document`, one PDF of 2-4 pages per request, as `pdf_of` writes it). `audio`: one WAV clip of 1-8 s per
    request at 16, 22.05 or 44.1 kHz (`wav_of`), for a model with an audio tower.
    Multiturn: every turn resends the conversation's image(s) and the whole
    history (with placeholder assistant replies of ~max_tokens words); a runner
    must not send turn k+1 before turn k has finished, so arrival_s is a lower bound.
    Conversations have 2-4 turns, or exactly `turns` (the last one shorter when
    num_requests is not a multiple of it). `audio_share` (mixed only, for a model that takes images and audio):
    that share of the requests also carries one clip, drawn as the audio trace draws it; 0 draws nothing, so
    the trace is byte-identical to one made without it.
    """
    if turns is not None and turns < 1:
        raise ValueError(f"turns must be >= 1, got {turns}")
    if name not in TRACE_NAMES:
        raise ValueError(f"unknown trace {name!r}; expected one of {TRACE_NAMES}")
    if num_requests < 0:
        raise ValueError("num_requests must be >= 0")
    ss = np.random.SeedSequence([seed, *name.encode()])
    r_arrival, r_class, r_text, r_img, r_shape = (np.random.default_rng(s) for s in ss.spawn(5))
    r_audio = np.random.default_rng(ss.spawn(1)[0])  # the mixed trace's clips: a stream of their own
    sizes, weights = zip(*(resolutions or (VIDEO_RESOLUTIONS if name == "video" else IMAGE_RESOLUTIONS)))
    probs = np.asarray(weights, dtype=float) / float(np.sum(weights))
    factory = ImageFactory(r_img, use_photos=photos if photos is not None else True, distinct=distinct_images)
    if photos and not factory.photos:
        log.info("photos requested but unavailable; falling back to synthetic images")

    def draw_images(count: int) -> tuple[list[bytes], list[tuple[int, int]]]:
        picked = [tuple(sizes[i]) for i in r_shape.choice(len(sizes), size=count, p=probs)]
        return [factory.make(s) for s in picked], picked  # type: ignore[arg-type]

    def image_count() -> int:
        if name == "text":
            return 0
        if name == "image":
            return 1
        if name == "multi-image":
            return int(r_shape.integers(2, 5))
        return 1 if r_shape.random() < image_share else 0  # mixed, multiturn

    def classes() -> tuple[int, str]:
        levels, pw = zip(*PRIORITY_LEVELS)
        prio = int(r_class.choice(levels, p=np.asarray(pw) / sum(pw)))
        return prio, "interactive" if r_class.random() < interactive_share else "batch"

    def draw_video() -> tuple[list[bytes], tuple[int, int]]:
        size = tuple(sizes[int(r_shape.choice(len(sizes), p=probs))])
        return factory.make_frames(size, int(r_shape.integers(VIDEO_FRAMES[0], VIDEO_FRAMES[1] + 1))), size  # type: ignore

    def user_message(images: list[bytes], video: list[bytes] | None = None) -> dict[str, Any]:
        parts: list[dict[str, Any]] = [{"type": "image", "image": b} for b in images]
        if video is not None:
            parts.append({"type": "video", "video": video})
        parts.append({"type": "text", "text": pseudo_english(r_text, prompt_tokens)})
        return {"role": "user", "content": parts}

    def modality(n_images: int) -> str:
        return "text" if n_images == 0 else "image" if n_images == 1 else "multi-image"

    arrivals = arrival_times(num_requests, rate, burstiness, r_arrival)
    trace: list[TraceRequest] = []
    if name != "multiturn":
        for i in range(num_requests):
            if name == "video":
                frames, size = draw_video()
                prio, lat = classes()
                trace.append(TraceRequest(request_id=f"r{i:06d}", arrival_s=arrivals[i], messages=[user_message([], frames)],
                                          max_tokens=max_tokens, modality="video", priority=prio, latency_class=lat,
                                          image_sizes=[size]))
                continue
            if name == "audio":  # one clip per request, for a model with an audio tower
                seconds = float(r_shape.uniform(*AUDIO_SECONDS))
                clip = wav_of(r_img, seconds, int(r_shape.choice(AUDIO_RATES)))
                prio, lat = classes()
                message = user_message([])
                message["content"].insert(0, {"type": "audio", "audio": clip})
                trace.append(TraceRequest(request_id=f"r{i:06d}", arrival_s=arrivals[i], messages=[message],
                                          max_tokens=max_tokens, modality="audio", priority=prio,
                                          latency_class=lat))
                continue
            if name == "document":
                pages, page_sizes = draw_images(int(r_shape.integers(DOCUMENT_PAGES[0], DOCUMENT_PAGES[1] + 1)))
                prio, lat = classes()
                message = user_message([])
                message["content"].insert(0, {"type": "document", "document": pdf_of(pages)})
                trace.append(TraceRequest(request_id=f"r{i:06d}", arrival_s=arrivals[i], messages=[message],
                                          max_tokens=max_tokens, modality="document", priority=prio,
                                          latency_class=lat, image_sizes=page_sizes))
                continue
            images, img_sizes = draw_images(image_count())
            prio, lat = classes()
            message, kind = user_message(images), modality(len(images))
            if name == "mixed" and audio_share > 0 and r_audio.random() < audio_share:
                clip = wav_of(r_audio, float(r_audio.uniform(*AUDIO_SECONDS)), int(r_audio.choice(AUDIO_RATES)))
                message["content"].insert(0, {"type": "audio", "audio": clip})
                kind = "audio"
            trace.append(
                TraceRequest(
                    request_id=f"r{i:06d}", arrival_s=arrivals[i], messages=[message],
                    max_tokens=max_tokens, modality=kind, priority=prio,
                    latency_class=lat, image_sizes=img_sizes,
                )
            )
        return trace

    lengths = _conversation_lengths(num_requests, r_shape, turns)
    histories: list[list[dict[str, Any]]] = []
    convs: list[tuple[list[tuple[int, int]], int, str, str]] = []
    for c in range(len(lengths)):
        # The same bytes objects ride along in every turn, so resends are byte-identical.
        images, img_sizes = draw_images(image_count())
        prio, lat = classes()
        turns = [user_message(images)]
        for _ in range(1, lengths[c]):
            reply = pseudo_english(r_text, max_tokens)
            turns.append({"role": "assistant", "content": [{"type": "text", "text": reply}]})
            turns.append(user_message([]))
        histories.append(turns)
        convs.append((img_sizes, prio, lat, modality(len(images))))
    for i, (c, turn) in enumerate(_interleave(lengths, r_shape)):
        img_sizes, prio, lat, mod = convs[c]
        trace.append(
            TraceRequest(
                request_id=f"r{i:06d}", arrival_s=arrivals[i], messages=histories[c][: 2 * turn + 1],
                max_tokens=max_tokens, modality=mod, priority=prio, latency_class=lat,
                conversation_id=f"c{c:05d}", turn=turn, image_sizes=list(img_sizes),
            )
        )
    return trace


# ---------------------------------------------------------------- persistence

_BYTES_KEY = "__bytes_b64__"


def _jsonable(obj: Any, encode_bytes: Any) -> Any:
    if isinstance(obj, (bytes, bytearray)):
        return encode_bytes(bytes(obj))
    if isinstance(obj, dict):
        return {k: _jsonable(v, encode_bytes) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v, encode_bytes) for v in obj]
    return obj


def _from_jsonable(obj: Any) -> Any:
    if isinstance(obj, dict):
        if set(obj) == {_BYTES_KEY}:
            return base64.b64decode(obj[_BYTES_KEY])
        return {k: _from_jsonable(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_from_jsonable(v) for v in obj]
    return obj


def request_to_dict(req: TraceRequest) -> dict[str, Any]:
    """JSON-safe dict with images as base64."""
    return _jsonable(asdict(req), lambda b: {_BYTES_KEY: base64.b64encode(b).decode("ascii")})


def request_from_dict(d: dict[str, Any]) -> TraceRequest:
    d = _from_jsonable(d)
    d["image_sizes"] = [tuple(s) for s in d.get("image_sizes", [])]
    return TraceRequest(**d)


def save_trace(trace: Iterable[TraceRequest], path: str | Path) -> Path:
    """Write one JSON object per line so a run can be replayed byte-identically."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as f:
        for req in trace:
            f.write(json.dumps(request_to_dict(req), separators=(",", ":")) + "\n")
    return path


def load_trace(path: str | Path) -> list[TraceRequest]:
    with Path(path).open(encoding="utf-8") as f:
        return [request_from_dict(json.loads(line)) for line in f if line.strip()]


def trace_digest(trace: Iterable[TraceRequest]) -> str:
    """sha256 over canonical JSON of every request, images replaced by their own sha256."""
    h = hashlib.sha256()
    for req in trace:
        d = _jsonable(asdict(req), lambda b: {"sha256": hashlib.sha256(b).hexdigest()})
        h.update(json.dumps(d, sort_keys=True, separators=(",", ":")).encode())
        h.update(b"\n")
    return h.hexdigest()
