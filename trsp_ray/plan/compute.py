"""Compute in dense-forward tokens (SPEC section 5), one formula per quantity.

A forward pass of the whole model over one token is 1. A training step's cost follows from what it
runs (`train_token_cost`): the forward; activation gradients from the loss down to the first trained
layer (about one forward over that depth: lm_head and the decoder layers at or above it); weight
gradients for the trained parameters (about one forward over their share of the forward's matmul
weights); and, for distillation, the dense teacher's forward. The shares come from the model's own
parameter counts (plan/shape.py), so a full-weight step is 3 (SPEC's heal token), a tail heal of
lm_head + 3 layers about 1.7 on SmolLM2-135M, LoRA about 2. The least-squares fit's float64 sums and
solves and the cosine fit's Gauss-Newton steps are counted from their FLOPs (`fit_solve_cost`).

What each selection spends is counted where it runs (methods.stage1_cost, selectors.sleb_cost); this
module adds recovery to it and turns a compute difference into heal steps, so every table, plot and
equal-compute row uses one rule.
"""

from __future__ import annotations

import functools
import math

from trsp_ray.config import registry
from trsp_ray.method.recipes import MAP_RECIPE, TAIL_RECIPE
from trsp_ray.plan.shape import Shape

# A float64 FLOP against the forward's (bf16) FLOP on the data-centre GPUs the fits run on at scale:
# A100 19.5 vs 312 TFLOP/s, H100/H200 67 vs 989 (tensor cores, dense). The fits' sums, solves and
# Gauss-Newton steps run in float64 on the map's device, so their FLOPs count 16 times a forward's.
FLOAT64_SLOWDOWN = 16.0
# The dense original's forward per token of a distillation step: the teacher runs the whole depth.
KD_TEACHER = 1.0
# The cosine fit per block (compensation_cosine.py), FLOPs per token in units of hidden^2: its
# curvature pass 2 matmuls (x T0, w^T w), each step 4 (the gradient's x T and x^T(.), the ladder's
# x T and x step); per block in hidden^3: a Cholesky 1/3, each step's cholesky_solve 2.
COSINE_CURVATURE, COSINE_STEP = 4.0, 8.0
COSINE_FACTOR, COSINE_SOLVE = 1.0 / 3.0, 2.0
# The least-squares sums per block (compensation._add: M^T M and M^T Y), 2 matmuls per token, and its
# solve (a Cholesky and two triangular solves of hidden columns) per block in hidden^3.
LSTSQ_SUMS, LSTSQ_SOLVE = 4.0, 1.0 / 3.0 + 2.0


def forward_weights(shape: Shape, *, kept_layers: int | None = None) -> float:
    """Matmul weights one token's forward multiplies by (FLOPs / 2): the decoder layers and lm_head
    (the input embedding is a lookup). Attention's score FLOPs are left out (about 4% of a layer at
    SmolLM2's 256-token windows and Llama-2-70B's 4k)."""
    c = shape.counts
    return (shape.layers if kept_layers is None else kept_layers) * c.layer + c.head


def train_token_cost(shape: Shape, *, recipe: str, kept_layers: int, first_trained: int = 0, tail_layers: int = 3,
                     lora_rank: int = 8, maps: int = 0, kd: bool = False) -> float:
    """Dense-forward tokens of one trained token of a model of `kept_layers` decoder layers (shape's
    sizes) training `recipe` (heal.py's: all | lora | tail | map; `maps` the map recipe's layers, the
    lowest at kept index `first_trained`; `kd`: distillation from the dense original).

    The trained model's forward counts as a whole dense forward (an upper bound for a pruned model;
    SPEC's heal token stays 3); the backward's shares are of that forward's matmul weights."""
    c = shape.counts
    forward = forward_weights(shape, kept_layers=kept_layers)
    if recipe == TAIL_RECIPE:
        depth, trained = tail_layers, shape.recipe_params(recipe, kept_layers=kept_layers, tail_layers=tail_layers)
    elif recipe == MAP_RECIPE:
        depth, trained = kept_layers - first_trained, maps * c.mlp_out
    elif recipe == "lora":
        depth, trained = kept_layers, shape.recipe_params(recipe, kept_layers=kept_layers, lora_rank=lora_rank)
    else:  # all: every matmul weight (the embedding's gradient is a scatter, not a matmul)
        depth, trained = kept_layers, forward
    activations = (c.head + depth * c.layer) / forward
    return 1.0 + activations + trained / forward + (KD_TEACHER if kd else 0.0)


