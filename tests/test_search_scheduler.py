"""GroupedASHA: early stopping only among trials that drop the same number of layers."""

import pytest

pytest.importorskip("ray.tune")

from ray.tune.experiment import Trial
from ray.tune.schedulers import ASHAScheduler, TrialScheduler

from trsp_ray.search.scheduler import GroupedASHA

SETTINGS = {"metric": "val_loss", "mode": "min", "max_t": 4, "grace_period": 1, "reduction_factor": 2}


def _trial(ratio: float) -> Trial:
    return Trial("run_trial", config={"point": {"ratio": ratio, "stage1.lambda1": 1e-3}}, stub=True)


def _feed(scheduler, trials_losses):
    decisions = []
    for trial, loss in trials_losses:
        decisions.append(scheduler.on_trial_result(None, trial, {"training_iteration": 1, "val_loss": loss}))
    return decisions


def test_large_ratio_trial_is_not_stopped_by_small_ratio_losses():
    # 8 layers: ratio 0.25 drops 2 layers (val loss ~1), ratio 0.5 drops 4 (val loss ~5).
    small_a, small_b, large = _trial(0.25), _trial(0.25), _trial(0.5)
    feed = [(small_a, 1.0), (small_b, 1.1), (large, 5.0)]

    plain = ASHAScheduler(**SETTINGS)
    for t in (small_a, small_b, large):
        plain.on_trial_add(None, t)
    # One ASHA over all ratios stops the large-ratio trial at its first rung: the flaw being fixed.
    assert _feed(plain, feed)[-1] == TrialScheduler.STOP

    grouped = GroupedASHA(num_layers=8, base_ratio=0.25, **SETTINGS)
    for t in (small_a, small_b, large):
        grouped.on_trial_add(None, t)
    assert grouped.group(large.config) == 4 and grouped.group(small_a.config) == 2
    decisions = _feed(grouped, feed)
    assert decisions[2] == TrialScheduler.CONTINUE  # alone in its group
    # Within a group ASHA still works: a worse same-ratio trial is stopped at the rung.
    assert decisions[1] == TrialScheduler.STOP


def test_trials_without_a_searched_ratio_share_the_base_group_and_complete_cleanly():
    grouped = GroupedASHA(num_layers=30, base_ratio=0.2, **SETTINGS)
    a = Trial("run_trial", config={"point": {"stage1.lambda1": 1e-3}}, stub=True)
    grouped.on_trial_add(None, a)
    assert grouped.group(a.config) == 6
    grouped.on_trial_complete(None, a, {"training_iteration": 4, "val_loss": 2.0})
    grouped.on_trial_remove(None, a)  # after completion: a no-op, not a KeyError
