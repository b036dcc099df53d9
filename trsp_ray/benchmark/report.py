"""How the comparison is shown: one terminal table per budget group, the verdicts of the TRSP rows
and of the default row column by column, and what the run cut; plots are in trsp_ray.common.plots."""

from __future__ import annotations

import math

from trsp_ray.benchmark import stats as stats
from trsp_ray.config import registry
from trsp_ray.config.budgets import budget_label
from trsp_ray.config.run_config import RunConfig

FIXED = ["row", "dropped (first seed)", "kept %", "select k", "recover k", "total k"]


def fmt(stat: dict | None, digits: int = 2, scale: float = 1.0) -> str:
    if not stat:
        return "-"
    mean = f"{stat['mean'] * scale:.{digits}f}"
    if "se" in stat:
        mean += f" ±{stat['se'] * scale:.{digits}f}"
    if stat["n"] > 1:
        mean += f" [{stat['min'] * scale:.{digits}f}-{stat['max'] * scale:.{digits}f}]"
    return mean


def table_columns(summary: list[dict], left_out: list[str]) -> list[str]:
    doms = summary[0]["domains"] if summary else []
    ppl = [stats.GEO] + [f"{d} PPL" for d in doms if d not in left_out]
    ppl += [f"{d} PPL (left out)" for d in doms if d in left_out]
    return FIXED + ppl + ["LAMBADA acc", "LAMBADA % dense", "zero-shot %", "zero-shot % dense", "wall s"]


def table_rows(summary: list[dict], left_out: list[str]) -> list[dict]:
    """The printed cells (compute in thousands of dense-forward tokens)."""
    out = []
    for s in summary:
        cell = {"group": s["group"], "budget": s["budget"], "row": s["row"],
                "dropped (first seed)": " ".join(map(str, sorted(s["drop"])))
                                        + ("" if s["same drop over seeds"] else " *"),
                "kept %": s["kept %"], "select k": s["select cost"] / 1e3, "recover k": s["recovery cost"] / 1e3,
                "total k": s["total cost"] / 1e3, stats.GEO: fmt(s[stats.GEO], 3),
                "LAMBADA acc": fmt(s.get("LAMBADA acc"), 3), "zero-shot %": fmt(s.get("zero-shot"), 1, 100.0),
                "LAMBADA % dense": fmt(s.get("LAMBADA % dense"), 1),
                "zero-shot % dense": fmt(s.get("zero-shot % dense"), 1),
                "wall s": s["seconds"]}
        for d in s["domains"]:  # the seed mean; the spread and the paired noise are in the verdicts below
            mean = s[f"{d} PPL"]["mean"]
            cell[f"{d} PPL" + (" (left out)" if d in left_out else "")] = f"{mean:.{1 if mean >= 100 else 2}f}"
        out.append(cell)
    return out


def _signed(col: str, p: dict) -> str:
    """A paired difference in the column's units: % of perplexity, or accuracy points, ± 2 SE."""
    if col in dict(stats.TASK_COLUMNS):
        return f"{p['diff'] * 100:+.1f}±{2 * p['se'] * 100:.1f}pt"
    return f"{(math.exp(p['diff']) - 1) * 100:+.1f}±{(math.exp(2 * p['se']) - 1) * 100:.1f}%"


def verdict_table(s: dict, by_row: dict, cols: list[tuple[str, bool]], summary: list[dict]) -> str:
    """One line per other row: its total compute and, per column, the paired verdict of `s` against it."""
    from trsp_ray.common.table import render

    costs = {o["row"]: o["total cost"] for o in summary if o["budget"] == s["budget"]}
    names = [c for c, _ in cols if any(c in v for v in by_row.values())]
    rows = []
    for other, verdicts in by_row.items():
        cell = {"against": other, "its total k": costs.get(other, 0.0) / 1e3}
        for c in names:
            cell[c] = f"{verdicts[c]['verdict']} {_signed(c, verdicts[c])}" if c in verdicts else "-"
        rows.append(cell)
    return render(rows, ["against", "its total k"] + names)


