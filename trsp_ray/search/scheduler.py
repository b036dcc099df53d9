"""ASHA that only compares trials dropping the same number of layers.

Removing more layers always costs validation loss, so one ASHA over a search that varies the ratio
stops every large-ratio trial at its first rung, whatever its lambdas: the search would learn
nothing about the ratios users care most about. `GroupedASHA` keeps one `ASHAScheduler` per
layer count (round(ratio x layers)) and hands each trial's results to its group's scheduler only;
a group with a single trial is never stopped.
"""

from __future__ import annotations

from ray.tune.schedulers import ASHAScheduler, FIFOScheduler, TrialScheduler


class GroupedASHA(FIFOScheduler):
    def __init__(self, *, num_layers: int, base_ratio: float, metric: str, mode: str, max_t: int,
                 grace_period: int, reduction_factor: float = 2):
        super().__init__()
        self.num_layers, self.base_ratio = num_layers, base_ratio
        self._settings = {"metric": metric, "mode": mode, "max_t": max_t, "grace_period": grace_period,
                          "reduction_factor": reduction_factor}
        self._metric, self._mode = metric, mode
        self._groups: dict[int, ASHAScheduler] = {}
        self._group_of: dict[str, int] = {}

    def group(self, config: dict) -> int:
        """Layers the trial drops: its searched ratio (or the base ratio) times the layer count."""
        from trsp_ray.method.stage1 import n_drop_for

        ratio = (config.get("point") or {}).get("ratio", self.base_ratio)
        return n_drop_for(float(ratio), self.num_layers)

    def set_search_properties(self, metric, mode, **spec) -> bool:
        return not ((metric and metric != self._metric) or (mode and mode != self._mode))

    def _scheduler(self, trial) -> ASHAScheduler:
        return self._groups[self._group_of[trial.trial_id]]

    def on_trial_add(self, tune_controller, trial) -> None:
        key = self.group(trial.config)
        if key not in self._groups:
            self._groups[key] = ASHAScheduler(**self._settings)
        self._group_of[trial.trial_id] = key
        self._groups[key].on_trial_add(tune_controller, trial)

    def on_trial_result(self, tune_controller, trial, result: dict) -> str:
        if trial.trial_id not in self._group_of:
            return TrialScheduler.CONTINUE
        return self._scheduler(trial).on_trial_result(tune_controller, trial, result)

    def on_trial_complete(self, tune_controller, trial, result: dict) -> None:
        if trial.trial_id in self._group_of:
            self._scheduler(trial).on_trial_complete(tune_controller, trial, result)
            del self._group_of[trial.trial_id]

    def on_trial_remove(self, tune_controller, trial) -> None:
        if trial.trial_id in self._group_of:
            self._scheduler(trial).on_trial_remove(tune_controller, trial)
            del self._group_of[trial.trial_id]

    def on_trial_error(self, tune_controller, trial) -> None:
        self.on_trial_remove(tune_controller, trial)

    def debug_string(self) -> str:
        return "GroupedASHA: " + "; ".join(f"{k} layers: {s.debug_string()}" for k, s in sorted(self._groups.items()))
