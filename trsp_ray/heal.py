"""Heal: CE-only fine-tuning of an already-pruned model, available after any method.

It gives the baselines the recovery training the paper's baselines received, and lets every method
be compared at an equal token budget.
"""

from __future__ import annotations

from dataclasses import dataclass

from trsp_ray.training import Batches, MakeStepper, Report, TorchStepper, add_lora, freeze, merge_lora, null_report


@dataclass
class HealResult:
    model: object
    steps: int
    tokens: int
    first_ce: float | None
    last_ce: float | None


def run_heal(*, model, batches: Batches, steps: int, lr: float, trainable: str = "all", lora_rank: int = 8,
             make_stepper: MakeStepper = TorchStepper, report: Report = null_report) -> HealResult:
    """Fine-tune `model` (pruned, no gates) for `steps` batches with next-token CE."""
    if trainable == "lora":
        freeze(model)
        train_model = add_lora(model, rank=lora_rank)
        params = [p for p in train_model.parameters() if p.requires_grad]
    else:
        train_model = model
        freeze(model, except_params=list(model.parameters()))
        params = list(model.parameters())
    stepper = make_stepper(train_model, [{"params": params, "lr": lr}])
    first = last = None
    for step in range(1, steps + 1):
        ce = stepper.forward(batches.next())
        stepper.backward(ce)
        stepper.step()
        last = ce.item()
        first = last if first is None else first
        report({"heal/ce": last}, step)
    final = merge_lora(train_model) if trainable == "lora" else model
    freeze(final)
    return HealResult(model=final, steps=steps, tokens=steps * batches.tokens_per_batch, first_ce=first, last_ce=last)
