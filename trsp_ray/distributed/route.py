"""The route every job takes: one process on one device when its single-process plan fits, else the
fewest Ray Train workers whose ZeRO-3 plan fits; a one-line refusal when neither does."""

from __future__ import annotations

from dataclasses import dataclass

from trsp_ray.distributed.memory import GB
from trsp_ray.distributed.shape import Shape
from trsp_ray.distributed.single_plan import SinglePlan, run_shape, single_hint, single_plan_for_run
from trsp_ray.distributed.zero3_plan import Plan, method_on_workers, zero3_plan
from trsp_ray.errors import TrspError


@dataclass
class Route:
    """How a job runs: `workers` 0 = one process on one device, N >= 1 = N Ray Train workers (ZeRO-3)."""

    workers: int
    device: str  # gpu | cpu
    plan: SinglePlan | Plan  # the plan the route was chosen by (per worker when workers >= 1)

    def describe(self) -> str:
        where = "GPU" if self.device == "gpu" else "CPU"
        if self.workers == 0:
            return (f"single process on one {where}: peak {self.plan.peak:.1f} of "
                    f"{self.plan.setup.memory_gb:.1f} GB ({self.plan.worst().name})")
        return (f"{self.workers} Ray Train worker(s), ZeRO-3 on {where}: peak {self.plan.peak:.1f} of "
                f"{self.plan.setup.gpu_memory_gb:g} GB per worker")


def route(cfg, *, device: str | None = None, memory_gb: float | None = None, shape: Shape | None = None,
          max_workers: int | None = None) -> Route:
    """The route of `cfg`: one process on one device when its single-process plan fits, else the
    fewest Ray Train workers (at most `max_workers`, default distributed.workers; 0 = none allowed)
    whose ZeRO-3 plan fits. A one-line TrspError when neither does, before any work.

    device: gpu | cpu (default from cfg.device; auto = gpu when distributed.use_gpu); memory_gb: what
    one device holds (default distributed.gpu_memory_gb on gpu, this host's memory on cpu); shape:
    the model's planner Shape (default: read from cfg.model's config.json, no weights).
    """
    import os

    from trsp_ray.config import replace

    if device is None:
        device = "gpu" if cfg.device == "cuda" or (cfg.device == "auto" and cfg.distributed.use_gpu) else "cpu"
    if memory_gb is None:
        memory_gb = (cfg.distributed.gpu_memory_gb if device == "gpu"
                     else os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / GB)
    s = shape or run_shape(cfg)
    single = single_plan_for_run(cfg, device=device, memory_gb=memory_gb, shape=s)
    if single.fits:
        return Route(0, device, single)
    limit = cfg.distributed.workers if max_workers is None else max_workers
    if limit >= 1 and method_on_workers(cfg.method) and cfg.heal.steps == 0:
        for w in range(1, limit + 1):
            if cfg.data.batch_size % w:  # every worker takes an equal slice of each batch
                continue
            cfg_w = replace(cfg, **{"distributed.workers": w, "distributed.use_gpu": device == "gpu",
                                    "distributed.gpu_memory_gb": memory_gb})
            zero = zero3_plan(cfg_w, s)
            if zero.fits:
                return Route(w, device, zero)
        raise TrspError(f"{single.reason()}, and no ZeRO-3 plan fits on <= {limit} workers; "
                        f"{single_hint(cfg, single)}")
    raise TrspError(f"the plan does not fit: {single.reason()}; {single_hint(cfg, single)}")
