"""The cluster's Redis prefix index stays exactly what a KV pool holds, through eviction churn, and
prompts recomputed after their blocks were evicted still give HF generate's tokens."""

from __future__ import annotations

import pytest

from mserve.common.prompt import PromptBuilder
from mserve.common.redis_store import RedisStore
from mserve.workers.cache_index import PrefixIndexPublisher
from mserve.workers.engine import Engine, EngineConfig
from mserve.workers.sequence import SamplingParams
from tests.helpers import PROMPTS, hf_generate, make_image

MAX_NEW = 6


@pytest.mark.parametrize("arch", ["llava", "qwen2_vl"])
def test_index_equals_pool_through_churn_and_evicted_prompts_stay_exact(tiny_model_dirs, redis_url, arch):
    model = str(tiny_model_dirs[arch])
    builder = PromptBuilder(model)
    image_a, image_b = make_image(160, 120, seed=1), make_image(120, 160, seed=2)
    prompts = {"a": builder.prepare_text(PROMPTS[0], [image_a]), "t": builder.prepare_text(PROMPTS[1] * 3, []),
               "b": builder.prepare_text(PROMPTS[2], [image_b]), "ab": builder.prepare_text(PROMPTS[3], [image_a, image_b])}
    longest = max(len(p.prompt_ids) for p in prompts.values())
    # Room for about two prompts at once: every new prompt evicts some cached blocks.
    engine = Engine(EngineConfig(model, dtype="float32", num_blocks=2 * (longest + MAX_NEW) // 16 + 2, block_size=16))
    down = RedisStore("redis://127.0.0.1:1/0", socket_timeout_s=0.2)  # nothing listens there
    store = RedisStore(redis_url)
    pub = PrefixIndexPublisher(down, "m", "w0", engine.pool, every_s=0)
    first: dict[str, list[int]] = {}
    order = ["a", "t", "b", "ab", "a", "t", "ab", "b", "a"]
    for step, name in enumerate(order):
        pp = prompts[name]
        rid = f"{name}-{step}"
        seq = engine.add_request(rid, pp.prompt_ids, images=pp.images, sampling=SamplingParams(max_tokens=MAX_NEW))
        out = engine.run_until_done()[rid]
        if name in first:
            assert out == first[name], f"{rid} after churn ({seq.num_cached_tokens} cached tokens)"
        else:
            first[name] = out
        engine.pool.check_integrity()
        if step == 2:  # Redis was down so far: the changes wait, then land in one go
            assert not pub.flush(0.0, force=True) and pub.pending
            pub.store = store
        if step >= 2:
            assert pub.flush(float(step), force=True)
            assert store.prefix_blocks_of("m", "w0") == set(engine.pool.cached_hashes())
    assert engine.pool.evictions > 0, "the pool never evicted: the churn did not churn"
    assert pub.removed > 0
    for name, pp in prompts.items():
        assert first[name] == hf_generate(model, pp.prompt_ids, pp.images, MAX_NEW), name
    stats = engine.pool.stats()
    assert stats["used_blocks"] == 0 and stats["free_blocks"] == stats["total_blocks"]
    store.close()
    down.close()
