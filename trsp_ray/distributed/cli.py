"""`trsp-ray plan`: will a distributed run fit? From a model's config.json alone (no weights).

    trsp-ray plan --model-config meta-llama/Llama-2-70b/config.json --workers 8 --gpu-memory-gb 80 \
        --seqlen 2048 --activation-checkpointing --offload-optimizer

Prints stage 1 and stage 2 per-GPU memory, whether each fits and, if not, what would.
Exit status: 0 fits, 1 does not fit.
"""

from __future__ import annotations

import argparse


def add_plan_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model-config", required=True, help="config.json or a model directory holding one")
    parser.add_argument("--workers", type=int, required=True, help="world size (GPUs)")
    parser.add_argument("--gpu-memory-gb", type=float, default=80.0, help="memory per GPU (GB)")
    parser.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16")
    parser.add_argument("--micro-batch", type=int, default=1, help="windows per GPU per step")
    parser.add_argument("--seqlen", type=int, default=2048, help="tokens per window")
    parser.add_argument("--trainable", choices=("all", "lora"), default="all", help="stage-2 weights")
    parser.add_argument("--lora-rank", type=int, default=8)
    parser.add_argument("--offload-optimizer", action="store_true")
    parser.add_argument("--offload-params", action="store_true")
    parser.add_argument("--activation-checkpointing", action="store_true")
    parser.add_argument("--train-base", action="store_true", help="stage 1 also trains the weights")
    parser.add_argument("--device", choices=("gpu", "cpu"), default="gpu", help="sets the fixed runtime overhead")


def setup_from_args(args: argparse.Namespace):
    from trsp_ray.distributed.planner import Setup
    from trsp_ray.errors import TrspError

    for name in ("workers", "micro_batch", "seqlen", "lora_rank"):
        if getattr(args, name) < 1:
            raise TrspError(f"--{name.replace('_', '-')}={getattr(args, name)} is not valid; it must be >= 1")
    if args.gpu_memory_gb <= 0:
        raise TrspError(f"--gpu-memory-gb={args.gpu_memory_gb} is not valid; it must be > 0")
    return Setup(workers=args.workers, gpu_memory_gb=args.gpu_memory_gb, dtype_bytes=2 if args.dtype == "bf16" else 4,
                 micro_batch=args.micro_batch, seqlen=args.seqlen, trainable=args.trainable,
                 lora_rank=args.lora_rank, offload_params=args.offload_params,
                 offload_optimizer=args.offload_optimizer, activation_checkpointing=args.activation_checkpointing,
                 train_base=args.train_base, device=args.device)


def run_plan(args: argparse.Namespace) -> int:
    from trsp_ray.distributed import planner

    result = planner.plan(planner.read_shape(args.model_config), setup_from_args(args))
    print(planner.format_plan(result))
    return 0 if result.fits else 1


def register(subparsers) -> None:
    """Add the `plan` subcommand to the trsp-ray CLI (`subparsers` from add_subparsers())."""
    parser = subparsers.add_parser("plan", help="per-GPU memory of stage 1 and stage 2; does a plan fit?",
                                   description=__doc__.splitlines()[0])
    add_plan_arguments(parser)
    parser.set_defaults(func=run_plan)
