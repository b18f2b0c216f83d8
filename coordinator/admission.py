"""Admission: validate a client's request at the edge and turn it into prompt ids, before any pixel is decoded.

A GENERATE is the outside world's input: pydantic checks it here (one parse, with messages that
name the field and the limit) and it leaves as the wire's typed `Generate` (common/protocol/client.py).

Each image is hashed and only its header is read (for its size); the exact visual token count
comes from the model family's processor rules, so the full prompt length is known here and every
limit is enforced with a message that names it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Literal

from jinja2 import TemplateError
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from mserve.common import sampling_rules as rules
from mserve.common.audio import AudioInfo, AudioPart, audio_hash, audio_key, read_audio_header
from mserve.common.model import VideoInfo
from mserve.common.images import ImageError, image_hash, image_size_from_header
from mserve.common.policy import LATENCY_CLASSES, Limits
from mserve.common.prompt import PromptBuilder, normalize_messages
from mserve.common.pruning import pruned_hash
from mserve.common.video import VideoPart, VideoProbe, describe_video, sample_video, video_file_key, video_hash
from mserve.common.protocol import ErrorCode
from mserve.common.protocol.client import Generate, MediaRef, Sampling


class AdmissionError(ValueError):
    """The request is invalid or over a limit; the message says which field and which limit.

    ``code`` is ``too_large`` for size limits (an HTTP gateway answers 413), else ``bad_request``.
    """

    def __init__(self, message: str, code: str = ErrorCode.BAD_REQUEST) -> None:
        super().__init__(message)
        self.code = code


class SamplingIn(BaseModel):
    # Unlike other bodies, unknown sampling fields are rejected, not ignored: silently dropping a
    # parameter the client relies on (a typo, or one this server lacks) would change its results.
    model_config = ConfigDict(extra="forbid")

    # The defaults and bounds are common/sampling_rules.py's (the wire's Sampling takes the same defaults).
    max_tokens: int = Field(rules.MAX_TOKENS, **rules.BOUNDS["max_tokens"].pydantic())
    temperature: float = Field(rules.TEMPERATURE, **rules.BOUNDS["temperature"].pydantic())
    top_k: int = Field(rules.TOP_K, **rules.BOUNDS["top_k"].pydantic())
    top_p: float = Field(rules.TOP_P, **rules.BOUNDS["top_p"].pydantic())
    seed: int | None = Sampling.seed
    stop_token_ids: list[int] = Field(default_factory=list)
    ignore_eos: bool = Sampling.ignore_eos


class GenerateIn(BaseModel):
    """The GENERATE body as a client sends it (extra fields from newer clients are ignored)."""

    model_config = ConfigDict(extra="ignore")

    request_id: str = Field(min_length=1, max_length=128)
    messages: list[dict[str, Any]] = Field(min_length=1)
    sampling: SamplingIn = Field(default_factory=SamplingIn)
    priority: int = Field(rules.PRIORITY, **rules.BOUNDS["priority"].pydantic())
    latency_class: Literal[LATENCY_CLASSES] = "interactive"  # type: ignore[valid-type]
    stream: bool = False
    # The client's token sink (a tcp:// address it binds): with the coordinator's token_report_every > 1
    # the decode worker streams this request's tokens there itself (docs/scaling.md). Ignored otherwise.
    tokens_to: str | None = Field(None, max_length=256, pattern=r"^tcp://[^\s/]+:\d+$")
    # The caller's span (W3C traceparent): the request's trace continues under it. One that does not
    # parse starts a new trace, as W3C Trace Context asks; it never fails the request.
    trace: str | None = Field(None, max_length=128)
    model: str | None = Field(None, max_length=256)  # which served model (coordinator/models.py chose it already)

    def to_wire(self) -> Generate:
        s = self.sampling
        return Generate(request_id=self.request_id, messages=self.messages,
                        sampling=Sampling(max_tokens=s.max_tokens, temperature=s.temperature, top_k=s.top_k,
                                          top_p=s.top_p, seed=s.seed, stop_token_ids=list(s.stop_token_ids),
                                          ignore_eos=s.ignore_eos),
                        priority=self.priority, latency_class=self.latency_class, stream=self.stream,
                        tokens_to=self.tokens_to, trace=self.trace, model=self.model)


@dataclass
class AdmittedImage:
    """One image, or one video: `frames` (a list of frames) or `frame_indices` (the frames of the video
    file in `data` that the model sees). `size` is a video's frame size."""

    hash: str
    data: bytes
    size: tuple[int, int]
    num_tokens: int
    frames: list[bytes] | None = None
    frame_indices: list[int] | None = None
    fps: float | None = None  # a video's sampled frame rate (VideoPart.fps)
    end: int = 0  # where its placeholder range ends in the prompt
    grid: list[int] | None = None  # an image's (t, h, w) patch grid on an M-RoPE family (ModelFamily.image_grid)
    # A prefill can do without its embeddings when the cached prefix holds its placeholders: an image (a
    # video is always encoded) whose grid is known where positions need one (workers/prefix_skip.py).
    skippable: bool = False
    # An audio clip (`data` its file): its length in samples at the feature extractor's rate, which the
    # encode worker holds the decoded clip to (common/audio.py). None: an image or a video.
    audio_samples: int | None = None
    media: MediaRef | None = None  # an image in a media store (`data` empty): where its encoder pulls it

    @property
    def is_video(self) -> bool:
        return self.frames is not None or self.frame_indices is not None

    @property
    def kind(self) -> str:
        """The item's modality label: "image", "video" or "audio" (the metrics' `modality`)."""
        return "audio" if self.audio_samples is not None else "video" if self.is_video else "image"


