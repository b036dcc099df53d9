"""The sections of a run's configuration (trsp_ray.config.run_config assembles them into RunConfig and loads
it): one frozen dataclass per section, each checking itself in `__post_init__` with a one-line
`TrspError` naming the bad value and what is valid."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from trsp_ray.common.errors import TrspError
from trsp_ray.data.domains import DEFAULT_MIX, eval_domain_names, parse_mix
from trsp_ray.method.compensation_forms import (
    MIN_TOKENS_PER_COLUMN,
    OBJECTIVES,
    TOKENS_PER_COLUMN,
    WEIGHTINGS,
    check_form,
    check_objective,
)
from trsp_ray.method.recipes import HEAL_RECIPES


def _choice(name: str, value: Any, valid: tuple) -> None:
    if value not in valid:
        raise TrspError(f"{name}={value!r} is not valid; choose one of {', '.join(map(str, valid))}")


def _positive(name: str, value: float, *, allow_zero: bool = False) -> None:
    if value < 0 or (value == 0 and not allow_zero):
        bound = ">= 0" if allow_zero else "> 0"
        raise TrspError(f"{name}={value!r} is not valid; it must be {bound}")


@dataclass(frozen=True)
class DataConfig:
    calib_text: str | None = None  # a text file to calibrate on instead of the mixture
    # the calibration mixture (trsp_ray/data/domains.py): 'SOURCE:WEIGHT,...' of text domains or files, or a
    # YAML file of source: weight; a domain with no weight is the benchmark's left-out domain
    calib_mix: str = DEFAULT_MIX
    eval_text: str | None = None  # any text file; default: gensim Wikipedia held-out articles
    seqlen: int = 128  # training / calibration window (tokens)
    batch_size: int = 4  # windows per optimizer step
    eval_seqlen: int = 256  # perplexity window (tokens)
    # cap on held-out windows per scored text (None = whole text): the benchmark scores every domain,
    # 5 x 16 x 256 = 20k tokens a row
    eval_max_windows: int | None = 16
    # the domains whose held-out documents the benchmark scores ('all' = every domain of domains.py)
    eval_domains: str = "all"
    # another calibration whose validation tail this run must not train on, as JSON {calib_text,
    # calib_mix, seqlen}: a search sets its base config's, so that no trial (on one device or on Ray
    # Train workers) is scored on text it trained on (workbench.calibration_of); "" = none
    validation_base: str = ""

    def __post_init__(self):
        for name in ("seqlen", "batch_size", "eval_seqlen"):
            _positive(f"data.{name}", getattr(self, name))
        if self.eval_max_windows is not None:
            _positive("data.eval_max_windows", self.eval_max_windows)
        if not self.calib_text:
            parse_mix(self.calib_mix)  # an unknown source or a bad weight: one line, before any work
        eval_domain_names(self.eval_domains)


@dataclass(frozen=True)
class GateConfig:
    gate: str = "delta"  # delta: x + s*(f(x)-x); output: s*f(x)
    # First layers never dropped: a count, or auto = one layer in eight, rounded up (stage1.head_protected):
    # Kim et al.'s 4 of 32 ("Shortened LLaMA", 2024), scaled to the depth. Block Influence ranks an early
    # layer of SmolLM2 (3) among the 8 of 30 to drop on every domain but Wikipedia, within 0.003 of a late
    # one (26), and removing it costs 2.6 +- 1.9 points of LAMBADA accuracy after the same heal
    # (docs/results.md).
    protect_head: int | str = "auto"
    protect_tail: int = 1  # last layers never dropped

    def __post_init__(self):
        _choice("gates.gate", self.gate, ("delta", "output"))
        if self.protect_head != "auto" and (isinstance(self.protect_head, bool)
                                            or not isinstance(self.protect_head, int) or self.protect_head < 0):
            raise TrspError(f"gates.protect_head={self.protect_head!r} is not valid; it must be an integer >= 0 "
                            f"or auto (one layer in eight)")
        _positive("gates.protect_tail", self.protect_tail, allow_zero=True)


@dataclass(frozen=True)
class Stage1Config:
    lambda1: float = 5e-3  # L1 coefficient on the candidate gates (paper's best)
    # Gate learning rate. Adam moves each gate about lr per step whatever its gradient, so lr x steps
    # must let gates travel to where CE and the L1 pull balance (~1.0), or the ranking is noise.
    lr: float = 5e-2
    first_round_steps: int = 16  # steps of round 1 (its ranking is also the one-shot selection)
    steps_per_round: int = 3  # steps of every later round (gates are warm-started)
    selection: str = "iterative"  # iterative | oneshot
    train_base: bool = False  # also train the base weights, as the reference code does
    base_lr: float = 2e-5
    # Removal probes (iterative selection): each round measures the removal cost of the `probe`
    # candidates with the smallest gates and drops the cheapest (0 or 1 = the smallest gate, as the
    # paper); cost = KL(dense || pruned) ("kl") or CE ("ce") on probe_windows calibration windows.
    # 4 is what measured best on SmolLM2 (README "What wins"; 6 chose a worse set, greedy is myopic).
    probe: int = 4
    probe_windows: int = 8
    probe_criterion: str = "kl"  # kl | ce | recall (kl + the CE increase where a token recurs: see stage1.py)
    probe_seqlen: int | None = None  # tokens per probe window; None = data.seqlen
    # the m lowest-Block-Influence candidates (ShortGPT's signal, one dense forward of the probe
    # windows) join the gates' shortlist every round (0 = the gates alone)
    shortlist_bi: int = 0
    # passes of swap refinement after the last round (0 = off): greedy removal is myopic; on SmolLM2
    # two swaps turned a greedy set with val PPL 52.9 into one with 47.1 (README "What wins")
    refine: int = 2
    # scorer calls refinement may spend in all: a pass that finds nothing costs n_drop x |pool|
    # calls (~980 at Llama-70B, 25%: 20 x a pool of 49). 320 >= 2 passes x 8 dropped x a pool of 17 (SmolLM2's 30 layers
    # - 5 protected - 8 dropped): SmolLM2 at 8 of 30 keeps both of its passes whole.
    refine_budget: int = 320

    def __post_init__(self):
        _positive("stage1.lambda1", self.lambda1, allow_zero=True)
        _positive("stage1.lr", self.lr)
        _positive("stage1.first_round_steps", self.first_round_steps)
        _positive("stage1.steps_per_round", self.steps_per_round)
        _choice("stage1.selection", self.selection, ("iterative", "oneshot"))
        _positive("stage1.base_lr", self.base_lr)
        _positive("stage1.probe", self.probe, allow_zero=True)
        _positive("stage1.probe_windows", self.probe_windows)
        _choice("stage1.probe_criterion", self.probe_criterion, ("kl", "ce", "recall"))
        if self.probe_seqlen is not None and self.probe_seqlen < 2:
            raise TrspError(f"stage1.probe_seqlen={self.probe_seqlen!r} is not valid; pass an integer >= 2 or null")
        _positive("stage1.shortlist_bi", self.shortlist_bi, allow_zero=True)
        _positive("stage1.refine", self.refine, allow_zero=True)
        _positive("stage1.refine_budget", self.refine_budget)


@dataclass(frozen=True)
class Stage2Config:
    enabled: bool = True
    lambda2: float = 1e-3  # coefficient of sum_{i in P} d(x_{i+1}, x_i) (paper's best)
    steps: int = 20  # also the weight-update budget every trained benchmark row gets
    lr: float = 1e-4  # learning rate of the weights outside P
    p_lr_scale: float = 1.0  # learning-rate multiplier for the weights of the layers in P
    mode: str = "joint"  # joint: all of P at once; sequential: one layer of P per segment
    norm: str = "l2"  # per-token distance: l2 | l1
    # all | lora; a heal method heals with this setting (methods.method_heal), so it also takes the heal
    # recipes tail | map (HealConfig), which TRSP's own stage 2 refuses (heal_recipe)
    trainable: str = "all"
    lora_rank: int = 8
    # constant: fixed lambda2; ramp: lambda2 grows linearly from 0; anneal: the P layers' residual
    # contribution is scaled by a factor going 1 -> 0 over anneal_fraction of the steps, so they are
    # exact identities (removal changes nothing) for the remaining steps.
    schedule: str = "anneal"
    anneal_fraction: float = 0.5

    def __post_init__(self):
        _positive("stage2.lambda2", self.lambda2, allow_zero=True)
        _positive("stage2.steps", self.steps, allow_zero=True)
        _positive("stage2.lr", self.lr)
        _positive("stage2.p_lr_scale", self.p_lr_scale, allow_zero=True)
        _choice("stage2.mode", self.mode, ("joint", "sequential"))
        _choice("stage2.norm", self.norm, ("l2", "l1"))
        _choice("stage2.trainable", self.trainable, HEAL_RECIPES)
        _positive("stage2.lora_rank", self.lora_rank)
        _choice("stage2.schedule", self.schedule, ("constant", "ramp", "anneal", "skip"))
        if not 0.0 < self.anneal_fraction <= 1.0:
            raise TrspError(f"stage2.anneal_fraction={self.anneal_fraction!r} is not valid; it must be in (0, 1]")


@dataclass(frozen=True)
class HealConfig:
    steps: int = 0  # CE-only fine-tuning of the pruned model; 0 = off
    lr: float = 1e-4
    # which weights the heal trains (trsp_ray/method/heal.py): all; lora (adapters, merged at the end); tail
    # (lm_head + the last tail_layers kept decoder layers, Lu et al.'s partial fine-tune); map (only
    # the down_proj weights a least-squares fold wrote its maps into, ReplaceMe's "LT" heal). A heal
    # method heals with stage2.trainable unless this names another recipe than all (heal_recipe).
    trainable: str = "all"
    lora_rank: int = 8
    # 3: Lu et al. ("Reassessing Layer Pruning", ICLR'26) found lm_head + the last three kept layers the
    # best partial fine-tune after a 25% cut (above LoRA of every layer) at a fraction of its state
    tail_layers: int = 3
    # total dense-forward tokens (selection + compensation + heal, SPEC section 5) a heal method may
    # spend: its heal gets the steps the budget leaves (trsp_ray/run/budget.py); 0 = off (stage2.steps)
    compute_budget: float = 0.0
    # the heal's windows (run/budget.heal_shape): 0 = sized by the budget, data.seqlen / data.batch_size
    # without one, longer and larger as the budget grows (long-range cloze needs the context)
    seqlen: int = 0
    batch_size: int = 0
    # passes over each calibration source the heal stream may read (data/stream.py) before that source
    # stops and the others share its weight; a heal needing more than every source gives is refused
    max_passes: float = 4.0
    # the learning rate over the heal: constant, or cosine (5% linear warmup, then cosine to 10%);
    # auto: cosine for a budget's grown heal (run/budget.heal_shape), else constant
    schedule: str = "auto"
    # minutes of a heal, or of TRSP's stage 2, in one process between its checkpoints (run/heal_store.py: an
    # interrupted heal or stage 2 resumes from the last one); 0: after every step; null: none
    checkpoint_minutes: float | None = 10.0

    def __post_init__(self):
        _positive("heal.steps", self.steps, allow_zero=True)
        if self.checkpoint_minutes is not None:
            _positive("heal.checkpoint_minutes", self.checkpoint_minutes, allow_zero=True)
        _positive("heal.seqlen", self.seqlen, allow_zero=True)
        _positive("heal.batch_size", self.batch_size, allow_zero=True)
        _positive("heal.max_passes", self.max_passes)
        _choice("heal.schedule", self.schedule, ("auto", "constant", "cosine"))
        _positive("heal.compute_budget", self.compute_budget, allow_zero=True)
        _positive("heal.lr", self.lr)
        _choice("heal.trainable", self.trainable, HEAL_RECIPES)
        _positive("heal.lora_rank", self.lora_rank)
        if isinstance(self.tail_layers, bool) or not isinstance(self.tail_layers, int) or self.tail_layers < 1:
            raise TrspError(f"heal.tail_layers={self.tail_layers!r} is not valid; it must be an integer >= 1")


TEACHERS = ("auto", "stored", "live")  # recovery.teacher


@dataclass(frozen=True)
class RecoveryConfig:
    """The objective every weight update optimises, in stage 2 and in a heal alike (so that rows that
    train compare at the same objective): next-token cross-entropy, or distillation from the dense
    model (KL(dense || pruned) on next-token distributions at temperature kd_temperature). A heal
    that reads the heal stream distils from the stored teacher (run/teacher_store.py: the dense
    model's top-kd_topk records, computed once per stream); stage 2 and short heals run the dense
    model beside the student (training.DistillLoss)."""

    objective: str = "ce"  # ce | kd
    kd_temperature: float = 1.0
    kd_topk: int = 64  # teacher tokens kept per position (+ one bin for the rest); 0 = full vocabulary, live
    kd_ce_weight: float = 0.0  # weight of next-token cross-entropy added to the KL
    teacher: str = "auto"  # auto (stored for heals that read the heal stream) | stored | live

    def __post_init__(self):
        _choice("recovery.objective", self.objective, ("ce", "kd"))
        _positive("recovery.kd_temperature", self.kd_temperature)
        _positive("recovery.kd_topk", self.kd_topk, allow_zero=True)
        _positive("recovery.kd_ce_weight", self.kd_ce_weight, allow_zero=True)
        _choice("recovery.teacher", self.teacher, TEACHERS)
        if self.teacher == "stored" and self.kd_topk == 0:
            raise TrspError("recovery.teacher=stored with recovery.kd_topk=0 is not valid: the store keeps the "
                            "top-k tokens; set recovery.kd_topk >= 1 or recovery.teacher=live|auto")


@dataclass(frozen=True)
class CompensationConfig:
    """Training-free repair of each removed block after removal and before any heal (SPEC section 7,
    trsp_ray/method/compensation.py): lstsq fits ReplaceMe's least-squares map on calibration activations
    and folds it into the MLP output projection of the layer before the block; scalar (Prune&Comp's
    form) rescales the stream at each cut by the ratio of dense token norms, folded into the output
    projections of the layers after it."""

    # auto: what the method runs (lstsq for a compensating method such as the default, none for any
    # other; config.for_method); none | lstsq | scalar: as set (none with a compensating method and
    # any compensation after TRSP's stage 2 are refused)
    method: str = "auto"
    # ridge, relative to the mean diagonal of M^T M; windows of data.seqlen tokens (at least the
    # hidden size in tokens). Chosen on SmolLM2's calibration KL (ShortGPT's set, norm weighting):
    # 32 windows overfit (KL 1.07, tail PPL 47.2 > held-out 39.7), 64 need ridge 1e-1 (0.97),
    # 128 at 1e-2 give 0.93 and 256 0.88 at twice the fit's forward
    ridge: float = 1e-2
    # calibration windows of the fit; 0 (auto) = tokens_per_column x hidden size / data.seqlen (128 on
    # SmolLM2; compensation_forms.TOKENS_PER_COLUMN says why), resolved where a run starts
    # (config.sized); a fit from fewer than min_tokens_per_column per map column is refused
    windows: int = 0
    tokens_per_column: float = TOKENS_PER_COLUMN
    min_tokens_per_column: float = MIN_TOKENS_PER_COLUMN
    # dense: M and the residual from the dense model (one pass); sequential: from the pruned model
    # with the earlier blocks already compensated (a pass per block); targets always dense
    activations: str = "dense"
    # which maps least squares may fit (trsp_ray/method/compensation_forms.py): full (d x d, ReplaceMe's),
    # diagonal (one scale per channel), lowrank (the identity plus a rank-`rank` correction)
    form: str = "full"
    rank: int = 64  # the lowrank form's rank (at most the hidden size)
    # norm: each token's error relative to its stream's norm (attention-sink tokens do not own the
    # fit); none: absolute errors, ReplaceMe's form (trsp_ray/method/compensation.py, module doc)
    weighting: str = "norm"
    # what the map minimises over the calibration tokens: mse (the ridge least squares above, closed
    # form) or cosine (ReplaceMe's mean 1 - cos of the repaired stream and the dense one, a few
    # Gauss-Newton steps from the mse map; trsp_ray/method/compensation_cosine.py). Same map, same fold:
    # cosine serves only a fitted map (method lstsq, or auto where it resolves to lstsq)
    objective: str = "mse"

    def __post_init__(self):
        _choice("compensation.method", self.method, ("auto", "none", "lstsq", "scalar"))
        _choice("compensation.objective", self.objective, OBJECTIVES)
        check_objective(self.objective, method=self.method)
        check_form(self.form, self.rank)
        _positive("compensation.ridge", self.ridge, allow_zero=True)
        _positive("compensation.windows", self.windows, allow_zero=True)
        _positive("compensation.tokens_per_column", self.tokens_per_column)
        _positive("compensation.min_tokens_per_column", self.min_tokens_per_column, allow_zero=True)
        _choice("compensation.activations", self.activations, ("dense", "sequential"))
        _choice("compensation.weighting", self.weighting, WEIGHTINGS)
        if self.method == "scalar" and self.activations != "dense":
            raise TrspError(f"compensation.activations={self.activations!r} is not used by the scalar fold (its "
                            "scales come from the dense model); use compensation.activations=dense")


# SLEB's calibration windows for `trsp-ray benchmark --full-baselines`: on SmolLM2 (8 of 30 layers,
# 128-token windows) its drop set no longer changed when the count doubled from 8 to 16.
FULL_SLEB_WINDOWS = 16


@dataclass(frozen=True)
class MergeConfig:
    """`merging`: the merge of adjacent pairs (--method merge, merge+heal; trsp_ray/method/merge.py): the calibration
    its heads and channels are scored on and its closed-form refits solved from, and the refits' settings."""

    # calibration windows of data.seqlen tokens; 0 (auto) = tokens_per_column x the widest refit (the MLP's
    # channels, or the attention's q rows) / data.seqlen (336 on SmolLM2: 1536 channels), resolved per
    # model (plan/merge_plan.merge_windows); a refit from fewer tokens than its columns is refused
    windows: int = 0
    tokens_per_column: float = TOKENS_PER_COLUMN
    refit: bool = True  # repair each cut in closed form; false: plain dropping of the weaker heads and channels
    ridge: float = 1e-2  # the refit's shrinkage towards plain dropping, relative to the mean diagonal of Z^T Z
    weighting: str = "norm"  # as compensation.weighting: each token relative to its stream's norm, or none
    # what the MLP's refit reproduces (method/merge.py): "dense", the stream the dense model leaves after the
    # pair (stored on the host in one pass, merge_costs.target_bytes); "pair", the two blocks' own output on the
    # merged stream; "wide", the flattened block's
    target: str = "dense"
    # which attention units a cut keeps (method/merge_choice.py): "energy", those that write most; "loss", the
    # candidate set (at most unit_trials) whose cut leaves the lowest loss on choice_windows calibration windows
    units: str = "loss"
    unit_trials: int = 24
    choice_windows: int = 16

    def __post_init__(self):
        _choice("merging.target", self.target, ("pair", "wide", "dense"))
        _choice("merging.units", self.units, ("energy", "loss"))
        _positive("merging.unit_trials", self.unit_trials)
        _positive("merging.choice_windows", self.choice_windows)
        _positive("merging.windows", self.windows, allow_zero=True)
        _positive("merging.tokens_per_column", self.tokens_per_column)
        _positive("merging.ridge", self.ridge, allow_zero=True)
        _choice("merging.weighting", self.weighting, WEIGHTINGS)


@dataclass(frozen=True)
class BaselineConfig:
    # calibration windows (of data.seqlen tokens) for ShortGPT's Block Influence; None = as many
    # tokens as TRSP's stage 1 sees (SPEC section 5: it is cheap, so it gets the same data)
    calib_windows: int | None = None
    # windows SLEB scores every candidate removal on; its cost is about n_drop x candidates forward
    # passes per token, so this is the knob that trades its time for a drop set that no longer changes.
    # The default is cut so that the README's benchmark fits 15 minutes on 2 CPU cores; the report
    # says so. A faithful SLEB needs the count at which doubling it no longer changes its drop set.
    sleb_windows: int = 2

    def __post_init__(self):
        if self.calib_windows is not None:
            _positive("baselines.calib_windows", self.calib_windows)
        _positive("baselines.sleb_windows", self.sleb_windows)


@dataclass(frozen=True)
class TrackingConfig:
    enabled: bool = True
    tracking_uri: str | None = None  # default: sqlite:///./runs/mlflow.db
    experiment: str = "trsp_ray"


@dataclass(frozen=True)
class DistributedConfig:
    workers: int = 0  # 0 = single process, no Ray Train
    strategy: str = "zero3"  # zero3 | ddp
    use_gpu: bool = False
    # CPUs (= torch threads) per worker; 0 = auto: 1, or the node's CPUs per worker when offloading
    cpus_per_worker: int = 0
    offload_params: bool = False
    offload_optimizer: bool = False
    grad_accum: int = 1
    activation_checkpointing: bool = False  # recompute layer activations in backward; every route (one process too)
    storage_path: str | None = None  # Ray Train storage; default ./runs/ray
    max_failures: int = 0
    checkpoint_every: int = 10  # stage-2 steps between checkpoints (stage 1: every round)
    keep_checkpoints: int = 2  # Ray Train keeps the last K checkpoints, deletes older ones
    # remote storage (s3://, gs://): "async" uploads a save in the background while the workers
    # train on (local disk holds at most two saves: the one uploading and the next); "sync" makes
    # every rank wait for its upload. Local/shared paths are written in place either way.
    checkpoint_upload: str = "async"
    disk_budget_gb: float | None = None  # storage the kept checkpoints may use; the plan refuses more
    gpu_memory_gb: float = 80.0  # per-GPU memory the planner checks against
    # Streaming export (distributed/export.py): max safetensors shard size in MB (10^6 bytes; a
    # larger single tensor gets its own shard); exports up to export_reload_max_gb GiB are also
    # reloaded on rank 0 and their logits checked; export_timeout_s 0 = sized from the bytes.
    export_shard_mb: int = 5000
    export_reload_max_gb: float = 16.0
    export_timeout_s: int = 0

    def __post_init__(self):
        _positive("distributed.workers", self.workers, allow_zero=True)
        _choice("distributed.strategy", self.strategy, ("zero3", "ddp"))
        _positive("distributed.cpus_per_worker", self.cpus_per_worker, allow_zero=True)
        _positive("distributed.grad_accum", self.grad_accum)
        _positive("distributed.max_failures", self.max_failures, allow_zero=True)
        _positive("distributed.checkpoint_every", self.checkpoint_every)
        _positive("distributed.keep_checkpoints", self.keep_checkpoints)
        _choice("distributed.checkpoint_upload", self.checkpoint_upload, ("async", "sync"))
        if self.disk_budget_gb is not None:
            _positive("distributed.disk_budget_gb", self.disk_budget_gb)
        _positive("distributed.gpu_memory_gb", self.gpu_memory_gb)
        _positive("distributed.export_shard_mb", self.export_shard_mb)
        _positive("distributed.export_reload_max_gb", self.export_reload_max_gb, allow_zero=True)
        _positive("distributed.export_timeout_s", self.export_timeout_s, allow_zero=True)