def fit_solve_cost(shape: Shape, *, tokens: float, blocks: int, cosine_steps: int | list[int] | None = None) -> float:
    """Dense-forward tokens of a least-squares fit's float64 work besides its forward passes (which
    compensation.cost counts): per block its sums over `tokens` calibration tokens and its solve, and
    for the cosine objective (`cosine_steps`: Gauss-Newton steps per block, one int for every block)
    the curvature pass and the steps over the cached rows; FLOPs x FLOAT64_SLOWDOWN over a dense
    forward's FLOPs per token."""
    d = float(shape.hidden)
    flops = blocks * (LSTSQ_SUMS * d * d * tokens + LSTSQ_SOLVE * d ** 3)
    if cosine_steps is not None:
        steps = [cosine_steps] * blocks if isinstance(cosine_steps, int) else list(cosine_steps)
        flops += sum(COSINE_CURVATURE * d * d * tokens + COSINE_FACTOR * d ** 3
                     + s * (COSINE_STEP * d * d * tokens + COSINE_SOLVE * d ** 3) for s in steps)
    return flops * FLOAT64_SLOWDOWN / (2.0 * forward_weights(shape))


@functools.lru_cache(maxsize=16)
def model_shape(model: str) -> Shape:
    """plan/shape.py's Shape of `model` (a --model value), from its config.json; cached per name."""
    from trsp_ray.data import assets
    from trsp_ray.plan.shape import read_shape

    return read_shape(assets.resolve_model(model))


def token_cost(cfg, *, spec: registry.Method, drop: list[int] | None = None, trainable: str | None = None,
               lora_rank: int | None = None, stage2: bool | None = None, map_layers: list[int] | None = None) -> float:
    """Dense-forward tokens of one token `cfg`'s pipeline trains (train_token_cost on cfg.model's
    shape): stage 2's on the whole gated model when it runs (`stage2` overrides), else its heal's on
    the model pruned of `drop` (n_drop layers when None), with recovery.objective's teacher. A map heal
    trains the maps of `drop`'s blocks (`map_layers`: their kept indices, as the fold reported them),
    n_drop maps from the bottom when neither is known. `trainable` / `lora_rank` override the recipe
    (a heal config given to methods.apply_method). `spec`: the pipeline's resolved registry entry
    (run.pipeline.Pipeline.spec), whose stage2 and heal say what trains."""
    from trsp_ray.config.run_config import heal_recipe
    from trsp_ray.method.boundaries import blocks, fold_layers
    from trsp_ray.method.stage1 import n_drop_for

    shape = model_shape(cfg.model)
    kd = cfg.recovery.objective == "kd"
    if (spec.stage2 and cfg.stage2.enabled) if stage2 is None else stage2:
        return train_token_cost(shape, recipe=trainable or cfg.stage2.trainable, kept_layers=shape.layers,
                                lora_rank=lora_rank or cfg.stage2.lora_rank, kd=kd)
    recipe, rank = heal_recipe(cfg, heal_method=spec.heal)
    n_drop = len(drop) if drop is not None else n_drop_for(cfg.ratio, shape.layers)
    if map_layers is None and drop is not None:
        kept = [i for i in range(shape.layers) if i not in set(drop)]
        map_layers = [kept.index(i) for i in fold_layers(blocks(drop, shape.layers))]
    maps = map_layers if map_layers is not None else [0] * n_drop
    return train_token_cost(shape, recipe=trainable or recipe, kept_layers=shape.layers - n_drop,
                            first_trained=min(maps, default=0), tail_layers=cfg.heal.tail_layers,
                            lora_rank=lora_rank or rank, maps=len(maps), kd=kd)


def step_cost(cfg, *, spec: registry.Method, drop: list[int] | None = None, trainable: str | None = None) -> float:
    """Dense-forward tokens of one training step of `cfg`'s pipeline (`spec`, its resolved registry
    entry; `trainable` overrides its recipe): its trained tokens per step (stage 2's data.batch_size x
    data.seqlen, a heal's heal_shape) at token_cost each (what a --compute-budget buys steps with)."""
    if spec.stage2 and cfg.stage2.enabled:
        tokens = cfg.data.batch_size * cfg.data.seqlen
    else:
        seqlen, batch = heal_shape(cfg)
        tokens = seqlen * batch
    return token_cost(cfg, spec=spec, drop=drop, trainable=trainable) * tokens


# The heal's windows as its compute budget grows, where heal.seqlen / heal.batch_size are 0: (budget
# from, sequence length, batch as a multiple of data.batch_size). Long-range cloze (LAMBADA's last
# word depends on a passage of ~80 words) is learned only from windows that hold such passages, so a
# heal that can afford it trains on 512 tokens and more; larger batches keep a long heal's steps
# stable. Below the first row (today's default budget, ~70k) the heal keeps data.seqlen and batch.
HEAL_SHAPES = ((200e3, 512, 1), (1e6, 512, 2), (10e6, 1024, 4), (100e6, 2048, 8))


