"""The recovery curve from the finished rows of benchmarks/recovery_probe.py (its --rows file): one
table of every row by total compute, LAMBADA accuracy (and the five-task zero-shot mean where the
row scored it) as % of dense with the paired difference against the default pipeline's row at the
same budget (cross-entropy, all weights, Block Influence's set), each domain's held-out perplexity,
and a retention-vs-compute PNG (the product's plots.retention_vs_compute, as the benchmark logs it
to MLflow). Where the file holds one row twice (a rerun after a change to the product healed it
again), the later row is shown.

    python benchmarks/recovery_curve.py /tmp/probe/curve.jsonl --plot docs/recovery_curve.png
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))


def row_name(row: dict) -> str:
    """A row's line in the plot: its drop set's name, objective and recipe (the budget is the x axis)."""
    _, _, _, method, recipe, overrides = json.loads(row["key"])[:6]
    extra = "" if recipe == "all" else f" {recipe}"
    base = row["set"] if "+" in row["set"] else f"{row['set']} ({method.split('+', 1)[1] if '+' in method else method})"
    return f"{base} {row['objective']}{extra}" + (f" {' '.join(overrides)}" if overrides else "")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("rows", help="the --rows JSONL file of recovery_probe.py")
    p.add_argument("--plot", default=None, help="write the retention-vs-compute PNG here")
    args = p.parse_args()

    from recovery_probe import paired, zeroshot_mean

    from trsp_ray.common import table
    from trsp_ray.config.budgets import budget_label

    with open(args.rows) as fh:
        latest = {}
        for r in (json.loads(line) for line in fh if line.strip()):
            latest[(row_name(r), r["budget"])] = r  # a later row of the same name and budget replaces it
    rows = list(latest.values())
    dense = latest[(row_name(next(r for r in rows if r["set"] == "dense" and _plain(r))), None)]
    trained = sorted((r for r in rows if r["set"] != "dense"), key=lambda r: (r["cost"], row_name(r)))
    zeroshot = zeroshot_mean(dense)
    default = {r["budget"]: r for r in trained if r["set"] == "shortgpt" and r["objective"] == "ce"
               and _plain(r)}
    shown, summary = [], []
    for r in trained:
        ref = default.get(r["budget"])
        diff, se = paired(r["items"], ref["items"]) if ref is not None and ref is not r else (None, None)
        budget = "default" if r["budget"] is None else budget_label(int(r["budget"]))
        retention = 100 * r["acc"] / dense["acc"]
        shown.append({"row": row_name(r), "budget": budget, "compute": f"{r['cost'] / 1e3:.0f}k", "steps": r["steps"],
                      "drop": ",".join(map(str, r["drop"])), "LAMBADA": f"{r['acc']:.3f}",
                      "% dense": f"{retention:.0f}",
                      "vs default row": "-" if diff is None else f"{diff:+.3f} ± {se:.3f}",
                      **({} if zeroshot is None else _zeroshot_cells(r, ref, dense)),
                      **{k: f"{v:.2f}" for k, v in r["ppl"].items()}})
        n = len(r["items"])
        summary.append({"group": "trained", "row": row_name(r), "total cost": r["cost"],
                        "LAMBADA % dense": {"mean": retention, "n": 1,
                                            "se": 100 * math.sqrt(r["acc"] * (1 - r["acc"]) / n) / dense["acc"]}})
    print(f"dense LAMBADA {dense['acc']:.3f} on {len(dense['items'])} passages; "
          + ("" if zeroshot is None else f"zero-shot {zeroshot:.3f}; ")
          + " ".join(f"{k} {v:.2f}" for k, v in dense["ppl"].items()))
    print(table.render(shown, list(shown[0])))
    if args.plot:
        from trsp_ray.common import plots

        fig = plots.retention_vs_compute(summary)
        fig.savefig(args.plot, dpi=120)
        plots.close(fig)
        print(f"wrote {args.plot}")


def _plain(row: dict) -> bool:
    """A row of the product's own recipe and settings (all weights, no --set)."""
    return json.loads(row["key"])[4:6] == ["all", []]


def _zeroshot_cells(r: dict, ref: dict | None, dense: dict) -> dict:
    """A row's zero-shot mean, its % of dense and its paired difference against the default row."""
    from recovery_probe import zeroshot_mean, zeroshot_paired

    mean = zeroshot_mean(r)
    if mean is None:
        return {"zero-shot": "-", "zs % dense": "-", "zs vs default": "-"}
    p = zeroshot_paired(r, ref) if ref is not None and ref is not r else None
    return {"zero-shot": f"{mean:.3f}", "zs % dense": f"{100 * mean / zeroshot_mean(dense):.0f}",
            "zs vs default": "-" if p is None else f"{p[0]:+.3f} ± {p[1]:.3f}"}


if __name__ == "__main__":
    main()
