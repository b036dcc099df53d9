"""One pipeline calibrated on several mixtures, compared paired: which mixture keeps accuracy, and
what it costs each domain's perplexity (issue 42: choose the default mixture on accuracy and on the
domains, paired, never on one kind of text).

    python benchmarks/calibration_paired.py [--rows dense,shortgpt+comp+heal] [--seeds 2] [--budgets 1]
        [--lambada 500] [--mix NAME=SPEC[;KEY=VALUE...] ...] [--workers 2]

Each mixture is one `trsp-ray benchmark` run (the rows' row cache: a row finished by an earlier run
of the same config, code and model, `--budget-curve --left-out none` included, is read back, not
recomputed). Every row is scored on the same held-out windows and the same LAMBADA passages
whatever it was calibrated on, so rows of two mixtures pair item by item (a mixture may also carry config
settings after ';', e.g. 'protected=DEFAULT;gates.protect_head=4', to pair one change of the pipeline on the
same calibration): the table gives, for each
row and budget, each mixture's figures and its paired difference against the first mixture (± 2
paired SE; PPL columns clustered on held-out documents; the seeds' spread too).
"""

from __future__ import annotations

import argparse

DEFAULT_MIXES = ("default=DEFAULT", "wiki-only=wiki:1", "four-domain=wiki:1,news:1,code:1,math:1")


def main(argv=None) -> int:
    from trsp_ray.benchmark import stats
    from trsp_ray.benchmark.cluster import RayRunner
    from trsp_ray.benchmark.comparison import run_benchmark
    from trsp_ray.benchmark.report import _signed, fmt
    from trsp_ray.common.table import render
    from trsp_ray.config.run_config import load_config, replace
    from trsp_ray.data import domains

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", default="dense,shortgpt+comp+heal")
    p.add_argument("--seeds", type=int, default=2)
    p.add_argument("--budgets", default="1")
    p.add_argument("--lambada", type=int, default=500)
    p.add_argument("--mix", action="append", default=None, metavar="NAME=SPEC",
                   help=f"a mixture to compare (repeatable; the first is the reference; DEFAULT = the product's); "
                        f"default {' '.join(DEFAULT_MIXES)}")
    p.add_argument("--workers", type=int, default=2, help="Ray workers (0 = in this process)")
    args = p.parse_args(argv)
    mixes = []  # (name, mixture, config settings)
    for entry in args.mix or DEFAULT_MIXES:
        name, _, rest = entry.partition("=")
        spec, *sets = rest.split(";")
        mixes.append((name, domains.DEFAULT_MIX if spec == "DEFAULT" else spec, sets))
    rows = args.rows.split(",")
    budgets = tuple(int(b) for b in args.budgets.split(","))
    summaries = {}
    for name, spec, sets in mixes:
        cfg = replace(load_config(None, sets), **{"data.calib_mix": spec})
        runner = RayRunner(args.workers) if args.workers else None
        summaries[name] = run_benchmark(cfg, rows, seeds=args.seeds, lambada_limit=args.lambada, budgets=budgets,
                                        runner=runner, cache=True, show=False)
    ref = mixes[0][0]
    doms = next(s for s in summaries[ref] if s["group"] != "dense")["domains"]
    cols = [(stats.GEO, False)] + [(f"{d} PPL", False) for d in doms] + [("LAMBADA acc", True)]
    cells = []
    for s_ref in summaries[ref]:
        if s_ref["group"] == "dense":
            continue
        for name, _, _ in mixes:
            s = next(o for o in summaries[name] if o["row"] == s_ref["row"] and o["budget"] == s_ref["budget"])
            cell = {"row": f"{s['row']} x{s['budget']}", "calibration": name, "total k": s["total cost"] / 1e3,
                    "LAMBADA % dense": fmt(s.get("LAMBADA % dense"), 1)}
            verdicts = stats.compare(s, s_ref, cols) if name != ref else {}
            for col, _ in cols:
                figure = fmt(s[col], 3 if col == stats.GEO else 2) if col != "LAMBADA acc" else fmt(s.get(col), 3)
                v = verdicts.get(col)
                cell[col] = figure + (f" ({v['verdict']} {_signed(col, v)})" if v else "")
            cells.append(cell)
    print(f"\nOne pipeline, several calibration mixtures ({', '.join(f'{n} = {m}' for n, m, _ in mixes)}); each "
          f"against {ref}, paired on the same windows and passages over {args.seeds} seed(s):")
    print(render(cells, ["row", "calibration", "total k"] + [c for c, _ in cols] + ["LAMBADA % dense"]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
