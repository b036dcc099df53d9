"""Layer-selection baselines in the same harness: ShortGPT, SLEB, random, and the 2024-26 anchors'
tail cut (Lu et al., ICLR'26) and angular-distance block (Gromov et al. 2024).

All work on a gated model (see `gates.attach_gates`) so that "remove layer j" is a bypass, which
gives exactly the logits of the model with j deleted.
"""

from __future__ import annotations

import math
import random as _random
from collections.abc import Callable

import torch

from trsp_ray.method.training import causal_lm_loss


@torch.no_grad()
def decoder_forward(model, batch: torch.Tensor) -> None:
    """The decoder stack's forward without the LM head: a score of the layers' inputs and outputs
    needs no logits, and the head is ~a quarter of a small model's forward (SmolLM2: V = 49,152 x
    576) and the largest activation of a big one ([tokens, V] fp32)."""
    device = next(model.parameters()).device
    model.base_model(input_ids=batch.to(device), use_cache=False)


def influence_sums(model, gates, batches: list[torch.Tensor], *, masks: list[torch.Tensor] | None = None,
                   head: bool = False) -> tuple[dict[int, float], float]:
    """({layer: sum over tokens of cos(x_i, x_{i+1})}, token count) over `batches`; `masks` (one 0/1
    per window of each batch) leave padding windows out of both (data-parallel ranks must all run
    as many forwards). `head=True` runs the whole model (ZeRO-3 ranks: the engine's hooks on the
    root module expect every forward to start there)."""
    sums, count = influence_tensors(model, gates, batches, masks=masks, head=head)
    return {i: float(v) for i, v in sums.items()}, count


def influence_tensors(model, gates, batches: list[torch.Tensor], *, masks: list[torch.Tensor] | None = None,
                      head: bool = False) -> tuple[dict[int, torch.Tensor | float], float]:
    """`influence_sums` with each layer's sum left as a float64 tensor on the activations' device."""
    # The sums stay on the activations' device (float64) and are read once at the end: a host
    # sync per layer and batch would stall the GPU; a host mask times GPU activations would fail.
    sums: dict[int, torch.Tensor | float] = {w.index: 0.0 for w in gates.wrappers}
    count, now = 0.0, {"mask": None}

    def probe(index: int, x: torch.Tensor, y: torch.Tensor) -> None:
        cos = torch.nn.functional.cosine_similarity(x.float(), y.float(), dim=-1).sum(dim=-1)
        if now["mask"] is not None:
            cos = cos * now["mask"].to(device=cos.device, dtype=cos.dtype)
        sums[index] = sums[index] + cos.sum().double()

    for w in gates.wrappers:
        w.probe = probe
    try:
        for k, batch in enumerate(batches):
            now["mask"] = None if masks is None else masks[k].to(torch.float32)
            causal_lm_loss(model, batch) if head else decoder_forward(model, batch)
            rows = batch.shape[0] if masks is None else float(masks[k].sum())
            count += rows * batch.shape[-1]
    finally:
        for w in gates.wrappers:
            w.probe = None
    return sums, count


def block_influence(model, gates, batches: list[torch.Tensor]) -> dict[int, float]:
    """ShortGPT's Block Influence per layer: 1 - mean over tokens of cos(x_i, x_{i+1})."""
    sums, count = influence_sums(model, gates, batches)
    return {i: 1.0 - s / count for i, s in sums.items()}


def lowest_influence(bi: dict[int, float], *, n_drop: int, candidates: list[int]) -> list[int]:
    return sorted(candidates, key=lambda i: bi[i])[:n_drop]


def shortgpt_drop(model, gates, batches: list[torch.Tensor], *, n_drop: int, candidates: list[int]) -> list[int]:
    """The n_drop candidates with the lowest Block Influence (one shot), lowest first."""
    return lowest_influence(block_influence(model, gates, batches), n_drop=n_drop, candidates=candidates)


def random_drop(*, n_drop: int, candidates: list[int], seed: int) -> list[int]:
    return _random.Random(seed).sample(candidates, n_drop)


def tail_drop(*, n_drop: int, candidates: list[int]) -> list[int]:
    """The last n_drop candidates (the layers just before the protected tail: "reverse-order"
    pruning), last first."""
    return sorted(candidates)[-n_drop:][::-1] if n_drop else []


def contiguous_starts(*, n_drop: int, candidates: list[int]) -> list[int]:
    """First layers a of every block a .. a + n_drop - 1 that lies inside the candidates."""
    allowed = set(candidates)
    return [a for a in sorted(allowed) if all(a + k in allowed for k in range(n_drop))]


