"""Results table: terminal text, CSV and markdown, from the pool's result dicts.

Columns: candidate, layers, held-out PPL, the paper's 5-task mean (PIQA, WinoGrande, HellaSwag,
ARC-e, ARC-c) of acc, the same mean with acc_norm where a task defines it (WinoGrande has acc only),
every task's acc and acc_norm, prefill and generation speed-ups beside the ideal L / L_kept.
Accuracies are fractions in [0, 1]; PPL is on the held-out text named in the report's footer.
"""

from __future__ import annotations

import csv
import io
from pathlib import Path

from trsp_ray.common import atomic
from trsp_ray.common.table import markdown, render
from trsp_ray.evaluation.tasks import PAPER_TASKS

METRICS = ("acc", "acc_norm")


def paper_mean(tasks: dict, metric: str = "acc") -> float | None:
    """Mean over the paper's five tasks; acc_norm falls back to acc where a task has no acc_norm.
    None unless all five were scored."""
    if not all(t in tasks for t in PAPER_TASKS):
        return None
    values = [tasks[t].get(metric, tasks[t]["acc"]) for t in PAPER_TASKS]
    return sum(values) / len(values)


def flat_metrics(result: dict) -> dict[str, float]:
    """Every number of one result as flat MLflow metric names (`piqa.acc`, `speed.prefill_speedup`)."""
    out: dict[str, float] = {}
    if result.get("ppl") is not None:
        out["ppl"] = result["ppl"]
    for task, scores in (result.get("tasks") or {}).items():
        out.update({f"{task}.{m}": v for m, v in scores.items() if m in METRICS})
    for metric in METRICS:
        mean = paper_mean(result.get("tasks") or {}, metric)
        if mean is not None:
            out[f"mean5.{metric}"] = mean
    for key, value in (result.get("speed") or {}).items():
        if isinstance(value, (int, float)):  # "settings" (what was timed) is a dict, not a metric
            out[f"speed.{key}"] = float(value)
    return out


def row(result: dict) -> dict[str, object]:
    """One table row (column name -> value; None where not measured)."""
    tasks, speed = result.get("tasks") or {}, result.get("speed") or {}
    r: dict[str, object] = {
        "candidate": result.get("name"), "status": result.get("status"),
        "layers": result.get("layers"), "ppl": result.get("ppl"),
        "mean5_acc": paper_mean(tasks, "acc"), "mean5_acc_norm": paper_mean(tasks, "acc_norm"),
    }
    for task, scores in tasks.items():
        for metric in METRICS:
            r[f"{task}.{metric}"] = scores.get(metric)
    for key in ("prefill_speedup", "throughput_speedup", "ideal_speedup", "prefill_ms", "tokens_per_s"):
        r[key] = speed.get(key)
    r["error"] = result.get("error")
    return r


def rows(results: list[dict]) -> list[dict]:
    """Rows with a common column set (a task missing from one candidate is an empty cell)."""
    table = [row(r) for r in results]
    columns: list[str] = []
    for r in table:
        columns += [c for c in r if c not in columns]
    columns.remove("error")
    columns.append("error")  # the longest cell goes last
    return [{c: r.get(c) for c in columns} for r in table]


def _cell(value: object) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        return f"{value:.4f}" if abs(value) < 10 else f"{value:.2f}"
    return str(value)


def _fmt(row_: dict, column: str) -> str:
    return _cell(row_[column])


def format_table(results: list[dict]) -> str:
    """Fixed-width table for the terminal."""
    table = rows(results)
    if not table:
        return "(no candidates)"
    return render(table, list(table[0]), fmt=_fmt, numbers_right=False, rule=False, trim=True)


def to_csv(results: list[dict]) -> str:
    table = rows(results)
    buf = io.StringIO()
    if table:
        writer = csv.DictWriter(buf, fieldnames=list(table[0]))
        writer.writeheader()
        writer.writerows({k: ("" if v is None else v) for k, v in r.items()} for r in table)
    return buf.getvalue()


def to_markdown(results: list[dict], *, footer: str = "") -> str:
    table = rows(results)
    if not table:
        return "(no candidates)\n"
    return markdown(table, list(table[0]), fmt=_fmt) + ("\n\n" + footer if footer else "") + "\n"


def write_reports(results: list[dict], out_dir: str | Path, *, footer: str = "") -> dict[str, Path]:
    """results.csv, results.md and results.txt under `out_dir` (each through a temp file + rename);
    returns their paths."""
    out = Path(out_dir)
    paths = {"csv": out / "results.csv", "md": out / "results.md", "txt": out / "results.txt"}
    atomic.write_text(paths["csv"], to_csv(results))
    atomic.write_text(paths["md"], to_markdown(results, footer=footer))
    atomic.write_text(paths["txt"], format_table(results) + ("\n\n" + footer if footer else "") + "\n")
    return paths


def summary_line(result: dict) -> str:
    """One progress line: the candidate and its headline numbers, or its error."""
    if result.get("status") != "ok":
        return f"{result.get('name')}: FAILED after {result.get('attempts', 0)} attempt(s): {result.get('error')}"
    parts = [f"{result['name']}: ok", f"{result.get('layers')} layers"]
    if result.get("ppl") is not None:
        parts.append(f"PPL {result['ppl']:.2f}")
    mean = paper_mean(result.get("tasks") or {})
    if mean is not None:
        parts.append(f"5-task mean acc {mean:.4f}")
    speed = result.get("speed") or {}
    if "prefill_speedup" in speed:
        parts.append(f"prefill x{speed['prefill_speedup']:.2f} (ideal x{speed['ideal_speedup']:.2f})")
    elif "prefill_ms" in speed:
        parts.append(f"prefill {speed['prefill_ms']:.0f} ms")
    if "seconds" in result:
        parts.append(f"{result['seconds']:.1f} s")
    return ", ".join(parts)
