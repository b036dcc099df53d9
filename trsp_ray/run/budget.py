"""A total compute budget for `prune` (heal.compute_budget, in dense-forward tokens, SPEC section 5):
a heal method's heal gets the steps that the budget leaves after its selection's and its
compensation's planned cost, so a user asks for "this much compute" and gets the most heal it buys.

The planned costs are the ones the comparison reports (compute.py, methods.select): ShortGPT's Block
Influence is one forward over its windows, SLEB's the prefix-replay count of selectors.sleb_cost, a
random selection nothing, a compensation at most one whole forward over its calibration windows.
TRSP's stage 1 spends an amount known only after it runs (its probes and refinement stop early),
so a budget is refused for it rather than overrun. A heal step costs what its recipe runs
(compute.train_token_cost: a tail or map heal, LoRA and a distillation's teacher priced apart) and a
fit its float64 solve besides its passes (compute.fit_solve_cost). `resolve` turns the budget into
stage2.steps (what a heal method heals with, methods.method_heal) before the route is planned, so
the single process and the Ray Train workers run the same number of steps and the manifest records both.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from trsp_ray.common.errors import TrspError
from trsp_ray.config import registry
from trsp_ray.plan import compute
from trsp_ray.plan.compute import heal_steps


def planned_select_cost(cfg, *, spec: registry.Method, num_layers: int) -> float | None:
    """Dense-forward tokens the selection of `cfg`'s pipeline (`spec`, its resolved registry entry)
    will spend; None when it is not known before the selection runs (TRSP's stage 1)."""
    from trsp_ray.method.selectors import sleb_cost
    from trsp_ray.method.stage1 import candidate_layers, n_drop_for
    from trsp_ray.run.methods import shortgpt_windows

    n_drop = n_drop_for(cfg.ratio, num_layers)
    seqlen = cfg.data.seqlen
    if spec.selector in (registry.SHORTGPT_SELECTOR, registry.ANGULAR_SELECTOR, registry.MERGE_SELECTOR):  # a forward
        return float(shortgpt_windows(cfg, n_drop) * seqlen)
    if spec.selector == registry.SLEB_SELECTOR:
        g = cfg.gates
        candidates = candidate_layers(num_layers, protect_head=g.protect_head, protect_tail=g.protect_tail)
        return sleb_cost(num_layers=num_layers, candidates=candidates, n_drop=n_drop,
                         tokens=cfg.baselines.sleb_windows * seqlen)
    if spec.selector in (registry.RANDOM_SELECTOR, registry.TAIL_SELECTOR):
        return 0.0
    if spec.selector == registry.RECOVER_SELECTOR:  # every trial run to its last step: what it may spend
        return audition_plan(cfg, spec=spec, num_layers=num_layers).total
    return None


def planned_compensation_cost(cfg, *, spec: registry.Method, num_layers: int) -> float:
    """An upper bound of a fit's cost before the drop set is known: its passes ("dense" and the scalar
    fold one pass over the calibration tokens, stopping after the last block; "sequential" per block
    a dense pass to its end and a pruned pass to its boundary, each at most the whole depth, for at
    most n_drop blocks) and a least-squares fit's float64 solve for n_drop blocks, the cosine
    objective's at every Gauss-Newton step it may take (compute.fit_solve_cost); a merge's, its own
    (merging.planned_cost)."""
    from trsp_ray.config.run_config import for_method
    from trsp_ray.method.stage1 import n_drop_for

    c = for_method(cfg).compensation  # the compensation the method runs (auto resolved)
    if spec.merges:  # a merge's scoring and refit passes and its refits' solves
        from trsp_ray.run.merging import planned_cost

        return planned_cost(cfg, compute.model_shape(cfg.model), n_pairs=n_drop_for(cfg.ratio, num_layers))
    if c.method == "none":
        return 0.0
    tokens = float(c.windows * cfg.data.seqlen)
    n_drop = n_drop_for(cfg.ratio, num_layers)
    passes = 2.0 * n_drop * tokens if c.activations == "sequential" and c.method != "scalar" else tokens
    return passes + compute.solve_cost(cfg, c, tokens=tokens, blocks=n_drop)


def fit_cost(cfg, *, spec: registry.Method, drop: list[int], num_layers: int) -> float:
    """Dense-forward tokens the fit `cfg` runs (compensation resolved, windows sized) spends on `drop`:
    its passes (compensation.cost) and its float64 solve (the cosine objective's at every step it may
    take); 0 without a fit."""
    from trsp_ray.method import compensation

    c = cfg.compensation
    if spec.merges:  # the merge is a merge pipeline's fit
        from trsp_ray.run.merging import drop_cost

        return drop_cost(cfg, drop=drop, num_layers=num_layers)
    if c.method == "none":
        return 0.0
    tokens = c.windows * cfg.data.seqlen
    passes = compensation.cost(drop=drop, num_layers=num_layers, tokens=tokens, activations=c.activations)
    return passes + compute.solve_cost(cfg, c, tokens=tokens, blocks=len(compensation.blocks(drop, num_layers)))


def resolve(cfg, *, spec: registry.Method, num_layers: int):
    """`cfg` with heal.compute_budget turned into the heal's steps (stage2.steps; heal.steps 0), or
    unchanged without a budget; `spec`: its pipeline's registry entry. One-line TrspError for a
    budget the selection cannot meet, or a method it cannot apply to, before any work."""
    budget = cfg.heal.compute_budget
    if not budget:
        return cfg
    if not spec.heal:
        heals = ", ".join(m.name for m in registry.METHODS.values() if m.heal)
        raise TrspError(f"heal.compute_budget={budget:g} is spent on a heal, and method={cfg.method!r} does not "
                        f"heal; use one of {heals}")
    select = planned_select_cost(cfg, spec=spec, num_layers=num_layers)
    if select is None:
        raise TrspError(f"heal.compute_budget={budget:g} cannot be planned for method={cfg.method!r}: its stage-1 "
                        "selection's cost is known only after it runs; set stage2.steps instead, or use "
                        f"{registry.DEFAULT_METHOD}")
    comp = planned_compensation_cost(cfg, spec=spec, num_layers=num_layers)
    try:
        return with_heal_steps(cfg, heal_steps(cfg, spec=spec, select=select, comp=comp))
    except TrspError as refused:
        cheaper = _cheaper_merge(cfg, spec=spec, select=select, num_layers=num_layers)
        if not cheaper:
            raise
        raise TrspError(f"{refused}{cheaper}") from None


def _cheaper_merge(cfg, *, spec: registry.Method, select: float, num_layers: int) -> str:
    """For a merge whose attention units are chosen by trial (merging.units=loss), the setting that skips
    the trials and the least budget it needs, as a refusal's tail; "" otherwise."""
    from trsp_ray.config.run_config import replace

    if not spec.merges or cfg.merging.units == "energy":
        return ""
    energy = replace(cfg, **{"merging.units": "energy"})
    least = compute.least_budget(energy, spec=spec, select=select,
                                 comp=planned_compensation_cost(energy, spec=spec, num_layers=num_layers))
    return (f", or choose the attention units by energy (--set merging.units=energy, no trials) and give it at "
            f"least {compute.tokens_text(least, up=True)}")


def with_heal_steps(cfg, steps: int):
    """`cfg` whose heal method heals `steps` steps (stage2.steps, what methods.method_heal reads; heal.steps 0)."""
    from trsp_ray.config.run_config import replace

    return replace(cfg, **{"stage2.steps": steps, "heal.steps": 0})


@dataclass(frozen=True)
class Budget:
    """Where a run's compute goes, in dense-forward tokens, split once from the resolved pipeline and
    the model's shape (`split`) and handed to the plan, the log, the manifest and the report: the
    selection (None for TRSP's stage 1, known only after it runs), the fit, the distillation
    teacher's forward over the heal's tokens, the student's heal steps, and the heal's windows."""

    total: float | None  # what was asked for (heal.compute_budget; None: steps were configured)
    selection: float | None
    fit: float
    teacher: float
    heal: float  # the student's forward and backward of every heal step (the teacher apart)
    steps: int
    seqlen: int
    batch: int

    @property
    def tokens(self) -> int:
        """Tokens the heal trains on."""
        return self.steps * self.seqlen * self.batch

    @property
    def spent(self) -> float | None:
        """Selection + fit + teacher + heal (None while the selection's cost is unknown)."""
        return None if self.selection is None else self.selection + self.fit + self.teacher + self.heal

    def as_dict(self) -> dict:
        return {**asdict(self), "tokens": self.tokens, "spent": self.spent}

    def describe(self) -> str:
        """One line for the log."""
        asked = f"compute budget {self.total / 1e3:.1f}k" if self.total else "compute"
        select = "unknown until it runs" if self.selection is None else f"{self.selection / 1e3:.1f}k"
        return (f"{asked} dense-forward tokens: selection {select}, fit {self.fit / 1e3:.1f}k"
                + (f", teacher {self.teacher / 1e3:.1f}k" if self.teacher else "")
                + f", heal {self.steps} steps of {self.batch} x {self.seqlen} tokens ({self.heal / 1e3:.1f}k)")


def split(cfg, *, spec: registry.Method, num_layers: int, steps: int) -> Budget:
    """The Budget of `cfg` (resolved: a budget already turned into `steps`, pipeline.training_steps,
    by `resolve`) on a model of `num_layers` layers."""
    seqlen, batch = compute.heal_shape(cfg) if not (spec.stage2 and cfg.stage2.enabled) else (
        cfg.data.seqlen, cfg.data.batch_size)
    trained = compute.step_cost(cfg, spec=spec) * steps
    teacher = compute.KD_TEACHER * steps * seqlen * batch if cfg.recovery.objective == "kd" and steps else 0.0
    return Budget(total=cfg.heal.compute_budget or None,
                  selection=planned_select_cost(cfg, spec=spec, num_layers=num_layers),
                  fit=planned_compensation_cost(cfg, spec=spec, num_layers=num_layers), teacher=teacher,
                  heal=trained - teacher, steps=steps, seqlen=seqlen, batch=batch)


@dataclass(frozen=True)
class AuditionPlan:
    candidates: int  # trials at most (planned_candidates: equal sets run once)
    steps: int  # heal steps a trial runs at most
    forward: float  # the candidates' dense forwards
    fit: float  # one candidate's fit, at most
    step: float  # one trial step
    report: float  # one validation report
    reports: int
    every: int  # steps between reports

    @property
    def trial(self) -> float:
        """One trial run to its last step."""
        return self.fit + self.steps * self.step + self.reports * self.report

    @property
    def total(self) -> float:
        return self.forward + self.candidates * self.trial


def audition_plan(cfg, *, spec: registry.Method, num_layers: int) -> AuditionPlan:
    """The audition `cfg` (a `recover` pipeline `spec`) runs on a model of `num_layers` layers."""
    from trsp_ray.config.run_config import trial_config
    from trsp_ray.method import candidates as cands
    from trsp_ray.method.stage1 import n_drop_for
    from trsp_ray.run.audition_plan import MIN_STEPS
    from trsp_ray.run.methods import shortgpt_windows

    s = cfg.selection
    names = cands.parse(s.candidates)
    n_drop = n_drop_for(cfg.ratio, num_layers)
    count = planned_candidates(cfg, names, n_drop=n_drop, num_layers=num_layers)
    forward = len(cands.needs_forward(names)) * float(shortgpt_windows(cfg, n_drop) * cfg.data.seqlen)
    from trsp_ray.config.run_config import sized

    tcfg = sized(trial_config(cfg), hidden=compute.model_shape(cfg.model).hidden)  # the fit as the trials size it
    fit = planned_compensation_cost(tcfg, spec=spec, num_layers=num_layers) if spec.compensate else 0.0
    step = compute.step_cost(tcfg, spec=spec)
    report = float(s.val_windows * (cfg.data.seqlen + 1))
    steps = s.steps
    budget = cfg.heal.compute_budget
    if budget:
        left = s.share * budget - forward - count * (fit + s.reports * report)
        steps = int(left // (count * step)) if left > 0 else 0
        if steps < MIN_STEPS:
            need = forward + count * (fit + s.reports * report + MIN_STEPS * step)
            raise TrspError(f"heal.compute_budget={budget:g} gives the selection by recovery "
                            f"{s.share * budget:g} dense-forward tokens (selection.share={s.share:g}), and its "
                            f"{count} candidates need {need:g} for {MIN_STEPS} heal steps each; raise the "
                            f"budget to at least {math.ceil(need / s.share):g}, raise selection.share or name fewer "
                            "selection.candidates")
    reports = min(s.reports, steps)
    return AuditionPlan(candidates=count, steps=steps, forward=forward, fit=fit, step=step, report=report,
                        reports=reports, every=max(1, -(-steps // reports)))


def planned_candidates(cfg, names: list[str], *, n_drop: int, num_layers: int) -> int:
    """Trials the audition may run: every candidate a forward chooses, and the distinct sets of those
    that need none (with the last layer protected the tail cut is block-1's set: one trial)."""
    from trsp_ray.method import candidates as cands
    from trsp_ray.method.stage1 import candidate_layers

    g = cfg.gates
    allowed = candidate_layers(num_layers, protect_head=g.protect_head, protect_tail=g.protect_tail)
    forward = [n for n in names if cands.needs_forward([n])]
    fixed = cands.drop_sets([n for n in names if n not in forward], n_drop=n_drop, num_layers=num_layers,
                            candidates=allowed)
    return max(1, len(forward) + len(fixed))
