"""The GPU check's planner-vs-measured part (benchmarks/gpu_parts.py `memory`): one `trsp-ray prune` in this
process with each stage's device peak read (torch.cuda.max_memory_allocated, reset when the stage starts),
beside the single-process plan of the same argv (plan/single_plan.py).

The planner's figure for a stage is its total less the runtime overhead (CUDA context and allocator slack,
which max_memory_allocated does not see). A stage whose figure is off by more than the tolerance fails the
part: the acceptance of issue 40 is every stage within 15%.
"""

from __future__ import annotations

import contextlib
import functools
import time

GIB = 2**30
# (module, attribute, stage name in the plan, whether it is a context manager); the selection is named
# after the method's selector in the plan (shortgpt, trsp, ...)
STAGES = (("methods", "run_stage1_for", "stage 1", False), ("methods", "select", "selection", False),
          ("methods", "_stage2", "stage 2", False), ("methods", "_dense_beside", "compensation", True),
          ("methods", "_heal", "heal", False), ("workbench", "Workbench.heldout_ppl", "evaluation", False))


class StagePeaks:
    """Wraps the stage functions of trsp_ray.run to record each stage's device peak and time."""

    def __init__(self):
        self.rows: list[dict] = []
        self.missing: list[str] = []

    def _begin(self):
        import torch

        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        return torch.cuda.memory_allocated(), time.time()

    def _end(self, name: str, start) -> None:
        import torch

        torch.cuda.synchronize()
        before, t0 = start
        self.rows.append({"stage": name, "before_gib": before / GIB,
                          "peak_gib": torch.cuda.max_memory_allocated() / GIB, "seconds": round(time.time() - t0, 2)})

    def _wrapped(self, original, name: str, context: bool):
        if context:
            @contextlib.contextmanager
            def stage_cm(*a, **k):
                start = self._begin()
                try:
                    with original(*a, **k) as value:
                        yield value
                finally:
                    self._end(name, start)
            return stage_cm

        @functools.wraps(original)
        def stage(*a, **k):
            start = self._begin()
            try:
                return original(*a, **k)
            finally:
                self._end(name, start)
        return stage

    def install(self) -> None:
        from trsp_ray.run import methods, workbench

        modules = {"methods": methods, "workbench": workbench}
        for module, attr, name, context in STAGES:
            owner = modules[module]
            *path, leaf = attr.split(".")
            for part in path:
                owner = getattr(owner, part)
            if not hasattr(owner, leaf):  # renamed in trsp_ray: said in the record, not a crash
                self.missing.append(f"{module}.{attr}")
                continue
            setattr(owner, leaf, self._wrapped(getattr(owner, leaf), name, context))


def plan_of(argv: list[str]):
    """(the resolved config, {stage name: planned GiB less the runtime overhead}) of a `trsp-ray prune` argv."""
    from trsp_ray.cli import build_parser
    from trsp_ray.plan.single_plan import single_plan_for_run
    from trsp_ray.run.pipeline import resolve
    from trsp_ray.run.run_args import run_config
    from trsp_ray.run.workbench import device_kind

    args = build_parser().parse_args(argv)
    cfg = resolve(run_config(args, method=args.method, output=args.output)).cfg
    kind, memory = device_kind(cfg)
    plan = single_plan_for_run(cfg, device=kind, memory_gb=memory)
    return cfg, {s.name: s.total - s.parts.get("runtime overhead", 0.0) for s in plan.stages}


def planner_vs_measured(argv: list[str], *, tolerance: float) -> dict:
    import torch

    from trsp_ray.cli import main as cli_main

    if not torch.cuda.is_available():
        raise RuntimeError("no CUDA device: the measured peak is torch.cuda.max_memory_allocated")
    cfg, planned = plan_of(argv)
    peaks = StagePeaks()
    peaks.install()
    rc = cli_main(argv)
    if rc:
        raise RuntimeError(f"trsp-ray prune exited {rc}")
    from trsp_ray.plan.single_plan import PRUNED_EVALUATION

    selector = cfg.method.split("+")[0]
    rows = []
    print(f"{'stage':<14}{'plan GiB':>10}{'peak GiB':>10}{'error':>8}{'s':>7}")
    scored = 0  # the driver scores the dense model, then the pruned one (the plan's PRUNED_EVALUATION)
    for row in peaks.rows:
        name = selector if row["stage"] == "selection" else row["stage"]
        if name == "evaluation":
            name, scored = (PRUNED_EVALUATION if scored and PRUNED_EVALUATION in planned else name), scored + 1
        est = planned.get(name)
        err = (est - row["peak_gib"]) / row["peak_gib"] if est is not None and row["peak_gib"] > 0 else None
        rows.append({**row, "plan_stage": name, "plan_gib": est, "error": err})
        print(f"{row['stage']:<14}{est if est is not None else float('nan'):>10.2f}{row['peak_gib']:>10.2f}"
              f"{'-' if err is None else f'{err:+.0%}':>8}{row['seconds']:>7.1f}")
    judged = [r for r in rows if r["error"] is not None]
    if not judged:
        raise RuntimeError(f"no stage of the run has a plan to compare: measured {[r['stage'] for r in rows]}, "
                           f"planned {sorted(planned)}, not wrapped {peaks.missing}")
    worst = max(judged, key=lambda r: abs(r["error"]))
    figure = (f"worst {worst['stage']} {worst['error']:+.0%}; " +
              ", ".join(f"{r['stage']} {r['error']:+.0%}" for r in judged))
    if abs(worst["error"]) > tolerance:
        raise RuntimeError(f"plan off by more than {tolerance:.0%}: {figure}")
    return {"figure": figure, "stages": rows, "not_wrapped": peaks.missing}
