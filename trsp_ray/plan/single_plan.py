"""Single-process plan: the memory of a run's stages in one process on one device (driver.run, the benchmark,
search trials, reproduction cells). One device holds the working copy of the model (Workbench.fresh_model; the
original stays in host memory, so on CPU both count), then per stage: a training stage's activations
(activations.py); per parameter, Adam's two fp32 moments (8) and, for bf16/fp16, an fp32 master copy (4):
training.TorchStepper. The step's fp32 gradients (4 per parameter) appear after backward freed the activations,
so the stage peaks at the larger of the two. A no-grad forward holds one layer's intermediates and its logits
(bytes per token, e = dtype bytes, V vocab): SLEB the model-dtype logits, their fp32 upcast and the log-softmax
(eV + 4V + 4V; fp32 skips the upcast); evaluation (perplexity.py) fp32 logits, their shifted copy and the
log-softmax (12V); ShortGPT's Block Influence and the angular block run the decoder stack alone
(selectors.decoder_forward: no logits) and hold the larger of one layer and Block Influence's fp32 probe
(activations.probe_bytes; counting the logits put Block Influence 59-80% over on one H200); SLEB and angular
also the inputs of every layer for one batch (L e h): baselines.sleb_drop streams batches. The least-squares fit
("compensation", after the removal): on a GPU a transient dense copy on the device (the pruned copy steps out to
host memory, methods._dense_beside; the fold lands there; the copy is dropped before the pruned copy returns,
and the removed layers before the fit: the first H200 run, which held all three, measured 4.03 GiB on a 1B
against 2.52 planned), on CPU the pruned copy and the original; beside it the fit's sums and its largest phase
over min(data.batch_size, windows) windows per forward (plan/compensation_plan.fit_phases, the workers'
formula). The pruned model's evaluation holds its kept weights ("evaluation (pruned)").
Measured: benchmarks/planner_single.py; the fit on workers: benchmarks/fit_memory.py.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from trsp_ray.method.recipes import TAIL_RECIPE
from trsp_ray.plan.activations import forward_layer_bytes, probe_bytes, training_activations_gb
from trsp_ray.plan.compensation_plan import WORKING_SET, cosine_host_gb, fit_phases, fit_rows, max_blocks
from trsp_ray.plan.memory import GB, SINGLE_OVERHEAD_GB, Peaks, StagePlan
from trsp_ray.plan.shape import Shape, read_shape
from trsp_ray.plan.teacher_plan import TeacherPass, bytes_per_token, single_teacher_stage, teacher_pass_for_run
from trsp_ray.plan.zero3_plan import method_on_workers, planned_maps


@dataclass(frozen=True)
class SingleSetup:
    """What the single-process path's memory depends on (RunConfig fields, see `single_setup_for_run`)."""

    memory_gb: float = 80.0  # what the one device holds: a GPU's memory, or host memory on CPU
    dtype_bytes: int = 2  # 2 = bf16 / fp16, 4 = fp32
    device: str = "gpu"  # gpu | cpu: on CPU the original model shares the memory with the working copy
    batch: int = 4  # windows per training step
    seqlen: int = 2048
    activation_checkpointing: bool = False
    trainable: str = "all"  # stage 2: all | lora
    lora_rank: int = 8
    train_base: bool = False
    baseline_batch: int = 4  # windows per ShortGPT / SLEB forward
    baseline_seqlen: int = 2048
    eval_batch: int = 4  # windows per perplexity forward
    eval_seqlen: int = 2048
    kd: bool = False  # recovery.objective == "kd": stage 2 and the heal read a dense teacher
    stored_teacher_k: int = 0  # > 0: the heal reads the teacher store's top-k records instead (teacher_plan)
    merge_gb: tuple = (0.0, 0.0)  # a merge's own device and host memory (plan/merge_plan.merge_memory)


