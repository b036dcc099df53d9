"""ZeRO-3 plan: per-worker memory of stage 1 and stage 2 under ZeRO-3, from config.json alone
(parameter counts are read off the model built on the meta device, see shape.py).

Model state (bytes per parameter, b = 2 for bf16, 4 for fp32), partitioned over W workers:
    frozen weights          b / W                 (stage 1 base, LoRA base)
    trained weights         b + b (grad) + 12 (fp32 master + Adam m, v), all / W
Offload moves the optimizer's 12 (+ the gradient partition) or the weights to host memory.
Plus the working set ZeRO-3 gathers: gathered parameters stay resident until their reuse is more
than `stage3_max_reuse_distance` away or `stage3_max_live_parameters` (1e9 by default) are live, so
a model under 1e9 parameters is held whole, gathered, during a step; a larger one holds the larger of
that cap and two decoder layers (the current and the prefetched one). Measured on SmolLM2 with 2
CPU workers (benchmarks/planner_check.py): the default cache is +0.6 GiB per worker against
max_live_parameters=1e6, the whole fp32 model.
Then the activations kept for backward (activations.py), DeepSpeed's reduce bucket when weights
train, and a fixed runtime overhead (CUDA context + allocator slack on GPU; Python, torch and
DeepSpeed themselves on CPU). Host memory, disk and checkpoints: host_plan.py.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, replace

from trsp_ray.method.recipes import MAP_RECIPE, TAIL_RECIPE
from trsp_ray.plan.activations import forward_layer_bytes, probe_bytes, training_activations_gb
from trsp_ray.plan.host_plan import HostPlan, disk_problem, host_and_disk
from trsp_ray.plan.memory import ADAM_FP32, GB, OVERHEAD_GB, REDUCE_BUCKET, Peaks, StagePlan
from trsp_ray.plan.shape import Shape, read_shape
from trsp_ray.plan.zero3_setup import Setup, setup_for_run


def _stage(name: str, s: Shape, st: Setup, *, trained: int, frozen: int, gated: bool = False,
           grad_layers: int | None = None) -> StagePlan:
    b, w = st.dtype_bytes, st.workers
    plan = StagePlan(name)
    weights = (trained + frozen) * b / w
    if st.offload_params:
        plan.host += weights / GB
    else:
        plan.parts["weights (partition)"] = weights / GB
    live = max(2 * s.layer_params, min(s.params, st.max_live_parameters))
    plan.parts["gathered parameters"] = live * b / GB
    if trained:
        grads, optim = trained * b / w, trained * ADAM_FP32 / w
        if st.offload_optimizer:
            plan.host += (optim + trained * 4 / w) / GB
        else:
            plan.parts["gradients (partition)"] = grads / GB
            plan.parts["optimizer fp32 + Adam (partition)"] = optim / GB
        plan.parts["reduce bucket"] = min(REDUCE_BUCKET, trained) * b / GB
    # every layer: a gate's gradient flows through all later layers in stage 1, all weights train in
    # stage 2 (a tail heal's backward: its k layers, `grad_layers`)
    plan.parts["activations"] = training_activations_gb(
        s, dtype_bytes=b, tokens=st.micro_batch * st.seqlen, layers=s.layers if grad_layers is None else grad_layers,
        checkpointing=st.activation_checkpointing,
        trained=trained > 0, gated=gated, zero3=True)
    plan.parts["runtime overhead"] = OVERHEAD_GB[st.device]
    return plan


def estimate(s: Shape, st: Setup) -> tuple[StagePlan, StagePlan]:
    """(stage 1, stage 2) per-worker plans."""
    p = s.params
    stage1 = _stage("stage 1", s, st, trained=p if st.train_base else 0, frozen=0 if st.train_base else p, gated=True)
    trained = st.trained_params(s)
    if st.trainable == "lora":
        stage2 = _stage("stage 2 (lora)", s, st, trained=trained, frozen=p)
    else:
        what = {"all": "all weights", TAIL_RECIPE: f"lm_head + last {st.tail_layers} layers",
                MAP_RECIPE: f"{st.maps} folded down_proj"}[st.trainable]
        stage2 = _stage(f"stage 2 ({what})", s, st, trained=trained, frozen=p - trained, grad_layers=st.grad_layers(s))
    return stage1, stage2


def influence_stage(s: Shape, st: Setup) -> StagePlan:
    """Block Influence on ZeRO-3 workers (ranks.block_influence_on_ranks), which the default pipeline runs
    instead of stage 1: stage 1's model state, and no-grad forwards of a micro batch through the whole
    model (selectors.influence_sums with head=True: the LM head and the loss run) holding the largest of
    one layer's forward, the fp32 probe and the logits with their fp32 upcast and log-softmax beside the
    final stream (e(V + h) + 8V; fp32 has no upcast). Per token, as single_plan counts one process's."""
    e = st.dtype_bytes
    stage1 = estimate(s, st)[0]
    plan = StagePlan("shortgpt (Block Influence)", {k: v for k, v in stage1.parts.items() if k != "activations"},
                     stage1.host)
    logits = e * (s.vocab + s.hidden) + s.vocab * (4 + (4 if e != 4 else 0))
    plan.parts["one layer | the fp32 probe | the logits"] = st.micro_batch * st.seqlen * max(
        forward_layer_bytes(s, e), probe_bytes(s, e), logits) / GB
    return plan