def angular_distances(model, gates, batches: list[torch.Tensor], *, n_drop: int,
                      starts: list[int], head: bool = False) -> dict[int, float]:
    """{a: mean over tokens of arccos(cos(x_a, x_{a+n})) / pi} for every start a: the angular
    distance between the stream entering layer a and the stream leaving layer a + n - 1 (Gromov et
    al.'s block score; we average over every token, not only the last, as a layer sees them all).
    `head=True` runs the whole model (ZeRO-3 ranks, influence_sums' reason)."""
    sums: dict[int, torch.Tensor | float] = dict.fromkeys(starts, 0.0)
    count = 0
    states: dict[int, torch.Tensor] = {}
    # only the streams a block score reads (not every layer's: at 70B that is 80 activations)
    wanted = set(starts) | {a + n_drop for a in starts}

    def probe(index: int, x: torch.Tensor, y: torch.Tensor) -> None:
        if index in wanted:
            states[index] = x
        if index + 1 in wanted:
            states[index + 1] = y

    for w in gates.wrappers:
        w.probe = probe
    try:
        for batch in batches:
            states.clear()
            if head:
                model(input_ids=batch.to(next(model.parameters()).device), use_cache=False, logits_to_keep=1)
            else:
                decoder_forward(model, batch)
            for a in starts:
                cos = torch.nn.functional.cosine_similarity(states[a].float(), states[a + n_drop].float(), dim=-1)
                sums[a] = sums[a] + (torch.arccos(cos.clamp(-1.0, 1.0)) / math.pi).sum().double()
            count += batch.numel()
    finally:
        for w in gates.wrappers:
            w.probe = None
        states.clear()
    return {a: float(v) / count for a, v in sums.items()}


@torch.no_grad()
def angular_drop(model, gates, batches: list[torch.Tensor], *, n_drop: int, candidates: list[int]) -> list[int]:
    """The contiguous block of n_drop candidates whose input and output are closest in angle."""
    from trsp_ray.common.errors import TrspError

    starts = contiguous_starts(n_drop=n_drop, candidates=candidates)
    if not starts:
        raise TrspError(f"no {n_drop} contiguous candidate layers to drop as one block (candidates "
                        f"{candidates[0]}..{candidates[-1]}); lower the ratio or protect fewer layers")
    dist = angular_distances(model, gates, batches, n_drop=n_drop, starts=starts)
    best = min(dist, key=dist.get)
    return list(range(best, best + n_drop))


@torch.no_grad()
def _calibration_nll(model, batches: list[torch.Tensor]) -> float:
    return sum(causal_lm_loss(model, b).item() for b in batches) / len(batches)


@torch.no_grad()
def sleb_cost(*, num_layers: int, candidates: list[int], n_drop: int, tokens: int) -> float:
    """Dense-forward tokens of SLEB with prefix replay (selectors.sleb_drop): per round one pass to
    record every layer's input, then for each candidate j a replay of the active layers after j."""
    drop: list[int] = []
    cost = 0.0
    for _ in range(n_drop):
        active = [i for i in range(num_layers) if i not in drop]
        cost += tokens * len(active) / num_layers
        for j in (c for c in candidates if c not in drop):
            cost += tokens * max(1, sum(1 for i in active if i > j)) / num_layers
        # which layer goes does not change the count much; take the last candidate as a stand-in
        drop.append([c for c in candidates if c not in drop][-1])
    return cost


def sleb_drop(model, gates, batches: list[torch.Tensor], *, n_drop: int, candidates: list[int],
              progress: Callable[[int, int, float], None] | None = None) -> list[int]:
    """SLEB: repeatedly remove the block whose removal gives the lowest calibration perplexity.

    Removing block j leaves layers < j untouched, so each round records every layer's input once
    and scores candidate j by replaying only the layers after it from x_j (bit-identical to a full
    forward with j bypassed, and about half the compute).

    Memory: batches are streamed. Each batch's layer inputs are recorded, every candidate is scored
    on that batch, and they are released before the next batch, so SLEB holds the model plus one
    batch's inputs to every layer (layers x batch x seqlen x hidden, model dtype, on the model's
    device) plus one forward pass, whatever the number of calibration windows. Per-candidate sums
    run over the batches in the same order as a batch-outer loop would, so the scores (and the drop
    list) are bit-identical to holding every batch's inputs at once.
    """
    drop: list[int] = []
    for r in range(n_drop):
        remaining = [c for c in candidates if c not in drop]
        totals = dict.fromkeys(remaining, 0.0)
        for batch in batches:
            inputs = _layer_inputs(model, gates, [batch], bypass=drop)
            for j in remaining:
                totals[j] += _score_without(model, gates, [batch], inputs, bypass=drop, j=j)
            del inputs
        scores = {j: total / len(batches) for j, total in totals.items()}
        best = min(scores, key=scores.get)
        drop.append(best)
        if progress is not None:
            progress(r + 1, n_drop, math.exp(scores[best]))
    gates.set_bypass([])
    return drop


def _layer_inputs(model, gates, batches, *, bypass: list[int]) -> list[dict[int, torch.Tensor]]:
    gates.set_bypass(bypass)
    captured: list[dict[int, torch.Tensor]] = []

    def probe(index: int, x: torch.Tensor, y: torch.Tensor) -> None:
        captured[-1][index] = x

    for w in gates.wrappers:
        w.probe = probe
    try:
        for batch in batches:
            captured.append({})
            causal_lm_loss(model, batch)
    finally:
        for w in gates.wrappers:
            w.probe = None
    return captured


def _score_without(model, gates, batches, inputs, *, bypass: list[int], j: int) -> float:
    later = [w.index for w in gates.wrappers if w.index > j and w.index not in bypass]
    if not later:  # j is the last active layer: nothing to replay, run the full model
        gates.set_bypass(bypass + [j])
        return _calibration_nll(model, batches)
    first_after = later[0]
    gates.set_bypass([w.index for w in gates.wrappers if w.index < first_after])
    total = 0.0
    try:
        for batch, captured in zip(batches, inputs):
            gates[first_after].inject = captured[j]
            total += causal_lm_loss(model, batch).item()
    finally:
        gates[first_after].inject = None
    return total / len(batches)