@dataclass
class SinglePlan(Peaks):
    """The single-process stages of a run on one device; same reading as `Plan`."""

    shape: Shape
    setup: SingleSetup
    stages: tuple[StagePlan, ...]

    @property
    def fits(self) -> bool:
        return self.peak <= self.setup.memory_gb

    def reason(self) -> str:
        w = self.worst()
        where = "one GPU" if self.setup.device == "gpu" else "host memory"
        return f"{w.name} needs {w.total:.1f} GB in one process, more than the {self.setup.memory_gb:.1f} GB of {where}"


def _single_weights(plan: StagePlan, s: Shape, st: SingleSetup, params: int) -> None:
    plan.parts["model (working copy)"] = params * st.dtype_bytes / GB
    if st.device == "cpu":
        plan.parts["model (original, host)"] = s.params * st.dtype_bytes / GB
    plan.parts["runtime overhead"] = SINGLE_OVERHEAD_GB[st.device]


def _optimizer_gb(params: int, e: int) -> float:
    """Adam's fp32 moments, plus the fp32 master copy of low-precision parameters (GB)."""
    return params * (8 if e == 4 else 12) / GB


def single_training(name: str, s: Shape, st: SingleSetup, *, trained_params: int, gated: bool, lora: bool = False,
                    layers: int | None = None, grad_layers: int | None = None, heal: bool = False) -> StagePlan:
    """One training stage in one process (stage 1, stage 2, heal); `layers` < L after removal;
    `lora`: `trained_params` are fp32 adapters beside the frozen weights; `grad_layers`: the layers
    backward runs through (default all of `layers`; a tail heal's k)."""
    layers = s.layers if layers is None else layers
    params = s.params - (s.layers - layers) * s.layer_params
    plan = StagePlan(name)
    _single_weights(plan, s, st, params)
    # Adapters keep the same Linear inputs for their gradients as trained weights do.
    acts = training_activations_gb(s, dtype_bytes=st.dtype_bytes, tokens=st.batch * st.seqlen,
                                   layers=layers if grad_layers is None else grad_layers,
                                   checkpointing=st.activation_checkpointing, trained=trained_params > 0,
                                   gated=gated)
    if lora:
        plan.parts["LoRA adapters (fp32)"] = trained_params * 4 / GB
    if trained_params:
        plan.parts["optimizer state"] = _optimizer_gb(trained_params, 4 if lora else st.dtype_bytes)
    # The step's fp32 gradients appear once backward has freed the activations.
    plan.parts["activations + logits | step gradients"] = max(acts, trained_params * 4 / GB)
    if st.kd and not gated and heal and st.stored_teacher_k:  # no teacher on the device: its stored records
        plan.parts["stored teacher records + KL terms"] = st.batch * st.seqlen * (
            s.vocab * KD_STORED_LOGIT_BYTES + bytes_per_token(st.stored_teacher_k)) / GB
    elif st.kd and not gated:
        _teacher(plan, s, st)
    return plan


# Per token, beside the student's logits: the teacher's logits (e) and their fp32 copy, the two
# fp32 log-softmaxes, the teacher's probabilities and the KL's product (training.DistillLoss).
KD_LOGIT_BYTES = 4 * 5
# Per token of a stored-teacher step: the student's fp32 logits and log-softmax (distill.topk_kl).
KD_STORED_LOGIT_BYTES = 4 * 2


def _teacher(plan: StagePlan, s: Shape, st: SingleSetup) -> None:
    """A distillation step's dense teacher (methods.recovery_stepper): on a GPU a device copy beside
    the student (on CPU the original already counts), and its logits while the loss is formed."""
    if st.device == "gpu":
        plan.parts["dense teacher (device copy)"] = s.params * st.dtype_bytes / GB
    tokens = st.batch * st.seqlen
    plan.parts["teacher logits + KL terms"] = tokens * s.vocab * (st.dtype_bytes + KD_LOGIT_BYTES) / GB


