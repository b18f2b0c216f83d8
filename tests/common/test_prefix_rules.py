"""The prefix cache's three rules (common/prefix_rules.py), and that both sides of each use them."""

from __future__ import annotations

from mserve.common.hashing import ImageSpan
from mserve.common.prefix_rules import covered, leading_run, reusable_blocks
from mserve.coordinator.recent_prefixes import RecentPrefixes
from mserve.coordinator.routing import prefix_covered
from mserve.workers import prefix_skip


def test_leading_run_counts_only_unbroken_runs_from_the_first_block():
    assert leading_run([{"a", "b"}, {"a", "b"}, {"a"}, {"a", "b"}]) == {"a": 4, "b": 2}
    assert leading_run([{"b"}, {"a", "b"}]) == {"b": 2}  # "a" lacks the first block: no run at all
    assert leading_run([set(), {"a"}]) == {} and leading_run([]) == {}
    read = []

    def lazily():
        for held in ({"a"}, set(), {"a"}):
            read.append(held)
            yield held

    assert leading_run(lazily()) == {"a": 1} and len(read) == 2  # stops at the first empty intersection
    recent = RecentPrefixes()
    recent.placed(["h1", "h2"], "a")
    recent.placed(["h1"], "b")
    assert recent.match(["h1", "h2", "h3"]) == leading_run([{"a", "b"}, {"a"}, set()])


def test_the_block_holding_the_last_token_is_never_reused():
    assert [reusable_blocks(n, 16) for n in (1, 16, 17, 32, 33)] == [0, 0, 1, 1, 2]
    assert reusable_blocks(0, 16) == 0
    # routing's count leaves out the same block: a 32-token prompt fully held reuses 1 block, not 2.
    assert prefix_covered([16, 32], prompt_tokens=32, hit_blocks=2, block_size=16) == [0]


def test_an_image_is_covered_only_wholly_inside_the_cached_prefix():
    assert covered([4, 16, 17, None], 16) == [0, 1]  # 17 ends past the prefix; None is never skipped
    assert covered([0], 16) == []  # an empty range is not an image to skip
    spans = [ImageSpan(0, 4, "x"), ImageSpan(10, 6, "y"), ImageSpan(12, 5, "z")]
    assert prefix_skip.covered(spans, 16) == covered([s.end for s in spans], 16) == [0, 1]
    assert prefix_covered([s.end for s in spans], prompt_tokens=40, hit_blocks=1, block_size=16) == [0, 1]
