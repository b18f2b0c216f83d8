"""lab.sampler_bench runs, and its per-request baseline is the sampler it replaced: greedy rows agree."""

from __future__ import annotations

import json

import torch

from lab.sampler_bench import main, per_request
from mserve.workers.sampler import sample
from mserve.workers.sequence import SamplingParams


def test_sampler_bench_reports_every_case(capsys):
    assert main(["--batch", "4", "--vocab", "300", "--repeat", "1"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert set(out["cases"]) == {"greedy", "temperature_only", "top_p_only", "sampled", "sampled_half_seeded"}
    assert all(c["per_request_ms"] > 0 and c["batched_ms"] > 0 for c in out["cases"].values())


def test_the_baseline_and_the_batched_sampler_agree_where_they_must():
    logits = torch.randn(5, 40, generator=torch.Generator().manual_seed(1))
    greedy = [SamplingParams()] * 5
    assert per_request(logits, greedy, [0] * 5) == sample(logits, greedy, [0] * 5) == logits.argmax(-1).tolist()
    peaked = logits.clone()
    peaked[:, 7] = 100.0  # all the mass on one token: any correct sampler picks it
    hot = [SamplingParams(temperature=1.0, top_p=0.9, top_k=5)] * 5
    assert per_request(peaked, hot, [0] * 5) == sample(peaked, hot, [0] * 5) == [7] * 5
