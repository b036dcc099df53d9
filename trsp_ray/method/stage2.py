"""Stage 2: move the knowledge out of the layers in the drop set P before they are removed.

    L2 = CE + lambda2(t) * sum_{i in P} d(x_{i+1}, x_i)

x_{i+1} - x_i is exactly what layer i adds to the residual stream, so the penalty drives the layers
in P toward identity maps while the rest of the network learns to do without them.

Schedules (our additions; SPEC section 1 records that a constant lambda2 barely moves the layers at
small budgets):
- constant: lambda2(t) = lambda2.
- ramp:     lambda2 grows linearly from 0 to lambda2 over each segment.
- anneal:   the P layers' residual contribution is scaled by a factor going 1 -> 0 over
            `anneal_fraction` of each segment; from then on they are exact identities, so the rest
            of the segment trains the network exactly as it will be after removal.
- skip:     the P layers are skipped from the first step (residual scale 0, no penalty): the rest of
            the network trains exactly as it will be after removal, i.e. a heal of the pruned model
            (the P layers get zero gradients). A heal method heals with `heal.run_heal` instead, in
            one process and on the Ray Train workers (P bypassed, frozen and out of the optimizer).
Modes: joint (one segment with all of P) or sequential (one segment per layer of P, in drop order).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from trsp_ray.method.training import (
    Batches,
    MakeStepper,
    Report,
    TorchStepper,
    add_lora,
    freeze,
    layer_param_groups,
    merge_lora,
    null_report,
)


@dataclass
class Stage2Result:
    model: object  # the trained model (a new object after LoRA merging)
    relative_update: dict[int, list[float]] = field(default_factory=dict)  # per layer in P, per step
    steps: int = 0
    tokens: int = 0


def _segments(drop: list[int], steps: int, mode: str) -> list[tuple[int, int, list[int]]]:
    if mode == "joint" or len(drop) <= 1:
        return [(0, steps, list(drop))]
    bounds = [round(k * steps / len(drop)) for k in range(len(drop) + 1)]
    return [(bounds[k], bounds[k + 1], [drop[k]]) for k in range(len(drop))]


def _schedule(t: int, start: int, end: int, *, schedule: str, lambda2: float, anneal_fraction: float):
    """(lambda2 at step t, residual scale of the segment's layers at step t)."""
    progress = (t - start + 1) / max(1, end - start)
    if schedule == "ramp":
        return lambda2 * progress, 1.0
    if schedule == "anneal":
        return lambda2, max(0.0, 1.0 - progress / anneal_fraction)
    if schedule == "skip":
        return 0.0, 0.0
    return lambda2, 1.0


def run_stage2(*, model, gates, batches: Batches, drop: list[int], lambda2: float, steps: int, lr: float,
               p_lr_scale: float = 1.0, mode: str = "joint", norm: str = "l2", trainable: str = "all",
               lora_rank: int = 8, schedule: str = "constant", anneal_fraction: float = 0.5,
               make_stepper: MakeStepper = TorchStepper, report: Report = null_report,
               checkpoints=None) -> Stage2Result:
    """Train `model` (gated, see `attach_gates`) with the stage-2 loss; the layers in `drop` stay in
    the model (removal is a separate step). Returns the trained model and per-layer relative updates
    ||x_{i+1} - x_i|| / ||x_i||, which must fall. `checkpoints` (one process: run/heal_store.HealCheckpoints,
    as run_heal's): a stored stage 2 is put back, its batches replayed without compute, and the relative
    updates so far read back from its record; stored after each step as it chooses; cleared at the end."""
    gates.set_gated(False)
    gates.reset_gates()
    gates.set_bypass([])
    for w in gates.wrappers:
        w.penalty_norm = norm if w.index in drop else None
        w.residual_scale = 1.0
    train_model = model
    if trainable == "lora":
        freeze(model)
        train_model = add_lora(model, rank=lora_rank)
    else:
        freeze(model, except_params=[p for p in model.parameters()])
        for p in gates.gate_params():
            p.requires_grad_(False)
    groups = layer_param_groups(train_model, gates, lr=lr, special=set(drop), special_lr=lr * p_lr_scale)
    stepper = make_stepper(train_model, groups)
    result = Stage2Result(model=model, relative_update={i: [] for i in drop})
    done = checkpoints.restore(stepper)[0] if checkpoints is not None else 0
    if done:
        result.relative_update.update({int(i): list(v) for i, v in checkpoints.record["relative_update"].items()})
        result.steps, result.tokens = done, done * batches.tokens_per_batch
    finished: list[int] = []
    for start, end, active in _segments(drop, steps, mode):
        for t in range(start, end):
            if t < done:  # a stored step: its batch is read, nothing computed
                batches.next()
                continue
            lam, scale = _schedule(t, start, end, schedule=schedule, lambda2=lambda2, anneal_fraction=anneal_fraction)
            for w in gates.wrappers:
                if w.index in active:
                    w.residual_scale = scale
                elif w.index in finished and schedule in ("anneal", "skip"):
                    w.residual_scale = 0.0
            ce = stepper.forward(batches.next())
            terms = [gates[i].distance for i in active if gates[i].distance is not None]
            penalty = torch.stack(terms).sum() if terms else torch.zeros((), device=ce.device)
            loss = ce + lam * penalty
            stepper.backward(loss)
            stepper.step()
            result.steps += 1
            result.tokens += batches.tokens_per_batch
            metrics = {"stage2/loss": loss.item(), "stage2/ce": ce.item(), "stage2/penalty": penalty.item(),
                       "stage2/lambda2": lam, "stage2/residual_scale": scale}
            for i in active:
                # The effective update: the annealed scale times the raw one (0 once skipped).
                raw = gates[i].relative_update if gates[i].distance is not None else 0.0
                result.relative_update[i].append(raw * scale)
                metrics[f"rel_update/{i:02d}"] = raw * scale
            report(metrics, result.steps)
            if checkpoints is not None:
                checkpoints.after(result.steps, steps, stepper, first=None,
                                  record={"relative_update": result.relative_update})
        finished += active
    for w in gates.wrappers:
        w.penalty_norm, w.residual_scale = None, 1.0
    gates.clear_records()
    if trainable == "lora":
        result.model = merge_lora(train_model)
    freeze(result.model)
    if checkpoints is not None:
        checkpoints.clear()
    return result
