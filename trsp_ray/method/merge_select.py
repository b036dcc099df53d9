"""Which adjacent pairs to merge (trsp_ray/method/merge.py): the pairs whose two blocks together change the
stream least.

A pair (a, a + 1) is scored by the angular distance between the stream entering a and the stream leaving
a + 1 (selectors.angular_distances over a block of two: Gromov et al.'s score, the pair's Block
Influence up to the arccos), on one dense forward of the calibration windows. Where two blocks together
barely turn the stream, each block's contribution is small beside the stream, which is where the
parallel form's approximation (block b reading the stream a reads, merge_blocks.py) costs least.

Pairs are taken greedily, lowest distance first, skipping any that overlaps a chosen one or cannot be
merged (merge_blocks.pair_refusal: sliding against full attention). Both layers of a pair are candidates
(stage1.candidate_layers: the protected head and tail stay out), and a pair count comes from the ratio
as a drop count does (stage1.n_drop_for: each pair removes one layer). The greedy order is kept, so the
pairs for a smaller count are a prefix of the pairs for a larger one, as a drop list's are.
"""

from __future__ import annotations

import torch

from trsp_ray.common.errors import TrspError
from trsp_ray.method.merge_blocks import family_refusal, pair_refusal
from trsp_ray.method.selectors import angular_distances


def pair_starts(candidates: list[int]) -> list[int]:
    """The first layer a of every pair (a, a + 1) whose two layers are both candidates."""
    allowed = set(candidates)
    return [a for a in sorted(allowed) if a + 1 in allowed]


def candidate_starts(candidates: list[int]) -> list[int]:
    """pair_starts, refused in one line where there is none (before any pass)."""
    starts = pair_starts(candidates)
    if not starts:
        raise TrspError(f"no two adjacent candidate layers to merge (candidates {candidates}); protect fewer "
                        "head/tail layers")
    return starts


@torch.no_grad()
def pair_distances(model, gates, batches: list[torch.Tensor], *, candidates: list[int],
                   head: bool = False) -> dict[int, float]:
    """{a: mean over tokens of arccos(cos(x_a, x_{a+2})) / pi} for every candidate pair (a, a + 1) of the
    gated `model` (gates.attach_gates) over calibration `batches` (token ids [B, S]): one decoder pass
    per batch, select_cost's count (`head`: whole passes, as ZeRO-3 ranks run them)."""
    return angular_distances(model, gates, batches, n_drop=2, starts=candidate_starts(candidates), head=head)


def choose_pairs(distances: dict[int, float], *, model, n_pairs: int) -> list[int]:
    """The first layers of `n_pairs` non-overlapping pairs of `model` that can be merged, lowest distance
    first (greedy); a one-line error where fewer exist among the scored pairs."""
    check_pairs_count(model, n_pairs)
    chosen: list[int] = []
    used: set[int] = set()
    refused = ""
    for a in sorted(distances, key=distances.get):
        if len(chosen) == n_pairs:
            break
        if a in used or a + 1 in used:
            continue
        why = pair_refusal(model, a)
        if why:
            refused = refused or why
            continue
        chosen.append(a)
        used |= {a, a + 1}
    if len(chosen) < n_pairs:
        first = f" ({refused})" if refused else ""
        raise TrspError(f"{n_pairs} pairs to merge asked, but the greedy choice found {len(chosen)} non-overlapping "
                        f"mergeable pairs among the {len(distances)} candidate pairs{first}; lower the ratio or "
                        "protect fewer layers")
    return chosen


def check_pairs_count(model, n_pairs: int) -> None:
    """Refuse a pair count below 1 or a family that merges no pair, before any pass."""
    if n_pairs < 1:
        raise TrspError(f"a merge of {n_pairs} pairs is not valid; merge at least 1 (raise the ratio)")
    reason = family_refusal(model)
    if reason:
        raise TrspError(reason)


def merge_select(model, gates, batches: list[torch.Tensor], *, n_pairs: int, candidates: list[int]) -> list[int]:
    """The first layers of the `n_pairs` pairs to merge (choose_pairs over pair_distances), in the order
    chosen (lowest distance first)."""
    check_pairs_count(model, n_pairs)
    return choose_pairs(pair_distances(model, gates, batches, candidates=candidates), model=model, n_pairs=n_pairs)


def select_cost(*, tokens: int) -> float:
    """Dense-forward tokens of merge_select over `tokens` calibration tokens: one whole decoder pass (no LM
    head; counted as a dense forward, as ShortGPT's Block Influence is)."""
    return float(tokens)


def merge_drop(model, gates, batches: list[torch.Tensor], *, n_drop: int, candidates: list[int]) -> list[int]:
    """The layers a merge of `n_drop` pairs removes (merge_select's pairs (a, a + 1): each a + 1), in the
    order chosen: a merge's drop set, as a drop selector's (selectors.angular_drop) reads."""
    return [a + 1 for a in merge_select(model, gates, batches, n_pairs=n_drop, candidates=candidates)]
