"""The DeepSpeed configuration of a distributed run, built from `DistributedConfig` and checked by
DeepSpeed itself in the driver, so a rejected option fails before any Ray worker starts.

Precision follows the device: bf16 on GPU (half the memory of fp32 weights and activations, no loss
scaling), fp32 on CPU (gloo + CPU kernels have no fast bf16 path and fp32 keeps the distributed run
bit-comparable with the single-process one).
"""

from __future__ import annotations

import copy
import re

from trsp_ray.common.errors import TrspError

# Optimizer steps are counted by the stage loops, never printed by DeepSpeed.
_QUIET = {"steps_print": 10**9, "wall_clock_breakdown": False}


def micro_batch(*, batch_size: int, workers: int) -> int:
    """Windows per worker per forward: the stage loop's batch split evenly across workers."""
    if workers < 1:
        raise TrspError(f"distributed.workers={workers} is not valid for a Ray Train run; use >= 1")
    if batch_size % workers:
        raise TrspError(f"data.batch_size={batch_size} does not split evenly over distributed.workers={workers}; "
                        f"use a batch size that is a multiple of {workers}")
    return batch_size // workers


def worker_dtype(cfg) -> str:
    """The workers' model dtype (a torch attribute name): bf16 on GPU, fp32 on CPU, the precision
    the DeepSpeed config enables. `dtype` other than auto or that is refused (check_worker_dtype)."""
    return "bfloat16" if cfg.distributed.use_gpu else "float32"


def check_worker_dtype(cfg) -> None:
    """One line, before any worker starts, when `dtype` asks for what the workers would not run."""
    from trsp_ray.common.errors import TrspError

    runs = {"bfloat16": "bf16", "float32": "fp32"}[worker_dtype(cfg)]
    if cfg.dtype not in ("auto", runs):
        where = "GPU" if cfg.distributed.use_gpu else "CPU"
        raise TrspError(f"dtype={cfg.dtype} is not available on Ray Train workers on {where}: they run {runs} "
                        f"(distributed.use_gpu={str(cfg.distributed.use_gpu).lower()}); use dtype=auto or dtype={runs}")


def build_ds_config(dist, *, batch_size: int, lr: float, extra: dict | None = None) -> dict:
    """The DeepSpeed config dict for a `DistributedConfig` `dist`.

    `batch_size` is the stage loop's batch (windows per stage step, all workers together); each
    worker gets batch_size / workers of it. With `grad_accum = k` a stage step is one micro-step and
    the optimizer steps every k stage steps (DeepSpeed's accumulation boundary). `lr` is only the
    default of the optimizer; the stage loops pass per-group learning rates. `extra` is merged in
    last (nested dicts merge key by key), for options this builder does not expose.
    """
    stage = 3 if dist.strategy == "zero3" else 0  # stage 0 = plain data-parallel all-reduce (DDP)
    micro = micro_batch(batch_size=batch_size, workers=max(1, dist.workers))
    zero: dict = {"stage": stage}
    if stage == 3:
        # 16-bit gather on save lets rank 0 write a plain HF state dict from the shards.
        zero.update(stage3_gather_16bit_weights_on_model_save=True, contiguous_gradients=True,
                    overlap_comm=dist.use_gpu)
    if dist.offload_params:
        if stage != 3:
            raise TrspError("distributed.offload_params=true needs distributed.strategy=zero3")
        zero["offload_param"] = {"device": "cpu", "pin_memory": dist.use_gpu}
    if dist.offload_optimizer:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": dist.use_gpu}
    config = {
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": dist.grad_accum,
        "train_batch_size": micro * dist.grad_accum * max(1, dist.workers),
        "gradient_clipping": 1.0,  # the same clip as the single-process TorchStepper
        "zero_optimization": zero,
        "bf16": {"enabled": bool(dist.use_gpu)},
        # torch's AdamW (identical math to the single-process path, no 100 s JIT build), except for
        # GPU runs with optimizer offload, where DeepSpeed's CPU Adam is several times faster.
        "optimizer": {"type": "AdamW", "params": {"lr": lr, "weight_decay": 0.0,
                                                  "torch_adam": not (dist.use_gpu and dist.offload_optimizer)}},
        "zero_allow_untested_optimizer": True,
        "zero_force_ds_cpu_optimizer": False,
        "steps_per_print": _QUIET["steps_print"],
        "wall_clock_breakdown": _QUIET["wall_clock_breakdown"],
    }
    return merge(config, extra or {})


def merge(base: dict, extra: dict) -> dict:
    """`base` updated by `extra`, nested dicts merged key by key (a new dict)."""
    out = copy.deepcopy(base)
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def parse_options(items: list[str]) -> dict:
    """`a.b=value` strings (value parsed as YAML) into a nested dict for `build_ds_config(extra=)`."""
    import yaml

    out: dict = {}
    for item in items:
        if "=" not in item:
            raise TrspError(f"DeepSpeed option {item!r} is not valid; write it as key.path=value")
        key, raw = item.split("=", 1)
        node = out
        parts = key.strip().split(".")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
        node[parts[-1]] = yaml.safe_load(raw)
    return out


def validate_ds_config(config: dict) -> None:
    """Let DeepSpeed parse `config` in this (driver) process; its complaint becomes a TrspError.

    The driver has no process group, so DeepSpeed would see a world of one: the batch triple is
    checked here and `train_batch_size` is left for DeepSpeed to recompute.
    """
    import logging

    micro = config.get("train_micro_batch_size_per_gpu", 1)
    accum = config.get("gradient_accumulation_steps", 1)
    total = config.get("train_batch_size")
    if total is not None and total % (micro * accum):
        raise TrspError(f"DeepSpeed rejected the config: train_batch_size={total} is not "
                        f"train_micro_batch_size_per_gpu={micro} x gradient_accumulation_steps={accum} x workers")
    local = {k: v for k, v in config.items() if k != "train_batch_size"}
    from deepspeed.runtime.config import DeepSpeedConfig
    from deepspeed.utils import logger as ds_logger

    level = ds_logger.level
    ds_logger.setLevel(logging.ERROR)
    try:
        DeepSpeedConfig(local)
    except Exception as exc:  # DeepSpeed raises ValueError, AssertionError or pydantic errors
        detail = re.sub(r"\s*For further information visit \S+", "", " ".join(str(exc).split()))
        raise TrspError(f"DeepSpeed rejected the config: {detail[:400]}") from None
    finally:
        ds_logger.setLevel(level)
