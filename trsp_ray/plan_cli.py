"""`trsp-ray plan`: will a distributed run fit? From a model's config.json alone (no weights).

    trsp-ray plan --model-config meta-llama/Llama-2-70b-hf --workers 16 --gpu-memory-gb 80 \
        --seqlen 2048 --activation-checkpointing [--offload-optimizer] [--disk-budget-gb 3000]

`--model-config` is a config.json, a model directory or a hub id (read from the Hugging Face cache,
else the hub). Prints stage 1 and stage 2 per-GPU memory, whether each fits and, if not, what
would; stage 1's removal probes and refinement (memory per GPU, compute in dense-forward tokens,
plan/probe_plan.py); with --compensation lstsq, the compensation's float64 sums, solve and
fold (plan/compensation_plan.py); then checkpoint size per save, storage for the kept ones,
disk and host memory per node, threads per worker and the export's host memory. Exit status:
0 fits, 1 does not fit, 2 refused (checkpoints over the disk budget, bad input).
"""

from __future__ import annotations

import argparse


def add_plan_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model-config", required=True, help="config.json, a model directory or a hub id")
    parser.add_argument("--workers", type=int, required=True, help="world size (GPUs)")
    parser.add_argument("--gpu-memory-gb", type=float, default=80.0, help="memory per GPU (GB)")
    parser.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16")
    parser.add_argument("--micro-batch", type=int, default=1, help="windows per GPU per step")
    parser.add_argument("--seqlen", type=int, default=2048, help="tokens per window")
    from trsp_ray.config import registry

    parser.add_argument("--trainable", choices=registry.HEAL_RECIPES, default="all",
                        help="stage-2 weights (a heal method's heal: tail | map too, see heal.trainable)")
    parser.add_argument("--lora-rank", type=int, default=8)
    parser.add_argument("--offload-optimizer", action="store_true")
    parser.add_argument("--offload-params", action="store_true")
    parser.add_argument("--activation-checkpointing", action="store_true")
    parser.add_argument("--train-base", action="store_true", help="stage 1 also trains the weights")
    parser.add_argument("--ratio", type=float, default=None,
                        help="fraction of layers dropped (stage-1 probe rounds; default: the config's)")
    parser.add_argument("--device", choices=("gpu", "cpu"), default="gpu", help="sets the fixed runtime overhead")
    parser.add_argument("--gpus-per-node", type=int, default=8)
    parser.add_argument("--cpus-per-node", type=int, default=96)
    parser.add_argument("--keep-checkpoints", type=int, default=2, help="checkpoints Ray Train keeps")
    parser.add_argument("--disk-budget-gb", type=float, default=None, help="storage the kept checkpoints may use")
    parser.add_argument("--export-shard-mb", type=int, default=5000, help="safetensors shard size of the export")
    parser.add_argument("--storage", choices=("remote", "shared"), default="remote",
                        help="remote (s3://, gs://: saves staged on local disk) or a shared path (written in place)")
    from trsp_ray.run.run_args import method_type

    parser.add_argument("--method", type=method_type(workers=True), default=registry.DEFAULT_METHOD,
                        help="what the workers run (default %(default)s: no stage-1 probes; the TRSP methods "
                             "add stage 1's removal probes and refinement)")
    parser.add_argument("--compensation", choices=("none", "lstsq", "scalar"), default=None,
                        help="closed-form compensation after the selection (its float64 sums, solve and fold); "
                             "default: lstsq for a method that compensates (shortgpt+comp+heal), else none")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="config override as a run takes it, e.g. --set heal.trainable=tail (repeatable)")