def heal_shape(cfg) -> tuple[int, int]:
    """(sequence length, batch size) of the heal's windows: heal.seqlen / heal.batch_size when set,
    else HEAL_SHAPES' row for heal.compute_budget (data.seqlen / data.batch_size below it or without a
    budget), the length capped at the model's max_position_embeddings."""
    h, d = cfg.heal, cfg.data
    seqlen, scale = d.seqlen, 1
    for start, length, times in HEAL_SHAPES:
        if h.compute_budget >= start:
            seqlen, scale = max(d.seqlen, length), times
    if not h.seqlen and seqlen > d.seqlen:
        seqlen = min(seqlen, _max_positions(cfg.model) or seqlen)
    return h.seqlen or seqlen, h.batch_size or d.batch_size * scale


# The heal's learning rate grows with the batch a budget sizes (HEAL_SHAPES: the linear scaling rule),
# at most this much: at 1M (batch 2x) SmolLM2's heal at 2x stage2.lr lowered every domain's held-out
# perplexity (wiki 32.10 -> 30.78, code 6.94 -> 6.51, prose 19.04 -> 17.10) and raised LAMBADA 0.182 ->
# 0.192 (docs/results.md); larger factors are not measured, so larger batches keep 2x
MAX_HEAL_LR_SCALE = 2.0


def heal_lr_scale(cfg) -> float:
    """The factor on stage2.lr of a heal method's heal: its batch over data.batch_size where the budget
    sized the batch (heal.batch_size 0), capped at MAX_HEAL_LR_SCALE; 1 for a configured batch."""
    if cfg.heal.batch_size:
        return 1.0
    return min(heal_shape(cfg)[1] / cfg.data.batch_size, MAX_HEAL_LR_SCALE)


def heal_reads_stream(cfg) -> bool:
    """Whether the heal reads the heal stream (data/stream.HealStream; workbench.heal_stream): from
    the first budget of HEAL_SHAPES, or with heal.seqlen / heal.batch_size set. Below it a short heal
    reads the calibration mixture's training.Batches."""
    h = cfg.heal
    return h.compute_budget >= HEAL_SHAPES[0][0] or bool(h.seqlen or h.batch_size)


def heal_teacher(cfg) -> str | None:
    """Where a heal's distillation teacher comes from: None (recovery.objective=ce); "stored"
    (run/teacher_store.py: the dense model's top-k records, computed once per heal stream and read
    by every row); "live" (training.DistillLoss: the dense model beside the student, full vocabulary).
    recovery.teacher=auto is stored for heals that read the heal stream with kd_topk >= 1. Stage 2
    always distils live (it reads training.Batches)."""
    from trsp_ray.common.errors import TrspError

    r = cfg.recovery
    if r.objective != "kd":
        return None
    if r.teacher == "stored" and not heal_reads_stream(cfg):
        raise TrspError(f"recovery.teacher=stored needs a heal that reads the heal stream, and "
                        f"heal.compute_budget={cfg.heal.compute_budget:g} heals on the calibration mixture; set "
                        f"heal.compute_budget >= {HEAL_SHAPES[0][0]:g} (or heal.seqlen), or recovery.teacher=auto|live")
    if r.teacher == "live" or r.kd_topk == 0:
        return "live"
    return "stored" if heal_reads_stream(cfg) else "live"


def heal_schedule(h) -> str:
    """heal.schedule of heal section `h` resolved: auto is cosine where the budget grew the heal's
    windows (HEAL_SHAPES), else constant."""
    if h.schedule != "auto":
        return h.schedule
    return "cosine" if h.compute_budget >= HEAL_SHAPES[0][0] else "constant"


def _max_positions(model: str) -> int | None:
    import json

    config = json.loads(model_shape(model).config or "{}")
    return config.get("max_position_embeddings") or config.get("n_positions")


def solve_cost(cfg, comp, *, tokens: float, blocks: int, cosine_steps: list[int] | None = None) -> float:
    """fit_solve_cost of the fit `comp` (a resolved CompensationConfig) on cfg.model: least squares
    over `blocks` blocks, the cosine objective at `cosine_steps` per block (COSINE_STEPS, the fit's
    bound, when None); 0 for the scalar fold (six float64 sums per token of hidden length) and none."""
    if comp.method != "lstsq" or not blocks:
        return 0.0
    if comp.objective == "cosine" and cosine_steps is None:
        from trsp_ray.method.compensation_cosine import COSINE_STEPS

        cosine_steps = [COSINE_STEPS] * blocks
    return fit_solve_cost(model_shape(cfg.model), tokens=tokens, blocks=blocks,
                          cosine_steps=cosine_steps if comp.objective == "cosine" else None)


