"""How well fixed drop sets recover at one compute budget, scored independently of the benchmark.

For each drop set (layer indices, or a selector's name: its drop set on the run's calibration),
the product's pipeline (`--method`, default the default pipeline) heals it with the budget's steps
(run/budget.resolve, the selection charged as the pipeline plans it) and the chosen objective and
recipe; then LAMBADA last-word accuracy on the first N test passages (scored here directly, the
lambada_openai rule, benchmarks/capability.py), each domain's held-out PPL and, with `--zeroshot K`,
the paper's five-task zero-shot mean on the first K items of each task (lm-eval on the healed model
in memory, the benchmark's metric per task). Every row is paired
with the dense model on the same passages (difference and its paired SE). LAMBADA is reported,
never used to choose anything in the product.

    python benchmarks/recovery_probe.py --budget 1M --objective kd --sets shortgpt 20,21,22,23,24,25,26,27
    python benchmarks/recovery_probe.py --budget 300k --recipe tail --sets tail --set heal.tail_layers=6
    python benchmarks/recovery_probe.py --budget default,1M --objective ce,kd --sets shortgpt --rows rows.jsonl
    python benchmarks/recovery_probe.py --method merge --budget default --objective ce --sets merge shortgpt+comp

`--budget` and `--objective` take comma lists (every set at every budget with every objective;
`default` is the pipeline's configured heal, no compute budget). With `--rows FILE` each finished
row (its per-passage LAMBADA results too) is appended to FILE and a rerun reads it back instead of
healing again, so a long probe can run in parts and later rows pair with earlier ones. A row's key
covers its resolved configuration, its heal's settings and the bytes and libraries it read
(run/content.store_key): after a change to any of them the row is healed again, never read stale. The
product's code is not in the key (every commit would heal every row again): each row records a digest of the
package's sources and the commit it ran at, and a row read back under other sources says so beside its line.
`--fresh` runs every row again even where FILE holds it (the new row is appended and read back after), e.g. to
store what an older row lacks; `--fresh SET ...` only those sets' rows (the others are read back). Prints one
line per row and, for every two rows after the dense one, the paired LAMBADA difference and, where both rows
stored their per-window held-out NLLs, each domain's paired difference of the mean window NLL (the log of the
PPL ratio, nats; windows of one document one cluster, trsp_ray/common/paired.py); the load average is printed
beside the wall time of each row. An interrupted row's heal resumes from its last checkpoint when the same command
runs again from the same directory (run/heal_store.py, under ./runs/checkpoints), so a 3M row of 100 minutes can
run in parts too.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))


def _tokens(text: str) -> float:
    from trsp_ray.cli import _tokens as parse

    return parse(text)


def _budgets(text: str) -> list:
    return [None if b == "default" else _tokens(b) for b in text.split(",")]


def paired(a: list[int], b: list[int]) -> tuple[float, float]:
    """(mean of a - b, its standard error) over paired items."""
    d = [x - y for x, y in zip(a, b)]
    n = len(d)
    mean = sum(d) / n
    var = sum((x - mean) ** 2 for x in d) / max(1, n - 1)
    return mean, math.sqrt(var / n)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sets", nargs="+", required=True,
                   help="drop sets: comma-separated layers, a selector name (healed by --method's pipeline) or a "
                        "pipeline with a '+' in its name (run as it is, e.g. shortgpt+comp)")
    p.add_argument("--budget", type=_budgets, required=True,
                   help="total compute, dense-forward tokens (e.g. 1M), or default; a comma list runs each")
    p.add_argument("--method", default=None, help="pipeline that heals (default: the product's default)")
    p.add_argument("--objective", default="kd", help="ce | kd, or a comma list (ce,kd) to run each")
    p.add_argument("--rows", default=None, help="JSONL file of finished rows, read back on a rerun")
    p.add_argument("--recipe", default="all", help="heal.trainable: all | tail | lora | map")
    p.add_argument("--lambada", type=int, default=500)
    p.add_argument("--zeroshot", type=int, default=0, help="items per zero-shot task (0: none)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--set", dest="overrides", action="append", default=[])
    p.add_argument("--fresh", nargs="*", default=None, metavar="SET",
                   help="run every row again (or only these sets' rows), even one the rows file holds")
    args = p.parse_args()

    import torch
    from capability import lambada_items, lambada_passages

    from trsp_ray.benchmark.jobs import domain_coverage, domain_nlls
    from trsp_ray.config import registry
    from trsp_ray.config.run_config import load_config
    from trsp_ray.data.perplexity import ppl_of
    from trsp_ray.distributed.audition import audition
    from trsp_ray.run.methods import apply_method
    from trsp_ray.run.pipeline import resolve
    from trsp_ray.run.workbench import prepare

    torch.set_num_threads(args.threads)
    method = args.method or registry.DEFAULT_METHOD
    objectives = args.objective.split(",")
    if set(objectives) - {"ce", "kd"}:
        sys.exit(f"--objective {args.objective!r} is not valid; choose ce, kd or ce,kd")
    base = ["tracking.enabled=false", f"method={method}", f"heal.trainable={args.recipe}", *args.overrides]
    passages = lambada_passages(args.lambada)
    rows = []
    dense = None
    done = _read_rows(args.rows)
    jobs = [("dense", None, "ce")] + [(x, b, o) for x in args.sets for b in args.budget for o in objectives]
    for spec_text, budget, objective in jobs:
        t0 = time.time()
        pipeline = "+" in spec_text and _is_pipeline(spec_text)
        named = spec_text if pipeline or spec_text in ("dense", *registry.SELECTORS) else None
        over = [*base, f"recovery.objective={objective}"]
        if pipeline:  # its own selection, fit and recovery
            over[1] = f"method={named}"
        elif named not in (None, "dense"):
            over[1] = f"method={method.replace(registry.method(method).selector, named, 1)}"
        if spec_text != "dense" and budget is not None:
            over.append(f"heal.compute_budget={budget}")
        cfg = load_config(overrides=over)
        pipe = resolve(cfg)
        key = json.dumps([spec_text, budget, objective, method, args.recipe, args.overrides, args.lambada,
                          _resolved_key(pipe, dense=spec_text == "dense")] + ([args.zeroshot] if args.zeroshot else []))
        fresh = args.fresh is not None and (not args.fresh or spec_text in args.fresh)
        if key in done and not fresh:
            row = done[key]
            dense = dense or row
            rows.append(row)
            _print(row, dense, cached=True)
            continue
        bench = prepare(pipe.cfg)
        if spec_text == "dense":
            model, info, drop = bench.scoring_model(), {}, []
        else:
            drop = None if named else [int(x) for x in spec_text.split(",")]
            out = apply_method(bench, pipe.spec, drop=drop, audition=audition)
            model, info, drop = out.model, out.info, out.drop
        items = lambada_items(model, bench.tokenizer, passages, bos=bench.bos)
        nlls = domain_nlls(bench, model)
        zeroshot = _zeroshot(model, bench.tokenizer, args.zeroshot) if args.zeroshot else None
        row = {"key": key, "set": spec_text, "budget": budget, "objective": objective if drop else "-",
               "drop": sorted(drop), "acc": sum(items) / len(items), "items": items,
               "ppl": {k: ppl_of(v) for k, v in nlls.items()}, "nlls": nlls,
               "docs": {k: v["docs"] for k, v in domain_coverage(bench).items()}, "steps": info.get("heal_steps", 0),
               "cost": sum(info.get(k, 0) for k in ("select_cost", "compensation_cost", "merge_cost",
                                                        "merge_solve_cost", "heal_cost")),
               "seconds": time.time() - t0, "load": os.getloadavg()[0], "code": code_version(),
               **({"zeroshot": zeroshot} if zeroshot else {})}
        dense = dense or row
        rows.append(row)
        if args.rows:
            with open(args.rows, "a") as fh:
                fh.write(json.dumps(row) + "\n")
        _print(row, dense, cached=False)
    if len(rows) > 2:
        print(f"paired LAMBADA differences between the rows ({len(rows[1]['items'])} passages):")
        for i, first in enumerate(rows[1:], 1):
            for row in rows[i + 1:]:
                diff, se = paired(row["items"], first["items"])
                print(f"  {_name(row)} - {_name(first)}: {diff:+.3f} ± {se:.3f} (z {diff / se if se else 0:+.1f})"
                      + ("" if zeroshot_paired(row, first) is None else
                         " LAMBADA; zero-shot {:+.3f} ± {:.3f}".format(*zeroshot_paired(row, first))))
                domains = domains_paired(row, first)
                if domains:
                    print("    log PPL ratio per domain (nats, paired by window, clustered by document): "
                          + ", ".join(f"{k} {d:+.3f} ± {e:.3f}" for k, (d, e) in domains.items()))


def _zeroshot(model, tokenizer, limit: int) -> dict:
    """The paper's five tasks on the first `limit` items each, per-item results kept for pairing."""
    from trsp_ray.evaluation.harness import run_tasks
    from trsp_ray.evaluation.tasks import PAPER_TASKS, write_task_dir

    return run_tasks(model, tokenizer, tasks=list(PAPER_TASKS), limit=limit, task_dir=write_task_dir(PAPER_TASKS),
                     items=True)["tasks"]


