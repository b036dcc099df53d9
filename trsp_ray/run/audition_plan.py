"""What a selection by recovery (the `recover` selector) runs and spends, decided before it runs; and
how its finished trials are ranked. The trials themselves run on Ray Tune (distributed/audition.py).

Every candidate drop set (method/candidates.py) is a trial: the pipeline's fit of that set, then a
short heal at the calibration's own windows (data.seqlen x data.batch_size) with the trials'
objective (selection.objective: distillation from the dense model beside the student by default),
reporting its loss and cloze accuracy on the first selection.val_windows windows of the calibration's
validation tail (which no trial trains on) selection.reports times; ASHA stops the worse half at each
rung on loss, and the survivors are ranked on loss, then on cloze accuracy among those tied on loss.

Compute is planned as if every trial ran to its last step (ASHA stops most before; what they spent
is measured and reported, and a budgeted heal gets what the trials left): the candidates' forwards
(Block Influence, the angular block), and per candidate its fit, its steps and its reports. With a
compute budget the trials get selection.share of it: the steps per trial are what that share buys
once the forwards, fits and reports are paid (at least MIN_STEPS, else a one-line refusal).
"""

from __future__ import annotations

from trsp_ray.common.errors import TrspError
from trsp_ray.common.paired import paired_se

MIN_STEPS = 2  # a trial shorter than this ranks the cut, not its recovery
TIE_SE = 2.0  # two trials within this many paired SE tie; the cheaper one wins


def rank(trials: list[dict]) -> list[dict]:
    """The finished trials (each {name, drop, nlls, accs, docs, cost, step}) best first.

    Those that reached the most steps (ASHA's survivors) come first, ordered by mean validation NLL.
    A survivor within TIE_SE paired SE (clustered by document) of the best NLL ties it on loss; the
    tied trials are then judged on cloze accuracy against the most accurate of them (paired the same
    way): those within TIE_SE of it lead, the cheapest first, and those clearly less accurate follow
    (loss and accuracy come apart after a heal; a tie on loss is decided by what a user would ask).
    Each returned trial carries diff / se / tie (NLL against the best) and acc_diff / acc_se
    (cloze accuracy against the most accurate trial tied on loss)."""
    if not trials:
        raise TrspError("the selection by recovery finished no trial; see the trial errors above")
    top = max(t["step"] for t in trials)
    survivors = sorted((t for t in trials if t["step"] == top), key=lambda t: _mean(t["nlls"]))
    best = survivors[0]
    compared = [{**t, **dict(zip(("diff", "se"), _paired(t, best, "nlls"))), "acc_diff": None, "acc_se": None}
                for t in survivors]
    for t in compared:
        t["tie"] = abs(t["diff"]) <= TIE_SE * t["se"]
    tied = [t for t in compared if t["tie"]]
    if all(t.get("accs") for t in tied):
        sharpest = max(tied, key=lambda t: _mean(t["accs"]))
        for t in tied:
            t["acc_diff"], t["acc_se"] = _paired(t, sharpest, "accs")
    accurate = [t for t in tied if t["acc_diff"] is None or t["acc_diff"] >= -TIE_SE * t["acc_se"]]
    lead = sorted(accurate, key=lambda t: (t["cost"], _mean(t["nlls"])))
    rest = [t for t in compared if t not in accurate]
    stopped = sorted((t for t in trials if t["step"] < top), key=lambda t: (-t["step"], _mean(t["nlls"])))
    return lead + rest + [{**t, "diff": None, "se": None, "tie": False, "acc_diff": None, "acc_se": None}
                          for t in stopped]


def _paired(t: dict, ref: dict, key: str) -> tuple[float, float]:
    """(t - ref, paired SE) of the per-window values `key`, clustered by document where both trials
    scored the same documents."""
    return paired_se(t[key], ref[key], clusters=t["docs"] if t["docs"] == ref["docs"] else None)


def _mean(values: list[float]) -> float:
    return sum(values) / len(values)
