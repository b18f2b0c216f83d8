"""Videos through the engine give exactly Hugging Face generate()'s greedy tokens on the same frames.

Qwen2-VL: the video goes through get_video_features (temporal patches) and M-RoPE with video_grid_thw;
HF gets pixel_values_videos / video_grid_thw built by mserve's own preprocessing (transformers' video
processor needs torchvision), so these tests check the model path, not the preprocessing (see
tests/common/test_video.py for that). LLaVA: each frame is an image, and HF gets the frames as images.
"""

from __future__ import annotations

import io

import pytest

from mserve.common.prompt import PromptBuilder
from mserve.common.video import VideoPart, visual_hash
from mserve.workers.engine import Engine, EngineConfig
from mserve.workers.sequence import SamplingParams
from tests.helpers import PROMPTS, hf_generate_visual, make_frames, make_image, make_video_file

MAX_NEW = 8


@pytest.fixture(scope="module")
def qwen(tiny_model_dirs) -> str:
    return str(tiny_model_dirs["qwen2_vl"])


@pytest.fixture(scope="module")
def llava(tiny_model_dirs) -> str:
    return str(tiny_model_dirs["llava"])


def new_engine(model_dir: str, **overrides) -> Engine:
    return Engine(EngineConfig(model_dir, **{"dtype": "float32", "num_blocks": 256, "block_size": 16, **overrides}))


def video_prompt(builder: PromptBuilder, parts: list, text: str):
    return builder.prepare([{"role": "user", "content": parts + [{"type": "text", "text": text}]}])


def run_one(model_dir: str, pp, **kw) -> list[int]:
    engine = new_engine(model_dir, **kw)
    engine.add_request("r", pp.prompt_ids, images=pp.images, sampling=SamplingParams(max_tokens=MAX_NEW))
    out = engine.run_until_done()["r"]
    engine.pool.check_integrity()
    assert engine.pool.num_used_blocks == 0
    return out


@pytest.mark.parametrize("n_frames", [4, 3], ids=["4-frames", "3-frames-padded"])
def test_qwen_video_matches_hf(qwen, n_frames):
    builder = PromptBuilder(qwen)
    frames = make_frames(120, 90, n_frames, seed=n_frames)
    pp = video_prompt(builder, [{"type": "video", "video": frames}], PROMPTS[0])
    family = builder.family
    info = pp.image_sizes[0]
    assert (info.num_frames, info.width, info.height) == (n_frames, 120, 90)
    t, h, w = family.video_grid(info)
    assert t == 2 and pp.prompt_ids.count(family.video_token_id) == t * h * w // 4 == family.video_token_count(info)
    assert family.image_token_id not in pp.prompt_ids
    assert run_one(qwen, pp) == hf_generate_visual(qwen, pp.prompt_ids, [frames], MAX_NEW)


@pytest.mark.parametrize("fps", [None, 2.0, 0.5], ids=["fps-unknown", "fps-2", "fps-0.5"])
def test_qwen2_5_video_spaced_by_its_frame_rate(tiny_model_dirs, fps):
    """Qwen2.5-VL: the video's temporal positions are spaced by second_per_grid_ts = temporal_patch_size /
    the frames' rate (24 when none is given, as transformers assumes), in one prompt with an image, prefilled
    in chunks; HF gets second_per_grid_ts from transformers' own VideoMetadata of the same frames."""
    model_dir = str(tiny_model_dirs["qwen2_5_vl"])
    builder = PromptBuilder(model_dir)
    frames = make_frames(120, 90, 6, seed=21)
    video = {"type": "video", "video": frames, **({"fps": fps} if fps is not None else {})}
    pp = video_prompt(builder, [{"type": "image", "image": make_image(90, 120, seed=2)}, video], PROMPTS[0])
    assert pp.images[1].fps == fps
    meta = [{"total_num_frames": 6, "fps": fps}] if fps is not None else None
    expected = hf_generate_visual(model_dir, pp.prompt_ids, [pp.images[0], frames], MAX_NEW, meta)
    assert run_one(model_dir, pp, max_num_batched_tokens=16) == expected
    if fps == 0.5:  # not vacuous: the rate moves the positions, and the tiny model's tokens with them
        assert expected != hf_generate_visual(model_dir, pp.prompt_ids, [pp.images[0], frames], MAX_NEW)


