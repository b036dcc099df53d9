"""Where a search's trials and evaluation actors run: CPUs, a GPU fraction, whole GPUs, or Ray Train.

A trial of a model that fits one GPU (the memory planner decides) holds a fraction of one, rounded
up to a quarter, so several small-model trials share a GPU; a trial whose model needs several GPUs
holds only a CPU itself and runs stage 2 on `workers` Ray Train workers (one GPU each) that it
launches. Evaluation actors get the GPUs a pruned model's inference needs. On a CPU run (device=cpu,
or auto on a cluster without GPUs) nothing requests a GPU.

Inside a trial, `trial_device` picks the device from what Ray gave the trial: CUDA only when the
trial holds a GPU *and* torch sees one, so a trial scheduled on a (fake, in tests) GPU resource of a
CPU-only machine still runs on the CPU.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from trsp_ray.errors import TrspError

GPU_STEP = 0.25  # trial GPU fractions are multiples of this (Ray packs them onto whole GPUs)


@dataclass(frozen=True)
class TrialRoute:
    use_gpu: bool
    gpus: float  # GPUs the trial process holds
    workers: int  # > 0: stage 2 on this many Ray Train workers launched by the trial
    eval_gpus: float  # per evaluation actor
    peak_gb: float | None = None  # the planner's per-GPU peak of the chosen route
    stage1_on_one_device: bool = True  # False: stage 1 itself needs the Ray Train workers (no shared store)

    def resources(self, cpus: float) -> dict:
        return {"cpu": cpus, **({"gpu": self.gpus} if self.gpus else {})}

    def gpus_per_trial(self) -> float:
        """GPUs one trial occupies at once (its own, or its Ray Train workers')."""
        return float(self.workers) if self.workers else self.gpus

    def to_dict(self) -> dict:
        return asdict(self)


def _fraction(gb: float, capacity_gb: float) -> float:
    return min(1.0, math.ceil(gb / capacity_gb / GPU_STEP - 1e-9) * GPU_STEP)


def _plan_single(cfg, model_path: str):
    """(plan of the run on one GPU, plan of its scoring) from config.json alone."""
    from trsp_ray.config import replace
    from trsp_ray.distributed import planner

    shape = planner.read_shape(model_path)
    one = replace(cfg, **{"distributed.workers": 1, "distributed.use_gpu": True})
    setup = planner.setup_for_run(one)
    return shape, setup, planner.plan_for_run(one, model_path)


def trial_route(cfg, *, model_path: str, cluster: dict, gpus_per_trial: float | None = None,
                workers: int | None = None, eval_gpus: float | None = None) -> TrialRoute:
    """The route of every trial of a search (they share model and shapes; the ratio barely moves
    the peak). `cluster` is `ray.cluster_resources()`; explicit values override the planner."""
    from dataclasses import replace as dc_replace

    from trsp_ray.distributed import planner

    _check_counts(gpus_per_trial, workers, eval_gpus)
    have = float(cluster.get("GPU", 0.0))
    if cfg.device == "cuda" and have == 0:
        raise TrspError("device=cuda but the Ray cluster has no GPUs; use device=cpu or auto, or add GPU nodes")
    use_gpu = cfg.device == "cuda" or (cfg.device == "auto" and have > 0) or bool(gpus_per_trial)
    if not use_gpu:  # CPU run: Ray Train workers (gloo) only when asked for
        return TrialRoute(use_gpu=False, gpus=0.0, workers=workers or 0, eval_gpus=0.0)
    shape, setup, single = _plan_single(cfg, model_path)
    capacity = setup.gpu_memory_gb
    inference_gb = shape.params * 2 * 1.2 / 2**30  # bf16 weights + KV cache and activations
    scoring = eval_gpus if eval_gpus is not None else (
        _fraction(inference_gb, capacity) if inference_gb <= capacity else float(math.ceil(inference_gb / capacity)))
    if workers is None and gpus_per_trial is None and not single.fits:
        workers = planner.min_workers(shape, setup)
        if workers is None:
            raise TrspError(f"a trial does not fit any number of {capacity:g} GB GPUs ({single.reason()}); "
                            "see `trsp-ray plan`")
    if workers:
        peak = planner.plan(shape, dc_replace(setup, workers=workers)).peak
        stage1 = planner.plan(shape, setup).stages[0]
        route = TrialRoute(use_gpu=True, gpus=0.0, workers=workers, eval_gpus=scoring, peak_gb=peak,
                           stage1_on_one_device=stage1.total <= capacity)
    else:
        gpus = gpus_per_trial if gpus_per_trial is not None else _fraction(single.peak, capacity)
        route = TrialRoute(use_gpu=True, gpus=gpus, workers=0, eval_gpus=scoring, peak_gb=single.peak)
    if have and route.gpus_per_trial() > have:
        raise TrspError(f"a trial needs {route.gpus_per_trial():g} GPUs, the Ray cluster has {have:g}; "
                        "add GPU nodes or lower the trial's memory (distributed.activation_checkpointing, LoRA)")
    return route


def _check_counts(gpus: float | None, workers: int | None, eval_gpus: float | None) -> None:
    for name, value in (("gpus per trial", gpus), ("gpus per evaluation actor", eval_gpus)):
        if value is not None and (value < 0 or (value > 1 and value != int(value))):
            raise TrspError(f"{name}={value!r} is invalid; pass 0, a fraction below 1, or a whole number of GPUs")
    if workers is not None and (not isinstance(workers, int) or workers < 1):
        raise TrspError(f"trial workers={workers!r} is invalid; pass a positive integer")


def trial_device(device: str, *, gpu_ids: list) -> str:
    """What a trial runs on: CUDA when it holds a GPU and torch sees one; else the CPU (also for a
    trial holding a GPU resource of a machine without CUDA, as in the tests)."""
    import torch

    if gpu_ids and device in ("cuda", "auto") and torch.cuda.is_available():
        return "cuda"
    if device == "cuda":
        raise TrspError(f"device=cuda but this trial holds GPUs {gpu_ids} that torch cannot see; "
                        "use device=auto or check the node's CUDA setup")
    return "cpu"