def zeroshot_mean(row: dict) -> float | None:
    """The five-task zero-shot mean of a row (the benchmark's metric per task), None if not scored."""
    from trsp_ray.benchmark.stats import zeroshot_stats

    z = zeroshot_stats(row["zeroshot"]) if row.get("zeroshot") else None
    return None if z is None else z[0]


def zeroshot_paired(a: dict, b: dict) -> tuple[float, float] | None:
    """(a - b, paired SE) of the zero-shot mean over the same items, None where either lacks it."""
    from trsp_ray.benchmark.stats import paired as paired_runs
    from trsp_ray.benchmark.stats import zeroshot_items

    if not (a.get("zeroshot") and b.get("zeroshot")):
        return None
    p = paired_runs({0: zeroshot_items(a["zeroshot"])}, {0: zeroshot_items(b["zeroshot"])})
    return p["diff"], p["se"]


def domains_paired(a: dict, b: dict) -> dict[str, tuple[float, float]]:
    """{domain: (mean window NLL of a - b, its document-clustered paired SE)} over the held-out windows both
    rows scored (the same windows: the same documents in the same order), {} where either row lacks them."""
    from trsp_ray.common.paired import paired_se

    if not (a.get("nlls") and b.get("nlls")):
        return {}
    got = {}
    for name, nlls in a["nlls"].items():
        if name in b["nlls"] and a["docs"][name] == b["docs"][name]:
            got[name] = paired_se(nlls, b["nlls"][name], clusters=a["docs"][name])
    return got