def single_forward(name: str, s: Shape, st: SingleSetup, *, batch: int, seqlen: int, evaluation: bool,
                   layers: int | None = None) -> StagePlan:
    """A no-grad pass: ShortGPT, SLEB (with its per-batch layer inputs) or perplexity; `layers` < L: of
    the pruned model."""
    from trsp_ray.config import registry

    e, tokens = st.dtype_bytes, batch * seqlen
    plan = StagePlan(name)
    _single_weights(plan, s, st, s.params - (s.layers - (s.layers if layers is None else layers)) * s.layer_params)
    if name in (registry.SHORTGPT_SELECTOR, registry.ANGULAR_SELECTOR, registry.MERGE_SELECTOR):  # no LM head
        plan.parts["one layer | the fp32 probe (no logits)"] = tokens * max(forward_layer_bytes(s, e),
                                                                           probe_bytes(s, e)) / GB
    else:
        logits = 12 * s.vocab if evaluation else s.vocab * (e + 4 + (4 if e != 4 else 0))
        plan.parts["logits + one layer"] = tokens * (logits + forward_layer_bytes(s, e)) / GB
    if name == registry.MERGE_SELECTOR:  # plan/merge_plan.merge_memory: on the device, and on the host
        device, host = st.merge_gb
        plan.parts["merge: wide pair, copies, sums, trial logits"] = device + (host if st.device == "cpu" else 0.0)
        plan.host += 0.0 if st.device == "cpu" else host
    if name in registry.LAYER_INPUT_SELECTORS:
        plan.parts["layer inputs of one batch"] = tokens * s.layers * e * s.hidden / GB
    return plan


@dataclass(frozen=True)
class FitSetup:
    """What the single-process fit's memory depends on (compensation.*, resolved and sized)."""

    windows: int
    blocks: int  # the most blocks the planned drop sets can have
    objective: str = "mse"
    activations: str = "dense"  # sequential: one block's sums at a time


def single_fit(s: Shape, st: SingleSetup, fit: FitSetup, *, n_drop: int) -> StagePlan:
    """The least-squares fit and fold in one process (module doc)."""
    e = st.dtype_bytes
    plan = StagePlan("compensation")
    if st.device == "gpu":
        plan.parts["model (a transient dense copy; the pruned copy waits in host memory)"] = s.params * e / GB
        plan.parts["runtime overhead"] = SINGLE_OVERHEAD_GB[st.device]
    else:
        _single_weights(plan, s, st, s.params - n_drop * s.layer_params)
    rows = fit_rows(windows=fit.windows, batch=st.batch)
    share = fit.windows * st.seqlen if fit.objective == "cosine" else 0
    blocks = fit.blocks if fit.activations == "dense" else min(1, fit.blocks)
    phases = fit_phases(s, dtype_bytes=e, tokens=rows * st.seqlen, blocks=blocks, sharded=False,
                        fold_here=st.device == "cpu", cosine_share=share)
    plan.parts[WORKING_SET] = max(phases.values())
    if share:  # the cosine fit's cached rows, in host memory
        rows_gb = cosine_host_gb(share=share, hidden=s.hidden, dtype_bytes=e, blocks=blocks)
        if st.device == "cpu":
            plan.parts["cosine rows of every block"] = rows_gb
        else:
            plan.host += rows_gb
    return plan


def _fits(cfg, method: str) -> bool:
    """Whether `method` runs a least-squares fit in one process (config.for_method resolves auto)."""
    from trsp_ray.common.errors import TrspError
    from trsp_ray.config.run_config import for_method

    try:
        return for_method(cfg, method).compensation.method == "lstsq"
    except TrspError:  # a compensation the run refuses in one line (after stage 2): no fit to plan
        return False


