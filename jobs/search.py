"""Search pruning pipelines with Ray Tune on a Ray cluster at a fixed total compute budget (selections
shared between trials that share them, ASHA on the calibration held-out loss, MLflow lineage with the
Pareto figure, best model registered).

    ray job submit --working-dir . -- python jobs/search.py --model /shared/models/Llama-2-7b-hf \
        --space method=shortgpt+heal,shortgpt+comp+heal,tail+heal,trsp+heal --space stage2.lr=1e-4,3e-4 \
        --compute-budget 20000000 --search-dir /shared/runs/search-llama2-7b --set device=cuda --cpus-per-trial 8

    ray job submit --working-dir . -- python jobs/search.py --model /shared/models/Llama-2-7b-hf \
        --method trsp --space ratio=0.25,0.3 --space stage1.lambda1=1e-3,5e-3 \
        --search-dir /shared/runs/search-llama2-7b-trsp --set device=cuda --cpus-per-trial 8

`--search-dir` must be on storage every node sees: it holds the stage-1 store, the trial records
that make a rerun skip finished trials, the exports, and the JSON-lines run log (`events.jsonl`).
On GPUs (`--set device=cuda`, or `device=auto` on a cluster with GPUs) each trial holds the GPU share the
memory planner gives it (a quarter of one for a small model, `--gpus-per-trial` to override); a
trial that does not fit one GPU drives stage 2 on Ray Train workers from inside the trial
(`--trial-workers N` to force it), and the evaluation actors get GPUs too.
On this CPU machine, with a tiny model directory:

    ray job submit --working-dir . -- python jobs/search.py --model /tmp/tiny --space method=shortgpt+heal,tail+heal \
        --space ratio=0.125,0.25 --compute-budget 20000 --set data.seqlen=32 --set data.batch_size=2
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the --working-dir copy of trsp_ray
PROG = Path(__file__).name  # what argparse calls the job; its own errors start with it too


def job_config(args: argparse.Namespace):
    """(run config, search space, options): job defaults, then --config, flags and --set overrides."""
    from trsp_ray.search.cli import options, search_config

    cfg, space = search_config(args)
    return cfg, space, options(args)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    from trsp_ray.cli import add_entry_flags
    from trsp_ray.run.run_args import add_run_arguments
    from trsp_ray.search.cli import add_arguments, add_method_argument

    parser = argparse.ArgumentParser(prog=PROG, description=__doc__.splitlines()[0])
    add_run_arguments(parser)
    add_method_argument(parser)
    add_arguments(parser)
    add_entry_flags(parser)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    from trsp_ray.common.errors import run_main
    from trsp_ray.common.logs import quiet_libraries

    args = parse_args(argv)
    quiet_libraries(verbose=args.verbose)

    def body() -> int:
        from trsp_ray.search.run import run_search

        cfg, space, opts = job_config(args)
        return 0 if not run_search(cfg, space, opts)["failed"] else 1

    return run_main(PROG, body)


if __name__ == "__main__":
    from trsp_ray.common.process_exit import exit_after

    exit_after(main)  # the commands' one exit: a finished run cannot fail in the teardown
