"""Reproduce the paper's tables on a Ray GPU cluster (or a small version on this CPU machine).

    ray job submit --working-dir . -- python jobs/reproduce.py --preset paper --out /shared/reproduce

    python jobs/reproduce.py --preset paper --dry-run    # every cell's route and plan; nothing runs

Cluster this assumes (cluster/): GPU nodes of 8 x 80 GB with model-hub access (HF_TOKEN for the
LLaMA repos), WikiText-2 train/test as text files under /shared/data/wikitext2, and /shared for
outputs. Each model's shared stage 1 (one run serves trsp, trsp-oneshot and trsp-no-stage2) and
its single-GPU cells are one Ray task on one GPU; cells whose stage 2 does not fit one GPU (the
memory planner routes every cell) run on Ray Train + ZeRO-3 from that same stage 1; the evaluation
actor pool scores every exported cell. Resubmitting with the same --out skips finished cells whose
settings are unchanged (see <out>/run_log.jsonl); a changed setting recomputes what it affects.

On this machine:

    python jobs/reproduce.py --preset local --out runs/reproduce-local
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the --working-dir copy of trsp_ray
PROG = Path(__file__).name  # what argparse calls the job; its own errors start with it too


def job_config(argv=None) -> argparse.Namespace:
    """The job's arguments: the same flags as `trsp-ray reproduce`, defaulting to the paper preset."""
    from trsp_ray.cli import add_entry_flags
    from trsp_ray.reproduce.cli import add_arguments

    p = argparse.ArgumentParser(prog=PROG, description=__doc__.splitlines()[0])
    add_arguments(p)
    add_entry_flags(p)
    p.set_defaults(preset="paper")
    return p.parse_args(argv)


def main(argv=None) -> int:
    from trsp_ray.common.errors import run_main
    from trsp_ray.common.logs import quiet_libraries
    from trsp_ray.reproduce.cli import run_from_args

    args = job_config(argv)
    quiet_libraries(verbose=args.verbose)
    return run_main(PROG, lambda: run_from_args(args))


if __name__ == "__main__":
    from trsp_ray.common.process_exit import exit_after

    exit_after(main)  # the commands' one exit: a finished run cannot fail in the teardown
