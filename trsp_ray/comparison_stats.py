"""Statistics and verdicts of the comparison: means and spreads over seeds, standard errors of the
task accuracies, and each row against the best baseline of its own group, column by column.

A row wins a column only beyond the noise: the larger seed spread (max - min) of the two rows, or
two standard errors of the difference for an accuracy, whichever is larger. Trained rows are
judged twice: against the healed baselines at equal weight-update tokens, and against the
equal-compute baselines (the same heal plus the TRSP selection's extra compute as heal steps).
"""

from __future__ import annotations

import math
import statistics

from trsp_ray import registry

# (column, higher is better); every column a row is judged on
COLUMNS = (("held-out PPL", False), ("domain-2 PPL", False), ("LAMBADA acc", True), ("zero-shot", True))


def stats(values: list[float]) -> dict:
    return {"mean": statistics.fmean(values), "min": min(values), "max": max(values),
            "spread": max(values) - min(values), "n": len(values)}


def zeroshot_stats(tasks: dict) -> tuple[float, float] | None:
    """(mean acc over the paper's five tasks, its standard error) from one evaluation result."""
    from trsp_ray.evaluation.tasks import PAPER_TASKS

    if not all(t in tasks for t in PAPER_TASKS):
        return None
    accs = [tasks[t]["acc"] for t in PAPER_TASKS]
    ses = [tasks[t].get("acc_stderr") or math.sqrt(a * (1 - a) / max(1, tasks[t].get("n", 1)))
           for t, a in zip(PAPER_TASKS, accs)]
    return sum(accs) / len(accs), math.sqrt(sum(s * s for s in ses)) / len(ses)


def verdict(row: dict, best: dict, metric: str, *, higher_is_better: bool = False) -> str:
    """better / worse / tie for `row` against `best` on `metric`; a tie when the difference of the
    means is not larger than the larger seed spread or two standard errors of the difference."""
    a, b = row.get(metric), best.get(metric)
    if not a or not b:
        return ""
    diff = a["mean"] - b["mean"]
    noise = max(a["spread"], b["spread"], 2 * math.hypot(a.get("se", 0.0), b.get("se", 0.0)))
    if abs(diff) <= noise:
        return "tie"
    good = diff > 0 if higher_is_better else diff < 0
    return "better" if good else "worse"


def _with_se(values: list[tuple[float, float]]) -> dict:
    """Seed statistics of an accuracy, with the mean per-seed standard error."""
    return {**stats([v for v, _ in values]), "se": statistics.fmean(se for _, se in values)}


def _row_summary(row: registry.Row, runs: list[dict], dense_params: int) -> dict:
    first = runs[0]
    s = {"row": row.name, "group": row.group, "budget": first.get("budget", 1), "seeds": len(runs),
         "drop": first["drop"], "same drop over seeds": all(sorted(r["drop"]) == sorted(first["drop"]) for r in runs),
         "params": first["params"], "kept %": 100.0 * first["params"] / dense_params,
         "calib tokens": first["info"].get("calib_tokens", 0),
         # seed means, like recovery and total (a TRSP selection's refinement spends a different
         # number of scorer calls per seed): select + recover = total in every printed row
         "select cost": statistics.fmean(r["info"].get("select_cost", 0.0) for r in runs),
         "recovery cost": statistics.fmean(r["info"].get("recovery_cost", 0.0) for r in runs),
         "total cost": statistics.fmean(r["info"].get("total_cost", 0.0) for r in runs),
         "weight tokens": first["info"].get("weight_tokens", 0),
         "seconds": statistics.fmean(r["seconds"] for r in runs), "is_baseline": row.is_baseline,
         "equal_compute": row.equal_compute, "comp_compute": row.comp_compute}
    for col in ("held-out PPL", "domain-2 PPL"):
        s[col] = stats([r[col] for r in runs])
    if all("lambada" in r for r in runs):
        s["LAMBADA acc"] = _with_se([(r["lambada"]["acc"], r["lambada"]["se"]) for r in runs])
    zs = [z for z in (zeroshot_stats(r["zeroshot"]) for r in runs if r.get("zeroshot")) if z]
    if zs:
        s["zero-shot"] = _with_se(zs)
    return s


def _best(baselines: list[dict], col: str, higher: bool) -> dict | None:
    having = [b for b in baselines if b.get(col)]
    if not having:
        return None
    return (max if higher else min)(having, key=lambda b: b[col]["mean"])


def judge(s: dict, baselines: list[dict]) -> dict:
    """{column: (verdict, best baseline's name)} of summary row `s` against `baselines`."""
    out = {}
    for col, higher in COLUMNS:
        best = _best([b for b in baselines if b is not s], col, higher)
        if best is not None and s.get(col):
            out[col] = (verdict(s, best, col, higher_is_better=higher), best["row"])
    return out


def summarize(results: list[dict], rows: list[registry.Row], *, dense_params: int) -> list[dict]:
    """One dict per (row, budget): means and spreads over seeds, and the verdicts of each row against
    its group's best baselines (trained rows at equal weight tokens and at equal total compute)."""
    out = []
    budgets = sorted({r.get("budget", 1) for r in results})
    for budget in budgets:
        for row in rows:
            runs = sorted((r for r in results if r["row"] == row.name and r.get("budget", 1) == budget),
                          key=lambda r: r["seed"])
            if runs:
                out.append(_row_summary(row, runs, dense_params))
    for budget in budgets:
        for group in ("selection", "trained"):
            members = [s for s in out if s["group"] == group and s["budget"] == budget]
            tokens = [s for s in members if s["is_baseline"] and not s["equal_compute"] and not s["comp_compute"]]
            computes = [s for s in members if s["is_baseline"] and s["equal_compute"]]
            for s in members:
                if tokens:
                    best = min(tokens, key=lambda b: b["held-out PPL"]["mean"])
                    s["best baseline"] = best["row"]
                    s["vs best"] = s["held-out PPL"]["mean"] / best["held-out PPL"]["mean"]
                s["verdicts"] = judge(s, tokens)
                if computes and not s["is_baseline"]:
                    s["verdicts at equal compute"] = judge(s, computes)
            trsp = [s for s in members
                    if registry.ROWS[s["row"]].uses_stage1 and not registry.ROWS[s["row"]].compensate]
            for s in members:
                if registry.ROWS[s["row"]].is_default and trsp:  # the default against TRSP's own pipelines
                    s["verdicts vs TRSP"] = judge(s, trsp)
    return out