def sleb_note(cfg: RunConfig) -> str:
    from trsp_ray.config.sections import FULL_SLEB_WINDOWS

    n, seqlen = cfg.baselines.sleb_windows, cfg.data.seqlen
    if n >= FULL_SLEB_WINDOWS:
        return (f"SLEB scored its removals on {n} calibration windows of {seqlen} tokens (in full: on SmolLM2 its "
                f"drop set did not change from {FULL_SLEB_WINDOWS // 2} to {FULL_SLEB_WINDOWS} windows).")
    return (f"SLEB scored its removals on {n} calibration windows of {seqlen} tokens: CUT to fit 15 minutes on 2 CPU "
            f"cores; --full-baselines runs it on {FULL_SLEB_WINDOWS}, where its drop set stops changing.")


def render_report(summary: list[dict], *, calibration_source: str, left_out: list[str], cfg: RunConfig,
                  seeds: list[int], zeroshot_limit: int, lambada_limit: int, cut: str = "") -> str:
    """The terminal report: one table per budget group, the paired verdicts of the default against
    every other row of its group, and of each row against its group's best baseline."""
    from trsp_ray.common.table import render
    from trsp_ray.data import domains

    cells = table_rows(summary, left_out)
    columns = table_columns(summary, left_out)
    cols = stats.columns(summary[0]["domains"] if summary else [], left_out)
    d = cfg.data
    parts = []
    for budget in sorted({c["budget"] for c in cells}):
        for group in ("dense", "selection", "trained"):
            rows = [c for c in cells if c["group"] == group and c["budget"] == budget]
            if rows:
                label = f", heal budget {budget_label(budget)}" if group == "trained" else ""
                title = registry.GROUP_TITLES[group] + label
                parts += [f"\n{title}", render(rows, columns)]
    tokens = cfg.stage2.steps * d.batch_size * d.seqlen
    scored = ", ".join(f"{n} ({domains.DOMAINS[n].source})" for n in (summary[0]["domains"] if summary else []))
    out_note = (f"left out of calibration (scored, never calibrated on): {', '.join(left_out)}" if left_out
                else "no domain is left out of calibration")
    parts.append(
        f"\nseeds {seeds} (mean [min-max]; '*' = the drop set changed across seeds).\n"
        f"calibration: {calibration_source}; {out_note}.\n"
        f"held-out PPL per domain over up to {d.eval_max_windows or 'all'} windows of {d.eval_seqlen} tokens of its "
        f"held-out documents (every {domains.HELDOUT_EVERY}th, near-duplicates on one side, none calibrated on), "
        "each window starting where a document starts (shorter documents joined with the next until the window "
        f"fills), one per document before any second: {scored}.\n"
        f"{stats.GEO}: the geometric mean over the domains of PPL / dense PPL (1.000 = dense).\n"
        f"trained rows: {cfg.stage2.steps} batches of {d.batch_size}x{d.seqlen} tokens ({tokens:,}) of weight updates "
        f"per budget unit, objective {cfg.recovery.objective}; '@compute' rows also heal with the TRSP selection's "
        "extra compute.\ncompute in thousands of dense-forward tokens (a forward token 1, a trained token what its "
        "recipe runs: 3 for all weights, less for tail, map or LoRA, + 1 with a KD teacher; plan/compute.py): "
        "select = choosing the drop set, recover = stage 2 / heal / compensation, total = both.")
    if any(registry.ROWS[s["row"]].method and registry.recipe(s["row"])[0] == registry.SLEB_SELECTOR
           for s in summary):
        parts.append(sleb_note(cfg))  # only where a SLEB row ran
    if lambada_limit:
        parts.append(f"LAMBADA: last-word accuracy (lm-eval lambada_openai rule) on the first {lambada_limit} test "
                     "passages, ± standard error; reported only, never used to select or tune.")
    if zeroshot_limit:
        metrics = ", ".join(f"{t} {m}" for t, m in stats.ZEROSHOT_METRIC.items())
        parts.append(f"zero-shot: mean over the paper's five tasks ({metrics}), {zeroshot_limit} items per task, "
                     "± standard error; reported only.")
    if any(registry.ROWS[s["row"]].compensate or registry.ROWS[s["row"]].comp_compute for s in summary):
        from trsp_ray.config.run_config import compensated

        c = compensated(cfg).compensation
        how = ("one scale per block from dense token norms" if c.method == "scalar"
               else f"{c.form if c.form != 'lowrank' else f'rank-{c.rank}'} map, {c.activations} activations, "
                    f"ridge {c.ridge} towards the identity, "
                    f"{'norm-weighted' if c.weighting == 'norm' else 'unweighted'} tokens")
        parts.append(f"+comp rows: {c.method} compensation after removal ({how}, {c.windows} calibration windows of "
                     f"{d.seqlen} tokens), folded into the weights before any heal; '@comp' rows heal instead "
                     "with what that compensation of their drop set costs as extra steps.")
    if any(registry.ROWS[s["row"]].full_compute for s in summary):
        parts.append("'@full' rows: a partial heal (tail, map, LoRA) that also heals, in steps of its own recipe, "
                     "with what a full heal of the same steps would cost beyond it (equal total compute).")
    if any(registry.ROWS[s["row"]].objective for s in summary):
        parts.append("'@kd' rows: distillation from the dense model (recovery.objective=kd: the KL divergence to its "
                     "next-token distribution) with as many heal steps as spend the cross-entropy row's training "
                     "compute, the teacher's forward counted (fewer steps: equal total compute).")
    if cut:
        parts.append(cut)
    parts += coverage(summary, cols, lambada_limit=lambada_limit, zeroshot_limit=zeroshot_limit)
    parts += _verdicts(summary, cols)
    parts += budget_curve_lines(summary)
    return "\n".join(parts)


