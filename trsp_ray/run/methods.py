"""Every method through one code path: select the drop set, recover (TRSP's stage 2 and/or a heal),
remove. TRSP and its ablations, ShortGPT, SLEB and random differ only in `select` (see registry.py); a
merge removes its drop set by merging each dropped layer into the one before it (run/merging.py).

Selection cost is counted in dense-forward tokens: a forward pass of the whole model over one token
is 1; a backward pass that needs only activation gradients (frozen weights) counts as 1 more, one
that also needs weight gradients as 2; a pass through a fraction of the layers counts that fraction.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass, field

from trsp_ray.common.logs import log as _log
from trsp_ray.config import registry
from trsp_ray.config.run_config import for_method, sized
from trsp_ray.method import compensation
from trsp_ray.method.boundaries import fold_layers
from trsp_ray.method.gates import attach_gates
from trsp_ray.method.heal import run_heal
from trsp_ray.method.probes import RemovalScorer, common_tokens
from trsp_ray.method.stage1 import Stage1Result, run_stage1, stage1_cost
from trsp_ray.method.stage2 import run_stage2
from trsp_ray.method.surgery import remove_layers
from trsp_ray.method.training import (
    FIT_STREAM,
    HEAL_STREAM,
    SELECTION_STREAM,
    STAGE1_STREAM,
    STAGE2_STREAM,
    DistillLoss,
    Report,
    TorchStepper,
    null_report,
)
from trsp_ray.models import families
from trsp_ray.plan import compute
from trsp_ray.plan.merge_plan import merge_windows
from trsp_ray.run.heal_store import heal_checkpoints, stage2_checkpoints
from trsp_ray.run.merging import heal_left, merge_layers
from trsp_ray.run.teacher_store import stored_objective
from trsp_ray.run.workbench import heal_stream


@dataclass
class Outcome:
    method: str
    model: object  # the pruned (and possibly trained) model, gates detached
    drop: list[int]  # original indices, in drop order
    kept: list[int]
    info: dict = field(default_factory=dict)  # tokens, steps, seconds, stage-2 relative updates


def stage1_settings(s1) -> dict:
    """`run_stage1`'s keyword arguments from the `stage1` section: one unpacking for both paths, so they agree."""
    return {"lambda1": s1.lambda1, "lr": s1.lr, "first_round_steps": s1.first_round_steps,
            "steps_per_round": s1.steps_per_round, "selection": s1.selection, "train_base": s1.train_base,
            "base_lr": s1.base_lr, "probe": s1.probe, "refine": s1.refine, "refine_budget": s1.refine_budget,
            "shortlist_bi": s1.shortlist_bi}


def probes_removal(s1) -> bool:
    """Whether stage 1 measures the removal cost of its smallest gates (iterative selection only)."""
    return s1.probe > 1 and s1.selection == "iterative"


def stage2_settings(s2) -> dict:
    """`run_stage2`'s keyword arguments from the `stage2` config section."""
    return {"lambda2": s2.lambda2, "steps": s2.steps, "lr": s2.lr, "p_lr_scale": s2.p_lr_scale, "mode": s2.mode,
            "norm": s2.norm, "trainable": s2.trainable, "lora_rank": s2.lora_rank, "schedule": s2.schedule,
            "anneal_fraction": s2.anneal_fraction}


def heal_settings(heal) -> dict:
    """`run_heal`'s budget and recipe from a `heal` section (cfg.heal, or method_heal's): both paths heal so."""
    return {"steps": heal.steps, "lr": heal.lr, "trainable": heal.trainable, "lora_rank": heal.lora_rank,
            "tail_layers": heal.tail_layers, "schedule": compute.heal_schedule(heal)}


