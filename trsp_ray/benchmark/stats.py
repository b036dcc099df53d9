"""Statistics and verdicts of the comparison: means and spreads over seeds, and *paired* verdicts.

Two rows scored on the same items differ by far less noise than two independent samples (LAMBADA,
500 passages: paired SE 0.013 vs unpaired 0.023), so every verdict compares two rows item by item:
per-window log-perplexity differences for a text domain (their mean over the domains for the
geometric mean), per-item 0/1 differences for a task. Windows of one held-out document are
correlated, so a domain's SE is clustered on documents (trsp_ray.data.heldout gives each window
its document): sum the differences per document, then the SE across documents. With seeds, each item's difference is
averaged over the seeds both rows ran, and the verdict also needs the difference to exceed the
spread (max - min) of the per-seed differences; one seed has no spread, so its verdicts say
"no spread" and count as no win. A row wins a column only beyond 2 paired standard errors.

Columns: every scored domain's held-out PPL, the geometric mean of those relative to dense (the
headline), the left-out domain (no calibration weight), LAMBADA acc, the zero-shot mean.
"""

from __future__ import annotations

import math
import statistics

from trsp_ray.common.paired import paired_se
from trsp_ray.config import registry

GEO = "geo-mean x dense"  # the headline perplexity column
LEFT_OUT = "left-out PPL"
TASK_COLUMNS = (("LAMBADA acc", True), ("zero-shot", True))
# each task column again as % of the dense model's score (what a pruned model keeps of the original)
RETENTION = {"LAMBADA acc": "LAMBADA % dense", "zero-shot": "zero-shot % dense"}
# the zero-shot metric of each task, as lm-eval's usual report does (acc_norm where the choices differ
# in length and the task defines it)
ZEROSHOT_METRIC = {"piqa": "acc", "winogrande": "acc", "hellaswag": "acc_norm", "arc_easy": "acc",
                   "arc_challenge": "acc_norm"}


def stats(values: list[float]) -> dict:
    return {"mean": statistics.fmean(values), "min": min(values), "max": max(values),
            "spread": max(values) - min(values), "n": len(values)}


def paired(a_runs: dict, b_runs: dict, clusters: dict | None = None) -> dict | None:
    """The paired difference a - b of one column. `*_runs`: {seed: {group: [per-item values]}}; the
    column is the mean over groups of each group's item mean (one group for a domain or a task, every
    domain for the geometric mean, every task for the zero-shot mean). `clusters`: {group: the
    document of each item} where items of one document are correlated (a domain's windows); the
    SE of such a group is clustered on documents (`paired_se`).

    Returns {"diff", "se", "spread", "seeds"} on the seeds both rows ran, or None when they share none."""
    seeds = sorted(set(a_runs) & set(b_runs))
    if not seeds:
        return None
    groups = sorted(a_runs[seeds[0]])
    per_seed, ses, diffs = [], [], []
    for s in seeds:
        per_seed.append(statistics.fmean(paired_se(a_runs[s][g], b_runs[s][g])[0] for g in groups))
    for g in groups:  # each item's difference averaged over seeds, then paired over items
        n = len(a_runs[seeds[0]][g])
        avg_a = [statistics.fmean(a_runs[s][g][i] for s in seeds) for i in range(n)]
        avg_b = [statistics.fmean(b_runs[s][g][i] for s in seeds) for i in range(n)]
        d, se = paired_se(avg_a, avg_b, (clusters or {}).get(g))
        diffs.append(d)
        ses.append(se)
    return {"diff": statistics.fmean(diffs), "se": math.sqrt(sum(x * x for x in ses)) / len(ses),
            "spread": max(per_seed) - min(per_seed), "seeds": len(seeds)}


def verdict(p: dict | None, *, higher_is_better: bool) -> str:
    """better / worse / tie of a paired difference: beyond 2 paired SE and the seed spread of the
    difference; with one seed a difference beyond 2 SE is 'better (no spread)' / 'worse (no spread)'."""
    if p is None:
        return ""
    if abs(p["diff"]) <= max(2 * p["se"], p["spread"]):
        return "tie"
    good = p["diff"] > 0 if higher_is_better else p["diff"] < 0
    word = "better" if good else "worse"
    return word if p["seeds"] > 1 else f"{word} (no spread)"


def zeroshot_stats(tasks: dict) -> tuple[float, float] | None:
    """(mean over the paper's five tasks of each task's metric, its standard error) from one result."""
    from trsp_ray.evaluation.tasks import PAPER_TASKS

    if not all(t in tasks for t in PAPER_TASKS):
        return None
    accs = [tasks[t].get(ZEROSHOT_METRIC[t], tasks[t]["acc"]) for t in PAPER_TASKS]
    ses = [math.sqrt(a * (1 - a) / max(1, tasks[t].get("n", 1))) for t, a in zip(PAPER_TASKS, accs)]
    return sum(accs) / len(accs), math.sqrt(sum(s * s for s in ses)) / len(ses)