def fit_setup(cfg, *, methods: tuple[str, ...] | None, layers: int, hidden: int) -> FitSetup | None:
    """The largest least-squares fit any of `methods` (default cfg.method) runs, None when none does
    (the scalar fold's six sums per block are left out)."""
    from trsp_ray.config.run_config import for_method, sized
    from trsp_ray.method.stage1 import candidate_layers, n_drop_for

    fits = [sized(for_method(cfg, m), hidden=hidden).compensation for m in methods or (cfg.method,) if _fits(cfg, m)]
    if not fits:
        return None
    g = cfg.gates
    candidates = len(candidate_layers(layers, protect_head=g.protect_head, protect_tail=g.protect_tail))
    blocks = max_blocks(n_drop=n_drop_for(cfg.ratio, layers), candidates=candidates)
    worst = max(fits, key=lambda c: c.windows)
    return FitSetup(windows=worst.windows, blocks=blocks, objective="cosine" if any(
        c.objective == "cosine" for c in fits) else "mse", activations=worst.activations)


PRUNED_EVALUATION = "evaluation (pruned)"
SELECTION_TRIALS = "selection trials"  # the recover selector's trials, each its own process


def single_stages(cfg, *, methods: tuple[str, ...] | None = None, trials: bool = True) -> tuple[str, ...]:
    """The single-process stages `cfg` runs (for every method of `methods` when given, e.g. benchmark
    rows); `trials`: with a selection by recovery's trials (False: one trial's own stages)."""
    from trsp_ray.config import registry
    from trsp_ray.plan.compute import heal_teacher

    out: list[str] = []
    for m in methods or (cfg.method,):
        selector, recovery = registry.recipe(m)
        wanted = ["stage 1"] if selector == registry.TRSP_SELECTOR else []
        if selector == registry.RECOVER_SELECTOR and trials:
            wanted.append(SELECTION_TRIALS)
        if recovery == "stage2" and cfg.stage2.enabled and cfg.stage2.steps > 0:
            wanted.append("stage 2")
        if selector in registry.FORWARD_SELECTORS:
            wanted.append(selector)
        if _fits(cfg, m):
            wanted.append("compensation")
        if (cfg.heal.steps > 0 and selector is not None) or recovery == "heal":
            wanted += ["teacher pass", "heal"] if heal_teacher(cfg) == "stored" else ["heal"]
        # the pruned model is scored after it: its kept weights only (planned with the dense ones, the
        # GPU's pruned evaluation measured 16-23% under)
        pruned = [PRUNED_EVALUATION] if selector is not None else []
        out += [w for w in wanted + ["evaluation"] + pruned if w not in out]
    return tuple(out)


def single_setup_for_run(cfg, *, device: str, memory_gb: float, shape: Shape | None = None) -> SingleSetup:
    from trsp_ray.plan.compute import heal_teacher
    from trsp_ray.plan.merge_plan import merge_memory

    e = {"bf16": 2, "fp16": 2, "fp32": 4}.get(cfg.dtype, 2 if device == "gpu" else 4)
    d = cfg.data
    return SingleSetup(memory_gb=memory_gb, dtype_bytes=e, device=device, batch=d.batch_size, seqlen=d.seqlen,
                       activation_checkpointing=cfg.distributed.activation_checkpointing,
                       trainable=cfg.stage2.trainable, lora_rank=cfg.stage2.lora_rank,
                       train_base=cfg.stage1.train_base, baseline_batch=d.batch_size, baseline_seqlen=d.seqlen,
                       eval_batch=4, eval_seqlen=d.eval_seqlen, kd=cfg.recovery.objective == "kd",
                       stored_teacher_k=cfg.recovery.kd_topk if heal_teacher(cfg) == "stored" else 0,
                       merge_gb=merge_memory(cfg, dtype_bytes=e, shape=shape))