def budget_curve_table(summary: list[dict]) -> str:
    """The heal-budget curve as a table: per trained row and budget its compute, the geometric mean,
    LAMBADA (and zero-shot where scored) with retention, and each budget's paired difference against
    the row's smallest budget; '' when no row ran at more than one budget."""
    from trsp_ray.common.table import render

    curve = stats.budget_curve(summary)
    if not curve:
        return ""
    rows = []
    for e in curve:
        s, vs = e["summary"], e["vs smallest"]
        cell = {"row": e["row"], "budget": budget_label(e['budget']), "total k": s["total cost"] / 1e3,
                stats.GEO: fmt(s[stats.GEO], 3), "LAMBADA acc": fmt(s.get("LAMBADA acc"), 3),
                "LAMBADA % dense": fmt(s.get("LAMBADA % dense"), 1),
                "zero-shot % dense": fmt(s.get("zero-shot % dense"), 1),
                "accuracy as budget grows": e["accuracy trend"]}
        for col, _ in stats.CURVE_COLUMNS:
            cell[f"{col} vs smallest"] = (f"{vs[col]['verdict']} {_signed(col, vs[col])}" if col in vs
                                          else "-" if vs else "(reference)")
        rows.append(cell)
    names = ["row", "budget", "total k", stats.GEO, "LAMBADA acc", "LAMBADA % dense", "zero-shot % dense"]
    names += [f"{c} vs smallest" for c, _ in stats.CURVE_COLUMNS if any(c in e["vs smallest"] for e in curve)]
    return render(rows, names + ["accuracy as budget grows"])


def budget_curve_lines(summary: list[dict]) -> list[str]:
    table = budget_curve_table(summary)
    if not table:
        return []
    return ["\nHeal-budget curve (each budget against the same row's smallest, paired over the seeds both ran; "
            "a row's accuracy 'rises' or 'falls' when LAMBADA at its largest budget differs from its smallest beyond "
            "2 paired SE and the seed spread):", table]


