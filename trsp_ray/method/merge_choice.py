"""Which attention units a merge keeps, by the loss the merged model is left with (merging.units=loss).

The energy choice (merge._top: the units that write most into the stream) and even the refit's own
least-squares error barely tell the kept units apart where it matters: on SmolLM2-135M, pair 8-9 alone
(its MLP left wide), the 20 ways to keep 3 of the wide block's 6 KV groups, each cut and refitted in
closed form on 64 calibration windows, spread the next-token loss on 16 held-out windows from 3.141 to
3.238 nats (dense 2.887, the flattened pair 3.115), and their refit errors (0.158-0.245 of the wide
output's energy) do not rank them: the lowest error was 4th by loss, the energy choice 17th of 20. So
each candidate is cut, refitted from the same full-width sums, and scored by the whole model's mean
next-token loss on a few calibration windows; the lowest is kept.

Candidates: every way to keep `units` of the 2 x units when there are at most `trials` of them (3 KV
groups a block: 20), else the energy choice and its single swaps (a kept unit out, a dropped one in),
the weakest kept against the strongest dropped first, up to `trials` in all. The layers before the
flattened block are the same for every trial, so the stream entering it is stored once (one pass of the
choice windows that stops there) and each trial runs the model from the block on; on ZeRO-3 ranks, where
every pass runs whole, each trial is a whole pass (merge_costs.merge_cost counts either).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import itertools
import math
from collections.abc import Callable

import torch

from trsp_ray.method.boundaries import Stop, hooked_pass
from trsp_ray.method.compensation import Stats
from trsp_ray.method.merge_blocks import Flat, cut_part, wide_of
from trsp_ray.method.surgery import shorten_config
from trsp_ray.method.training import causal_lm_loss
from trsp_ray.models import families

Refit = Callable[[torch.Tensor], torch.Tensor]  # kept units (ascending) -> the o columns' new weight [d, width]


def candidates(energy_top: torch.Tensor, energy: torch.Tensor, *, trials: int) -> list[tuple[int, ...]]:
    """The unit sets to try (module doc), the energy choice `energy_top` (ascending) first; `energy`: every
    wide unit's score."""
    wide, keep = len(energy), len(energy_top)
    top = tuple(int(u) for u in energy_top)
    if math.comb(wide, keep) <= trials:  # as merge_costs.choice_sets counts them
        return [top] + [s for s in itertools.combinations(range(wide), keep) if s != top]
    kept = sorted(top, key=lambda u: float(energy[u]))  # weakest kept first
    dropped = sorted((u for u in range(wide) if u not in top), key=lambda u: -float(energy[u]))  # strongest first
    swaps = sorted(itertools.product(range(keep), range(wide - keep)), key=lambda ij: (ij[0] + ij[1], ij))
    got = [top]
    for i, j in swaps[:trials - 1]:
        got.append(tuple(sorted(set(top) - {kept[i]} | {dropped[j]})))
    return got


@torch.no_grad()
def mean_loss(model, windows, *, reduce: Callable[[torch.Tensor], torch.Tensor]) -> float:
    """The mean next-token cross-entropy of `model` over token-id batches `windows`, summed over ranks."""
    total = torch.zeros(2, dtype=torch.float64, device=next(model.parameters()).device)
    for batch in windows:  # training.causal_lm_loss: the mean over the batch's next tokens
        n = batch[:, 1:].numel()
        total += torch.stack([causal_lm_loss(model, batch).double() * n, total.new_tensor(float(n))])
    total = reduce(total)
    return float(total[0] / total[1])


def block_inputs(model, index: int, windows) -> list[torch.Tensor]:
    """Per batch of `windows`, the stream entering decoder layer `index`, from one pass a batch that stops
    there (held where the model runs: choice windows' worth, 2,048 x d values on SmolLM2's defaults)."""
    layer = families.decoder_layers(model)[index]
    got: list[torch.Tensor] = []

    def keep(_module, args, kwargs):
        got.append(args[0] if args else kwargs["hidden_states"])
        raise Stop

    for batch in windows:
        hooked_pass(model, batch, [layer.register_forward_pre_hook(keep, with_kwargs=True)])
    return got