def setup_from_args(args: argparse.Namespace):
    from trsp_ray.common.errors import TrspError
    from trsp_ray.plan.zero3_setup import Setup

    for name in ("workers", "micro_batch", "seqlen", "lora_rank", "gpus_per_node", "cpus_per_node",
                 "keep_checkpoints", "export_shard_mb"):
        if getattr(args, name) < 1:
            raise TrspError(f"--{name.replace('_', '-')}={getattr(args, name)} is not valid; it must be >= 1")
    for name in ("gpu_memory_gb", "disk_budget_gb"):
        if getattr(args, name) is not None and getattr(args, name) <= 0:
            raise TrspError(f"--{name.replace('_', '-')}={getattr(args, name)} is not valid; it must be > 0")
    return Setup(workers=args.workers, gpu_memory_gb=args.gpu_memory_gb, dtype_bytes=2 if args.dtype == "bf16" else 4,
                 micro_batch=args.micro_batch, seqlen=args.seqlen, trainable=args.trainable,
                 lora_rank=args.lora_rank, offload_params=args.offload_params,
                 offload_optimizer=args.offload_optimizer, activation_checkpointing=args.activation_checkpointing,
                 train_base=args.train_base, device=args.device, gpus_per_node=args.gpus_per_node,
                 cpus_per_node=args.cpus_per_node, keep_checkpoints=args.keep_checkpoints,
                 disk_budget_gb=args.disk_budget_gb, export_shard_gb=args.export_shard_mb * 1e6 / 2**30,
                 remote_storage=args.storage == "remote")


