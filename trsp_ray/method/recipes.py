"""The heal recipes: which weights a heal (or TRSP's stage 2) trains, by name. Torch-free, so the
registry and the config can name them without importing the method (heal.py trains them)."""

from __future__ import annotations

from trsp_ray.common.errors import TrspError

# all: every weight; lora: adapters merged at the end; tail: lm_head + the last heal.tail_layers kept
# layers; map: only the weights the fit folded into. "tail" is also a selector's name, so the recipe is
# named here once, not spelled out
HEAL_RECIPES = ("all", "lora", "tail", "map")
_, _, TAIL_RECIPE, MAP_RECIPE = HEAL_RECIPES
PARTIAL_RECIPES = (TAIL_RECIPE, MAP_RECIPE)  # recipes that train a subset of the weights (heal.recipe_params)


def check_tail_layers(tail_layers: int, *, kept: int) -> None:
    """A tail heal trains lm_head + the last `tail_layers` of `kept` decoder layers: fewer than all of them
    (all of them is heal.trainable=all without the embedding); a one-line refusal otherwise."""
    if not 1 <= tail_layers < kept:
        raise TrspError(f"heal.tail_layers={tail_layers} is not valid for a heal of {kept} kept layers; use 1.."
                        f"{kept - 1}, or heal.trainable=all to train every layer")