def zeroshot_items(tasks: dict) -> dict | None:
    from trsp_ray.evaluation.tasks import PAPER_TASKS

    if not all(t in tasks and "items" in tasks[t] for t in PAPER_TASKS):
        return None
    out = {}
    for t in PAPER_TASKS:
        items = tasks[t]["items"]
        out[t] = items.get(ZEROSHOT_METRIC[t]) or items["acc"]
    return out


def _with_se(values: list[tuple[float, float]]) -> dict:
    """Seed statistics of an accuracy, with the mean per-seed standard error."""
    return {**stats([v for v, _ in values]), "se": statistics.fmean(se for _, se in values)}


def columns(domains: list[str], left_out: list[str]) -> list[tuple[str, bool]]:
    """(column, higher is better) of every judged column, headline first."""
    cols = [(GEO, False)] + [(f"{d} PPL", False) for d in domains if d not in left_out]
    if left_out:
        cols.append((LEFT_OUT, False))
    return cols + list(TASK_COLUMNS)


def _row_summary(row: registry.Row, runs: list[dict], dense_params: int, dense_nll: dict, left_out: list[str]) -> dict:
    first = runs[0]
    doms = list(first["nll"])
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
         "heal steps": first["info"].get("heal_steps", 0) + first["info"].get("stage2_steps", 0),
         "train cost": statistics.fmean(r["info"].get("heal_cost", 0.0) + r["info"].get("stage2_cost", 0.0)
                                        for r in runs),
         "seconds": statistics.fmean(r["seconds"] for r in runs), "is_baseline": row.is_baseline,
         "equal_compute": row.equal_compute, "comp_compute": row.comp_compute,
         "full_compute": row.full_compute, "items": {}, "domains": doms,
         # every row is scored on the same windows: the first run's coverage is every run's
         "coverage": first.get("coverage", {}), "clusters": {}}
    docs = {d: c["docs"] for d, c in s["coverage"].items() if "docs" in c}
    dense_logppl = {d: statistics.fmean(dense_nll[d]) for d in doms}
    for d in doms:
        s[f"{d} PPL"] = stats([r["ppl"][d] for r in runs])
        s["items"][f"{d} PPL"] = {r["seed"]: {d: r["nll"][d]} for r in runs}
        s["clusters"][f"{d} PPL"] = {d: docs[d]} if d in docs else {}
    s[GEO] = stats([math.exp(statistics.fmean(statistics.fmean(r["nll"][d]) - dense_logppl[d] for d in doms))
                    for r in runs])
    s["items"][GEO] = {r["seed"]: dict(r["nll"]) for r in runs}
    s["clusters"][GEO] = docs
    scored_out = [d for d in left_out if d in doms]
    if scored_out:
        s[LEFT_OUT] = stats([math.exp(statistics.fmean(statistics.fmean(r["nll"][d]) for d in scored_out))
                             for r in runs])
        s["items"][LEFT_OUT] = {r["seed"]: {d: r["nll"][d] for d in scored_out} for r in runs}
        s["clusters"][LEFT_OUT] = {d: docs[d] for d in scored_out if d in docs}
    s["per seed"] = {}
    if all("lambada" in r for r in runs):
        s["LAMBADA acc"] = _with_se([(r["lambada"]["acc"], r["lambada"]["se"]) for r in runs])
        s["per seed"]["LAMBADA acc"] = [r["lambada"]["acc"] for r in runs]
        if all("items" in r["lambada"] for r in runs):
            s["items"]["LAMBADA acc"] = {r["seed"]: {"lambada": r["lambada"]["items"]} for r in runs}
    zs = [z for z in (zeroshot_stats(r["zeroshot"]) for r in runs if r.get("zeroshot")) if z]
    if zs:
        s["zero-shot"] = _with_se(zs)
        s["per seed"]["zero-shot"] = [z for z, _ in zs]
        items = {r["seed"]: zeroshot_items(r["zeroshot"]) for r in runs if r.get("zeroshot")}
        if all(items.values()):
            s["items"]["zero-shot"] = items
    return s


def _retention(s: dict, dense: dict) -> None:
    """Add each task column's retention: the per-seed score as % of the dense model's (`dense`:
    {column: dense score}), seed statistics like the column's."""
    for col, name in RETENTION.items():
        base = dense.get(col)
        if s.get(col) and base:
            per_seed = s.get("per seed", {}).get(col) or [s[col]["mean"]]
            s[name] = {**stats([100.0 * v / base for v in per_seed]), "se": 100.0 * s[col]["se"] / base}