def single_plan(s: Shape, st: SingleSetup, stages: tuple[str, ...], *, n_drop: int = 0, heal_trainable: str = "all",
                heal_lora_rank: int = 8, heal_tail_layers: int = 3, heal_maps: int = 0,
                fit: FitSetup | None = None, teacher: TeacherPass | None = None,
                trials: StagePlan | None = None) -> SinglePlan:
    """The plan of the single-process `stages` (names as `single_stages` gives them); the heal trains
    `heal_trainable` (heal.py's recipes: the tail's k = `heal_tail_layers`, the map's `heal_maps`);
    `fit`: the least-squares fit of the "compensation" stage; `teacher`: the "teacher pass" stage's;
    `trials`: the "selection trials" stage (`trials_stage`)."""
    from trsp_ray.config import registry

    built = []
    for name in stages:
        if name == "compensation":
            if fit is None:
                raise ValueError("the compensation stage's plan needs its FitSetup (fit_setup)")
            built.append(single_fit(s, st, fit, n_drop=n_drop))
        elif name == "stage 1":
            built.append(single_training(name, s, st, trained_params=s.params if st.train_base else 0, gated=True))
        elif name == "stage 2":
            lora = st.trainable == "lora"
            trained = s.recipe_params(st.trainable, kept_layers=s.layers, lora_rank=st.lora_rank)
            built.append(single_training(name, s, st, trained_params=trained, gated=False, lora=lora))
        elif name == "heal":
            kept = s.layers - n_drop
            lora = heal_trainable == "lora"
            trained = s.recipe_params(heal_trainable, kept_layers=kept, lora_rank=heal_lora_rank,
                                      tail_layers=heal_tail_layers, maps=heal_maps)
            # a tail heal's backward stops at its first trained layer (heal.output_side_only)
            grad = heal_tail_layers if heal_trainable == TAIL_RECIPE else None
            built.append(single_training(name, s, st, trained_params=trained, gated=False, lora=lora, layers=kept,
                                         grad_layers=grad, heal=True))
        elif name == SELECTION_TRIALS:
            if trials is None:
                raise ValueError("the selection trials' plan needs their stage (trials_stage)")
            built.append(trials)
        elif name == "teacher pass":
            if teacher is None:
                raise ValueError("the teacher pass's plan needs its TeacherPass (teacher_plan.teacher_pass_for_run)")
            weights = StagePlan(name)
            _single_weights(weights, s, st, s.params)  # the dense model where the working copy was
            built.append(single_teacher_stage(teacher, weights.parts))
        elif name in registry.FORWARD_SELECTORS:
            built.append(single_forward(name, s, st, batch=st.baseline_batch, seqlen=st.baseline_seqlen,
                                        evaluation=False))
        else:
            kept = s.layers - n_drop if name == PRUNED_EVALUATION else None
            built.append(single_forward(name, s, st, batch=st.eval_batch, seqlen=st.eval_seqlen, evaluation=True,
                                        layers=kept))
    return SinglePlan(s, st, tuple(built))


def single_plan_for_run(cfg, *, device: str, memory_gb: float, methods: tuple[str, ...] | None = None,
                        shape: Shape | None = None, trials: bool = True) -> SinglePlan:
    """The single-process plan of `cfg` (or of every method in `methods`) on one `device` of `memory_gb`;
    `trials` as `single_stages` takes it."""
    from trsp_ray.config import registry
    from trsp_ray.config.run_config import heal_recipe
    from trsp_ray.method.stage1 import n_drop_for

    s = shape or run_shape(cfg)
    st = single_setup_for_run(cfg, device=device, memory_gb=memory_gb, shape=s)
    # a heal method heals with stage 2's weights setting (methods.method_heal, the benchmark's heal rows);
    # heal.* sizes only an extra heal after another method
    heals = any(registry.recipe(m)[1] == "heal" for m in (methods or (cfg.method,)))
    trainable, rank = heal_recipe(cfg, heal_method=heals)
    n_drop = n_drop_for(cfg.ratio, s.layers)
    # the map recipe: the most folds any planned method's drop set can take
    maps = max(planned_maps(registry.recipe(m)[0], n_drop=n_drop) for m in (methods or (cfg.method,)))
    stages = single_stages(cfg, methods=methods, trials=trials)
    return single_plan(s, st, stages, n_drop=n_drop, heal_trainable=trainable, heal_lora_rank=rank,
                       heal_tail_layers=cfg.heal.tail_layers, heal_maps=maps,
                       fit=fit_setup(cfg, methods=methods, layers=s.layers, hidden=s.hidden),
                       teacher=teacher_pass_for_run(cfg, s, heal_method=heals),
                       trials=trials_stage(cfg, device=device, memory_gb=memory_gb, shape=s)
                       if SELECTION_TRIALS in stages else None)