def test_qwen2_5_video_file_rate_is_the_sampled_frames(tiny_model_dirs):
    """A file at 4 fps sampled to 2 fps: the rate that spaces positions is transformers' sampled_fps of
    VideoMetadata(total frames, the file's fps, the indices kept)."""
    from mserve.common.video import decode_video_file

    pytest.importorskip("av")
    model_dir = str(tiny_model_dirs["qwen2_5_vl"])
    data = make_video_file(make_frames(112, 84, 9, seed=5), fps=4)
    builder = PromptBuilder(model_dir)
    pp = video_prompt(builder, [{"type": "video", "video": data}], PROMPTS[5])
    part = pp.images[0]
    assert part.indices == (0, 1, 3, 5, 7) and part.fps == pytest.approx(5 / 9 * 4)
    frames = []
    for image in decode_video_file(data, part.indices):
        buf = io.BytesIO()
        image.save(buf, format="PNG")
        frames.append(buf.getvalue())
    meta = [{"total_num_frames": 9, "fps": 4.0, "frames_indices": list(part.indices)}]
    assert run_one(model_dir, pp) == hf_generate_visual(model_dir, pp.prompt_ids, [frames], MAX_NEW, meta)


def test_the_oracle_sees_the_frames_and_their_order(qwen):
    """Not vacuous: the tiny model's tokens change with the frames' content and with their order."""
    builder = PromptBuilder(qwen)
    frames = make_frames(120, 90, 4, seed=4)
    pp = video_prompt(builder, [{"type": "video", "video": frames}], PROMPTS[0])
    base = hf_generate_visual(qwen, pp.prompt_ids, [frames], MAX_NEW)
    assert base != hf_generate_visual(qwen, pp.prompt_ids, [[frames[1], frames[0]] + frames[2:]], MAX_NEW)
    assert base != hf_generate_visual(qwen, pp.prompt_ids, [make_frames(120, 90, 4, seed=9)], MAX_NEW)


def test_qwen_image_and_video_in_one_prompt_chunked(qwen):
    """Positions of an image then a video (both grids through get_rope_index), prefilled in 16-token chunks."""
    builder = PromptBuilder(qwen)
    image, frames = make_image(150, 100, seed=3), make_frames(96, 128, 5, seed=4)
    pp = video_prompt(builder, [{"type": "image", "image": image}, {"type": "video", "video": frames}], PROMPTS[2])
    assert run_one(qwen, pp, max_num_batched_tokens=16) == hf_generate_visual(qwen, pp.prompt_ids, [image, frames],
                                                                            MAX_NEW)


@pytest.mark.parametrize("arch", ["llava", "llava_next"])
def test_llava_video_is_its_frames_as_images(tiny_model_dirs, arch):
    llava = str(tiny_model_dirs[arch])  # LLaVA-NeXT: each frame an any-res image of its own
    builder = PromptBuilder(llava)
    frames = make_frames(100, 80, 3, seed=7)
    pp = video_prompt(builder, [{"type": "video", "video": frames}], PROMPTS[1])
    per_image = builder.family.visual_token_count((100, 80))
    assert len(builder.family.image_spans(pp.prompt_ids)) == 3
    assert pp.prompt_ids.count(builder.family.image_token_id) == 3 * per_image
    # the same prompt as three image parts
    as_images = builder.prepare([{"role": "user", "content": [{"type": "image", "image": f} for f in frames]
                                  + [{"type": "text", "text": PROMPTS[1]}]}])
    assert as_images.prompt_ids == pp.prompt_ids
    assert run_one(llava, pp) == hf_generate_visual(llava, pp.prompt_ids, [frames], MAX_NEW)


@pytest.mark.parametrize("arch", ["qwen2_vl", "qwen2_5_vl", "llava", "llava_next"])
def test_video_encoded_elsewhere_then_kv_handed_off(tiny_model_dirs, arch):
    """The disaggregated path in-process: encode on one engine, prefill on a second, decode on a third."""
    model_dir = str(tiny_model_dirs[arch])
    builder = PromptBuilder(model_dir)
    frames = make_frames(110, 70, 4, seed=11)
    pp = video_prompt(builder, [{"type": "video", "video": frames}], PROMPTS[3])
    video = pp.images[0]
    encoded = new_engine(model_dir).encode([video])
    prefill, decode = new_engine(model_dir), new_engine(model_dir, num_blocks=200)
    prefill.add_request("r", pp.prompt_ids, encoded=encoded, image_hashes=[visual_hash(video)],
                        sampling=SamplingParams(max_tokens=MAX_NEW), prefill_only=True, item_fps=[video.fps])
    first = []
    while prefill.has_unfinished():
        first += [o.new_token_ids[0] for o in prefill.step()]
    payload = prefill.export_kv("r")
    assert len(payload.state.images) == (1 if arch.startswith("qwen") else 4)  # one placeholder run per frame on LLaVA
    decode.import_kv(payload)
    out = first + decode.run_until_done()["r"]
    assert out == hf_generate_visual(model_dir, pp.prompt_ids, [frames], MAX_NEW)