def _resolved_key(pipe, *, dense: bool) -> str:
    """What a row depends on beyond its command line (run/content.store_key): the resolved
    configuration, the heal a heal method runs (its steps, rate, recipe), the bytes of the model and
    of every text, the library versions and the precision; a row is read back only where none changed.
    The dense row depends on the model, the texts and the libraries only."""
    import dataclasses

    from trsp_ray.run.content import run_inputs, store_key
    from trsp_ray.run.methods import method_heal

    d = pipe.cfg.to_dict()
    what = {"dense": d["model"]} if dense else {
        "cfg": d, "heal": dataclasses.asdict(method_heal(pipe.cfg) if pipe.spec.heal else pipe.cfg.heal)}
    return store_key(what, cfg=d, data=run_inputs(d))


def _is_pipeline(name: str) -> bool:
    from trsp_ray.common.errors import TrspError
    from trsp_ray.config import registry

    try:
        registry.method(name)
    except TrspError:
        return False
    return True


def _name(row: dict) -> str:
    from trsp_ray.config.budgets import budget_label

    budget = "default" if row["budget"] is None else budget_label(int(row["budget"]))
    return row["set"] if row["set"] == "dense" else f"{row['set']} @ {budget} {row['objective']}"


@functools.cache
def code_version() -> dict:
    """The sources a row ran: a digest of every .py file of the trsp_ray package and the commit checked out
    (None outside a git checkout), with whether the checkout had changes."""
    import hashlib
    import subprocess
    from pathlib import Path

    import trsp_ray

    package = Path(trsp_ray.__file__).parent
    h = hashlib.sha256()
    for f in sorted(package.rglob("*.py")):
        h.update(f.relative_to(package).as_posix().encode() + b"\0" + f.read_bytes())

    def git(*cmd):
        done = subprocess.run(["git", "-C", str(package), *cmd], capture_output=True, text=True)
        return done.stdout.strip() if done.returncode == 0 else None

    commit = git("rev-parse", "--short", "HEAD")
    return {"sources": h.hexdigest()[:16], "commit": commit,
            "changed": bool(git("status", "--porcelain", "--", ".")) if commit else None}


def _print(row: dict, dense: dict, *, cached: bool) -> None:
    diff, se = paired(row["items"], dense["items"])
    when = "read back" if cached else f"{row['seconds']:.0f}s, load {row['load']:.2f}"
    if cached and row.get("code", {}).get("sources") != code_version()["sources"]:
        ran = row.get("code", {}).get("commit")
        when += (f"; computed by other sources (commit {ran}): --fresh {row['set']} heals it again" if ran else
                 f"; computed before rows recorded their sources: --fresh {row['set']} heals it again")
    print(f"{_name(row):>28} drop {row['drop']} steps {row['steps']} cost {row['cost'] / 1e3:.0f}k  LAMBADA "
          f"{row['acc']:.3f} ({100 * row['acc'] / dense['acc']:.0f}% dense; vs dense {diff:+.3f} ± {se:.3f})  "
          + " ".join(f"{k} {v:.2f}" for k, v in row["ppl"].items())
          + ("" if zeroshot_mean(row) is None else f"  zero-shot {zeroshot_mean(row):.3f}") + f"  [{when}]", flush=True)


def _read_rows(path: str | None) -> dict:
    if not path or not os.path.exists(path):
        return {}
    with open(path) as fh:
        return {row["key"]: row for row in map(json.loads, filter(str.strip, fh))}


if __name__ == "__main__":
    main()
