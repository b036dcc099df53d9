"""Stage 1's removal probes and swap refinement in the plan: memory per GPU and compute.

A probe (probes.RemovalScorer) is a no-grad forward of the probe windows through the sharded
model with some layers bypassed, scored against the dense model's log-probs. Data-parallel: each of
W ranks scores ceil(windows / W) of them, in forwards of at most `chunk` windows. Memory per GPU
while a probe runs: stage 1's model state (the weights' partition, the gathered working set, the
optimizer's partitions when weights train) without the training activations, one layer's forward
intermediates over the chunk, and the probe's logits and log-probs over the chunk's tokens x V
(probes.probe_memory_bytes, the teacher cache when probes.teacher_cached says it fits).

Compute, in dense-forward tokens of all GPUs together: every scorer call is one forward of all
probe windows (windows x seqlen), plus the dense teacher once when cached, else once per call.
Calls: each of the n_drop rounds probes min(probe, candidates left) layers; refinement then spends
at most stage1.refine_budget calls (a pass that finds nothing costs n_drop x |pool|, the pool at
most min(candidates - n_drop, n_drop x (probe - 1)) layers).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from trsp_ray.plan.activations import forward_layer_bytes
from trsp_ray.plan.memory import GB, StagePlan
from trsp_ray.plan.shape import Shape
from trsp_ray.plan.zero3_plan import estimate
from trsp_ray.plan.zero3_setup import Setup


@dataclass(frozen=True)
class ProbeSetup:
    """The stage-1 settings the probes depend on (config: ratio, stage1.*, gates.protect_*)."""

    ratio: float
    windows: int  # stage1.probe_windows
    probe: int  # stage1.probe: layers measured per round (0 with one-shot selection)
    refine: int  # stage1.refine: passes of swap refinement
    refine_budget: int  # stage1.refine_budget: scorer calls refinement may spend
    protect_head: int | str  # gates.protect_head (a count, or auto)
    protect_tail: int
    criterion: str

    @classmethod
    def from_config(cls, cfg, *, spec) -> "ProbeSetup":
        """The probe settings of `cfg`, whose pipeline's registry entry is `spec` (Pipeline.spec)."""
        s1, g = cfg.stage1, cfg.gates
        probes = s1.selection == "iterative" and spec.uses_stage1  # ShortGPT probes nothing
        return cls(ratio=cfg.ratio, windows=s1.probe_windows, probe=s1.probe if probes else 0,
                   refine=s1.refine, refine_budget=s1.refine_budget, protect_head=g.protect_head,
                   protect_tail=g.protect_tail, criterion=s1.probe_criterion)


@dataclass
class ProbePlan:
    memory: StagePlan  # GB per GPU while a probe runs
    n_drop: int
    probe_calls: int  # the rounds' scorer calls
    refine_calls: int  # refinement's, at most (its budget or its passes, the smaller)
    refine_unbounded: int  # what the passes alone would allow
    window_tokens: int  # tokens of all probe windows: one scorer call on all GPUs together
    windows_per_gpu: int
    teacher_cached: bool

    @property
    def calls(self) -> int:
        return self.probe_calls + self.refine_calls

    @property
    def passes(self) -> int:
        """Forwards of the probe windows: one per scorer call, plus the dense teacher's."""
        return self.calls + (1 if self.teacher_cached else self.calls)

    @property
    def compute(self) -> int:
        """Dense-forward tokens of all probes and refinement, all GPUs together (at most)."""
        return self.window_tokens * self.passes

    def compute_per_gpu(self, seqlen: int) -> int:
        """What one GPU runs: its share of the windows (a GPU without one runs a padding forward)."""
        return self.windows_per_gpu * seqlen * self.passes


def probe_calls(*, candidates: int, n_drop: int, probe: int) -> int:
    return sum(min(probe, candidates - r) for r in range(n_drop)) if probe > 1 else 0


def refine_calls(*, candidates: int, n_drop: int, probe: int, refine: int) -> int:
    """The most scorer calls `refine` passes can take (each pass: n_drop positions x the pool)."""
    if probe <= 1 or refine <= 0:
        return 0
    pool = min(candidates - n_drop, n_drop * (min(probe, candidates) - 1))
    return refine * n_drop * pool


def probe_plan(s: Shape, st: Setup, ps: ProbeSetup) -> ProbePlan:
    from trsp_ray.method.probes import probe_memory_bytes, teacher_cached
    from trsp_ray.method.stage1 import candidate_layers, n_drop_for

    n_drop = n_drop_for(ps.ratio, s.layers)
    candidates = len(candidate_layers(s.layers, protect_head=ps.protect_head, protect_tail=ps.protect_tail))
    per_gpu = math.ceil(ps.windows / st.workers)
    chunk = min(per_gpu, st.micro_batch * st.workers)  # forwards of at most data.batch_size windows
    cached = ps.criterion == "kl" and teacher_cached(windows=ps.windows, scored_positions=st.seqlen, world=st.workers,
                                                     vocab=s.vocab, dtype_bytes=st.dtype_bytes)
    stage1 = estimate(s, st)[0]
    memory = StagePlan("stage 1 probes", {k: v for k, v in stage1.parts.items() if k != "activations"}, stage1.host)
    memory.parts["one layer's forward (probe chunk)"] = chunk * st.seqlen * forward_layer_bytes(s, st.dtype_bytes) / GB
    probe_bytes = probe_memory_bytes(chunk_tokens=chunk * st.seqlen, cached_tokens=per_gpu * st.seqlen if cached else 0,
                                     vocab=s.vocab, dtype_bytes=st.dtype_bytes)
    memory.parts.update({k: v / GB for k, v in probe_bytes.items()})
    unbounded = refine_calls(candidates=candidates, n_drop=n_drop, probe=ps.probe, refine=ps.refine)
    return ProbePlan(memory=memory, n_drop=n_drop, probe_calls=probe_calls(candidates=candidates, n_drop=n_drop,
                                                                           probe=ps.probe),
                     refine_calls=min(unbounded, ps.refine_budget), refine_unbounded=unbounded,
                     window_tokens=ps.windows * st.seqlen, windows_per_gpu=per_gpu, teacher_cached=cached)


def format_probe_plan(pp: ProbePlan, st: Setup) -> list[str]:
    if pp.calls == 0:
        return ["  stage 1 probes: none (stage1.probe <= 1 or one-shot selection)"]
    m = pp.memory
    verdict = "fits" if m.total <= st.gpu_memory_gb else "DOES NOT FIT"
    teacher = "cached on the device" if pp.teacher_cached else "recomputed every call (over the cache budget)"
    lines = [f"  stage 1 probes: {m.total:.1f} GB per worker ({verdict}); {pp.windows_per_gpu} of the probe windows "
             f"per GPU, teacher log-probs {teacher}"]
    lines += [f"      {k}: {v:.2f} GB" for k, v in m.parts.items()]
    lines.append(f"  stage 1 probe compute: {pp.probe_calls} scorer calls in {pp.n_drop} rounds + at most "
                 f"{pp.refine_calls} refinement calls (stage1.refine_budget; the passes alone allow "
                 f"{pp.refine_unbounded}) x {pp.window_tokens:,} tokens = {pp.compute / 1e6:,.1f}M dense-forward "
                 f"tokens (all GPUs; {pp.compute_per_gpu(st.seqlen) / 1e6:,.1f}M per GPU)")
    return lines
