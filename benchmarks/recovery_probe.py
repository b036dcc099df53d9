"""How well fixed drop sets recover at one compute budget, scored independently of the benchmark.

For each drop set (layer indices, or a selector's name: its drop set on the run's calibration),
the product's pipeline (`--method`, default the default pipeline) heals it with the budget's steps
(run/budget.resolve, the selection charged as the pipeline plans it) and the chosen objective and
recipe; then LAMBADA last-word accuracy on the first N test passages (scored here directly, the
lambada_openai rule, benchmarks/capability.py) and each domain's held-out PPL. Every row is paired
with the dense model on the same passages (difference and its paired SE). LAMBADA is reported,
never used to choose anything in the product.

    python benchmarks/recovery_probe.py --budget 1M --objective kd --sets shortgpt 20,21,22,23,24,25,26,27
    python benchmarks/recovery_probe.py --budget 300k --recipe tail --sets tail --set heal.tail_layers=6

Prints one table; the load average is printed beside the wall time of each row.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))


def _tokens(text: str) -> float:
    from trsp_ray.cli import _tokens as parse

    return parse(text)


def paired(a: list[int], b: list[int]) -> tuple[float, float]:
    """(mean of a - b, its standard error) over paired items."""
    d = [x - y for x, y in zip(a, b)]
    n = len(d)
    mean = sum(d) / n
    var = sum((x - mean) ** 2 for x in d) / max(1, n - 1)
    return mean, math.sqrt(var / n)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sets", nargs="+", required=True, help="drop sets: comma-separated layers, or a selector name")
    p.add_argument("--budget", type=_tokens, required=True, help="total compute, dense-forward tokens (e.g. 1M)")
    p.add_argument("--method", default=None, help="pipeline that heals (default: the product's default)")
    p.add_argument("--objective", default="kd", choices=["ce", "kd"])
    p.add_argument("--recipe", default="all", help="heal.trainable: all | tail | lora | map")
    p.add_argument("--lambada", type=int, default=500)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--set", dest="overrides", action="append", default=[])
    args = p.parse_args()

    import torch
    from capability import lambada_items, lambada_passages

    from trsp_ray.benchmark.jobs import domain_nlls
    from trsp_ray.config import registry
    from trsp_ray.config.run_config import load_config
    from trsp_ray.data.perplexity import ppl_of
    from trsp_ray.run.methods import apply_method
    from trsp_ray.run.pipeline import resolve
    from trsp_ray.run.workbench import prepare

    torch.set_num_threads(args.threads)
    method = args.method or registry.DEFAULT_METHOD
    base = ["tracking.enabled=false", f"method={method}", f"recovery.objective={args.objective}",
            f"heal.trainable={args.recipe}", *args.overrides]
    passages = lambada_passages(args.lambada)
    rows = []
    dense = None
    for spec_text in ["dense", *args.sets]:
        t0 = time.time()
        named = spec_text if spec_text in ("dense", *registry.SELECTORS) else None
        over = list(base)
        if named not in (None, "dense"):
            over[1] = f"method={method.replace(registry.method(method).selector, named, 1)}"
        cfg = load_config(overrides=[*over, f"heal.compute_budget={args.budget}"] if spec_text != "dense" else over)
        pipe = resolve(cfg)
        bench = prepare(pipe.cfg)
        if spec_text == "dense":
            model, info, drop = bench.scoring_model(), {}, []
        else:
            drop = None if named else [int(x) for x in spec_text.split(",")]
            out = apply_method(bench, pipe.spec, drop=drop)
            model, info, drop = out.model, out.info, out.drop
        items = lambada_items(model, bench.tokenizer, passages, bos=bench.bos)
        nlls = domain_nlls(bench, model)
        row = {"set": spec_text, "drop": sorted(drop), "acc": sum(items) / len(items), "items": items,
               "ppl": {k: ppl_of(v) for k, v in nlls.items()}, "steps": info.get("heal_steps", 0),
               "cost": info.get("select_cost", 0) + info.get("compensation_cost", 0) + info.get("heal_cost", 0),
               "seconds": time.time() - t0, "load": os.getloadavg()[0]}
        dense = dense or row
        rows.append(row)
        diff, se = paired(items, dense["items"])
        print(f"{spec_text:>28} drop {row['drop']} steps {row['steps']} cost {row['cost'] / 1e3:.0f}k  LAMBADA "
              f"{row['acc']:.3f} ({100 * row['acc'] / dense['acc']:.0f}% dense; vs dense {diff:+.3f} ± {se:.3f})  "
              + " ".join(f"{k} {v:.2f}" for k, v in row["ppl"].items())
              + f"  [{row['seconds']:.0f}s, load {row['load']:.2f}]", flush=True)
    if len(rows) > 2:
        print("paired LAMBADA differences against the first drop set:")
        for row in rows[2:]:
            diff, se = paired(row["items"], rows[1]["items"])
            print(f"  {row['set']} - {rows[1]['set']}: {diff:+.3f} ± {se:.3f} (z {diff / se if se else 0:+.1f})")


if __name__ == "__main__":
    main()
