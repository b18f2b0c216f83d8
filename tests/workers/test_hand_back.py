"""KV hand-back: a decode engine's finished reply, adopted by the prefill engine, is a prefix hit for the
next turn, and the next turn's tokens still equal HF generate's."""

from __future__ import annotations

import pytest

from mserve.common.prompt import PromptBuilder
from mserve.workers.engine import Engine, EngineConfig
from mserve.workers.sequence import SamplingParams
from tests.helpers import PROMPTS, hf_generate, make_image

BS = 16


@pytest.mark.parametrize("arch", ["llava", "qwen2_vl"])
def test_handed_back_reply_blocks_are_a_prefix_hit_for_the_next_turn(tiny_model_dirs, arch):
    model = str(tiny_model_dirs[arch])
    pp = PromptBuilder(model).prepare_text(PROMPTS[1], [make_image(150, 110, seed=5)])
    prefill = Engine(EngineConfig(model, dtype="float32", num_blocks=128, block_size=BS))
    decode = Engine(EngineConfig(model, dtype="float32", num_blocks=96, block_size=BS))
    prefill.add_request("t1", pp.prompt_ids, images=pp.images, sampling=SamplingParams(max_tokens=40, ignore_eos=True),
                        prefill_only=True)
    first = prefill.run_until_done()["t1"]
    seq = decode.import_kv(prefill.export_kv("t1"))
    seq.hand_back = True
    reply, blocks = list(first), None
    while decode.has_unfinished():  # the finishing step's output carries the reply's blocks
        for out in decode.step():
            reply += out.new_token_ids
            blocks = out.hand_back if out.finished else blocks
    assert decode.pool.num_used_blocks == 0 and blocks.first_block == len(pp.prompt_ids) // BS

    adopted = prefill.adopt_blocks(blocks.token_ids, blocks.images, blocks.first_block, blocks.kv)
    covered = (blocks.first_block + blocks.kv.shape[2]) * BS
    assert adopted == blocks.kv.shape[2] > 0 and covered > len(pp.prompt_ids)
    prefill.pool.check_integrity()
    assert prefill.adopt_blocks(blocks.token_ids, blocks.images, blocks.first_block, blocks.kv) == 0

    # Turn 2 resends prompt + reply and asks more: the reply's blocks are found, and the answer is exact.
    turn2 = pp.prompt_ids + reply + pp.prompt_ids[-12:]
    seq2 = prefill.add_request("t2", turn2, images=pp.images, sampling=SamplingParams(max_tokens=6))
    out2 = prefill.run_until_done()["t2"]
    assert seq2.num_cached_tokens == covered
    assert out2 == hf_generate(model, turn2, pp.images, 6)
    # Without the hand-back only the prompt's blocks would have been there.
    assert covered > len(pp.prompt_ids) // BS * BS