@dataclass
class Admitted:
    request: Generate
    prompt_ids: list[int]
    images: list[AdmittedImage]
    admission_s: float = 0.0  # how long admission took (the trace's admission span)
    # The request's own keep ratio (SLO-adaptive pruning): its placeholders are counted at it, its
    # image hashes carry it (common/pruning.py: pruned_hash) and its encoder prunes to it. None: as
    # the cluster's --visual-token-pruning.
    keep_ratio: float | None = None
    model: str | None = None  # the served model that takes it (a group's chosen variant): RESULT names it

    @property
    def visual_tokens(self) -> int:
        return sum(im.num_tokens for im in self.images)

    @property
    def inline_media_bytes(self) -> int:
        """Raw media bytes this request brings through the coordinator (none for items in a media store)."""
        return sum(len(im.data) + sum(len(f) for f in im.frames or ()) for im in self.images)


def _pydantic_message(exc: ValidationError) -> str:
    parts = []
    for err in exc.errors():
        field = ".".join(str(x) for x in err["loc"]) or "request"
        parts.append(f"{field}: {err['msg']}")
    return "; ".join(parts)


def admit(builder: PromptBuilder, limits: Limits, payload: dict[str, Any],
          keep_ratio: Callable[[str], float | None] | None = None) -> Admitted:
    """`keep_ratio`: the pruning ratio a request of this latency class gets now (SLO-adaptive pruning),
    None for the cluster's own; asked only of requests with images."""
    try:
        req = GenerateIn.model_validate(payload)
    except ValidationError as exc:
        raise AdmissionError(_pydantic_message(exc)) from None
    if req.sampling.max_tokens > limits.max_tokens:
        raise AdmissionError(f"sampling.max_tokens={req.sampling.max_tokens} is over the limit max_tokens={limits.max_tokens}")
    try:
        messages, images = normalize_messages(req.messages, allow_paths=False)
    except ValueError as exc:
        raise AdmissionError(str(exc)) from None
    n_images = sum(1 for x in images if _kind(x) == "image")
    n_audio = sum(1 for x in images if _kind(x) == "audio")
    if n_audio > limits.max_audio_per_request:
        raise AdmissionError(f"{n_audio} audio clips is over the limit max_audio_per_request={limits.max_audio_per_request}")
    if n_images > limits.max_images_per_request:
        raise AdmissionError(f"{n_images} images is over the limit max_images_per_request={limits.max_images_per_request}")
    ratio = keep_ratio(req.latency_class) if keep_ratio is not None and images else None
    admitted_images: list[AdmittedImage] = []
    sizes: list[tuple[int, int] | VideoInfo | AudioInfo] = []
    for i, data in enumerate(images):
        if _kind(data) == "audio":
            clip, audio = _admit_audio(builder, limits, i, data, req.model)
            admitted_images.append(clip)
            images[i] = AudioPart(clip.data, clip.audio_samples)
            sizes.append(audio)
            continue
        if _kind(data) == "video":
            video, info = _admit_video(builder, limits, i, data, ratio)
            admitted_images.append(video)
            sizes.append(info)
            continue
        if (why := builder.family.image_unsupported()) is not None:
            raise AdmissionError(f"image {i}: model {req.model or builder.model_dir} takes no image input: {why}")
        # An image in a media store comes as its ref: its facts are counted, its bytes never come here.
        ref = data if isinstance(data, MediaRef) else None
        nbytes = ref.nbytes if ref is not None else len(data)
        if nbytes > limits.max_image_bytes:
            raise AdmissionError(f"image {i} is {nbytes} bytes, over the limit max_image_bytes={limits.max_image_bytes}",
                                 ErrorCode.TOO_LARGE)
        try:
            w, h = _stored_size(ref) if ref is not None else image_size_from_header(data)
            if w * h > limits.max_image_pixels:
                raise AdmissionError(f"image {i} is {w}x{h} = {w * h} pixels, over the limit "
                                     f"max_image_pixels={limits.max_image_pixels}", ErrorCode.TOO_LARGE)
            tokens = builder.family.visual_token_count((w, h), ratio)
        except ImageError as exc:
            raise AdmissionError(f"image {i}: {exc}") from None
        admitted_images.append(AdmittedImage(pruned_hash(ref.hash if ref is not None else image_hash(data), ratio),
                                             b"" if ref is not None else data, (w, h), tokens, media=ref))
        sizes.append((w, h))
    try:
        prompt = builder.prepare_normalized(messages, sizes, images, ratio)
    except (ValueError, TemplateError) as exc:  # templates reject some conversations (roles, order)
        raise AdmissionError(f"the chat template rejected the messages: {exc}" if isinstance(exc, TemplateError)
                             else str(exc)) from None
    if len(prompt.prompt_ids) > limits.max_prompt_tokens:
        raise AdmissionError(f"prompt is {len(prompt.prompt_ids)} tokens ({sum(i.num_tokens for i in admitted_images)} "
                             f"visual), over the limit max_prompt_tokens={limits.max_prompt_tokens}",
                             ErrorCode.TOO_LARGE)
    _place(builder.family, prompt.prompt_ids, admitted_images)
    return Admitted(req.to_wire(), prompt.prompt_ids, admitted_images, keep_ratio=ratio)