def column_coverage(summary: list[dict], cols: list[tuple[str, bool]], *, lambada_limit: int = 0,
                    zeroshot_limit: int = 0) -> list[dict]:
    """One dict per judged column: the held-out documents, windows and tokens it averages over (a
    task column: its items), and a note where a domain has too few documents for one window each."""
    from trsp_ray.evaluation.tasks import PAPER_TASKS

    cov = summary[0].get("coverage", {}) if summary else {}
    clusters = summary[0].get("clusters", {}) if summary else {}
    out = []
    for col, _ in cols:
        if col in dict(stats.TASK_COLUMNS):
            n = lambada_limit if col == "LAMBADA acc" else zeroshot_limit * len(PAPER_TASKS)
            if n:
                out.append({"column": col, "documents": n, "windows": "-", "tokens": "-",
                            "note": "passages" if col == "LAMBADA acc" else "items (5 tasks)"})
            continue
        doms = [d for d in clusters.get(col, {}) if d in cov]
        if not doms:
            continue
        few = [d for d in doms if cov[d]["too_few"]]
        note = "; ".join(f"{d}: TOO FEW held-out documents ({cov[d]['held_out']}) for one window each, "
                         f"{cov[d]['windows']} windows share {cov[d]['clusters']}" for d in few)
        out.append({"column": col, "documents": sum(cov[d]["documents"] for d in doms),
                    "windows": sum(cov[d]["windows"] for d in doms), "tokens": sum(cov[d]["tokens"] for d in doms),
                    "note": note or ", ".join(f"{d} {cov[d]['documents']} of {cov[d]['held_out']}" for d in doms)})
    return out


def coverage(summary: list[dict], cols: list[tuple[str, bool]], *, lambada_limit: int = 0,
             zeroshot_limit: int = 0) -> list[str]:
    """The lines that say what every column covers (printed above the verdicts)."""
    from trsp_ray.common.table import render

    rows = column_coverage(summary, cols, lambada_limit=lambada_limit, zeroshot_limit=zeroshot_limit)
    if not rows:
        return []
    return ["\nWhat each column covers (held-out documents, or a task's items; a document shorter than a window "
            "shares one with the next; paired SEs of a PPL column are clustered on documents):",
            render(rows, ["column", "documents", "windows", "tokens", "note"], trim=True)]


def _verdicts(summary: list[dict], cols: list[tuple[str, bool]]) -> list[str]:
    parts = ["\nPaired verdicts (each item / window compared with itself across rows; a PPL difference in % of "
             "perplexity, an accuracy's in points, ± 2 paired SE; a win must also exceed the seeds' spread of the "
             "difference; one seed has no spread, its verdicts say so and count as no win):"]
    for s in summary:
        if s.get("default vs"):
            parts.append(f"\nthe default `trsp-ray prune` (method {registry.DEFAULT_METHOD} = row {s['row']}, total "
                         f"{s['total cost'] / 1e3:.1f}k) against every row of its group:")
            parts.append(verdict_table(s, s["default vs"], cols, summary))
    judged = {s["row"]: s["vs best"] for s in summary if s.get("vs best") and not registry.ROWS[s["row"]].is_default}
    if judged:
        parts.append("\neach row against the best baseline of its group (by the geometric mean):")
        best = {s["row"]: s["best baseline"] for s in summary if s.get("vs best")}
        for row, verdicts in judged.items():
            subject = next(s for s in summary if s["row"] == row)
            line = "; ".join(f"{c} {v['verdict']} {_signed(c, v)}" for c, _ in cols for v in [verdicts.get(c)] if v)
            wins = sum(v["verdict"] == "better" for v in verdicts.values())
            label = budget_label(subject["budget"])
            parts.append(f"{row} {label} vs {best[row]}: {line} -> wins {wins} of {len(verdicts)}")
    mde = stats.detectable(summary, cols)
    if mde:
        parts.append("smallest difference each column can detect (2 x the median paired SE of these comparisons): "
                     + ", ".join(f"{c} {v * 100:.1f}pt" if c in dict(stats.TASK_COLUMNS) else f"{c} {v:.1f}%"
                                 for c, v in mde.items()))
    return parts


