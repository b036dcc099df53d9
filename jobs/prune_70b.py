"""Prune 25% of the layers of Llama-2-70B / Llama-3-70B on a Ray GPU cluster (ZeRO-3 workers).

The default method is shortgpt+comp+heal (Block Influence scored data-parallel on the workers; a
norm-weighted least-squares map of each removed block, its float64 sums all-reduced over the ranks,
solved once and folded into the down_proj before the block; then a heal with stage 2's budget): the
best pipeline the comparison found at equal total compute (docs/results.md). `--method shortgpt+heal` skips
the fold, `--method trsp+heal` selects with TRSP's stage 1 instead, `--method trsp` runs the paper's
stage 2.

    ray job submit --runtime-env cluster/runtime_env.yaml -- python jobs/prune_70b.py \
        --model meta-llama/Llama-2-70b-hf --storage-path s3://my-bucket/trsp --output /shared/pruned/llama2-70b

Cluster this configuration assumes: 2 nodes x 8 x 80 GB GPUs (16 workers, ZeRO-3, bf16). `--model`
is a hub id (read from the Hugging Face cache, HF_HOME on shared storage, else the hub) or a model
directory; `--storage-path` (progress records, checkpoints, resume) is a shared path or any URI Ray
Train supports (s3://, gs://; `?endpoint_override=host:port&scheme=http` for an S3-compatible
server). Figures for the default, from `trsp-ray plan --model-config cluster/models/llama-2-70b.json
--workers 16 --gpu-memory-gb 80 --activation-checkpointing` (2048-token windows): Block Influence
and the fit are forward-only (19.9 GB per GPU with stage 1's state); the fit's calibration is
sized from the hidden size, 28 tokens per column of the 8192 x 8192 map (112 windows x 2048 tokens
= 229k tokens), and its sums (two float64 8192 x 8192 matrices per removed block, at most 20
blocks) with one forward's rows held to each block's end need 36.8 GB per GPU before the heal's
optimizer exists, and 10.0 GB of host memory per worker for the maps (128.0 GB of host memory per
node while the fit holds them); the heal trains the kept ~52B weights, ~16 bytes per parameter
of model state: 60.7 GB per GPU on 16 GPUs. On one 8-GPU node the heal needs 111 GB per GPU and
fits only with `--offload-optimizer` (26.4 GB per GPU, ~103 GB host memory per GPU, slower steps).
Ray Train keeps the last `distributed.keep_checkpoints` (2) checkpoints, 580 GB each (fp32 master +
Adam moments of the kept weights). `--method trsp` (stage 2 trains all 69B weights) needs 74.6 GB
per GPU on 16 and 771 GB per checkpoint.

The same script on this CPU machine (fp32, gloo), with SmolLM2 or a tiny model directory:

    ray job submit --working-dir . -- python jobs/prune_70b.py --model smollm2-135m --workers 2 \
        --device cpu --ratio 0.1 --set stage1.first_round_steps=2 --set stage1.steps_per_round=1 \
        --set stage2.steps=2 --output runs/smollm2-pruned

A plan that does not fit is refused before any worker starts, with what would fit.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the --working-dir copy of trsp_ray
PROG = Path(__file__).name  # what argparse calls the job; its own errors start with it too

from trsp_ray.config import registry  # noqa: E402 (after the path insert)
from trsp_ray.run.run_args import method_type  # noqa: E402


def job_config(args: argparse.Namespace):
    """The run config: 70B cluster defaults, then --config, then the flags, then --set overrides."""
    from trsp_ray.config.run_config import load_config

    gpu = args.device == "cuda"
    base = {
        "model": args.model, "method": args.method, "ratio": args.ratio, "output": args.output, "device": args.device,
        "data": {"seqlen": 2048 if gpu else 128, "batch_size": max(args.workers, 2 if not gpu else args.workers)},
        "stage1": {"lambda1": args.lambda1, "first_round_steps": 32, "steps_per_round": 8},
        "stage2": {"lambda2": args.lambda2, "steps": 200, "trainable": "all"},
        # MLflow, written by the driver: --tracking-uri, else $TRSP_RAY_MLFLOW_DIR/mlflow.db,
        # else <storage-path>/mlflow.db
        "tracking": {"enabled": not args.no_tracking, "tracking_uri": args.tracking_uri},
        # cpus_per_worker 0 = auto: 1, or the node's CPUs per GPU with --offload-optimizer (CPU Adam)
        "distributed": {"workers": args.workers, "strategy": "zero3", "use_gpu": gpu, "cpus_per_worker": 0,
                        "activation_checkpointing": gpu, "offload_optimizer": args.offload_optimizer,
                        "max_failures": args.max_failures, "checkpoint_every": 20,
                        "storage_path": args.storage_path, "gpu_memory_gb": args.gpu_memory_gb},
    }
    return load_config(args.config, overrides=args.set, base=base)


def parse_args(argv=None) -> argparse.Namespace:
    from trsp_ray.cli import add_entry_flags

    p = argparse.ArgumentParser(prog=PROG, description=__doc__.splitlines()[0])
    p.add_argument("--model", default="meta-llama/Llama-2-70b-hf", help="model directory, hub id or smollm2-135m")
    p.add_argument("--method", default=registry.DEFAULT_METHOD, type=method_type(workers=True),
                   help="shortgpt+comp+heal (default): Block-Influence selection on the workers, a least-squares "
                        "fold of each cut fitted data-parallel, then the stage-2 budget spent healing the pruned "
                        "model (best at equal total compute, docs/results.md); shortgpt+heal: the same without the "
                        "fold; "
                        "trsp+heal: TRSP's stage-1 selection + the heal; trsp: the paper's stage 2")
    p.add_argument("--workers", type=int, default=16)
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--gpu-memory-gb", type=float, default=80.0)
    p.add_argument("--ratio", type=float, default=0.25)
    p.add_argument("--lambda1", type=float, default=5e-3)
    p.add_argument("--lambda2", type=float, default=1e-3)
    p.add_argument("--offload-optimizer", action="store_true")
    p.add_argument("--output", default=None, help="export directory of the pruned model")
    p.add_argument("--overwrite", action="store_true")
    p.add_argument("--storage-path", default=None, help="Ray Train storage (shared across nodes)")
    p.add_argument("--max-failures", type=int, default=3)
    p.add_argument("--tracking-uri", default=None,
                   help="MLflow tracking URI (default: $TRSP_RAY_MLFLOW_DIR/mlflow.db, else sqlite in --storage-path)")
    p.add_argument("--no-tracking", action="store_true", help="no MLflow run")
    p.add_argument("--config", default=None, help="YAML run config applied over the defaults")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="config override, e.g. stage2.steps=50")
    p.add_argument("--deepspeed", action="append", default=[], metavar="KEY=VALUE",
                   help="extra DeepSpeed option, e.g. zero_optimization.stage3_max_live_parameters=5e8")
    p.add_argument("--fault-round", type=int, default=None, help="test only: kill worker 1 once in this stage-1 round")
    add_entry_flags(p)
    return p.parse_args(argv)


def main(argv=None) -> int:
    from trsp_ray.common.errors import run_main
    from trsp_ray.common.logs import quiet_libraries
    from trsp_ray.distributed.deepspeed_config import parse_options
    from trsp_ray.distributed.train import run_distributed
    from trsp_ray.plan.plan_format import format_plan
    from trsp_ray.plan.zero3_plan import plan_for_run

    args = parse_args(argv)
    quiet_libraries(verbose=args.verbose)

    def body() -> int:
        from trsp_ray.data import assets
        from trsp_ray.distributed.deepspeed_config import build_ds_config
        from trsp_ray.run.export import check_export_target
        from trsp_ray.run.pipeline import resolve

        # the compensation the method runs (the default's least squares), then the heal steps that
        # --set heal.compute_budget=N buys after it
        pipe = resolve(job_config(args))
        cfg = pipe.cfg
        print(pipe.describe(), flush=True)
        options = parse_options(args.deepspeed)
        ds = build_ds_config(cfg.distributed, batch_size=cfg.data.batch_size, lr=cfg.stage1.lr, extra=options)
        plan = plan_for_run(cfg, assets.resolve_model(cfg.model), ds, spec=pipe.spec)
        check_export_target(cfg.output, overwrite=args.overwrite, plan=plan, ratio=cfg.ratio)  # before any worker
        print(format_plan(plan), flush=True)
        fault = {"round": args.fault_round} if args.fault_round else None
        result = run_distributed(cfg, ds_options=options, fault=fault, overwrite=args.overwrite)
        print(json.dumps({"drop_order": result.drop_order, "rounds_computed": result.rounds_computed(),
                          "attempts": result.attempts(), "output": result.output, "storage": result.storage,
                          "mlflow_run": result.mlflow_run}))
        return 0

    return run_main(PROG, body)


if __name__ == "__main__":
    from trsp_ray.common.process_exit import exit_after

    exit_after(main)  # the commands' one exit: a finished run cannot fail in the teardown