def _shortgpt_lines(pipe, result) -> list[str]:
    """What ShortGPT's selection costs on the workers: forward passes only (no optimizer, no vocabulary
    logits kept), within the memory of the "stage 1" figure above, which also holds the gates' state.
    `pipe`: the resolved pipeline (run_plan's)."""
    from trsp_ray.config import registry
    from trsp_ray.config.run_config import replace
    from trsp_ray.method.stage1 import n_drop_for
    from trsp_ray.plan.zero3_plan import influence_stage
    from trsp_ray.run.methods import shortgpt_windows

    cfg = pipe.cfg
    if pipe.spec.selector == registry.TAIL_SELECTOR:
        return [f"  selection ({cfg.method}): the last candidates before the protected tail, no forward pass"]
    seqlen = result.setup.seqlen
    windows = shortgpt_windows(replace(cfg, **{"data.seqlen": seqlen}), n_drop_for(cfg.ratio, result.shape.layers))
    per_gpu = -(-windows // result.setup.workers)
    bi = influence_stage(result.shape, result.setup)
    what = "the adjacent pairs' angular distances" if pipe.spec.merges else "Block Influence"
    return [f"  selection ({cfg.method}): {what}, forward-only: {bi.total:.1f} GB per worker (stage 1's "
            f"model state and one micro batch's logits), within the stage-1 figure; {windows} "
            f"windows x {seqlen} tokens = {windows * seqlen / 1e6:,.2f}M dense-forward tokens (all GPUs; "
            f"{per_gpu} windows per GPU)"]


def run_plan(args: argparse.Namespace) -> int:
    from trsp_ray.common.errors import TrspError
    from trsp_ray.config import registry
    from trsp_ray.config.run_config import load_config, replace
    from trsp_ray.plan import plan_format, zero3_plan
    from trsp_ray.plan.probe_plan import ProbeSetup, format_probe_plan, probe_plan
    from trsp_ray.plan.shape import read_shape

    if args.compensation == "none" and registry.method(args.method).compensate:
        raise TrspError(f"--compensation none does not plan --method {args.method}, which compensates; use "
                        "--compensation lstsq|scalar, or --method shortgpt+heal for no compensation")
    # the probes' settings: the config's stage1 / gates defaults (stage-1 settings are not flags)
    overrides = [f"method={args.method}"] + ([] if args.ratio is None else [f"ratio={args.ratio}"])
    overrides += [f"compensation.method={args.compensation}"] if args.compensation else []
    overrides += [f"stage2.trainable={args.trainable}", f"stage2.lora_rank={args.lora_rank}"]
    overrides += list(getattr(args, "overrides", []))  # --set: a heal's recipe (heal.trainable, heal.tail_layers)
    from trsp_ray.distributed.compensate import check_for_workers
    from trsp_ray.plan.zero3_plan import with_heal_setup
    from trsp_ray.run.pipeline import resolve

    shape = read_shape(args.model_config)
    # the pipeline as a run resolves it (the fit it runs, its calibration sized to the model in the
    # plan's windows of --seqlen, refused below the floor), on the --model-config's hidden size
    pipe = resolve(replace(load_config(None, overrides), **{"data.seqlen": args.seqlen}), hidden=shape.hidden,
                   budget_layers=False)
    cfg = pipe.cfg
    check_for_workers(cfg, workers=args.workers)  # what a run on these workers would refuse
    # as a run plans
    result = zero3_plan.plan(shape, with_heal_setup(cfg, setup_from_args(args), shape, spec=pipe.spec))
    disk = result.disk_problem()
    if disk:
        raise TrspError(disk)
    probes = probe_plan(result.shape, result.setup, ProbeSetup.from_config(cfg, spec=pipe.spec))
    after = format_probe_plan(probes, result.setup) if pipe.spec.uses_stage1 else _shortgpt_lines(pipe, result)
    comp_fits, fit_host = True, 0.0
    if cfg.compensation.method == "scalar":
        after += ["  compensation (scalar, after the selection): six float64 sums per block and one layer's output "
                  "projections gathered at a time to scale: within stage 1's memory"]
    elif cfg.compensation.method != "none":
        from trsp_ray.plan.compensation_plan import calibration_line, compensation_plan, format_compensation_plan

        c = cfg.compensation
        comp = compensation_plan(result.shape, result.setup, ratio=cfg.ratio, protect_head=cfg.gates.protect_head,
                                 protect_tail=cfg.gates.protect_tail, objective=c.objective, windows=c.windows)
        line = calibration_line(windows=c.windows, seqlen=cfg.data.seqlen, hidden=shape.hidden,
                                tokens_per_column=c.tokens_per_column, floor=c.min_tokens_per_column)
        after += format_compensation_plan(comp, result.setup, calibration=line)
        comp_fits, fit_host = comp.memory.total <= result.setup.gpu_memory_gb, comp.host_gb
    if pipe.spec.merges:  # distributed/merging.py: each pair gathered whole on every rank
        from trsp_ray.method.stage1 import n_drop_for
        from trsp_ray.plan.merge_plan import store_gb
        from trsp_ray.run.merging import planned_cost

        merge = zero3_plan.merge_stage(cfg, shape, result.setup)
        cost = planned_cost(replace(cfg, **{"distributed.workers": args.workers}), shape,
                            n_pairs=n_drop_for(cfg.ratio, shape.layers))
        after += [f"  merge (each pair gathered on every rank, flattened, cut and refitted from all-reduced sums): "
                  f"{merge.total:.1f} GB per worker ({merge.parts['the wide pair, its copies and the refit sums']:.2f} "
                  f"GB of it the merge's own), host {merge.host:.1f} GB; at most {cost / 1e6:,.2f}M dense-forward "
                  "tokens (whole passes)",
                  f"  merge store: at most {store_gb(cfg, dtype_bytes=result.setup.dtype_bytes, shape=shape):.1f} GB "
                  "of disk under rank 0's checkpoint_dir (one merged block per pair, stored as it is done so an "
                  "interrupted merge resumes; kept beside the heal's checkpoints until the heal is done)"]
        comp_fits, fit_host = merge.total <= result.setup.gpu_memory_gb, merge.host  # its share of the targets
    from trsp_ray.plan.teacher_plan import teacher_pass_for_run

    teacher = teacher_pass_for_run(cfg, shape, heal_method=pipe.spec.heal, workers=args.workers)  # before stage 1
    after += [f"  {teacher.describe()}"] if teacher is not None else []
    print(pipe.describe())
    holds = "the merge holds its dense targets" if pipe.spec.merges else "the fit holds its maps"
    print(plan_format.format_plan(result, after_stages=tuple(after), fit_host_gb=fit_host, fit_holds=holds))
    return 0 if result.fits and probes.memory.total <= result.setup.gpu_memory_gb and comp_fits else 1


def register(subparsers) -> None:
    """Add the `plan` subcommand to the trsp-ray CLI (`subparsers` from add_subparsers())."""
    parser = subparsers.add_parser("plan", help="per-GPU memory of stage 1 and stage 2; does a plan fit?",
                                   description=__doc__.splitlines()[0])
    add_plan_arguments(parser)
    parser.set_defaults(func=run_plan)
