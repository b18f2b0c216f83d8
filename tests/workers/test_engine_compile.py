"""The engine with its decode steps compiled by torch.compile (EngineConfig.compile) gives exactly HF generate's tokens.

Inductor fuses and reorders the language model's elementwise work, so this is not a given: a
ragged batch (text and images, requests joining while others decode) must still reproduce HF's
greedy ids, with batches of one and of many both going through the compiled graphs.
"""

from __future__ import annotations

import pytest

from mserve.common.prompt import PromptBuilder
from mserve.workers.engine import Engine, EngineConfig
from mserve.workers.sequence import SamplingParams
from tests.helpers import hf_generate, request_mix

# torch's own compile path touches torch.jit.script_method, which torch itself now marks deprecated.
pytestmark = pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")

MAX_NEW = 12


@pytest.fixture(scope="module", params=["llava", "qwen2_vl"])
def model_dir(request, tiny_model_dirs) -> str:
    return str(tiny_model_dirs[request.param])


def test_compiled_decode_gives_hf_tokens(model_dir):
    builder = PromptBuilder(model_dir)
    requests = {f"r{i}": builder.prepare_text(text, images) for i, (text, images) in enumerate(request_mix(6, seed=7))}
    engine = Engine(EngineConfig(model_dir, dtype="float32", num_blocks=512, block_size=16, max_num_batched_tokens=4096,
                                 compile=True))
    assert engine.runner._compiled_decode is not None
    compiled_steps = 0
    real = engine.runner._compiled_decode

    def counted(*args, **kwargs):
        nonlocal compiled_steps
        compiled_steps += 1
        return real(*args, **kwargs)

    engine.runner._compiled_decode = counted
    # r0 alone first (decode batches of one), then the rest join (batches of many).
    engine.add_request("r0", requests["r0"].prompt_ids, images=requests["r0"].images,
                       sampling=SamplingParams(max_tokens=MAX_NEW))
    results: dict[str, list[int]] = {}
    for _ in range(4):
        for o in engine.step():
            results.setdefault(o.request_id, []).extend(o.new_token_ids)
    alone = compiled_steps
    for rid, pp in list(requests.items())[1:]:
        engine.add_request(rid, pp.prompt_ids, images=pp.images, sampling=SamplingParams(max_tokens=MAX_NEW))
    for rid, ids in engine.run_until_done().items():
        results.setdefault(rid, []).extend(ids)
    assert alone >= 3 and compiled_steps - alone >= MAX_NEW - 2  # both batch shapes ran compiled
    for rid, pp in requests.items():
        assert results[rid] == hf_generate(model_dir, pp.prompt_ids, pp.images, MAX_NEW), rid


def test_compile_refuses_exact_length_attention(tiny_model_dirs):
    with pytest.raises(ValueError, match="exact_attention"):
        Engine(EngineConfig(str(tiny_model_dirs["llava"]), dtype="bfloat16", exact_attention=True, num_blocks=64,
                            compile=True))