def trial_peak(cfg, *, device: str, memory_gb: float, shape: Shape | None = None) -> StagePlan:
    """One recovery trial's largest stage, its fit or heal as its process runs them (trial_config)."""
    from trsp_ray.config.run_config import trial_config

    own = single_plan_for_run(trial_config(cfg), device=device, memory_gb=memory_gb, shape=shape, trials=False)
    return max((st for st in own.stages if st.name in ("compensation", "heal")), key=lambda st: st.total)


def trials_stage(cfg, *, device: str, memory_gb: float, shape: Shape | None = None) -> StagePlan:
    """The selection trials on one device: on a GPU one (each has its own); on CPU as many side by
    side as distributed/audition.trials_at_once runs (concurrency or cores, candidates, memory)."""
    from trsp_ray.method.candidates import parse

    peak = trial_peak(cfg, device=device, memory_gb=memory_gb, shape=shape)
    n = 1
    if device == "cpu":
        wanted = min(len(parse(cfg.selection.candidates)), cfg.selection.concurrency or os.cpu_count() or 1)
        n = max(1, min(wanted, int(memory_gb // peak.total)))  # what host memory holds, at least one
    parts = {f"{part} (trial {peak.name}{f', x {n} at once' if n > 1 else ''})": gb * n
             for part, gb in peak.parts.items()}
    if device == "cpu":  # the run's own process keeps its model in the same memory meanwhile
        parts["the run's model beside the trials"] = sum(gb for part, gb in peak.parts.items() if "model (" in part)
    return StagePlan(SELECTION_TRIALS, parts)


def run_shape(cfg) -> Shape:
    """The Shape of `cfg.model` (its config.json, no weights)."""
    from trsp_ray.data import assets

    return read_shape(assets.resolve_model(cfg.model))


def single_hint(cfg, p: SinglePlan) -> str:
    """What would make a single-process plan fit (cheapest first), or the Ray Train route."""
    from trsp_ray.config.run_config import replace

    st = p.setup
    # a kd run's teacher is a whole second model on the device: without it is the nearest run
    teacher = [("recovery.objective", "ce")] if st.kd else []
    changes = [("distributed.activation_checkpointing", True), ("dtype", "bf16"), *teacher,
               ("stage2.trainable", "lora")]
    options = []
    for key, value in changes:
        section, _, name = key.rpartition(".")
        now = getattr(getattr(cfg, section) if section else cfg, name)
        if now == value:
            continue
        changed = single_plan_for_run(replace(cfg, **{key: value}), device=st.device, memory_gb=st.memory_gb,
                                      shape=p.shape)
        if changed.fits:
            what = {"stage2.trainable": " (heal low-rank adapters, merged at the end)",
                    "recovery.objective": " (no dense teacher beside the student)"}.get(key, "")
            options.append(f"set {key}={str(value).lower()}{what}: peak {changed.peak:.1f} GB")
            break
    if method_on_workers(cfg.method) and cfg.heal.steps == 0:
        options.append("allow Ray Train workers (distributed.workers=N) so every weight heals under ZeRO-3")
    return " or ".join(options) if options else "use a smaller data.batch_size or data.seqlen, or a larger device"