def _kind(item: Any) -> str:
    """An item's modality: "image", "video" or "audio", inline or in a media store."""
    if isinstance(item, MediaRef):
        return item.kind
    return "audio" if isinstance(item, AudioPart) else "video" if isinstance(item, VideoPart) else "image"


def _check_source(ref: MediaRef) -> None:
    # The worker parses the whole descriptor when it pulls (the coordinator loads no torch for it).
    if ref.source.get("shared") is not True or ref.source.get("backend") not in ("auto", "shm", "tcp"):
        raise ImageError("its media ref's source must be a media store's shared shm/tcp transfer descriptor")


def _stored_size(ref: MediaRef) -> tuple[int, int]:
    """A stored image's (width, height) from its ref, once the ref is one an encoder can pull."""
    if len(ref.size) != 2 or min(ref.size) < 1:
        raise ImageError(f"its media ref's size must be [width, height], both positive (got {ref.size}; "
                         "0x0: the client could not read its header)")
    _check_source(ref)
    return ref.size[0], ref.size[1]


def _place(family: Any, prompt_ids: list[int], images: list[AdmittedImage]) -> None:
    """Each item's placeholder end in the prompt, and an image's M-RoPE grid (for a prefix-cache skip)."""
    runs = iter(family.image_spans(prompt_ids))
    for im in images:
        covered = 0
        while covered < im.num_tokens and (run := next(runs, None)) is not None:
            covered += run[1]
            im.end = run[0] + run[1]
        if not im.is_video and im.audio_samples is None and family.uses_mrope:  # an image's grid
            grid = family.image_grid(im.size)
            if grid is not None and grid[0] * grid[1] * grid[2] // family.merge_size ** 2 == im.num_tokens:
                im.grid = list(grid)
        im.skippable = not im.is_video and (im.grid is not None or not family.uses_mrope)


def _admit_audio(builder: PromptBuilder, limits: Limits, i: int, part: AudioPart | MediaRef,
                 model: str | None) -> tuple[AdmittedImage, AudioInfo]:
    """Check one audio clip against the limits and count its tokens from its container header (no sample
    decoded): read here from inline bytes, or the facts of a stored clip's ref (common/media_facts.py)."""
    family = builder.family
    if family.audio_unsupported() is not None:
        raise AdmissionError(f"audio {i}: model {model or builder.model_dir} takes no audio input "
                             f"(model_type {family.model_type} has no audio tower mserve serves)")
    ref = part if isinstance(part, MediaRef) else None
    nbytes = ref.nbytes if ref is not None else len(part.data)
    if nbytes > limits.max_audio_bytes:
        raise AdmissionError(f"audio {i} is {nbytes} bytes, over the limit max_audio_bytes={limits.max_audio_bytes}",
                             ErrorCode.TOO_LARGE)
    try:
        info = _stored_audio(ref) if ref is not None else read_audio_header(part.data)
    except ImageError as exc:
        raise AdmissionError(f"audio {i}: {exc}") from None
    if info.seconds > limits.max_audio_seconds:
        raise AdmissionError(f"audio {i} is {info.seconds:.3f} s, over the limit max_audio_seconds="
                             f"{limits.max_audio_seconds:g}", ErrorCode.TOO_LARGE)
    tokens = family.audio_token_count(info)
    if tokens < 1:
        raise AdmissionError(f"audio {i} is {info.seconds:.3f} s, too short for one audio token of "
                             f"{family.model_type} (a clip must be at least {family.audio_features.min_seconds:.3f} s)")
    samples = info.resampled_samples(family.audio_features.sampling_rate)
    if ref is not None:
        return AdmittedImage(audio_key(ref.hash, samples), b"", (0, 0), tokens, audio_samples=samples, media=ref), info
    return AdmittedImage(audio_hash(AudioPart(part.data, samples)), part.data, (0, 0), tokens,
                         audio_samples=samples), info


