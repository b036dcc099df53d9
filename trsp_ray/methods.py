"""Every method of the comparison through one code path: select the drop set, (stage 2), remove,
(heal). TRSP and its ablations, ShortGPT, SLEB and random differ only in `select`."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from trsp_ray.gates import attach_gates
from trsp_ray.heal import run_heal
from trsp_ray.stage1 import Stage1Result, run_stage1
from trsp_ray.stage2 import run_stage2
from trsp_ray.surgery import remove_layers
from trsp_ray.training import Report, null_report


@dataclass
class Outcome:
    method: str
    model: object  # the pruned (and possibly trained) model, gates detached
    drop: list[int]  # original indices, in drop order
    kept: list[int]
    info: dict = field(default_factory=dict)  # tokens, steps, seconds, stage-2 relative updates


def run_stage1_for(bench, *, model=None, report: Report = null_report, on_round=None, resume=None) -> Stage1Result:
    """Stage 1 with the run's config on `model` (default: a fresh copy); gates are left attached."""
    from trsp_ray.pipeline import log

    cfg = bench.cfg
    model = model if model is not None else bench.fresh_model()
    gates = attach_gates(model, gate_mode=cfg.gates.gate)
    s1 = cfg.stage1
    n_drop = bench.n_drop()

    def progress(metrics: dict, step: int) -> None:
        report(metrics, step)
        if "stage1/loss" in metrics:
            log(f"  stage 1 step {step}: loss {metrics['stage1/loss']:.4f} (CE {metrics['stage1/ce']:.4f}, "
                f"sum|s| {metrics['stage1/penalty']:.2f})")
        if "stage1/rounds_done" in metrics:
            log(f"  stage 1 round {metrics['stage1/rounds_done']}/{1 if s1.selection == 'oneshot' else n_drop}: "
                f"drop layer {metrics['stage1/dropped']}")

    return run_stage1(model=model, gates=gates, batches=bench.batches(), n_drop=n_drop,
                      candidates=bench.candidates(), lambda1=s1.lambda1, lr=s1.lr,
                      first_round_steps=s1.first_round_steps, steps_per_round=s1.steps_per_round,
                      selection=s1.selection, train_base=s1.train_base, base_lr=s1.base_lr,
                      report=progress, on_round=on_round, resume=resume)


def _windows(bench, count: int) -> list:
    """Exactly `count` fixed calibration windows, as batches of at most data.batch_size."""
    import torch

    size = bench.cfg.data.batch_size
    stacked = torch.cat(bench.fixed_batches(-(-count // size)))[:count]
    return list(stacked.split(size))


def select(bench, method: str, *, model, gates, stage1: Stage1Result | None, report: Report) -> tuple[list[int], dict]:
    """The drop list of `method`; TRSP variants reuse a given stage-1 result when there is one."""
    from trsp_ray import baselines
    from trsp_ray.pipeline import log

    n_drop, candidates, cfg = bench.n_drop(), bench.candidates(), bench.cfg
    if method in ("trsp", "trsp-no-stage2", "trsp-oneshot"):
        if stage1 is None:
            stage1 = run_stage1_for(bench, model=model, report=report)
        drop = stage1.drop_for(method, n_drop)
        return drop, {"stage1_tokens": stage1.tokens, "stage1_steps": stage1.steps}
    calib = _windows(bench, cfg.baselines.calib_windows)
    if method == "shortgpt":
        return baselines.shortgpt_drop(model, gates, calib, n_drop=n_drop, candidates=candidates), {}
    if method == "sleb":
        sleb_calib = _windows(bench, cfg.baselines.sleb_windows)
        progress = lambda r, n, ppl: log(f"  SLEB round {r}/{n}: calibration PPL {ppl:.2f}")
        return baselines.sleb_drop(model, gates, sleb_calib, n_drop=n_drop, candidates=candidates,
                                   progress=progress), {}
    return baselines.random_drop(n_drop=n_drop, candidates=candidates, seed=cfg.seed), {}


def apply_method(bench, method: str, *, stage1: Stage1Result | None = None, stage2: bool | None = None,
                 stage2_cfg=None, heal_cfg=None, report: Report = null_report) -> Outcome:
    """Prune a fresh copy of the model with `method`; returns the pruned model and what it cost."""
    from trsp_ray.pipeline import log

    cfg = bench.cfg
    s2 = stage2_cfg or cfg.stage2
    heal = heal_cfg or cfg.heal
    model = bench.fresh_model()
    gates = attach_gates(model, gate_mode=cfg.gates.gate)
    t0 = time.time()
    drop, info = select(bench, method, model=model, gates=gates, stage1=stage1, report=report)
    info["select_seconds"] = time.time() - t0
    log(f"{method}: drop set {drop}")
    use_stage2 = (method in ("trsp", "trsp-oneshot") and s2.enabled) if stage2 is None else stage2
    if use_stage2 and s2.steps > 0:
        t1 = time.time()
        log(f"{method}: stage 2 ({s2.steps} steps, schedule {s2.schedule}, lambda2 {s2.lambda2})")
        def stage2_progress(metrics: dict, step: int) -> None:
            report(metrics, step)
            if step % 5 == 0 or step == s2.steps:
                log(f"  stage 2 step {step}/{s2.steps}: CE {metrics['stage2/ce']:.4f}, "
                    f"penalty {metrics['stage2/penalty']:.3f}, P-layer scale {metrics['stage2/residual_scale']:.2f}")

        result = run_stage2(model=model, gates=gates, batches=bench.batches(seed_offset=1), drop=drop,
                            lambda2=s2.lambda2, steps=s2.steps, lr=s2.lr, p_lr_scale=s2.p_lr_scale,
                            mode=s2.mode, norm=s2.norm, trainable=s2.trainable, lora_rank=s2.lora_rank,
                            schedule=s2.schedule, anneal_fraction=s2.anneal_fraction, report=stage2_progress)
        model = result.model
        info.update(stage2_tokens=result.tokens, stage2_steps=result.steps, stage2_seconds=time.time() - t1,
                    relative_update={i: (v[0], v[-1]) for i, v in result.relative_update.items() if v})
    kept = remove_layers(model, drop)
    if heal.steps > 0:
        t2 = time.time()
        log(f"{method}: heal ({heal.steps} steps)")
        def heal_progress(metrics: dict, step: int) -> None:
            report(metrics, step)
            if step % 5 == 0 or step == heal.steps:
                log(f"  heal step {step}/{heal.steps}: CE {metrics['heal/ce']:.4f}")

        healed = run_heal(model=model, batches=bench.batches(seed_offset=2), steps=heal.steps, lr=heal.lr,
                          trainable=heal.trainable, lora_rank=heal.lora_rank, report=heal_progress)
        model = healed.model
        info.update(heal_tokens=healed.tokens, heal_steps=healed.steps, heal_seconds=time.time() - t2)
    info["weight_tokens"] = info.get("stage2_tokens", 0) + info.get("heal_tokens", 0)
    info["seconds"] = time.time() - t0
    return Outcome(method=method, model=model.eval(), drop=drop, kept=kept, info=info)
