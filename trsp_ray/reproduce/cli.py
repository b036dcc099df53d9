"""`trsp-ray reproduce`: run or resume a reproduction grid and write its tables and plot.

    trsp-ray reproduce --preset local --out runs/reproduce-local
    trsp-ray reproduce --preset paper --out /shared/reproduce --methods dense trsp shortgpt
    trsp-ray reproduce --preset paper --dry-run      # every cell's route and plan; nothing runs

Exit status: 0 when every cell finished, 1 when some failed (rerun to retry them), 2 for bad input
caught before anything runs.
"""

from __future__ import annotations

import argparse
import sys


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--preset", default="local", help="paper (GPU cluster) or local (this machine)")
    p.add_argument("--out", default=None, help="output dir; rerunning with the same dir resumes "
                                              "(default: runs/reproduce-<preset>)")
    p.add_argument("--models", nargs="+", default=None, help="subset of the preset's models (keys)")
    p.add_argument("--methods", nargs="+", default=None, help="subset of dense trsp trsp-no-stage2 "
                                                             "trsp-oneshot shortgpt sleb")
    p.add_argument("--ratios", nargs="+", type=float, default=None, help="layer ratios (default: preset's)")
    p.add_argument("--limit", type=int, default=None, help="zero-shot items per task (default: preset's)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="run-config override for every cell, e.g. --set stage2.steps=50")
    p.add_argument("--no-ray", action="store_true", help="run every cell in this process (debugging)")
    p.add_argument("--dry-run", action="store_true",
                   help="print every cell's route and memory plan (and each model's shared stage 1); run nothing")
    p.add_argument("--address", default=None, help="Ray cluster address (default: RAY_ADDRESS or local)")


def run_from_args(args: argparse.Namespace) -> int:
    from trsp_ray.reproduce.run import dry_run, run_reproduce

    if args.dry_run:
        print(dry_run(args.preset, models=args.models, methods=args.methods, ratios=args.ratios,
                      overrides=args.overrides))
        return 0

    out = args.out or f"runs/reproduce-{args.preset}"
    eval_overrides = {"limit": args.limit} if args.limit is not None else None
    result = run_reproduce(args.preset, out=out, models=args.models, methods=args.methods, ratios=args.ratios,
                           overrides=args.overrides, eval_overrides=eval_overrides, use_ray=not args.no_ray,
                           address=args.address)
    print(result["paths"]["txt"].read_text(encoding="utf-8"))
    print(f"computed {len(result['computed'])} cell(s), skipped {len(result['skipped'])} finished; "
          f"tables: {result['paths']['md']} {result['paths']['csv']}; log: {out}/run_log.jsonl")
    for cell in result["missing"]:
        print(f"NOT FINISHED {cell} (see the run log; rerun to retry)", file=sys.stderr)
    return 1 if result["missing"] else 0


def _main(args: argparse.Namespace) -> int:
    return run_from_args(args)


def register(subparsers) -> argparse.ArgumentParser:
    """Add the `reproduce` subcommand to the trsp-ray CLI (`subparsers` from add_subparsers())."""
    p = subparsers.add_parser("reproduce", help="reproduce the paper's tables (grid of models x methods x ratios)",
                              description=__doc__.splitlines()[0])
    add_arguments(p)
    p.set_defaults(func=_main)
    return p


if __name__ == "__main__":
    from trsp_ray.common.process_exit import exit_after

    parser = argparse.ArgumentParser(prog="trsp-ray reproduce")
    add_arguments(parser)
    exit_after(lambda: run_from_args(parser.parse_args()))
