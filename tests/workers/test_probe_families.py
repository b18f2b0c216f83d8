"""Transformers VLMs this repository has no code or tests for serve once the load-time probe proves
them: the probe passes, and the engine's answers to requests of its own equal HF generate's."""

from __future__ import annotations

import pytest

from mserve.common.model import load_family
from mserve.common.prompt import PromptBuilder
from mserve.workers.engine import Engine, EngineConfig
from mserve.workers.probe import CASES, verify
from mserve.workers.sequence import SamplingParams
from tests.helpers import PROMPTS, hf_generate, make_image

# Five model types from transformers' image-text-to-text mapping, each with something of its own:
# several vision layers projected (vipllava), any-res tiles over a sliding-window Mistral (llava_next_video),
# a SigLIP tower + aligner with a fixed count (deepseek_vl), a separate image tower whose pixels are
# pixel_values_images (video_llava), Qwen2-VL grids over a RiceViT and Qwen3 text (llava_onevision1_5).
SERVED = ["vipllava", "llava_next_video", "deepseek_vl", "video_llava", "llava_onevision1_5"]


@pytest.fixture(scope="module", params=SERVED)
def model_dir(request, tiny_model_dirs) -> str:
    return str(tiny_model_dirs[request.param])


def test_untested_family_loads_as_untested(model_dir):
    assert load_family(model_dir).tested is False


def test_probe_serves_it_every_case_exact(model_dir):
    verdict = verify(model_dir, dtype="float32")
    assert verdict.served, verdict.reason
    assert [c.name for c in verdict.cases] == [c.name for c in CASES]
    assert all(c.ok and c.expected == c.produced and len(c.expected) > 0 for c in verdict.cases)
    by_name = {c.name: c for c in verdict.cases}
    assert by_name["chunk ends inside an image"].detail.startswith("prefill chunks")  # it really was chunked
    assert not by_name["prefix hit"].detail.startswith("0 ")  # and really hit the prefix cache


def test_engine_answers_equal_hf_generate(model_dir):
    """Beyond the probe's cases: a ragged batch of requests of other sizes, on a fresh engine and a separate
    reference model, token for token against HF generate."""
    builder = PromptBuilder(model_dir)
    requests = {f"r{i}": builder.prepare_text(PROMPTS[i], [make_image(90 + 30 * i + 17 * k, 70 + 20 * i, seed=10 * i + k)
                                                           for k in range(i % 3)]) for i in range(5)}
    engine = Engine(EngineConfig(model_dir, dtype="float32", num_blocks=256, block_size=16, max_num_batched_tokens=4096))
    for rid, pp in requests.items():
        engine.add_request(rid, pp.prompt_ids, images=pp.images, sampling=SamplingParams(max_tokens=8))
    results = engine.run_until_done()
    for rid, pp in requests.items():
        assert results[rid] == hf_generate(model_dir, pp.prompt_ids, pp.images, 8), rid
    engine.pool.check_integrity()


def test_a_family_the_traits_allow_but_the_engine_gets_wrong_is_refused_by_the_probe_naming_the_case(tiny_model_dirs):
    """LightOnOCR's traits are all honoured and one image serves exactly, but two images in a row are one
    run of identical placeholder tokens that the engine cannot split by image: refused, naming the case."""
    from mserve.workers.verdicts import cached_verdict

    model = str(tiny_model_dirs["lighton_ocr"])
    assert load_family(model).tested is False  # admitted at load ...
    verdict, _ = cached_verdict(model)  # (cached for the worker test below)
    assert not verdict["served"]  # ... refused by the probe
    assert verdict["reason"].startswith("case 'two images': the engine failed (ValueError: request two images: prompt "
                                     "has 1 image placeholder runs but 2 images")


def test_video_to_a_family_verified_at_load_is_refused_naming_why(model_dir):
    """The probe proves images only: a video (even as frames) is refused at admission, not guessed at."""
    assert load_family(model_dir).video_unsupported().endswith("a family verified at load is proven on images only")


def test_worker_of_a_family_the_probe_refused_exits_before_ready_in_one_line(tiny_model_dirs):
    """`mserve worker` checks the verdict before it connects (the coordinator address is never dialled); a
    restart after the refusal above reads it from the cache instead of probing again."""
    import os
    import subprocess
    import sys

    from mserve.workers.verdicts import cached_verdict

    cached_verdict(tiny_model_dirs["lighton_ocr"], dtype="float32")  # the refusal, as the test above left it (or made now)
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run([sys.executable, "-m", "mserve.cli", "worker", "--role", "unified", "--model",
                           str(tiny_model_dirs["lighton_ocr"]), "--dtype", "float32", "--coordinator", "tcp://127.0.0.1:9"],
                          capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 1
    assert "Traceback" not in proc.stderr
    assert proc.stderr.splitlines()[-1].startswith(
        "error: model_type 'lighton_ocr' failed the load-time exactness probe: case 'two images': the engine failed")
    assert "probe verdict of" in proc.stderr and "read from" in proc.stderr  # not probed again
