"""How the comparison is shown: one terminal table per budget group, the verdicts of the TRSP rows
and of the default row column by column, and what the run cut; plots are in trsp_ray.plots."""

from __future__ import annotations

from trsp_ray import registry
from trsp_ray.comparison_stats import COLUMNS as JUDGED
from trsp_ray.config import RunConfig

COLUMNS = ["row", "dropped (first seed)", "kept %", "calib tokens", "weight tokens", "select k", "recover k",
           "total k", "held-out PPL", "domain-2 PPL", "LAMBADA acc", "zero-shot %", "wall s"]


def fmt(stat: dict | None, digits: int = 2, scale: float = 1.0) -> str:
    if not stat:
        return "-"
    mean = f"{stat['mean'] * scale:.{digits}f}"
    if "se" in stat:
        mean += f" ±{stat['se'] * scale:.{digits}f}"
    if stat["n"] > 1:
        mean += f" [{stat['min'] * scale:.{digits}f}-{stat['max'] * scale:.{digits}f}]"
    return mean


def table_rows(summary: list[dict]) -> list[dict]:
    """The printed cells (compute in thousands of dense-forward tokens)."""
    out = []
    for s in summary:
        out.append({"group": s["group"], "budget": s["budget"], "row": s["row"],
                    "dropped (first seed)": (" ".join(map(str, sorted(s["drop"])))
                                             + ("" if s["same drop over seeds"] else " *")),
                    "kept %": s["kept %"], "calib tokens": s["calib tokens"], "weight tokens": s["weight tokens"],
                    "select k": s["select cost"] / 1e3, "recover k": s["recovery cost"] / 1e3,
                    "total k": s["total cost"] / 1e3,
                    "held-out PPL": fmt(s["held-out PPL"]), "domain-2 PPL": fmt(s["domain-2 PPL"]),
                    "LAMBADA acc": fmt(s.get("LAMBADA acc"), 3), "zero-shot %": fmt(s.get("zero-shot"), 1, 100.0),
                    "wall s": s["seconds"]})
    return out


def sleb_note(cfg: RunConfig) -> str:
    from trsp_ray.config import FULL_SLEB_WINDOWS

    n, seqlen = cfg.baselines.sleb_windows, cfg.data.seqlen
    if n >= FULL_SLEB_WINDOWS:
        return (f"SLEB scored its removals on {n} calibration windows of {seqlen} tokens (in full: on SmolLM2 its "
                f"drop set did not change from {FULL_SLEB_WINDOWS // 2} to {FULL_SLEB_WINDOWS} windows).")
    return (f"SLEB scored its removals on {n} calibration windows of {seqlen} tokens: CUT to fit 15 minutes on 2 CPU "
            f"cores; --full-baselines runs it on {FULL_SLEB_WINDOWS}, where its drop set stops changing.")


def _verdict_line(s: dict, key: str, label: str) -> str | None:
    verdicts = s.get(key) or {}
    parts = [f"{col} {v} (vs {best})" for col, _ in JUDGED if col in verdicts for v, best in [verdicts[col]] if v]
    if not parts:
        return None
    wins = sum(verdicts[c][0] == "better" for c in verdicts)
    return f"{s['row']} x{s['budget']} {label}: " + "; ".join(parts) + f" -> wins {wins} of {len(verdicts)} columns"


def render_report(summary: list[dict], *, heldout_source: str, domain2_source: str, cfg: RunConfig,
                  seeds: list[int], zeroshot_limit: int, lambada_limit: int, cut: str = "") -> str:
    """The terminal report: one table per budget group, then the verdicts of the TRSP rows."""
    from trsp_ray.table import render

    cells = table_rows(summary)
    d = cfg.data
    parts = []
    for budget in sorted({c["budget"] for c in cells}):
        for group in ("dense", "selection", "trained"):
            rows = [c for c in cells if c["group"] == group and c["budget"] == budget]
            if rows:
                title = registry.GROUP_TITLES[group] + (f", heal budget x{budget}" if group == "trained" else "")
                parts += [f"\n{title}", render(rows, COLUMNS)]
    tokens = cfg.stage2.steps * d.batch_size * d.seqlen
    parts.append(
        f"\nseeds {seeds} (mean [min-max]; '*' = the drop set changed across seeds); a difference inside the larger "
        f"spread, or within 2 standard errors for an accuracy, is a tie.\nheld-out: {heldout_source}; domain 2: "
        f"{domain2_source}; PPL over {d.eval_max_windows or 'all'} windows of {d.eval_seqlen} tokens.\n"
        f"trained rows: {cfg.stage2.steps} batches of {d.batch_size}x{d.seqlen} tokens ({tokens:,}) of weight updates "
        f"per budget unit, objective {cfg.recovery.objective}; '@compute' rows also heal with the TRSP selection's "
        "extra compute.\ncompute in thousands of dense-forward tokens (a forward token 1, a trained token 3): "
        "select = choosing the drop set, recover = stage 2 / heal / compensation, total = both.")
    if any(registry.ROWS[s["row"]].method and registry.recipe(s["row"])[0] == registry.SLEB_SELECTOR
           for s in summary):
        parts.append(sleb_note(cfg))  # only where a SLEB row ran
    if lambada_limit:
        parts.append(f"LAMBADA: last-word accuracy (lm-eval lambada_openai rule) on the first {lambada_limit} test "
                     "passages, ± standard error; reported only, never used to select or tune.")
    if zeroshot_limit:
        parts.append(f"zero-shot: mean acc over PIQA, WinoGrande, HellaSwag, ARC-e, ARC-c, {zeroshot_limit} items "
                     f"per task, ± standard error.")
    if any(registry.ROWS[s["row"]].compensate or registry.ROWS[s["row"]].comp_compute for s in summary):
        from trsp_ray.config import compensated

        c = compensated(cfg).compensation
        how = ("one scale per block from dense token norms" if c.method == "scalar"
               else f"{c.form if c.form != 'lowrank' else f'rank-{c.rank}'} map, {c.activations} activations, "
                    f"ridge {c.ridge} towards the identity, "
                    f"{'norm-weighted' if c.weighting == 'norm' else 'unweighted'} tokens")
        parts.append(f"+comp rows: {c.method} compensation after removal ({how}, {c.windows} calibration windows of "
                     f"{d.seqlen} tokens), folded into the weights before any heal; '@comp' rows heal instead "
                     "with what that compensation of their drop set costs as extra steps.")
    if cut:
        parts.append(cut)
    default = next((s["row"] for s in summary if registry.ROWS[s["row"]].is_default), None)
    if default:
        parts.append(f"default `trsp-ray prune` (method {registry.DEFAULT_METHOD}) = row {default}.")
    for s in summary:
        line = _verdict_line(s, "verdicts vs TRSP", "(the default) against TRSP's best row, equal weight tokens")
        if line:
            parts.append(line)
        if registry.ROWS[s["row"]].uses_stage1:
            for key, label in (("verdicts", "at equal weight tokens"), ("verdicts at equal compute",
                                                                         "at equal total compute")):
                line = _verdict_line(s, key, label)
                if line:
                    parts.append(line)
    return "\n".join(parts)