def run_stage1_for(bench, *, model=None, n_drop: int | None = None, report: Report = null_report,
                   on_round=None, resume=None) -> Stage1Result:
    """Stage 1 with the run's config on `model` (default: a fresh copy) for `n_drop` layers
    (default: the run's ratio); gates are left attached."""
    cfg = bench.cfg
    model = model if model is not None else bench.fresh_model()
    gates = attach_gates(model, gate_mode=cfg.gates.gate)
    s1 = cfg.stage1
    n_drop = bench.n_drop() if n_drop is None else n_drop
    rounds = 1 if s1.selection == "oneshot" else n_drop

    def progress(metrics: dict, step: int) -> None:
        report(metrics, step)
        if "stage1/loss" in metrics:
            _log(f"  stage 1 step {step}: loss {metrics['stage1/loss']:.4f} (CE {metrics['stage1/ce']:.4f}, "
                 f"sum|s| {metrics['stage1/penalty']:.2f})")
        if "stage1/refine_calls_so_far" in metrics:
            _log(f"  stage 1 refinement: {metrics['stage1/refine_calls_so_far']} of at most {s1.refine_budget} "
                 f"scorer calls, {metrics['stage1/swaps_so_far']} swap(s) so far")
        if "stage1/swaps" in metrics:
            _log(f"  stage 1 refinement: {metrics['stage1/swaps']} swap(s) lowered the measured removal cost; "
                 f"{metrics['stage1/refine_calls']} of {s1.refine_budget} scorer calls "
                 f"({metrics['stage1/refine_cost']:,} dense-forward tokens)")
        if "stage1/rounds_done" in metrics:
            _log(f"  stage 1 round {metrics['stage1/rounds_done']}/{rounds}: drop layer {metrics['stage1/dropped']}")

    scorer, influence, spent = None, None, 0
    if probes_removal(s1):
        windows = probe_windows(bench.calib_ids, s1=s1, data=cfg.data, seed=cfg.seed, bos=bench.bos,
                                strata=bench.calib_strata)
        scorer = RemovalScorer(model=model, gates=gates, windows=windows, criterion=s1.probe_criterion,
                               common=common_tokens(bench.calib_ids) if s1.probe_criterion == "recall" else None)
        if s1.shortlist_bi:
            from trsp_ray.method.selectors import block_influence

            influence, spent = block_influence(model, gates, windows), scorer.tokens
    result = run_stage1(model=model, gates=gates, batches=bench.batches(STAGE1_STREAM), n_drop=n_drop,
                        candidates=bench.candidates(), scorer=scorer, report=progress, on_round=on_round,
                        resume=resume, influence=influence, **stage1_settings(s1))
    result.probe_cost += spent  # Block Influence's dense forward of the probe windows
    return result


