"""The `selection` section of a run's configuration: how a selection by recovery auditions its
candidate drop sets (its own module beside sections.py, which holds every other section)."""

from __future__ import annotations

from dataclasses import dataclass

from trsp_ray.common.errors import TrspError
from trsp_ray.config.sections import _choice, _positive


@dataclass(frozen=True)
class SelectionConfig:
    """A selection by recovery (the `recover` selector, run/audition.py): every candidate drop set
    gets a short distillation heal, trials in parallel under successive halving (ASHA), ranked on
    the calibration's validation tail; the winner is healed with the rest of the budget."""

    # the candidate drop sets (method/candidates.py): Block Influence with the head protected, the
    # same with the last 2 candidates protected, the blocks just before the last 1 and 3 layers, the
    # angular block and the tail cut
    candidates: str = "bi,bi-tail2,block-1,block-3,angular-block,tail-cut"
    # a trial's heal steps at most (ASHA stops most before): without a compute budget this, with one
    # the steps `share` of the budget buys for every candidate at the trials' windows (at least 2)
    steps: int = 8
    share: float = 0.25
    objective: str = "kd"  # the trials' heal objective: kd (distillation, live teacher) | ce
    reduction: int = 2  # ASHA's reduction factor: a rung keeps 1/reduction of the trials that reach it
    reports: int = 4  # validation reports over a trial's steps (ASHA's rungs fall on them)
    val_windows: int = 8  # validation windows each report scores (the ranking pairs the last report's)
    concurrency: int = 0  # trials at once; 0 = one per CPU the local Ray has, at most the candidates

    def __post_init__(self):
        from trsp_ray.method.candidates import parse

        parse(self.candidates)
        _positive("selection.steps", self.steps)
        if not 0.0 < self.share < 1.0:
            raise TrspError(f"selection.share={self.share!r} is not valid; it must be in the open interval (0, 1)")
        _choice("selection.objective", self.objective, ("kd", "ce"))
        if self.reduction < 2:
            raise TrspError(f"selection.reduction={self.reduction!r} is not valid; it must be an integer >= 2")
        _positive("selection.reports", self.reports)
        _positive("selection.val_windows", self.val_windows)
        _positive("selection.concurrency", self.concurrency, allow_zero=True)
