"""The route every job takes: one process on one device when its single-process plan fits, else the
fewest Ray Train workers whose ZeRO-3 plan fits; a one-line refusal when neither does."""

from __future__ import annotations

from dataclasses import dataclass

from trsp_ray.common.errors import TrspError
from trsp_ray.plan.memory import GB
from trsp_ray.plan.shape import Shape
from trsp_ray.plan.single_plan import SinglePlan, run_shape, single_hint, single_plan_for_run
from trsp_ray.plan.zero3_plan import Plan, method_on_workers, zero3_plan


@dataclass
class Route:
    """How a job runs: `workers` 0 = one process on one device, N >= 1 = N Ray Train workers (ZeRO-3)."""

    workers: int
    device: str  # gpu | cpu
    plan: SinglePlan | Plan  # the plan the route was chosen by (per worker when workers >= 1)
    allowed: int = 0  # distributed.workers: the most workers the run allows, used only when one process does not fit

    def describe(self) -> str:
        where = "GPU" if self.device == "gpu" else "CPU"
        if self.workers == 0:
            unused = (f"; one process fits, so the {self.allowed} Ray Train worker(s) distributed.workers allows "
                      "are not started" if self.allowed else "")
            return (f"single process on one {where}: peak {self.plan.peak:.1f} of "
                    f"{self.plan.setup.memory_gb:.1f} GB ({self.plan.worst().name}){unused}")
        return (f"{self.workers} Ray Train worker(s), ZeRO-3 on {where}: peak {self.plan.peak:.1f} of "
                f"{self.plan.setup.gpu_memory_gb:g} GB per worker")


def route(cfg, *, spec, device: str | None = None, memory_gb: float | None = None, shape: Shape | None = None,
          max_workers: int | None = None, drop_given: bool = False) -> Route:
    """The route of `cfg`: one process on one device when its single-process plan fits, else the
    fewest Ray Train workers (at most `max_workers`, default distributed.workers; 0 = none allowed)
    whose ZeRO-3 plan fits. A one-line TrspError when neither does, before any work.

    device: gpu | cpu (default from cfg.device; auto = gpu when distributed.use_gpu); memory_gb: what
    one device holds (default distributed.gpu_memory_gb on gpu, this host's memory on cpu); shape:
    the model's planner Shape (default: read from cfg.model's config.json, no weights); drop_given:
    a heal method's drop set is chosen in one process and handed to the workers (HANDED_OVER_METHODS);
    spec: the pipeline's registry entry (Pipeline.spec, resolved where the run starts).
    """
    import os

    from trsp_ray.config.run_config import replace

    if device is None:
        device = "gpu" if cfg.device == "cuda" or (cfg.device == "auto" and cfg.distributed.use_gpu) else "cpu"
    if memory_gb is None:
        memory_gb = (cfg.distributed.gpu_memory_gb if device == "gpu"
                     else os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / GB)
    s = shape or run_shape(cfg)
    single = single_plan_for_run(cfg, device=device, memory_gb=memory_gb, shape=s)
    limit = cfg.distributed.workers if max_workers is None else max_workers
    if single.fits:
        return Route(0, device, single, allowed=limit)
    if limit >= 1 and method_on_workers(cfg.method, drop_given=drop_given) and cfg.heal.steps == 0:
        extra = None
        for w in range(1, limit + 1):
            if cfg.data.batch_size % w:  # every worker takes an equal slice of each batch
                continue
            cfg_w = replace(cfg, **{"distributed.workers": w, "distributed.use_gpu": device == "gpu",
                                    "distributed.gpu_memory_gb": memory_gb})
            zero = zero3_plan(cfg_w, s, spec=spec)
            extra = zero.fits and device == "gpu" and worker_extras_problem(cfg_w, zero, spec=spec)
            if zero.fits and not extra:
                return Route(w, device, zero)
        if extra:  # the stages fit the most workers allowed, what they hold beside them does not
            raise TrspError(f"{single.reason()}, and on {limit} workers {extra}")
        raise TrspError(f"{single.reason()}, and no ZeRO-3 plan fits on <= {limit} workers; "
                        f"{single_hint(cfg, single)}")
    raise TrspError(f"the plan does not fit: {single.reason()}; {single_hint(cfg, single)}")


def worker_extras_problem(cfg, plan: Plan, *, spec) -> str | None:
    """What a worker holds beside the stages' training, one line when it does not fit the GPU:
    stage 1's removal probes (logits over the vocabulary of each probe window) and a least-squares
    compensation's float64 d x d sums; None when both fit (or the run has neither). `spec`: the
    pipeline's registry entry."""
    from trsp_ray.plan.probe_plan import ProbeSetup, probe_plan

    available = plan.setup.gpu_memory_gb
    probed = probe_plan(plan.shape, plan.setup, ProbeSetup.from_config(cfg, spec=spec))
    if probed.calls and probed.memory.total > available:
        return (f"stage 1's removal probes need {probed.memory.total:.1f} GB per worker (logits over the "
                f"vocabulary of each probe window), more than the {available:g} GB available; use more workers, "
                "a shorter data.seqlen or stage1.probe=0")
    from trsp_ray.config.run_config import for_method, sized

    if for_method(cfg).compensation.method == "lstsq":  # the compensation the method runs (auto resolved)
        from trsp_ray.plan.compensation_plan import compensation_plan

        g, c = cfg.gates, sized(for_method(cfg), hidden=plan.shape.hidden).compensation  # windows 0: auto
        comp = compensation_plan(plan.shape, plan.setup, ratio=cfg.ratio, protect_head=g.protect_head,
                                 protect_tail=g.protect_tail, objective=c.objective, windows=c.windows).memory
        if comp.total > available:
            return (f"the least-squares compensation needs {comp.total:.1f} GB per worker (float64 sums of "
                    f"d x d per block, the solve and the fold), more than the {available:g} GB available; use "
                    "compensation.method=scalar (no d x d sums) or larger GPUs")
    return None
