"""What a merge (trsp_ray/method/merge.py) costs before it runs: its passes in dense-forward tokens and the
bytes it holds (the refit's sums, target "dense"'s stored streams), read by merge_pairs, the budget
(run/merging.py) and the single-process plan."""

from __future__ import annotations

import math


def refit_bytes(*, intermediate: int, hidden: int, attention_width: int) -> int:
    """Bytes of one pair's float64 refit sums (one pair's are held at a time): Z^T Z and Z^T Y of the MLP
    ([I, I], [I, d]) and of the attention ([w, w], [w, d], w = attention_width: the kept heads' q rows,
    hidden size without GQA). SmolLM2-135M (I 1536, d 576, w 576): 31 MB; an 8B Llama (14336, 4096, 4096):
    2.4 GB; a 70B Llama (28672, 8192, 8192): 9.5 GB."""
    return 8 * (intermediate * (intermediate + hidden) + attention_width * (attention_width + hidden))


def target_bytes(*, pairs: int, tokens: int, hidden: int, dtype_bytes: int) -> int:
    """Bytes of target "dense"'s stored streams on the host (boundaries.layer_outputs: every pair's, held from
    the start; each is freed once its pair is merged): SmolLM2-135M in fp32 at 8 pairs of 43,008 tokens: 793 MB."""
    return pairs * tokens * hidden * dtype_bytes


def choice_sets(units: int, trials: int) -> int:
    """How many attention unit sets merging.units=loss tries a pair (merge_choice.candidates): every way to
    keep `units` of the wide block's 2 x units when there are at most `trials`, else the energy choice and
    its single swaps (units^2 of them), at most `trials` in all."""
    every = math.comb(2 * units, units)
    return every if every <= trials else min(trials, 1 + units * units)


def merge_cost(*, firsts, num_layers: int, tokens: int, refit: bool = True, stops: bool = True,
               target: str = "wide", sets: int = 0, choice_tokens: int = 0) -> float:
    """Dense-forward tokens of merge_pairs over `tokens` calibration tokens: per pair one scoring pass and,
    with `refit`, one refit pass (target "pair": one more, the MLP's refit after the attention's cut, which
    also runs the pair's two original blocks), each through the model merged so far up to the pair's
    block (two layers' worth); target "dense": the same three passes, and one pass of the dense model to the
    deepest pair's end that stores the targets. `stops=False`: whole passes (ZeRO-3 ranks run every pass to
    the end). merging.units=loss: plus `sets` trials a pair on `choice_tokens` (trial_cost)."""
    pair = refit and target == "pair"
    dense = refit and target == "dense"
    passes = (3 if pair or dense else 2) if refit else 1
    firsts = sorted(firsts)
    cost = (max(firsts) + 2) * tokens / num_layers if dense and firsts else 0.0
    for k, a in enumerate(firsts):
        depth = (a - k + 2) if stops else (num_layers - k)  # k earlier pairs are one layer each by now
        cost += (passes * depth + (2 if pair else 0)) * tokens / num_layers
    trials = trial_cost(firsts=firsts, num_layers=num_layers, sets=sets, choice_tokens=choice_tokens, stops=stops)
    return cost + (trials if refit else 0.0)


def trial_cost(*, firsts, num_layers: int, sets: int, choice_tokens: int, stops: bool = True) -> float:
    """Dense-forward tokens of merging.units=loss's trials (merge_choice.choose_units) over the pairs at
    original indices `firsts`: per pair, one pass of `choice_tokens` up to its block (the k earlier pairs
    are one layer each by now) that stores the block's input, then `sets` trials from the block to the end
    (num_layers - a layers' worth, the wide block counted twice); `stops=False`: each trial a whole pass
    through the model merged so far (num_layers - k). Unlike the other passes this shrinks with depth: the
    shallowest pairs bound it."""
    cost = 0.0
    for k, a in enumerate(sorted(firsts)):
        trial = (num_layers - a) if stops else (num_layers - k)
        cost += ((a - k if stops else 0) + sets * trial) * choice_tokens / num_layers
    return cost