def merge_stage(cfg, s: Shape, st: Setup) -> StagePlan:
    """A merge on ZeRO-3 workers (distributed/merging.py): Block Influence's model state and whole forward,
    and beside them what each rank holds of the merge (merge_plan.merge_memory per rank)."""
    from trsp_ray.plan.merge_plan import merge_memory

    base = influence_stage(s, st)
    device, host = merge_memory(cfg, dtype_bytes=st.dtype_bytes, shape=s, ranks=st.workers)
    plan = StagePlan("merge (pairs gathered on every rank)", dict(base.parts), base.host + host)
    plan.parts["the wide pair, its copies and the refit sums"] = device
    return plan


@dataclass
class Plan(Peaks):
    shape: Shape
    setup: Setup
    stages: tuple[StagePlan, ...]

    @property
    def fits(self) -> bool:
        return self.peak <= self.setup.gpu_memory_gb

    def reason(self) -> str:
        worst = self.worst()
        return (f"{worst.name} needs {worst.total:.1f} GB per worker, more than the "
                f"{self.setup.gpu_memory_gb:g} GB available")

    def suggestion(self) -> str:
        return "what would fit: " + "; ".join(alternatives(self.shape, self.setup))

    def host(self, *, fit_host_gb: float = 0.0) -> HostPlan:
        """`fit_host_gb`: a worker's host memory while the pipeline's fit holds its maps (host_and_disk)."""
        return host_and_disk(self.shape, self.setup, self.stages, fit_host_gb=fit_host_gb)

    def disk_problem(self) -> str | None:
        """A one-line refusal when the kept checkpoints exceed `disk_budget_gb`, else None."""
        return disk_problem(self.host(), self.setup)


def plan(s: Shape, st: Setup) -> Plan:
    return Plan(s, st, estimate(s, st))


def min_workers(s: Shape, st: Setup, *, limit: int = 4096) -> int | None:
    """The smallest world size (a multiple of 8 above 8, whole nodes) at which `st` fits."""
    for w in [1, 2, 4] + list(range(8, limit + 1, 8)):
        if plan(s, replace(st, workers=w)).fits:
            return w
    return None


def alternatives(s: Shape, st: Setup) -> list[str]:
    """Changes that make `st` fit: more workers, offload, LoRA, activation checkpointing."""
    out = []
    w = min_workers(s, st)
    if w is not None and w != st.workers:
        out.append(f"--workers {w} ({math.ceil(w / 8)} node(s) of 8 GPUs)")
    # Cheapest first: recomputation costs ~30% compute, offload costs PCIe traffic every step.
    options = [("activation_checkpointing", "--activation-checkpointing"),
               ("offload_optimizer", "--offload-optimizer"), ("offload_params", "--offload-params")]
    free = [(a, f) for a, f in options if not getattr(st, a)]
    subsets = [c for n in range(1, len(free) + 1) for c in itertools.combinations(free, n)]
    for subset in subsets:
        if plan(s, replace(st, **{a: True for a, _ in subset})).fits:
            out.append(" + ".join(f for _, f in subset) + f" at {st.workers} workers")
            break
    if st.trainable != "lora" and plan(s, replace(st, trainable="lora")).fits:
        out.append(f"--trainable lora at {st.workers} workers")
    return out or ["nothing at this GPU size; use larger GPUs or a smaller micro batch / seqlen"]


