"""`trsp-ray eval`: score exported candidates on a pool of Ray actors and write the results table.

    trsp-ray eval --models out/trsp-25 out/shortgpt-25 --dense ~/.cache/trsp_ray/models/smollm2-135m-instruct \
        --tasks piqa winogrande hellaswag arc_easy arc_challenge --limit 200 --actors 2

Exit code: 0 when every candidate was evaluated, 1 when some failed (the others still finish and are
reported), 2 for bad input caught before anything starts.
"""

from __future__ import annotations

import argparse
import os
import sys
import time


def register(subparsers) -> argparse.ArgumentParser:
    """Add the `eval` subcommand to the top-level CLI's subparsers."""
    from trsp_ray.config.sections import DataConfig
    from trsp_ray.evaluation.tasks import DEFAULT_TASKS

    p = subparsers.add_parser("eval", help="evaluate exported candidates (PPL, zero-shot tasks, speed)",
                              description=__doc__.splitlines()[0])
    p.add_argument("--models", nargs="+", required=True, metavar="DIR", help="exported model directories")
    p.add_argument("--tasks", nargs="*", default=list(DEFAULT_TASKS), metavar="TASK",
                   help=f"offline tasks ({', '.join(DEFAULT_TASKS)}) or lm_eval:<stock task>; "
                        "'none' or no value skips zero-shot")
    p.add_argument("--limit", type=int, default=None, help="items per task (default: whole split)")
    p.add_argument("--actors", type=int, default=1, help="evaluation actors in the pool")
    p.add_argument("--cpus-per-actor", type=float, default=None,
                   help="CPUs (and torch threads) per actor; default: this machine's cores / actors")
    p.add_argument("--gpus-per-actor", type=float, default=0.0, help="a GPU fraction or whole GPUs")
    p.add_argument("--placement-group", action="store_true",
                   help="reserve each actor's resources as one placement-group bundle (multi-GPU candidates)")
    p.add_argument("--dense", metavar="DIR", help="dense model timed beside each candidate for speed-ups")
    p.add_argument("--eval-text", metavar="FILE", help="held-out text for PPL (default: Wikipedia excerpt)")
    data = DataConfig()  # `prune`'s held-out windows, so that `eval` of an export prints the PPL `prune` did
    p.add_argument("--ppl-windows", type=int, default=data.eval_max_windows,
                   help=f"held-out PPL windows, one per document first (default {data.eval_max_windows}, as "
                        "prune's data.eval_max_windows; 0 skips PPL)")
    p.add_argument("--ppl-seqlen", type=int, default=data.eval_seqlen,
                   help=f"tokens per PPL window (default {data.eval_seqlen}, as prune's data.eval_seqlen)")
    p.add_argument("--no-speed", action="store_true", help="skip the speed benchmark")
    p.add_argument("--prompt-len", type=int, default=None,
                   help="prefill prompt length in tokens (default: the device's, see evaluation/speed.py)")
    p.add_argument("--batch-size", type=int, default=8, help="lm-eval batch size")
    p.add_argument("--out", metavar="DIR", help="where results.csv/.md/.txt go (default: runs/eval-<time>)")
    p.add_argument("--no-mlflow", action="store_true", help="do not log to MLflow")
    p.add_argument("--tracking-uri", help="MLflow tracking URI (default: sqlite under ./runs)")
    p.add_argument("--experiment", default="trsp_ray-eval", help="MLflow experiment")
    p.add_argument("--address", help="Ray cluster address (default: RAY_ADDRESS or a local instance)")
    p.set_defaults(func=run_eval)
    return p


def eval_request(args):
    """The settings of `trsp-ray eval`'s flags, with every check the command makes before the pool
    starts: the settings' values and the candidate directories (the tests check documented commands
    with it)."""
    from trsp_ray.evaluation.evaluator import EvalSettings, check_candidate
    from trsp_ray.evaluation.speed import SpeedSettings

    tasks = [] if args.tasks in ([], ["none"]) else args.tasks
    settings = EvalSettings(
        tasks=tuple(tasks), limit=args.limit, batch_size=args.batch_size,
        ppl=args.ppl_windows != 0, eval_text=args.eval_text, ppl_windows=args.ppl_windows or None,
        ppl_seqlen=args.ppl_seqlen,
        speed=None if args.no_speed else SpeedSettings(prompt_len=args.prompt_len),
        dense=args.dense,
    )
    for path in args.models:
        check_candidate(path)  # a missing or weightless directory is known before any actor starts
    return settings


def _footer(settings) -> str:
    from trsp_ray.data.assets import WIKI_SOURCE
    from trsp_ray.evaluation.harness import lm_eval_version

    text = settings.eval_text or f"{WIKI_SOURCE}, held-out articles"
    return (f"PPL: {settings.ppl_seqlen}-token windows (max {settings.ppl_windows}, one per held-out document "
            f"first, BOS first where the tokenizer adds one) of {text}. "
            f"Zero-shot: lm-eval {lm_eval_version()}, 0-shot, limit={settings.limit}. "
            "mean5 = mean over PIQA, WinoGrande, HellaSwag, ARC-e, ARC-c (the paper's 5 tasks).")


def run_eval(args) -> int:
    """Validate everything cheap first, then run the pool; returns the process exit code (a TrspError
    reaches `trsp-ray`'s one error line)."""
    from trsp_ray.evaluation import report
    from trsp_ray.evaluation.pool import ActorResources, evaluate_pool
    from trsp_ray.run.tracking import make_tracker

    settings = eval_request(args)
    cpus = args.cpus_per_actor or max(1, (os.cpu_count() or 1) // max(1, args.actors))
    resources = ActorResources(num_cpus=cpus, num_gpus=args.gpus_per_actor,
                               placement_group=args.placement_group)
    tracker = make_tracker(enabled=not args.no_mlflow, tracking_uri=args.tracking_uri,
                           experiment=args.experiment)
    out = args.out or os.path.join("runs", time.strftime("eval-%Y%m%d-%H%M%S"))
    with tracker.run("eval", tags={"kind": "eval"}):
        tracker.log_params({"settings": settings.to_dict(), "actors": args.actors,
                            "resources": vars(resources), "models": args.models})
        results = evaluate_pool(args.models, settings=settings, actors=args.actors,
                                resources=resources, tracker=tracker, address=args.address)
        paths = report.write_reports(results, out, footer=_footer(settings))
        for path in paths.values():
            tracker.log_artifact(str(path))
    print(report.format_table(results))
    print(f"results: {paths['csv']} {paths['md']}")
    failed = [r for r in results if r["status"] != "ok"]
    for r in failed:
        print(f"FAILED {r['model']}: {r['error']}", file=sys.stderr)
    return 1 if failed else 0
