"""lab.redis_stall: a stream with Redis answering, then one with it paused, each with its time and gaps."""

from __future__ import annotations

import re

import pytest

from lab.redis_stall import main

pytestmark = pytest.mark.slow


def test_it_streams_with_redis_answering_then_paused(capsys, tiny_model_dirs):
    assert main(["--model", str(tiny_model_dirs["llava"]), "--tokens", "40"]) == 0
    out = capsys.readouterr().out
    for state in ("answering", "paused  "):
        assert re.search(rf"redis {state}: 40 token events in [\d.]+ s, longest gap \d+ ms, \d+ gaps over 300 ms",
                         out), out