def method_on_workers(method: str, *, drop_given: bool = False) -> bool:
    """Whether the Ray Train path can run pipeline `method` (stage 1 or ShortGPT, stage 2 or a heal,
    export); `drop_given`: its drop set is chosen in one process and handed over, the workers only
    heal it. The registry's own rule on the name (registry.on_workers, Pipeline.on_workers)."""
    from trsp_ray.config import registry

    return registry.on_workers(method, drop_given=drop_given)


def trains_on_workers(spec) -> bool:
    """Whether the Ray Train path trains weights after stage 1 for pipeline `spec` (its registry entry):
    TRSP's stage 2, or a heal (heal.run_heal on the gated model with the drop set frozen: stage 2's
    memory less the frozen layers' state)."""
    return spec.stage2 or spec.heal


def recovers_on_workers(cfg, *, spec) -> bool:
    """Whether the workers train weights after stage 1 (`spec`: the pipeline's registry entry): a heal
    method heals with stage 2's budget whatever stage2.enabled says (as one process does,
    methods.method_heal); TRSP's stage 2 runs when enabled."""
    return cfg.stage2.steps > 0 and (spec.heal or (spec.stage2 and cfg.stage2.enabled))


def plan_for_run(cfg, model_path: str, ds_config: dict | None = None, *, spec) -> Plan:
    """The plan of a run config (`spec`: its pipeline's registry entry, Pipeline.spec); stage 2 counts
    only when the method trains weights."""
    return zero3_plan(cfg, read_shape(model_path), ds_config, spec=spec)


def with_heal_setup(cfg, st: Setup, s: Shape, *, spec) -> Setup:
    """`st` with a heal method's drop set frozen (heal.run_heal on the workers keeps it out of the optimizer)
    and its heal's recipe (config.heal_recipe): the tail's k, and for the map recipe one folded
    down_proj per block, at most one per dropped layer (a contiguous selector's drop set is one block).
    `spec`: the pipeline's registry entry."""
    from trsp_ray.config.run_config import heal_recipe
    from trsp_ray.method.stage1 import n_drop_for

    if not spec.heal:
        return st
    n_drop = n_drop_for(cfg.ratio, s.layers)
    trainable, rank = heal_recipe(cfg, heal_method=True)
    return replace(st, frozen_layers=n_drop, trainable=trainable, lora_rank=rank, tail_layers=cfg.heal.tail_layers,
                   maps=planned_maps(spec.selector, n_drop=n_drop))


def planned_maps(selector: str | None, *, n_drop: int) -> int:
    """The folded down_proj a map heal after `selector`'s drop set trains, as a plan counts them before
    the drop set is known: one per block of the drop set, so one for a contiguous selector (tail,
    angular) and at most `n_drop` (every dropped layer its own block) for the others; 0 for the dense model."""
    from trsp_ray.config import registry

    if selector is None:
        return 0
    return min(1, n_drop) if selector in (registry.TAIL_SELECTOR, registry.ANGULAR_SELECTOR) else n_drop


def zero3_plan(cfg, s: Shape, ds_config: dict | None = None, *, spec) -> Plan:
    """`plan_for_run` for a known Shape (a preset's config.json fields, no model directory)."""
    from trsp_ray.config import registry

    st = with_heal_setup(cfg, setup_for_run(cfg, ds_config), s, spec=spec)
    p = plan(s, st)
    if spec.selector == registry.SHORTGPT_SELECTOR:  # worker._shortgpt: no stage 1
        p.stages = (influence_stage(s, st),) + p.stages[1:]
    if spec.merges:  # the pairs' distances (one forward, as Block Influence), then the merge on the ranks
        p.stages = (influence_stage(s, st), merge_stage(cfg, s, st)) + p.stages[1:]
    if not recovers_on_workers(cfg, spec=spec):
        p.stages = p.stages[:1]
    return p