def probe_windows(ids, *, s1, data, seed: int, bos: int | None, strata=None) -> list:
    """The removal probes' fixed calibration windows (stage1.probe_windows of stage1.probe_seqlen
    tokens, default data.seqlen), as chunks of about data.batch_size x data.seqlen tokens: one
    definition for the single process and the Ray Train workers."""
    from trsp_ray.method.training import PROBE_STREAM, Batches

    seqlen = s1.probe_seqlen or data.seqlen
    chunk = max(1, data.batch_size * data.seqlen // seqlen)
    stream = Batches(ids, seqlen=seqlen, batch_size=chunk, seed=seed + PROBE_STREAM, bos=bos, strata=strata)
    return fixed_windows(stream, s1.probe_windows)


def stage1_tokens_for(cfg, n_drop: int) -> int:
    """Calibration tokens stage 1 sees with the run's config, probe windows included (what ShortGPT
    is given by default)."""
    s1, d = cfg.stage1, cfg.data
    rounds = 1 if s1.selection == "oneshot" else n_drop
    steps = s1.first_round_steps + (rounds - 1) * s1.steps_per_round
    probes = s1.probe_windows * (s1.probe_seqlen or d.seqlen) if probes_removal(s1) else 0
    return steps * d.batch_size * d.seqlen + probes


def shortgpt_windows(cfg, n_drop: int) -> int:
    """Calibration windows ShortGPT scores Block Influence on: baselines.calib_windows, else as many
    tokens as stage 1 would see (one definition for the single process and the Ray Train workers)."""
    return cfg.baselines.calib_windows or -(-stage1_tokens_for(cfg, n_drop) // cfg.data.seqlen)


def _windows(bench, count: int, seed_offset: int = SELECTION_STREAM) -> list:
    """Exactly `count` fixed calibration windows, as batches of at most data.batch_size."""
    return fixed_windows(bench.batches(seed_offset), count)


def fixed_windows(stream, count: int) -> list:
    """The first `count` windows of a batch stream, as batches of at most its batch size (both paths read so)."""
    import torch

    size = stream.batch_size
    stacked = torch.cat([stream.next() for _ in range(-(-count // size))])[:count]
    return list(stacked.split(size))


# audition(bench, spec, model=, gates=) -> (drop, info): a selection by recovery, whose trials run on Ray
# Tune (distributed/audition.py); its callers above this floor hand it in
Audition = Callable[..., tuple[list[int], dict]]


def select(bench, spec: registry.Method, *, model, gates, stage1: Stage1Result | None = None,
           report: Report = null_report, audition: Audition | None = None) -> tuple[list[int], dict]:
    """The drop list of pipeline `spec` (Pipeline.spec) and what choosing it cost (calibration tokens,
    dense-forward tokens).

    TRSP methods reuse a given stage-1 result (one stage-1 run serves every TRSP method and ratio);
    a selection by recovery runs `audition`."""
    from trsp_ray.common.errors import TrspError
    from trsp_ray.method import merge_select, selectors

    n_drop, candidates, cfg = bench.n_drop(), bench.candidates(), bench.cfg
    seqlen = cfg.data.seqlen
    if spec.selector == registry.RECOVER_SELECTOR:
        if audition is None:
            raise TrspError(f"method={spec.name} auditions its candidates as Ray Tune trials, which this path "
                            "cannot start (a search trial or a benchmark row); run it with `trsp-ray prune`")
        return audition(bench, spec, model=model, gates=gates)
    if spec.uses_stage1:
        if stage1 is None:
            stage1 = run_stage1_for(bench, model=model, report=report)
            gates.set_gated(False)
            gates.set_bypass([])
        drop = stage1.drop_for(spec.ranking, n_drop)
        return drop, {"calib_tokens": stage1.tokens + stage1.probe_tokens, "stage1_steps": stage1.steps,
                      "select_cost": stage1_cost(stage1, num_layers=bench.num_layers,
                                                 train_base=cfg.stage1.train_base)}
    if spec.selector == "shortgpt":
        windows = shortgpt_windows(cfg, n_drop)
        drop = selectors.shortgpt_drop(model, gates, _windows(bench, windows), n_drop=n_drop, candidates=candidates)
        return drop, {"calib_tokens": windows * seqlen, "select_cost": float(windows * seqlen)}
    if spec.selector == "sleb":
        windows = cfg.baselines.sleb_windows
        progress = lambda r, n, ppl: _log(f"  SLEB round {r}/{n}: calibration PPL {ppl:.2f}")
        drop = selectors.sleb_drop(model, gates, _windows(bench, windows), n_drop=n_drop, candidates=candidates,
                                   progress=progress)
        cost = selectors.sleb_cost(num_layers=bench.num_layers, candidates=candidates, n_drop=n_drop,
                                   tokens=windows * seqlen)
        return drop, {"calib_tokens": windows * seqlen, "select_cost": cost}
    if spec.selector in (registry.ANGULAR_SELECTOR, registry.MERGE_SELECTOR):  # ShortGPT's windows: one forward
        windows = shortgpt_windows(cfg, n_drop)
        pick = merge_select.merge_drop if spec.merges else selectors.angular_drop  # merge: each pair's 2nd layer
        drop = pick(model, gates, _windows(bench, windows), n_drop=n_drop, candidates=candidates)
        return drop, {"calib_tokens": windows * seqlen, "select_cost": float(windows * seqlen)}
    if spec.selector == registry.TAIL_SELECTOR:
        return selectors.tail_drop(n_drop=n_drop, candidates=candidates), {"calib_tokens": 0, "select_cost": 0.0}
    return selectors.random_drop(n_drop=n_drop, candidates=candidates, seed=cfg.seed), {
        "calib_tokens": 0, "select_cost": 0.0}


def recovery_stepper(bench, *, stream=None, windows: int = 0, model=None):
    """Stage 2's and the heal's stepper factory: CE, or distillation (recovery.objective = kd) from the
    teacher store for a heal `stream` (`windows` of it; compute.heal_teacher), missing shards computed by
    the dense model beside `model` (as the fit's), else from the dense model where the student trains."""
    if bench.cfg.recovery.objective != "kd":
        return TorchStepper
    if stream is not None and compute.heal_teacher(bench.cfg) == "stored":
        dense = lambda: _dense_beside(bench, model, activations="dense")  # noqa: E731
        objective = stored_objective(bench.cfg, stream, windows=windows, dense=dense)
    else:
        objective = DistillLoss(bench.scoring_model().eval(), temperature=bench.cfg.recovery.kd_temperature)
    return functools.partial(TorchStepper, objective=objective)


def _stage2(bench, *, model, gates, drop: list[int], s2, report: Report):
    def progress(metrics: dict, step: int) -> None:
        report(metrics, step)
        if step % 5 == 0 or step == s2.steps:
            _log(f"  stage 2 step {step}/{s2.steps}: {bench.cfg.recovery.objective} {metrics['stage2/ce']:.4f}, "
                 f"penalty {metrics['stage2/penalty']:.3f}, P-layer scale {metrics['stage2/residual_scale']:.2f}")

    return run_stage2(model=model, gates=gates, batches=bench.batches(STAGE2_STREAM), drop=drop,
                      make_stepper=recovery_stepper(bench), report=progress, **stage2_settings(s2),
                      checkpoints=stage2_checkpoints(bench.cfg, s2, model, drop=drop))


def _heal(bench, *, model, heal, report: Report, map_layers=()):
    def progress(metrics: dict, step: int) -> None:
        report(metrics, step)
        if step % 5 == 0 or step == heal.steps:
            _log(f"  heal step {step}/{heal.steps}: {bench.cfg.recovery.objective} {metrics['heal/ce']:.4f}")

    stream = heal_stream(bench.cfg, bench.calibration, bos=bench.bos, seed_offset=HEAL_STREAM, steps=heal.steps)
    make = recovery_stepper(bench, stream=stream, windows=heal.steps * stream.batch_size, model=model)
    return run_heal(model=model, batches=stream, map_layers=map_layers, make_stepper=make, report=progress,
                    checkpoints=heal_checkpoints(bench.cfg, model, heal, map_layers, stream), **heal_settings(heal))


def method_heal(cfg):
    """The heal a heal method (e.g. trsp+heal) runs: stage 2's weight-update budget (stage2.steps
    batches at stage2.lr times compute.heal_lr_scale, stage2.trainable unless heal.trainable names
    another recipe: heal_recipe) on the pruned model, then any heal.steps on top."""
    from dataclasses import replace

    from trsp_ray.config.run_config import heal_recipe

    trainable, rank = heal_recipe(cfg, heal_method=True)
    return replace(cfg.heal, steps=cfg.stage2.steps + cfg.heal.steps, lr=cfg.stage2.lr * compute.heal_lr_scale(cfg),
                   trainable=trainable, lora_rank=rank)


@contextmanager
def _dense_beside(bench, model, *, activations: str):
    """The dense model a compensation of `model` (the pruned working copy) reads, where its passes
    run at the device's speed without the device holding two models. On CPU: the original (both
    live in host memory). On a GPU run the original waits in host memory, so for dense activations
    (and the scalar fold, which reads only the dense model) the pruned copy steps out to host memory
    while a transient dense copy on the device computes the sums; the fold lands in the pruned copy
    there and it returns to the device. Sequential activations need both models in every pass: the
    original's passes then run in host memory (slow for a large model; the dense fit is the default)."""
    import gc

    import torch

    device = next(model.parameters()).device
    here = next(bench.model.parameters()).device
    if here == device or activations != "dense":
        yield bench.model
        return
    model.to("cpu")
    dense = bench.scoring_model()  # a transient copy on the run's device
    try:
        yield dense
    finally:
        dense.to("meta")  # off the device whoever still names it (the caller, a wrapper measuring the stage)
        del dense
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
        model.to(device)


# fit_store(compute, apply) -> (the fit's info, its folded weights): see apply_method
FitStore = Callable[[Callable[[], tuple[dict, dict]], Callable[[dict], None]], tuple[dict, dict]]


def apply_method(bench, spec: registry.Method, *, drop: list[int] | None = None, stage2: bool | None = None,
                 stage1: Stage1Result | None = None, stage2_cfg=None, heal_cfg=None, report: Report = null_report,
                 on_model: Callable[[object], None] | None = None, fit_store: FitStore | None = None,
                 audition: Audition | None = None) -> Outcome:
    """Prune a fresh copy of the model with pipeline `spec` (Pipeline.spec); returns the pruned model and its cost.

    `drop` skips the selection (a drop set computed before, e.g. shared by several benchmark rows);
    `stage2` overrides whether TRSP's stage 2 runs; `stage2_cfg` / `heal_cfg` override the run's;
    `on_model` is handed the working copy before anything trains it (a search measures its
    validation loss mid-training through `report`); `fit_store(compute, apply)` shares a least-squares
    fit among runs of the same drop set and fit (a search's trials): it returns compute()'s result,
    computed now or stored, and hands a stored one's weights to `apply` (compensation.folded_weights);
    `audition`: what runs a selection by recovery (select)."""
    method, cfg = spec.name, bench.cfg
    s2 = stage2_cfg or cfg.stage2
    heal = heal_cfg or (method_heal(cfg) if spec.heal and stage2 is None else cfg.heal)
    use_stage2 = (spec.stage2 and s2.enabled) if stage2 is None else stage2
    # a compensating method fits least squares by default; a fit after stage 2 is refused here
    comp = sized(for_method(cfg, method, stage2=bool(use_stage2) and s2.steps > 0),
                 hidden=families.text_config(bench.model).hidden_size).compensation  # windows 0: auto
    if comp.method != "none":  # a family or calibration size it cannot serve fails before any work
        compensation.check_request(model=bench.model, method=comp.method, tokens=comp.windows * cfg.data.seqlen,
                                   form=comp.form, rank=comp.rank, minimum=comp.min_tokens_per_column)
    model = bench.fresh_model()
    if on_model is not None:
        on_model(model)
    gates = attach_gates(model, gate_mode=cfg.gates.gate)
    t0 = time.time()
    if drop is None:
        drop, info = select(bench, spec, model=model, gates=gates, stage1=stage1, report=report, audition=audition)
        if "budget_heal_steps" in info and heal_cfg is None:  # what a budget left after the selection's trials
            heal = dataclasses.replace(heal, steps=info["budget_heal_steps"])
    else:
        drop, info = list(drop), {}
    info["select_seconds"] = time.time() - t0
    _log(f"{method}: drop set {drop}")
    if use_stage2 and s2.steps > 0:
        t1 = time.time()
        _log(f"{method}: stage 2 ({s2.steps} steps, schedule {s2.schedule}, lambda2 {s2.lambda2})")
        result = _stage2(bench, model=model, gates=gates, drop=drop, s2=s2, report=report)
        model = result.model
        info.update(stage2_tokens=result.tokens, stage2_steps=result.steps, stage2_seconds=time.time() - t1,
                    stage2_cost=result.tokens * compute.token_cost(cfg, spec=spec, stage2=True, trainable=s2.trainable,
                                                                   lora_rank=s2.lora_rank),
                    relative_update={i: (v[0], v[-1]) for i, v in result.relative_update.items() if v})
    if spec.merges:  # each pair (d - 1, d) becomes one block (run/merging.py) where a drop removes d
        windows = fixed_windows(bench.batches(FIT_STREAM), merge_windows(cfg))
        kept, merged = merge_layers(model, drop=drop, windows=windows, cfg=cfg, info=info)
        heal = heal if heal_cfg is not None else heal_left(cfg, spec=spec, heal=heal, drop=drop, info=info)
    else:
        kept = remove_layers(model, drop)
    del gates  # its wrappers hold the removed layers: on the GPU they stayed through the fit and the heal
    if comp.method != "none":
        t3 = time.time()

        def fit() -> tuple[dict, dict]:
            windows = fixed_windows(bench.batches(FIT_STREAM), comp.windows)
            with _dense_beside(bench, model, activations=comp.activations) as dense:
                done = compensation.compensate(model=model, dense=dense, drop=drop, windows=windows,
                                               method=comp.method, ridge=comp.ridge, activations=comp.activations,
                                               form=comp.form, rank=comp.rank, weighting=comp.weighting,
                                               objective=comp.objective)
                del dense  # before the pruned copy returns (held, the GPU fit had both: 4.03 GiB on a 1B)
            return done, compensation.folded_weights(model, kept, done)

        if fit_store is not None and comp.method == "lstsq":  # a scalar fold rescales many modules: not shared
            done, _ = fit_store(fit, lambda weights: compensation.load_folded(model, weights))
        else:
            done, _ = fit()
        info.update(**compensation.describe(comp, form=done.get("form")), compensation_tokens=done["tokens"],
                    compensation_seconds=time.time() - t3,
                    compensation_cost=compensation.cost(drop=drop, num_layers=bench.num_layers, tokens=done["tokens"],
                                                        activations=comp.activations),
                    compensation_solve_cost=compute.measured_solve_cost(cfg, comp, done))
        _log(f"{method}: {comp.method} compensation of blocks {done['blocks']} on {done['tokens']} tokens")
    if heal.steps > 0:
        t2 = time.time()
        _log(f"{method}: heal ({heal.steps} steps)")
        # the map recipe trains the layers the fold reported writing into (pruned-model indices)
        maps = [kept.index(i) for i in fold_layers(done["blocks"])] if comp.method == "lstsq" else []
        healed = _heal(bench, model=model, heal=heal, report=report, map_layers=maps)
        model = healed.model
        info.update(heal_tokens=healed.tokens, heal_steps=healed.steps, heal_resumed_after=healed.resumed,
                    heal_seconds=time.time() - t2, heal_cost=healed.tokens * compute.token_cost(
                        cfg, spec=spec, drop=drop, stage2=False, trainable=heal.trainable, lora_rank=heal.lora_rank,
                        map_layers=maps))
    if spec.merges:  # kept through the heal: an interrupted heal resumes on the stored pairs, not a new merge
        merged.clear()
    info["weight_tokens"] = info.get("stage2_tokens", 0) + info.get("heal_tokens", 0)
    info["seconds"] = time.time() - t0
    return Outcome(method=method, model=model.eval(), drop=drop, kept=kept, info=info)