def compare(a: dict, b: dict, cols: list[tuple[str, bool]]) -> dict:
    """{column: {"verdict", "diff", "se", "spread", "seeds"}} of summary row `a` against `b`, paired
    (a PPL column's SE clustered on held-out documents); a PPL column's diff is in log-perplexity
    (nats per token), an accuracy's in accuracy."""
    out = {}
    for col, higher in cols:
        if col in a["items"] and col in b["items"]:
            p = paired(a["items"][col], b["items"][col], a.get("clusters", {}).get(col))
            if p is not None:
                out[col] = {**p, "verdict": verdict(p, higher_is_better=higher)}
    return out


def _best(candidates: list[dict], col: str) -> dict | None:
    having = [b for b in candidates if b.get(col)]
    return min(having, key=lambda b: b[col]["mean"]) if having else None


def summarize(results: list[dict], rows: list[registry.Row], *, dense_params: int, dense_nll: dict,
              left_out: list[str], dense_scores: dict | None = None) -> list[dict]:
    """One dict per (row, budget): means and spreads over seeds, each task column's retention (% of
    the dense model's score: the dense row's, else `dense_scores` {column: score}), and the paired
    verdicts of each row against its group's best baseline (by the geometric mean) and, for the
    default row, against every other row of its group (each row's total compute beside it in the
    report)."""
    out = []
    budgets = sorted({r.get("budget", 1) for r in results})
    for budget in budgets:
        for row in rows:
            runs = sorted((r for r in results if r["row"] == row.name and r.get("budget", 1) == budget),
                          key=lambda r: r["seed"])
            if runs:
                out.append(_row_summary(row, runs, dense_params, dense_nll, left_out))
    if not out:
        return out
    dense = dict(dense_scores or {})
    for s in out:
        if s["group"] == "dense":
            dense.update({c: s[c]["mean"] for c in RETENTION if s.get(c)})
    for s in out:
        _retention(s, dense)
    cols = columns(out[0]["domains"], left_out)
    for budget in budgets:
        for group in ("selection", "trained"):
            members = [s for s in out if s["group"] == group and s["budget"] == budget]
            tokens = [s for s in members if s["is_baseline"] and not s["equal_compute"] and not s["comp_compute"]
                      and not s["full_compute"]]
            for s in members:
                best = _best([b for b in tokens if b is not s], GEO)
                if best is not None:
                    s["best baseline"] = best["row"]
                    s["vs best"] = compare(s, best, cols)
                if registry.ROWS[s["row"]].is_default:
                    s["default vs"] = {o["row"]: compare(s, o, cols) for o in members if o is not s}
    return out


def detectable(summary: list[dict], cols: list[tuple[str, bool]]) -> dict:
    """{column: the smallest difference its paired test can detect (2 x the median paired SE over
    the comparisons made)}, in the column's units: % of perplexity for a PPL column, accuracy points."""
    ses: dict[str, list[float]] = {}
    for s in summary:
        for verdicts in [s.get("vs best") or {}] + list((s.get("default vs") or {}).values()):
            for col, p in verdicts.items():
                if math.isfinite(p["se"]):
                    ses.setdefault(col, []).append(p["se"])
    out = {}
    for col, _ in cols:
        if ses.get(col):
            two = 2 * statistics.median(ses[col])
            out[col] = (math.exp(two) - 1) * 100 if col not in dict(TASK_COLUMNS) else two
    return out


CURVE_COLUMNS = ((GEO, False), ("LAMBADA acc", True), ("zero-shot", True))


def budget_curve(summary: list[dict]) -> list[dict]:
    """The heal-budget curve of every trained row run at more than one budget: each budget against the
    row's smallest, paired on the same windows and passages over the seeds both ran (the geometric
    mean, LAMBADA and the zero-shot mean), and whether the row's accuracy rises, falls or stays
    within the noise as its budget grows (LAMBADA at its largest budget against its smallest)."""
    out = []
    for name in dict.fromkeys(s["row"] for s in summary if s["group"] == "trained"):
        points = sorted((s for s in summary if s["row"] == name), key=lambda s: s["budget"])
        if len(points) < 2:
            continue
        base = points[0]
        for s in points:
            out.append({"row": name, "budget": s["budget"], "summary": s,
                        "vs smallest": {} if s is base else compare(s, base, list(CURVE_COLUMNS))})
        last = out[-1]["vs smallest"].get("LAMBADA acc")
        word = ("rises" if last["verdict"].startswith("better") else "falls" if last["verdict"].startswith("worse")
                else "flat (within the noise)") if last else "not measured"
        for entry in out[-len(points):]:
            entry["accuracy trend"] = word
    return out