def measured_solve_cost(cfg, comp, done: dict) -> float:
    """solve_cost of a fit that ran (compensation.compensate's result `done`): every block's
    Gauss-Newton passes as run (a fit that stops on its tolerance runs no pass after its last step). A
    fit stored before its passes were recorded is charged its steps plus one, at most the bound."""
    from trsp_ray.method.compensation_cosine import COSINE_STEPS

    steps = (done["cosine_passes"] if "cosine_passes" in done else
             [min(s + 1, COSINE_STEPS) for s in done["cosine_steps"]] if "cosine_steps" in done else None)
    return solve_cost(cfg, comp, tokens=done["tokens"], blocks=len(done["blocks"]), cosine_steps=steps)


def train_spent(info: dict) -> float:
    """Dense-forward tokens a row's training spent: stage 2's and the heal's (methods.apply_method)."""
    return info.get("stage2_cost", 0.0) + info.get("heal_cost", 0.0)


def fit_spent(info: dict) -> float:
    """Dense-forward tokens a row's fit spent: its passes (compensation_cost) and its float64 solve, or a
    merge's (run/merging.py: merge_cost, merge_solve_cost)."""
    return sum(info.get(k, 0.0) for k in ("compensation_cost", "compensation_solve_cost", "merge_cost",
                                          "merge_solve_cost"))


def recovery_cost(info: dict) -> float:
    """Dense-forward tokens a row spent after its selection: training and fit."""
    return train_spent(info) + fit_spent(info)


def total_cost(info: dict) -> float:
    """Selection + recovery, dense-forward tokens."""
    return info.get("select_cost", 0.0) + recovery_cost(info)


def extra_heal_steps(extra_cost: float, *, step_cost: float) -> int:
    """Heal steps of `step_cost` dense-forward tokens each that spend `extra_cost` (rounded to the
    nearest step, never negative): what a cheaper selection gets to reach another row's total compute."""
    if step_cost <= 0:
        raise ValueError(f"step_cost={step_cost} must be > 0")
    return max(0, round(extra_cost / step_cost))


_UNITS = ((1e9, "B"), (1e6, "M"), (1e3, "k"), (1.0, ""))


def tokens_text(tokens: float, *, up: bool = False) -> str:
    """A dense-forward token count as people read it, to three figures: 192, 12.3k, 1.22M, 3B; `up` rounds
    up (a least budget that, passed back, is enough)."""
    i = next((i for i, (scale, _) in enumerate(_UNITS) if tokens >= scale), len(_UNITS) - 1)
    value = tokens / _UNITS[i][0]
    if value > 0:
        digits = 10.0 ** (2 - math.floor(math.log10(value)))
        value = (math.ceil if up else round)(value * digits) / digits
    if value >= 1000 and i > 0:  # 999.6k rounds to 1M
        value, i = value / 1000, i - 1
    return f"{value:g}{_UNITS[i][1]}"


def least_budget(cfg, *, spec: registry.Method, select: float, comp: float, drop: list[int] | None = None) -> float:
    """The least heal.compute_budget that buys one heal step after `select` and `comp`: a step is priced at that
    budget, not at cfg's, since its cost grows with the budget (HEAL_SHAPES)."""
    from trsp_ray.config.run_config import replace

    least = select + comp
    for _ in range(len(HEAL_SHAPES) + 1):  # a step that crosses a shape's threshold is priced at the next shape
        step = step_cost(replace(cfg, **{"heal.compute_budget": least}), spec=spec, drop=drop)
        if least >= select + comp + step:
            return least
        least = select + comp + step
    return least


def heal_steps(cfg, *, spec: registry.Method, select: float, comp: float, drop: list[int] | None = None) -> int:
    """Heal steps heal.compute_budget leaves after a selection and a fit (a compensation or a merge) costing
    `select` and `comp` dense-forward tokens (the search calls it with a selection's measured cost and its
    `drop`), each step at its recipe's cost (compute.step_cost); a one-line TrspError when not even one step
    is left, naming the least budget that buys one."""
    from trsp_ray.common.errors import TrspError

    budget, step = cfg.heal.compute_budget, step_cost(cfg, spec=spec, drop=drop)
    steps = int((budget - select - comp) // step)
    if steps < 1:
        fit = "the merge" if spec.merges else "compensation"
        raise TrspError(f"heal.compute_budget={tokens_text(budget)} dense-forward tokens cannot meet {cfg.method}: its "
                        f"selection costs {tokens_text(select)}, {fit} {tokens_text(comp)} and one heal step "
                        f"{tokens_text(step)}; raise it to at least "
                        f"{tokens_text(least_budget(cfg, spec=spec, select=select, comp=comp, drop=drop), up=True)}")
    return steps