def _stored_audio(ref: MediaRef) -> AudioInfo:
    """A stored clip's header facts, as read_audio_header gives an inline clip's."""
    if ref.sample_rate < 1 or ref.samples < 0:
        raise ImageError(f"its media ref's sample_rate must be positive and samples not negative (got "
                         f"sample_rate={ref.sample_rate}, samples={ref.samples}; 0: the client could not read its header)")
    _check_source(ref)
    return AudioInfo(sample_rate=ref.sample_rate, samples=ref.samples, codec="stored")


def _admit_video(builder: PromptBuilder, limits: Limits, i: int, part: VideoPart | MediaRef,
                 ratio: float | None = None) -> tuple[AdmittedImage, VideoInfo]:
    """Check one video against the limits and count its tokens, decoding no pixel (a file is demuxed only;
    a stored file's probe is its ref's facts, common/media_facts.py)."""
    if (why := builder.family.video_unsupported()) is not None:
        raise AdmissionError(f"video {i}: {why}")
    if isinstance(part, MediaRef):
        return _admit_stored_video(builder, limits, i, part, ratio)
    if part.frames is not None:
        if len(part.frames) > limits.max_video_frames:
            raise AdmissionError(f"video {i} has {len(part.frames)} frames, over the limit "
                                 f"max_video_frames={limits.max_video_frames}", ErrorCode.TOO_LARGE)
        for k, frame in enumerate(part.frames):
            if len(frame) > limits.max_image_bytes:
                raise AdmissionError(f"video {i} frame {k} is {len(frame)} bytes, over the limit "
                                     f"max_image_bytes={limits.max_image_bytes}", ErrorCode.TOO_LARGE)
    elif len(part.data or b"") > limits.max_image_bytes:
        raise AdmissionError(f"video {i} is {len(part.data or b'')} bytes, over the limit "
                             f"max_image_bytes={limits.max_image_bytes}", ErrorCode.TOO_LARGE)
    try:
        part, info = describe_video(part, limits.video_fps, limits.max_video_frames, builder.family)
        tokens = _video_tokens(builder, limits, i, info, ratio)
    except ImageError as exc:
        raise AdmissionError(f"video {i}: {exc}") from None
    admitted = AdmittedImage(pruned_hash(video_hash(part), ratio), part.data or b"", (info.width, info.height), tokens,
                             frames=list(part.frames) if part.frames is not None else None,
                             frame_indices=list(part.indices) if part.indices is not None else None, fps=part.fps)
    return admitted, info


def _video_tokens(builder: PromptBuilder, limits: Limits, i: int, info: VideoInfo, ratio: float | None) -> int:
    if info.width * info.height > limits.max_image_pixels:
        raise AdmissionError(f"video {i} frames are {info.width}x{info.height} = {info.width * info.height} "
                             f"pixels, over the limit max_image_pixels={limits.max_image_pixels}", ErrorCode.TOO_LARGE)
    return builder.family.visual_token_count(info, ratio)


def _admit_stored_video(builder: PromptBuilder, limits: Limits, i: int, ref: MediaRef,
                        ratio: float | None) -> tuple[AdmittedImage, VideoInfo]:
    """A video file in a media store: sampled and counted from its ref's facts (frames, fps, size)."""
    if ref.nbytes > limits.max_image_bytes:
        raise AdmissionError(f"video {i} is {ref.nbytes} bytes, over the limit max_image_bytes={limits.max_image_bytes}",
                             ErrorCode.TOO_LARGE)
    try:
        if len(ref.size) != 2 or min(ref.size) < 1 or ref.frames < 1 or ref.fps < 0:
            raise ImageError(f"its media ref's size must be [width, height], both positive, frames positive and fps "
                             f"not negative (got size={ref.size}, frames={ref.frames}, fps={ref.fps}; 0: the client "
                             "could not read its header)")
        _check_source(ref)
        probe = VideoProbe(ref.frames, ref.fps or None, ref.size[0], ref.size[1])
        indices, fps, info = sample_video(probe, limits.video_fps, limits.max_video_frames, builder.family)
        tokens = _video_tokens(builder, limits, i, info, ratio)
    except ImageError as exc:
        raise AdmissionError(f"video {i}: {exc}") from None
    return AdmittedImage(pruned_hash(video_file_key(ref.hash, indices), ratio), b"", (info.width, info.height), tokens,
                         frame_indices=list(indices), fps=fps, media=ref), info
