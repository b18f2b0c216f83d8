"""SLO-adaptive visual-token pruning policy (coordinator/pruning_policy.py): thresholds, hysteresis, none below saturation."""

from __future__ import annotations

import pytest

from mserve.coordinator.pruning_policy import ClassObjective, PruningGovernor, QueuedWork, predicted_ttft_s


def governor(**kw) -> PruningGovernor:
    return PruningGovernor({"interactive": ClassObjective(ttft_s=1.0, max_keep_ratio=0.25, release=0.5, hold_s=2.0,
                                                          **kw)})


def test_below_saturation_nothing_is_pruned_however_long():
    g = governor()
    for t in range(100):
        g.observe("interactive", 0.99, now=float(t))  # at the objective, never past it
        assert g.keep_ratio("interactive") is None
    assert g.keep_ratio("interactive", configured=0.5) == 0.5  # the cluster's fixed ratio stands


def test_breaking_the_objective_prunes_at_once_to_the_class_ceiling():
    g = governor()
    g.observe("interactive", 1.01, now=0.0)
    assert g.pruning("interactive") and g.keep_ratio("interactive") == 0.25
    assert g.keep_ratio("interactive", configured=0.1) == 0.1  # a lower fixed ratio is never raised
    assert g.keep_ratio("batch") is None  # a class without an objective is never pruned
    g.observe("batch", 100.0, now=0.0)
    assert g.keep_ratio("batch") is None


def test_pruning_lifts_only_after_the_prediction_stays_below_release_for_the_hold():
    g = governor()
    g.observe("interactive", 3.0, now=0.0)
    g.observe("interactive", 0.8, now=1.0)  # back under the objective, above release: still pruning
    g.observe("interactive", 0.4, now=2.0)  # below release: the hold starts
    g.observe("interactive", 0.4, now=3.9)
    assert g.pruning("interactive")
    g.observe("interactive", 0.6, now=4.0)  # above release again: the hold starts over
    g.observe("interactive", 0.4, now=5.0)
    g.observe("interactive", 0.4, now=6.9)
    assert g.pruning("interactive")
    g.observe("interactive", 0.4, now=7.0)
    assert not g.pruning("interactive") and g.keep_ratio("interactive") is None
    g.observe("interactive", 0.9, now=8.0)  # under the objective: stays off
    assert not g.pruning("interactive")
    g.observe("interactive", 1.5, now=9.0)
    assert g.pruning("interactive")


def test_no_hold_lifts_as_soon_as_the_prediction_is_below_release():
    g = PruningGovernor({"batch": ClassObjective(ttft_s=10.0, max_keep_ratio=0.5, release=0.8, hold_s=0.0)})
    g.observe("batch", 11.0, now=0.0)
    g.observe("batch", 7.9, now=0.1)
    assert g.keep_ratio("batch") is None


def test_prediction_is_the_queued_work_over_the_pools():
    assert predicted_ttft_s(QueuedWork()) == 0.0
    work = QueuedWork(images_to_encode=8, encode_s_per_image=0.5, encoders=2, prompt_tokens_to_prefill=3000,
                      prefill_tokens_per_s=1000.0, prefill_workers=3)
    assert predicted_ttft_s(work) == pytest.approx(8 * 0.5 / 2 + 3000 / 3000)
    assert predicted_ttft_s(QueuedWork(prompt_tokens_to_prefill=10**6)) == 0.0  # no measured rate: no guess


@pytest.mark.parametrize("kw, match", [({"ttft_s": 0}, "ttft_s"), ({"max_keep_ratio": 0}, "max_keep_ratio"),
                                       ({"max_keep_ratio": 1.5}, "max_keep_ratio"), ({"release": 0}, "release"),
                                       ({"hold_s": -1}, "hold_s")])
def test_bad_objectives_are_refused_naming_the_field(kw, match):
    with pytest.raises(ValueError, match=match):
        ClassObjective(**{"ttft_s": 1.0, "max_keep_ratio": 0.5, **kw})