@contextlib.contextmanager
def starting_at(model, index: int, inputs: list[torch.Tensor]):
    """Within the block, `model`'s passes run its decoder layers from `index` on only, the k-th pass's stream
    entering layer `index` replaced by inputs[k] (block_inputs of the same windows, in order): the layers
    before it are skipped, and everything else a forward does (embeddings, masks, positions, the final norm
    and head) runs as usual, whatever the family; the config's per-layer lists (sliding or full attention,
    read by position) are cut to the same layers. Layers and config are put back however the block ends."""
    layers = families.decoder_layers(model)
    stream = iter(inputs)

    def enter(_module, args, kwargs):
        h = next(stream)
        return ((h, *args[1:]), kwargs) if args else (args, {**kwargs, "hidden_states": h})

    text, total = families.text_config(model), len(layers)
    named = families.per_layer_lists(text, total, families.family_of(model).per_layer_config)
    saved = {name: getattr(text, name) for name in (*named, "num_hidden_layers")}
    handle = layers[index].register_forward_pre_hook(enter, with_kwargs=True)
    try:
        families.set_decoder_layers(model, torch.nn.ModuleList(list(layers)[index:]))
        shorten_config(model.config, kept=list(range(index, total)), total=total)  # e.g. layer_types, read by position
        yield
    finally:
        families.set_decoder_layers(model, layers)
        for name, value in saved.items():
            setattr(text, name, value)
        handle.remove()


def choose_units(model, flat: Flat, sets: list[tuple[int, ...]], refit: Refit, windows, *,
                 reduce: Callable[[torch.Tensor], torch.Tensor], stop: bool = True,
                 score: Callable[..., float] = mean_loss) -> tuple[torch.Tensor, list[float]]:
    """(the unit set of `sets` whose cut, with `refit`'s weights, leaves `model` the lowest mean loss on
    `windows`, and every set's loss). The flattened block is cut on a copy each time; `model` is left as
    it came, still wide. `stop`: the stream entering the block is stored once and each trial runs from the
    block on (module doc); False: whole passes (ZeRO-3 ranks). `score(model, windows, reduce=)`: what a
    trial is ranked by, lower better (mean_loss; benchmarks/merge_units.py also ranks by the KL to dense)."""
    wide = wide_of(model, flat)
    inputs = block_inputs(model, flat.index, windows) if stop else None
    losses = []
    try:
        for units in sets:
            keep, trial = torch.tensor(units), copy.deepcopy(wide)
            _put(model, flat, trial)
            cut_part(model, dataclasses.replace(flat, restore=dict(flat.restore)), "attention", keep=keep,
                     out=refit(keep))
            with starting_at(model, flat.index, inputs) if stop else contextlib.nullcontext():
                losses.append(score(model, windows, reduce=reduce))
    finally:
        _put(model, flat, wide)
    return torch.tensor(sets[min(range(len(sets)), key=losses.__getitem__)]), losses


def _put(model, flat: Flat, block: torch.nn.Module) -> None:
    """`block` as the flattened pair's wide block: its own (a ZeRO-3 rank's, which a hook runs) or the model's layer."""
    if flat.block is not None:
        flat.block = block
    else:
        families.decoder_layers(model)[flat.index] = block


def sub_stats(stats: Stats, cols: torch.Tensor) -> Stats:
    """The refit sums of the input columns `cols` alone, from sums over every column."""
    cols = cols.to(stats.mtm.device)
    return Stats(stats.block, stats.mtm[cols][:, cols], stats.mty[cols], stats.yty, stats.tokens)


def first_rows(windows: list, rows: int) -> list:
    """The first batches of `windows` that hold `rows` windows (the last one cut to fit)."""
    got, left = [], rows
    for batch in windows:
        if left <= 0:
            break
        got.append(batch[:left])
        left -= len(got[-1])
    return got
