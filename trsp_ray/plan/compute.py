"""Compute in dense-forward tokens (SPEC section 5), one formula per quantity.

A forward pass of the whole model over one token is 1; a backward pass that needs only activation
gradients (frozen weights, e.g. stage 1's gates) 1 more; one that also needs weight gradients 2
more, so a token of stage 2 or of a heal costs 3. What each selection spends is counted where it
runs (methods.stage1_cost, methods.sleb_cost); this module adds recovery to it and turns a
compute difference into heal steps, so every table, plot and equal-compute row uses one rule.
"""

from __future__ import annotations

TRAIN_TOKEN = 3.0  # forward + backward with weight gradients, per token


def recovery_cost(info: dict) -> float:
    """Dense-forward tokens a row spent after its selection: every weight-update token (stage 2 or
    heal) at TRAIN_TOKEN, plus a closed-form compensation's calibration forward."""
    return TRAIN_TOKEN * info.get("weight_tokens", 0) + info.get("compensation_cost", 0.0)


def total_cost(info: dict) -> float:
    """Selection + recovery, dense-forward tokens."""
    return info.get("select_cost", 0.0) + recovery_cost(info)


def extra_heal_steps(extra_cost: float, *, tokens_per_step: int) -> int:
    """Heal steps that spend `extra_cost` dense-forward tokens (rounded to the nearest step, never
    negative): what a cheaper selection gets to reach another row's total compute."""
    if tokens_per_step < 1:
        raise ValueError(f"tokens_per_step={tokens_per_step} must be >= 1")
    return max(0, round(extra_cost / (TRAIN_TOKEN * tokens_per_step)))