def transfer_rows(per_domain: dict[str, list[dict]]) -> list[dict]:
    """One dict per pipeline row (budget x1 where several ran) of a leave-one-out benchmark: for each
    left-out domain its held-out PPL relative to dense and LAMBADA accuracy, the worst of each, and
    the default row's paired verdict against it on every left-out column."""
    dense_ppl = {}
    for d, summary in per_domain.items():
        dense = next((s for s in summary if s["group"] == "dense"), None)
        if dense is not None:
            dense_ppl[d] = dense[f"{d} PPL"]["mean"]
    names = [s["row"] for s in next(iter(per_domain.values())) if s["group"] != "dense"]
    out = []
    for name in dict.fromkeys(names):
        entry = {"row": name, "x dense": {}, "lambada": {}, "lambada % dense": {}, "default vs": {}, "total k": []}
        for d, summary in per_domain.items():
            s = next((s for s in sorted(summary, key=lambda s: s["budget"]) if s["row"] == name), None)
            if s is None:
                continue
            if d in dense_ppl:
                entry["x dense"][d] = s[f"{d} PPL"]["mean"] / dense_ppl[d]
            if s.get("LAMBADA acc"):
                entry["lambada"][d] = s["LAMBADA acc"]["mean"]
            if s.get("LAMBADA % dense"):
                entry["lambada % dense"][d] = s["LAMBADA % dense"]["mean"]
            entry["total k"].append(s["total cost"] / 1e3)
            default = next((o for o in summary if o.get("default vs") and o["budget"] == s["budget"]), None)
            if default is not None and name in default["default vs"]:
                entry["default vs"][d] = default["default vs"][name]
        entry["worst x dense"] = max(entry["x dense"].values(), default=math.nan)
        entry["worst domain"] = max(entry["x dense"], key=entry["x dense"].get) if entry["x dense"] else "-"
        entry["worst LAMBADA"] = min(entry["lambada"].values(), default=math.nan)
        out.append(entry)
    return out


def transfer_report(per_domain: dict[str, list[dict]], *, mixture: str) -> str:
    """The terminal report of a leave-one-out benchmark: the transfer table (rows = pipelines, columns
    = the domain each run left out: its held-out PPL / dense PPL, then LAMBADA accuracy of each run),
    the worst case of each, and the default's paired verdicts on every left-out column."""
    from trsp_ray.common.table import render

    entries = transfer_rows(per_domain)
    doms = list(per_domain)
    cells = []
    for e in entries:
        cell = {"row": e["row"], "total k": sum(e["total k"]) / max(1, len(e["total k"]))}
        cell.update({f"{d} x dense": f"{e['x dense'][d]:.3f}" if d in e["x dense"] else "-" for d in doms})
        cell["worst x dense"] = f"{e['worst x dense']:.3f} ({e['worst domain']})"
        cell.update({f"LAMBADA ({d} out)": f"{e['lambada'][d]:.3f}" if d in e["lambada"] else "-" for d in doms})
        cell["worst LAMBADA"] = "-" if math.isnan(e["worst LAMBADA"]) else f"{e['worst LAMBADA']:.3f}"
        cells.append(cell)
    cols = (["row", "total k"] + [f"{d} x dense" for d in doms] + ["worst x dense"]
            + [f"LAMBADA ({d} out)" for d in doms] + ["worst LAMBADA"])
    parts = [f"\nLeave-one-out transfer (calibration: {mixture} with each domain left out in turn; 'D x dense' = "
             "held-out PPL of the left-out domain D / the dense model's, 1.000 = dense; 'LAMBADA (D out)' = "
             "last-word accuracy of the model calibrated without D; total k = mean total compute, thousands of "
             "dense-forward tokens):", render(cells, cols)]
    verdicts = []
    for e in entries:
        if e["default vs"]:
            cell = {"default against": e["row"]}
            for d in doms:
                p = e["default vs"].get(d, {}).get(stats.LEFT_OUT)
                cell[f"{d} out: {d} PPL"] = f"{p['verdict']} {_signed(stats.LEFT_OUT, p)}" if p else "-"
                a = e["default vs"].get(d, {}).get("LAMBADA acc")
                cell[f"{d} out: LAMBADA"] = f"{a['verdict']} {_signed('LAMBADA acc', a)}" if a else "-"
            verdicts.append(cell)
    if verdicts:
        parts += [f"\nthe default ({registry.DEFAULT_METHOD}) against each row, paired, on each run's left-out domain "
                  "and LAMBADA (± 2 paired SE; PPL in % of perplexity, clustered on held-out documents):",
                  render(verdicts, list(verdicts[0]))]
    return "\n".join(parts)
