"""The memory planner against the peak memory measured per worker: SmolLM2, 2 ZeRO-3 workers, CPU.

    python benchmarks/planner_check.py [--seqlen 128] [--batch 4] [--stage2-steps 2] [--method merge+heal]

Starts its own local Ray (2 CPUs), runs the default pipeline's selection (Block Influence) and heal,
or `--method`'s stages (`--method trsp`: stage 1 and stage 2), through `run_distributed`, and reads
each stage's peak resident memory of rank 0 from the run's log (VmHWM, reset at the start of each
stage). The planner gets the same model config, world size, dtype (fp32 on CPU), micro batch and
sequence length. Goal: estimate within 25% of the measurement for both stages. `--method merge+heal`:
the pairs' selection, the merge on the ranks and the heal instead (`--set merging.unit_trials=3`
shortens the merge without changing what it holds).
"""

from __future__ import annotations

import argparse
import os
import tempfile


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seqlen", type=int, default=128)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--stage2-steps", type=int, default=2)
    parser.add_argument("--method", default=None, help="pipeline the workers run (default: the config's default)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--ds", action="append", default=[], metavar="KEY=VALUE",
                        help="a DeepSpeed option for both the run and the planner, e.g. "
                             "zero_optimization.stage3_max_live_parameters=1e6")
    args = parser.parse_args()
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")

    import ray

    from trsp_ray.config.run_config import load_config
    from trsp_ray.data import assets
    from trsp_ray.distributed.deepspeed_config import parse_options
    from trsp_ray.distributed.train import run_distributed
    from trsp_ray.plan.plan_format import format_plan
    from trsp_ray.plan.zero3_plan import plan_for_run
    from trsp_ray.run.pipeline import named

    storage = tempfile.mkdtemp(prefix="trsp-planner-check-")
    cfg = load_config(overrides=[
        "model=smollm2-135m", "ratio=0.07", "threads=1", "tracking.enabled=false",
        f"data.seqlen={args.seqlen}", f"data.batch_size={args.batch}",
        "stage1.first_round_steps=2", "stage1.steps_per_round=1", f"stage2.steps={args.stage2_steps}",
        "distributed.workers=2", f"distributed.checkpoint_every={max(1, args.stage2_steps)}",
        f"distributed.storage_path={storage}", *([f"method={args.method}"] if args.method else []), *args.overrides])
    ray.init(num_cpus=2, include_dashboard=False)
    try:
        result = run_distributed(cfg, ds_options=parse_options(args.ds))
    finally:
        ray.shutdown()
    stages = ("stage1_done", "merged", "stage2_done")  # as the plan lists them; a merge only in a merge pipeline
    measured = {e["event"]: e["peak_gb"] for e in result.events if e["event"] in stages}
    from trsp_ray.distributed.deepspeed_config import build_ds_config

    ds_config = build_ds_config(cfg.distributed, batch_size=cfg.data.batch_size, lr=cfg.stage1.lr,
                                extra=parse_options(args.ds))
    estimate = plan_for_run(cfg, assets.resolve_model(cfg.model), ds_config, spec=named(cfg).spec)
    print(format_plan(estimate))
    print(f"\n{'stage':<40}{'planner GiB':>12}{'measured GiB':>14}{'error':>9}")
    for stage, key in zip(estimate.stages, [k for k in stages if k in measured]):
        got = measured.get(key)
        err = f"{(stage.total - got) / got:+.0%}" if got else "n/a"
        print(f"{stage.name:<40}{stage.total:>12.2f}{(got or float('nan')):>14.2f}{err:>9}")


if __name__ == "__main__":
    main()