def test_a_video_reference_keeps_its_frame_rate():
    """The wire's ImageRef -> the engine's VideoPart (encode and unified workers) keeps the rate."""
    from mserve.common.protocol.to_worker import ImageRef
    from mserve.workers.roles.encode import visual_input

    frames = ImageRef.parse(ImageRef(hash="h", data=b"", frames=[b"x"], fps=0.5).fields(), "ImageRef")
    assert visual_input(frames) == VideoPart(frames=(b"x",), fps=0.5)
    assert visual_input(ImageRef(hash="h", data=b"v", frame_indices=[0, 3], fps=1.5)).fps == 1.5


def test_video_hash_keys_frames_and_order():
    a, b = make_frames(40, 30, 2, seed=1), make_frames(40, 30, 2, seed=2)
    assert visual_hash(VideoPart(frames=tuple(a))) == visual_hash(VideoPart(frames=tuple(a)))
    assert visual_hash(VideoPart(frames=tuple(a))) != visual_hash(VideoPart(frames=tuple(a[::-1])))
    assert visual_hash(VideoPart(frames=tuple(a))) != visual_hash(VideoPart(frames=tuple(b)))
    assert visual_hash(VideoPart(data=b"x", indices=(0, 2))) != visual_hash(VideoPart(data=b"x", indices=(0, 1)))
    # the same frames at another rate take other M-RoPE positions (Qwen2.5-VL): another key
    assert visual_hash(VideoPart(frames=tuple(a), fps=2.0)) != visual_hash(VideoPart(frames=tuple(a)))


@pytest.mark.parametrize("arch", ["qwen2_vl", "llava"])
def test_video_file_sampled_and_decoded(tiny_model_dirs, arch):
    """A video file (PyAV): admission-time sampling by demux, decode on the worker, same tokens as HF on the
    frames PyAV decodes at those indices."""
    from mserve.common.video import decode_video_file, describe_video

    pytest.importorskip("av")
    data = make_video_file(make_frames(112, 84, 9, seed=5), fps=4)  # 2.25 s at 4 fps -> 5 frames at 2 fps
    model_dir = str(tiny_model_dirs[arch])
    builder = PromptBuilder(model_dir)
    part, info = describe_video(VideoPart(data=data))
    assert part.indices == (0, 1, 3, 5, 7) and (info.num_frames, info.width, info.height) == (5, 112, 84)
    pp = video_prompt(builder, [{"type": "video", "video": data}], PROMPTS[5])
    assert pp.images[0] == part
    frames = []
    for image in decode_video_file(data, part.indices):  # PyAV's frames, losslessly as PNG for the oracle
        buf = io.BytesIO()
        image.save(buf, format="PNG")
        frames.append(buf.getvalue())
    assert run_one(model_dir, pp) == hf_generate_visual(model_dir, pp.prompt_ids, [frames], MAX_NEW)


@pytest.mark.parametrize("arch", ["qwen2_vl", "llava"])
def test_coordinator_and_engine_key_video_blocks_alike(tiny_model_dirs, arch):
    """The prefix-affinity keys the coordinator computes from admission equal the engine's block keys."""
    from mserve.common.hashing import item_spans, prompt_block_hashes
    from mserve.coordinator.admission import Limits, admit

    model_dir = str(tiny_model_dirs[arch])
    builder = PromptBuilder(model_dir)
    frames = make_frames(100, 80, 3, seed=13)
    content = [{"type": "image", "image": make_image(90, 60, seed=14)}, {"type": "video", "video": frames},
               {"type": "text", "text": PROMPTS[6]}]
    admitted = admit(builder, Limits(), {"request_id": "x", "messages": [{"role": "user", "content": content}]})
    spans = item_spans(builder.family.image_spans(admitted.prompt_ids), [(im.hash, im.num_tokens) for im in admitted.images])
    engine = new_engine(model_dir)
    pp = builder.prepare([{"role": "user", "content": content}])
    seq = engine.add_request("r", pp.prompt_ids, images=pp.images, sampling=SamplingParams(max_tokens=1))
    assert pp.prompt_ids == admitted.prompt_ids and seq.images == spans
    assert len(spans) == (2 if arch == "qwen2_vl" else 4)  # LLaVA: the image and one run per frame
    assert prompt_block_hashes(admitted.prompt_ids, 16, spans) == seq.prompt_hashes(16)
    if arch == "llava":
        assert [s.image_hash for s in spans[1:]] == [f"{admitted.images[1].hash}/{k}" for k in range(3)]
