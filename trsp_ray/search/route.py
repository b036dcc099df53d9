"""Where a search's trials and evaluation actors run: CPUs, a GPU fraction, whole GPUs, or Ray Train.

A trial of a model that fits one GPU (the memory planner's route decides) holds a fraction of one, rounded
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

from trsp_ray.common.errors import TrspError
from trsp_ray.config import registry

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


def trial_route(cfg, *, model_path: str, cluster: dict, gpus_per_trial: float | None = None,
                workers: int | None = None, eval_gpus: float | None = None) -> TrialRoute:
    """The route of every trial of a search (they share model and shapes; the ratio barely moves
    the peak), from the memory planner's `route`: one GPU (a fraction of it) when the single-process
    plan fits, else the fewest Ray Train workers the cluster's GPUs allow. `cluster` is
    `ray.cluster_resources()`; explicit values override the planner."""
    from trsp_ray.config.run_config import replace
    from trsp_ray.plan import route as routing
    from trsp_ray.plan.shape import read_shape
    from trsp_ray.plan.single_plan import single_plan, single_plan_for_run, single_setup_for_run
    from trsp_ray.plan.zero3_plan import zero3_plan
    from trsp_ray.run.pipeline import named

    _check_counts(gpus_per_trial, workers, eval_gpus)
    have = float(cluster.get("GPU", 0.0))
    if cfg.device == "cuda" and have == 0:
        raise TrspError("device=cuda but the Ray cluster has no GPUs; use device=cpu or auto, or add GPU nodes")
    use_gpu = cfg.device == "cuda" or (cfg.device == "auto" and have > 0) or bool(gpus_per_trial)
    if not use_gpu:  # CPU run: Ray Train workers (gloo) only when asked for
        return TrialRoute(use_gpu=False, gpus=0.0, workers=workers or 0, eval_gpus=0.0)
    shape = read_shape(model_path)
    memory = cfg.distributed.gpu_memory_gb
    limit = workers if workers is not None else (0 if gpus_per_trial is not None else max(1, int(have)))
    spec = named(cfg).spec  # the base config's pipeline: every trial shares this route
    chosen = routing.route(cfg, spec=spec, device="gpu", memory_gb=memory, shape=shape, max_workers=limit)
    scoring = single_plan(shape, single_setup_for_run(cfg, device="gpu", memory_gb=memory, shape=shape),
                          ("evaluation",)).peak
    scoring = eval_gpus if eval_gpus is not None else (
        _fraction(scoring, memory) if scoring <= memory else float(math.ceil(scoring / memory)))
    if workers and not chosen.workers:  # asked for Ray Train though one GPU would do
        chosen = routing.Route(workers, "gpu", zero3_plan(
            replace(cfg, **{"distributed.workers": workers, "distributed.use_gpu": True}), shape, spec=spec))
    if chosen.workers:
        stage1 = single_plan_for_run(replace(cfg, method=registry.STAGE1_ONLY, **{"heal.steps": 0}),
                                     device="gpu", memory_gb=memory, shape=shape)
        route = TrialRoute(use_gpu=True, gpus=0.0, workers=chosen.workers, eval_gpus=scoring,
                           peak_gb=chosen.plan.peak, stage1_on_one_device=stage1.fits)
    else:
        gpus = gpus_per_trial if gpus_per_trial is not None else _fraction(chosen.plan.peak, memory)
        route = TrialRoute(use_gpu=True, gpus=gpus, workers=0, eval_gpus=scoring, peak_gb=chosen.plan.peak)
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
