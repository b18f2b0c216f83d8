"""gateway/models.py: the names /v1/models lists and how a client's "model" maps to the coordinator's, from
hand-made STATUS replies (the cluster test, tests/coordinator/test_cluster_models.py, runs it for real)."""

from __future__ import annotations

import asyncio

import pytest

from mserve.gateway.models import ModelCatalog
from mserve.gateway.openai_api import ApiError


class Statuses:
    """STATUS replies in turn (the last one repeats), counting the reads."""

    def __init__(self, *replies: dict) -> None:
        self.replies, self.reads = list(replies), 0

    async def __call__(self) -> dict:
        self.reads += 1
        return self.replies[min(self.reads, len(self.replies)) - 1]


def two(*served: str) -> dict:
    return {"model": "/m/llava", "models": {n: {"model_path": n} for n in ("/m/llava", "/m/qwen")},
            "served_models": list(served)}


def test_a_model_that_joins_later_is_found_by_reading_status_again_and_an_unknown_one_is_a_404_naming_the_served():
    status = Statuses(two("/m/llava"), two("/m/llava", "/m/qwen"))
    catalog = ModelCatalog(status, None, None)

    async def run():
        await catalog.refresh()
        assert catalog.names() == ["/m/llava"]
        assert await catalog.resolve("/m/qwen") == "/m/qwen" and status.reads == 2  # read again: it joined
        assert catalog.names() == ["/m/llava", "/m/qwen"]
        with pytest.raises(ApiError) as err:
            await catalog.resolve("gpt-4")
        return err.value

    err = asyncio.run(run())
    assert err.status == 404 and "'/m/llava', '/m/qwen'" in err.body()["error"]["message"]


def test_served_model_name_renames_the_default_model_for_clients():
    catalog = ModelCatalog(Statuses(two("/m/qwen", "/m/llava")), "llava", None)

    async def run():
        await catalog.refresh()
        return catalog.names(), await catalog.resolve("llava"), await catalog.resolve("/m/qwen")

    assert asyncio.run(run()) == (["llava", "/m/qwen"], "/m/llava", "/m/qwen")  # the default first


def test_each_model_says_whether_its_family_is_tested_or_verified_at_load():
    status = Statuses({"model": "/m/llava", "served_models": ["/m/llava", "/m/vip"],
                       "models": {"/m/llava": {"model_path": "/m/llava", "verification": "tested"},
                                  "/m/vip": {"model_path": "/m/vip", "verification": "verified at load"}}})
    catalog = ModelCatalog(status, "tiny", None)
    asyncio.run(catalog.refresh())
    assert [(n, catalog.verification(n)) for n in catalog.names()] == [("tiny", "tested"), ("/m/vip", "verified at load")]
