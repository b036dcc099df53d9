"""Heal: fine-tuning of an already-pruned model (next-token CE or distillation), available after any method.

It gives the baselines the recovery training the paper's baselines received, and lets every method
be compared at an equal token budget. Recipes (`trainable`), i.e. which weights train:
  all   every weight;
  lora  low-rank adapters on the decoder layers' Linears, merged at the end;
  tail  lm_head + the last `tail_layers` kept decoder layers (Lu et al., "Reassessing Layer Pruning");
  map   only the MLP output projections (down_proj) a least-squares fold wrote its maps into
        (ReplaceMe's "LT" heal), weight and bias: the fold wrote both.
Everything outside a recipe's set is frozen and never reaches the optimizer (no gradient, master
copy or Adam moment for it).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from torch import nn

from trsp_ray.common.errors import TrspError
from trsp_ray.method.recipes import MAP_RECIPE, PARTIAL_RECIPES, TAIL_RECIPE, check_tail_layers
from trsp_ray.method.training import (
    Batches,
    MakeStepper,
    Report,
    TorchStepper,
    add_lora,
    freeze,
    merge_lora,
    null_report,
)
from trsp_ray.models import families


@dataclass
class HealResult:
    model: object
    steps: int
    tokens: int
    first_ce: float | None
    last_ce: float | None
    resumed: int = 0  # steps read back from a checkpoint, not computed in this call


def recipe_params(model, *, trainable: str, layers, tail_layers: int = 3, map_layers=(),
                  mlp_output=families.map_module) -> list[nn.Parameter]:
    """The parameters a `tail` or `map` heal trains, each once. `layers`: the kept decoder layers of
    `model` in order (the modules; on Ray Train workers the gated layers' inner ones); `map_layers`:
    indices into `layers` of the layers whose MLP output took a fold's map; `mlp_output(layer, model)`
    finds the module the map folded into (families.map_module: the down_proj, or Gemma's MLP norm;
    ZeRO-3 workers: with the layer gathered, as their fit does)."""
    if trainable == TAIL_RECIPE:
        check_tail_layers(tail_layers, kept=len(layers))
        modules = [model.get_output_embeddings(), *list(layers)[-tail_layers:]]
    elif trainable == MAP_RECIPE:
        if not map_layers:
            raise TrspError("heal.trainable=map trains the down_proj weights a least-squares fold wrote its maps "
                            "into, and no map was folded; use compensation.method=lstsq or heal.trainable=all|tail")
        modules = [mlp_output(layers[i], model) for i in map_layers]
    else:
        raise TrspError(f"heal.trainable={trainable!r} has no parameter set here; choose tail or map")
    out, seen = [], set()
    for module in modules:
        for p in module.parameters():
            if id(p) not in seen:
                seen.add(id(p))
                out.append(p)
    return out


def output_side_only(model):
    """A hook handle (None when lm_head is not tied): a tail heal of a model whose lm_head *is* the
    input embedding trains that shared weight as the LM head, from the head's gradient only. The
    embedding's output is detached, so backward stops at the first trained layer (memory and compute
    as an untied head) and the earlier layers stay frozen in effect too; the input embedding moves
    with the head because it is the same tensor. Untying instead would add vocab x hidden parameters
    to the export (21% of SmolLM2-135M), and freezing it would leave out the piece Lu et al. train."""
    head, embedding = model.get_output_embeddings(), model.get_input_embeddings()
    if head is None or head.weight is not embedding.weight:
        return None
    return embedding.register_forward_hook(lambda _module, _inputs, output: output.detach())


def run_heal(*, model, batches: Batches, steps: int, lr: float, trainable: str = "all", lora_rank: int = 8,
             tail_layers: int = 3, map_layers=(), layers=None, mlp_output=families.map_module,
             make_stepper: MakeStepper = TorchStepper, report: Report = null_report,
             schedule: str = "constant", checkpoints=None) -> HealResult:
    """Fine-tune the pruned `model` for `steps` batches with the stepper's objective (next-token CE by
    default). `tail_layers`: the tail recipe's k; `map_layers`: the map recipe's layers (indices into
    the kept layers of those whose down_proj took a map).

    The one heal loop, in one process and on Ray Train workers (distributed/recovery.heal_on_workers).
    `layers`: the kept decoder layers, by default every decoder layer of `model`. A ZeRO-3 worker
    cannot cut its partitioned model: it heals the gated model with the drop set bypassed and passes
    the kept wrappers' inner layers, so the rest of the decoder layers' parameters (the dropped
    layers, the gates) stay frozen, out of the optimizer and without LoRA adapters. `mlp_output`:
    recipe_params'. A resuming stepper (the workers' `skip`) replays the first steps without compute
    (their "heal/ce" is then a placeholder); `report` sees every step. `schedule`: the learning rate
    over the steps (lr_factor). `checkpoints` (one process: run/heal_store.HealCheckpoints): `restore(stepper)`
    puts a stored heal back and gives (steps done, first loss), whose batches are then replayed without
    compute; `after(step, steps, stepper, first=)` may store the heal after each step; `clear()` at the end."""
    kept = families.decoder_layers(model) if layers is None else list(layers)
    hook = None
    if trainable == "lora":
        freeze(model)
        train_model = add_lora(model, rank=lora_rank, layers=kept)  # a dropped layer gets no adapter
        params = [p for p in train_model.parameters() if p.requires_grad]
    elif trainable in PARTIAL_RECIPES:
        train_model = model
        params = recipe_params(model, trainable=trainable, layers=kept, tail_layers=tail_layers,
                               map_layers=map_layers, mlp_output=mlp_output)
        hook = output_side_only(model) if trainable == TAIL_RECIPE else None
    else:
        train_model = model
        params = list(model.parameters())
    outside = _outside(model, kept)
    params = [p for p in params if id(p) not in outside]
    freeze(model, except_params=params)
    stepper = make_stepper(train_model, [{"params": params, "lr": lr}])
    done, first = checkpoints.restore(stepper) if checkpoints is not None else (0, None)
    for _ in range(done):  # the stream's batches the stored steps read
        batches.next()
    last = None
    for step in range(done + 1, steps + 1):
        set_lr(stepper, lr * lr_factor(schedule, step, steps))
        ce = stepper.forward(batches.next())
        stepper.backward(ce)
        stepper.step()
        last = ce.item()
        first = last if first is None else first
        report({"heal/ce": last}, step)
        if checkpoints is not None:
            checkpoints.after(step, steps, stepper, first=first)
    if hook is not None:
        hook.remove()
    final = merge_lora(train_model) if trainable == "lora" else model
    freeze(final)
    if checkpoints is not None:
        checkpoints.clear()
    return HealResult(model=final, steps=steps, tokens=steps * batches.tokens_per_batch, first_ce=first, last_ce=last,
                      resumed=done)


WARMUP = 0.05  # of a cosine schedule's steps
FLOOR = 0.1  # a cosine schedule's last learning rate, of its peak


def lr_factor(schedule: str, step: int, steps: int) -> float:
    """The learning rate of step `step` (1-based) of `steps`, as a fraction of the peak: 1 for
    constant; for cosine a linear warmup over the first WARMUP of the steps, then a half cosine from 1
    down to FLOOR at the last step (a long heal that ends at its peak rate ends on its noisiest steps)."""
    if schedule == "constant":
        return 1.0
    if schedule != "cosine":
        raise TrspError(f"heal schedule {schedule!r} is not valid; choose constant or cosine")
    warm = max(1, round(WARMUP * steps))
    if step <= warm:
        return step / warm
    done = (step - warm) / max(1, steps - warm)
    return FLOOR + (1.0 - FLOOR) * 0.5 * (1.0 + math.cos(math.pi * done))


def set_lr(stepper, lr: float) -> None:
    """Set every param group's learning rate of the stepper's optimizer (a torch optimizer, or a
    DeepSpeed engine's, whose param groups are the same dicts)."""
    optimizer = getattr(stepper, "optimizer", None) or stepper.engine.optimizer
    for group in optimizer.param_groups:
        group["lr"] = lr


def _outside(model, kept) -> set[int]:
    """ids of the decoder layers' parameters that are not in the `kept` layers: none for a pruned
    model; a gated model's gates and dropped layers."""
    inside = {id(p) for layer in kept for p in layer.parameters()}
    return {id(p) for layer in families.decoder_layers(model) for p in layer.parameters() if id(p) not in inside}
