"""The reproduction's tables (markdown, CSV, terminal) and plot, from the stored cell records.

Our numbers sit beside the paper's where it reports the cell (its models at 25%), with the
difference ours - paper. PPL text and calibration text are named in every footer: the `local`
preset uses a Wikipedia excerpt, NOT WikiText-2, so its PPL is not comparable to the paper's.
"""

from __future__ import annotations

import csv
import io
from pathlib import Path

from trsp_ray.common.table import markdown, render
from trsp_ray.reproduce.presets import GRID_METHODS

COLUMNS = ["model", "method", "ratio", "layers", "dropped", "PPL", "paper PPL", "d PPL",
           "mean5 acc %", "paper acc %", "d acc", "prefill x", "route", "prune s"]
# A TRSP cell whose drop set is not the model's shared stage-1 one (a Ray Train run that learned
# its own stage 1): marked, so an ablation that does not share its drop set cannot pass unseen.
UNSHARED = "*"


def _diff(ours, paper):
    return None if ours is None or paper is None else ours - paper


def table_rows(results: list[dict]) -> list[dict]:
    """One row per cell, ordered by model, ratio, then the paper's method order."""
    order = {m: i for i, m in enumerate(GRID_METHODS)}
    rows = []
    for r in sorted(results, key=lambda r: (r["model"], r["ratio"], order.get(r["method"], 99))):
        layers = f"{r.get('layers')}/{r.get('layers_original')}" if r.get("layers") is not None else None
        speed = r.get("speed") or {}
        rows.append({"model": r["model"], "method": r["method"], "ratio": r["ratio"] or None, "layers": layers,
                     "dropped": (" ".join(map(str, r.get("dropped") or [])) or "-")
                     + (UNSHARED if r.get("stage1_shared") is False else ""),
                     "PPL": r.get("ppl"), "paper PPL": r.get("paper_ppl"),
                     "d PPL": _diff(r.get("ppl"), r.get("paper_ppl")),
                     "mean5 acc %": r.get("mean5_acc"), "paper acc %": r.get("paper_acc"),
                     "d acc": _diff(r.get("mean5_acc"), r.get("paper_acc")),
                     "prefill x": speed.get("prefill_speedup"), "route": r.get("route"),
                     "prune s": r.get("prune_seconds")})
    return rows


def _cell(v) -> str:
    if v is None:
        return ""
    if isinstance(v, float):
        return f"{v:.2f}"
    return str(v)


def _fmt(row: dict, col: str) -> str:
    v = row.get(col)
    if col.startswith("d ") and isinstance(v, float):
        return f"{v:+.2f}"
    return _cell(v)


def footer(preset) -> str:
    eval_text = (preset.run.get("data", {}).get("eval_text")
                 or "gensim enwiki excerpt (real Wikipedia, NOT WikiText-2), held-out articles")
    e = preset.evaluation
    tasks = ", ".join(e.get("tasks") or ()) or "none"
    return (f"Preset {preset.name}: {preset.description}. Calibration: {preset.calibration}. "
            f"PPL: {e.get('ppl_seqlen')}-token windows (max {e.get('ppl_windows') or 'all'}) of {eval_text}. "
            f"Zero-shot (lm-eval, 0-shot, limit {e.get('limit') or 'whole split'}): {tasks}; mean5 = mean acc over "
            "PIQA, WinoGrande, HellaSwag, ARC-e, ARC-c, in %. Paper numbers: Feng et al. (arXiv 2505.18232), "
            "25% of layers removed, WikiText-2 PPL; d = ours - paper. Every TRSP row of a model prunes from "
            f"one shared stage-1 run; {UNSHARED} marks a drop set that is not the shared one. "
            + " ".join(preset.notes))


def to_markdown(rows: list[dict], foot: str) -> str:
    return markdown(rows, COLUMNS, fmt=_fmt) + "\n\n" + foot + "\n"


def to_text(rows: list[dict], foot: str) -> str:
    return render(rows, COLUMNS, fmt=_fmt, numbers_right=False, rule=False, trim=True) + "\n\n" + foot + "\n"


def to_csv(rows: list[dict]) -> str:
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=COLUMNS)
    writer.writeheader()
    writer.writerows({c: ("" if r.get(c) is None else r.get(c)) for c in COLUMNS} for r in rows)
    return buf.getvalue()


def plot(rows: list[dict], path: Path) -> Path | None:
    """PPL per method (log scale), one panel per model; hollow markers are the paper's numbers."""
    rows = [r for r in rows if r["PPL"] is not None]
    if not rows:
        return None
    from trsp_ray.common.plots import _pyplot

    plt = _pyplot()
    models = sorted({r["model"] for r in rows})
    fig, axes = plt.subplots(1, len(models), figsize=(5 * len(models), 4), squeeze=False)
    for ax, model in zip(axes[0], models):
        mine = [r for r in rows if r["model"] == model]
        labels = [f"{r['method']}" + (f"\n{r['ratio']:g}" if r["ratio"] else "") for r in mine]
        ax.bar(range(len(mine)), [r["PPL"] for r in mine], color="tab:blue", label="ours")
        paper = [(i, r["paper PPL"]) for i, r in enumerate(mine) if r["paper PPL"] is not None]
        if paper:
            ax.scatter(*zip(*paper), marker="o", facecolors="none", edgecolors="tab:red", s=60, label="paper")
        ax.set_xticks(range(len(mine)), labels, rotation=45, ha="right", fontsize=7)
        ax.set_yscale("log")
        ax.set_title(model)
        ax.set_ylabel("held-out PPL (log)")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write_reports(results: list[dict], out: Path, *, preset) -> dict[str, Path]:
    """results.md / .csv / .txt and ppl.png under `out` (each through a temp file + rename)."""
    from trsp_ray.common import atomic

    rows, foot = table_rows(results), footer(preset)
    out = Path(out)
    paths = {}
    for name, text in (("results.md", to_markdown(rows, foot)), ("results.csv", to_csv(rows)),
                       ("results.txt", to_text(rows, foot))):
        atomic.write_text(out / name, text)
        paths[name.split(".")[1]] = out / name
    if any(r["PPL"] is not None for r in rows):  # plot() draws nothing without a PPL
        with atomic.temp_path(out / "ppl.png", suffix=".png") as tmp:
            plot(rows, tmp)
        paths["png"] = out / "ppl.png"
    return paths
