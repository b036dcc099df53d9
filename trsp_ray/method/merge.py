"""Merge instead of drop (FlattenGPT, ICML 2026): each chosen pair of adjacent blocks becomes one block of the original
shape, so the export is a stock model with one layer fewer per pair. The pair is first flattened into one block of
twice the width (trsp_ray/method/merge_blocks.py: the parallel form, the norms folded), then cut back to the
original counts of heads and channels and repaired.

The cut. Both blocks' attention units and MLP channels are scored on calibration windows through the flattened
model: a unit's score is the summed squared norm of what it adds to the residual stream (its heads' outputs through
their o columns), a channel's the same through its down column. The top half is kept: as many KV groups (heads
without grouped-query attention) and channels as one block has. That is the channels' choice; the attention's
(merging.units=loss, the default) tries every set of units to keep (at most merging.unit_trials), refitted, and
keeps the one leaving the lowest next-token loss (merge_choice.py: on SmolLM2 the energy choice was 17th of 20 by
held-out loss).

The repair. What the removed units wrote is refitted into the kept units' output weights in closed form, for the MLP
(down columns) and the attention (o columns) alike. On a second pass through the flattened block, still wide, Z =
the kept units' inputs to the output linear [n, k] (the kept channels' activations; the kept heads' attention
outputs) and Y = the wide block's output of that linear [n, d] (its bias aside):
    W = argmin ||Z W - Y||^2 + r ||W - W0||^2 = W0 + (Z^T Z + r I)^-1 (Z^T Y - Z^T Z W0),
W0 = the kept units' own output rows (plain dropping), r = ridge * mean(diag(Z^T Z)): the ridge shrinks towards
plain dropping, so a cut that loses nothing keeps its weights. The sums are float64 (compensation.Stats, as the
least-squares fold's) and, under "norm" weighting, every token's rows are divided by the norm of the stream entering
the block (compensation.py's reason: a few attention-sink tokens, streams ~100x the others', would otherwise hold
the fit and the scores). Both refits aim at the flattened pair's own outputs, so one pass serves both; the MLP's
inputs are then those of the wide attention, which the attention's refit imitates. On SmolLM2-135M's pair 8-9
(validation PPL, dense 28.3, flattened 33.0) the attention's refit took its cut from 38.9 to 35.0.

The target (merging.target). "wide": both refits aim at the flattened block's own outputs, as above. "pair": the
attention's refit does, then the attention is cut and one more pass refits the MLP's down columns towards the stream
the two original blocks leave on the same input (copies of them run inside the pass), Y = y* - (the block's output
less its MLP's) - the down bias: the last linear repairs the flattening's approximation and the attention's cut too,
as the fold repairs a drop. On SmolLM2-135M at 8 of 30 (docs/results.md) it raised LAMBADA from 0.032 to 0.088 and
halved wiki PPL. "dense" (the default): the same, with y* the stream the dense model leaves after the pair on the
same window, stored on the host by one pass before the first merge (boundaries.layer_outputs, target_bytes):
each pair's refit also repairs what the earlier merges left in its input, as the sequential fold does. Same pairs:
LAMBADA 0.090, every domain's perplexity 7-17% lower than "pair" (wiki 55.9 -> 50.3), and no original blocks to run.

Order. Pairs are merged from the first, each on the stream the earlier merges left (the windows run through the
model as merged so far), so every pair's cut and repair see what the final model feeds it. Each pass stops after the
pair's block (merge_cost counts it). A pair done is final: an interrupted merge resumes after it (run/merge_store.py).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from trsp_ray.common.errors import TrspError
from trsp_ray.method.boundaries import Stop, hidden, hooked_pass, layer_outputs
from trsp_ray.method.compensation import Stats
from trsp_ray.method.compensation_forms import WEIGHTINGS
from trsp_ray.method.merge_blocks import (
    Flat,
    InPlace,
    attention_layout,
    check_pairs,
    cut_part,
    mlp_layout,
    module_at,
    wide_of,
)
from trsp_ray.method.merge_choice import candidates, choose_units, first_rows, sub_stats
from trsp_ray.method.merge_costs import choice_sets, merge_cost, refit_bytes
from trsp_ray.models import families

Reduce = Callable[[torch.Tensor], torch.Tensor]
# what the MLP's refit reproduces: the two blocks' own output, the wide block's, or the dense model's stream
TARGETS = ("pair", "wide", "dense")
def _token_weights(x: torch.Tensor, weighting: str) -> torch.Tensor:
    """[n] float32 on x's device: 1 / the norm of each token's stream entering the block ("norm"), or 1."""
    x = x.reshape(-1, x.shape[-1]).float()
    return x.new_ones(x.shape[0]) if weighting == "none" else 1.0 / x.norm(dim=-1).clamp_min(1e-12)


def _passes(model, flat: Flat, windows, *, weighting: str, stop: bool, attn=None, mlp=None, block=None,
            enter=None) -> int:
    """Run `windows` (token ids [B, S] each) through `model` with hooks on the flattened block: attn(z, y,
    w) gets the attention output linear's input [n, width] and output [n, d], mlp(z, y, w) the MLP output
    linear's [n, I] and [n, d], both with the token weights w [n]; block(y, w) the block's output
    [n, d], after them; enter(args, kwargs) the block's call as it begins. `stop`: each pass ends after the
    block. Returns the tokens run."""
    layer = wide_of(model, flat)
    now: dict = {}
    rows = lambda t: t.reshape(-1, t.shape[-1])  # noqa: E731

    def weigh(_module, args, kwargs):
        now["w"] = _token_weights(args[0] if args else kwargs["hidden_states"], weighting)
        if enter is not None:
            enter(args, kwargs)

    def halt(*_):
        raise Stop

    hooks = [(flat.attention.output.path, attn), (flat.mlp.output.path, mlp)]
    tokens = 0
    for batch in windows:
        handles = [layer.register_forward_pre_hook(weigh, with_kwargs=True)]
        for path, call in hooks:
            if call is not None:
                hook = lambda _m, inputs, output, call=call: call(rows(inputs[0]), rows(output), now["w"])  # noqa: E731
                handles.append(module_at(layer, path).register_forward_hook(hook))
        if block is not None:
            handles.append(layer.register_forward_hook(lambda _m, _i, output: block(rows(hidden(output)), now["w"])))
        if stop:
            handles.append(layer.register_forward_hook(halt))
        hooked_pass(model, batch, handles)
        tokens += int(batch.numel())
    return tokens


def _outputs(model, flat: Flat) -> tuple:
    """The flattened block's attention and MLP output linears."""
    layer = wide_of(model, flat)
    return module_at(layer, flat.attention.output.path), module_at(layer, flat.mlp.output.path)


@torch.no_grad()
def scores(model, flat: Flat, windows, *, weighting: str = "norm", stop: bool = True,
           reduce: Reduce = lambda t: t) -> tuple[torch.Tensor, torch.Tensor]:
    """(attention unit scores [2 x units], channel scores [2 x channels]), float64, a's first: the summed
    (token-weighted) squared norm of each one's contribution to the residual stream over `windows`,
    through the flattened (still wide) pair `flat`; `reduce` sums them over ranks."""
    width, wide_units = flat.attention.output.sizes[0], 2 * flat.attention.units
    o_proj, down = _outputs(model, flat)
    got: dict = {}

    def attn(z, _y, w):
        s = got.setdefault("attn", z.new_zeros(wide_units, dtype=torch.float64))
        for u in range(wide_units):  # one [n, d] contribution at a time, not [n, units, d]
            part = z[:, u * width:(u + 1) * width] @ o_proj.weight[:, u * width:(u + 1) * width].T
            s[u] += (part.float().pow(2).sum(-1) * w.pow(2)).sum().double()

    def mlp(z, _y, w):
        s = got.setdefault("mlp", z.new_zeros(z.shape[1], dtype=torch.float64))
        s += (z.float() * w[:, None]).pow(2).sum(0, dtype=torch.float64)

    _passes(model, flat, windows, weighting=weighting, stop=stop, attn=attn, mlp=mlp)
    if not got:
        raise TrspError("merge has no calibration windows to score the pair's heads and channels on")
    total = reduce(torch.cat([got["attn"], got["mlp"]]))
    return total[:wide_units], total[wide_units:] * down.weight.double().pow(2).sum(0).to(total.device)


def columns(units: torch.Tensor, width: int) -> torch.Tensor:
    """The input columns [len(units) x width] of an output linear that units `units` (ascending) own."""
    return (units[:, None] * width + torch.arange(width, device=units.device)).flatten()


def _add(stats: Stats | None, block: tuple[int, int], z: torch.Tensor, y: torch.Tensor, w: torch.Tensor) -> Stats:
    """Add one batch's rows, z [n, k] (the kept units' inputs) and y [n, d] (the target), each token's
    weighted by w [n], to the float64 sums (new when `stats` is None)."""
    z = z.double() * w[:, None]
    y = y.to(torch.float64, copy=True).mul_(w[:, None])  # a copy: `y` may be the forward's own float64 tensor
    return (stats or Stats.zeros(block, z.shape[1], y.shape[1], z)).add(z, y)


@torch.no_grad()
def refit_sums(model, flat: Flat, windows, *, units: torch.Tensor | None, channels: torch.Tensor | None,
               weighting: str = "norm", stop: bool = True, reduce: Reduce = lambda t: t) -> tuple:
    """The float64 sums of the two refits (module doc) over `windows` through the flattened pair `flat`,
    still wide, token-weighted and summed over ranks by `reduce`: (attention, MLP), each with Z^T Z of
    the kept `units`' (`channels`') inputs to the output linear, Z^T Y with Y the wide output less its
    bias, and ||Y||^2; a part whose kept units are None is not summed (its entry is None)."""
    o_proj, down = _outputs(model, flat)
    keep = {"attn": None if units is None else columns(units, flat.attention.output.sizes[0]), "mlp": channels}
    bias = {"attn": o_proj.bias, "mlp": down.bias}
    got: dict = {"attn": None, "mlp": None}

    def adder(key):
        if keep[key] is None:
            return None

        def add(z, y, w):
            target = y if bias[key] is None else y - bias[key]
            got[key] = _add(got[key], (flat.index, flat.index + 1), z[:, keep[key].to(z.device)], target, w)
        return add

    _passes(model, flat, windows, weighting=weighting, stop=stop, attn=adder("attn"), mlp=adder("mlp"))
    return tuple(None if got[key] is None else got[key].reduced(reduce) for key in ("attn", "mlp"))


@torch.no_grad()
def pair_mlp_sums(model, flat: Flat, windows, pair: torch.nn.ModuleList | list, *, channels: torch.Tensor,
                  weighting: str = "norm", stop: bool = True, reduce: Reduce = lambda t: t) -> Stats:
    """The float64 sums of the MLP's refit towards the pair's own output (target "pair", module doc), over
    `windows` through the flattened pair `flat` whose attention is already cut: Z the kept `channels`'
    activations [n, k], Y = y* - (the block's output less what its MLP output linear wrote, bias
    included) - that linear's bias, so Z W^T + bias completes the stream to y*, the output of `pair` (the
    two blocks as they were, run on the block's own input and arguments); or, when `pair` is a list (target
    "dense"), y* = its i-th tensor [n, d] for the i-th window: the dense model's stream there (layer_outputs)."""
    down = _outputs(model, flat)[1]
    now: dict = {"window": 0}
    got: dict = {"stats": None}

    def enter(args, kwargs):
        x = args[0] if args else kwargs["hidden_states"]
        if isinstance(pair, list):
            now["truth"], now["window"] = pair[now["window"]].to(x.device), now["window"] + 1
            return
        for block in pair:  # each original block on the stream the one before it left
            x = hidden(block(x, *args[1:], **kwargs) if args else block(**{**kwargs, "hidden_states": x}))
        now["truth"] = x.reshape(-1, x.shape[-1])

    def mlp(z, y, _w):
        now["z"], now["y"] = z[:, channels.to(z.device)], y

    def block_out(out, w):
        target = now["truth"].double() - out.double() + now["y"].double()
        if down.bias is not None:
            target -= down.bias.double()
        got["stats"] = _add(got["stats"], (flat.index, flat.index + 1), now["z"], target, w)

    _passes(model, flat, windows, weighting=weighting, stop=stop, mlp=mlp, block=block_out, enter=enter)
    return got["stats"].reduced(reduce)


def solve_refit(stats: Stats, w0: torch.Tensor, *, ridge: float) -> torch.Tensor:
    """W [k, d] (float64) = W0 + (A + r I)^-1 (B - A W0): the kept units' output rows (an output linear's
    columns, transposed) that best reproduce the wide block's output, shrunk towards W0 [k, d] (their own)
    by r = ridge * mean(diag A)."""
    a, w0 = stats.mtm, w0.to(stats.mtm)
    shifted = a.clone()
    shifted.diagonal().add_(ridge * a.diagonal().mean())
    try:
        return w0 + torch.linalg.solve(shifted, stats.mty - a @ w0)
    except torch.linalg.LinAlgError:
        raise TrspError(f"the merge's refit is singular at ridge={ridge}; raise the ridge or the "
                        "calibration windows") from None


def _writes(model, flat: Flat) -> tuple[torch.Tensor, torch.Tensor]:
    """(per attention unit, per channel) the squared norm of its output columns, float64, a's first."""
    layer = wide_of(model, flat)
    got = []
    for layout in (flat.attention, flat.mlp):
        columns = module_at(layer, layout.output.path).weight.double().pow(2).sum(0)
        got.append(columns.reshape(-1, layout.output.sizes[0]).sum(1))
    return got[0], got[1]


def _top(score: torch.Tensor, writes: torch.Tensor, keep: int) -> torch.Tensor:
    """The indices of the `keep` highest scores, ascending (a's units before b's). Equal scores go to the
    unit whose output columns write more: a ReLU channel silent on the calibration windows (score 0) is
    kept before one whose down column is zero, which can never write anything."""
    by_writes = torch.sort(writes.to(score.device), descending=True, stable=True).indices
    order = by_writes[torch.sort(score[by_writes], descending=True, stable=True).indices]
    return torch.sort(order[:keep]).values


def _check(*, model, firsts, windows, refit: bool, ridge: float, weighting: str, tokens: int, target: str,
           units: str) -> None:
    """Refuse, in one line and before any pass, a merge that cannot run."""
    if target not in TARGETS:
        raise TrspError(f"merge target={target!r} is not valid; choose one of {', '.join(TARGETS)}")
    if units not in ("loss", "energy"):
        raise TrspError(f"merge units={units!r} is not valid; choose loss or energy")
    if weighting not in WEIGHTINGS:
        raise TrspError(f"merge weighting={weighting!r} is not valid; choose one of {', '.join(WEIGHTINGS)}")
    if not ridge >= 0:
        raise TrspError(f"merge ridge={ridge!r} is not valid; use a number >= 0 (1e-2 by default)")
    check_pairs(model=model, firsts=firsts)
    if not windows:
        raise TrspError("merge has no calibration windows; pass at least one batch of token ids")
    first = families.decoder_layers(model)[0]
    channels = mlp_layout(model, first).units
    width = module_at(first, attention_layout(model, first).output.path).in_features
    if refit and tokens < max(channels, width):
        raise TrspError(f"merge has {tokens} calibration tokens, fewer than the {max(channels, width)} kept inputs "
                        "(MLP channels, attention q rows) a refit solves for; add calibration windows or merge "
                        "with refit=False")


@torch.no_grad()
def merge_pairs(*, model, firsts, windows, refit: bool = True, ridge: float = 1e-2, weighting: str = "norm",
                target: str = "dense", units: str = "loss", trials: int = 24, choice_windows: int = 16,
                stop: bool = True, reduce: Reduce = lambda t: t,
                progress: Callable[[int, int, dict], None] | None = None,
                resume: list[tuple[dict, dict]] | None = None, host=None) -> dict:
    """Merge blocks (a, a + 1) of `model` for every a of `firsts` (original indices, non-overlapping), in
    place: each pair becomes one block of the original shape at a (module doc).

    `windows`: calibration batches of token ids [B, S] (this rank's shard); `refit`: repair the cut in
    closed form (False: plain dropping of heads and channels); `ridge`: the refit's shrinkage towards plain
    dropping; `weighting`: "norm" (each token relative to its stream) or "none"; `target`: what the MLP's
    refit reproduces, "dense" (the dense model's stream after the pair), "pair" (the two blocks' own output)
    or "wide" (the flattened block's); `units`: the attention units kept, "loss" (of at most `trials` sets, the
    one leaving the lowest loss on the first `choice_windows` windows, merge_choice.py) or "energy" (those
    that write most); `stop=False` runs every pass to the end (ZeRO-3); `reduce(t)`: the sum over ranks;
    `progress(k, n, pair)`: called as the k-th of the n pairs is done, with its "per_pair" entry; `resume`: the
    first pairs' ("per_pair" entry, merged block's state_dict) as an interrupted merge stored them, put back;
    `host`: where the pairs are flattened and put (merge_blocks.InPlace, the default; ZeRO-3 ranks:
    distributed/merging.py, whose model keeps its layers and gates). Returns {"pairs": [(a, a + 1)],
    "removed": the original indices gone (a + 1), "kept": the original index behind each layer of the merged
    model, "tokens": calibration tokens (all ranks), "cost": dense-forward tokens (merge_cost), "sizes": what a
    plan counts (hidden, intermediate, attention units and their q rows, the refit's sum bytes), "per_pair":
    per pair the units and channels kept from each block ("units_from", "channels_from": (from a, from b))
    and, with the refit, the attention's and the MLP's output error relative to the wide block's on the
    calibration tokens, dropped and refitted ("attn_error_drop", "attn_error_refit", "mlp_error_drop",
    "mlp_error_refit"); units "loss": every set's loss, the energy choice's first ("unit_losses"), and its rank)}."""
    host = host or InPlace()
    firsts = sorted(int(a) for a in firsts)
    windows = list(windows)
    tokens = int(round(reduce(torch.tensor(float(sum(int(w.numel()) for w in windows)), dtype=torch.float64)).item()))
    _check(model=model, firsts=firsts, windows=windows, refit=refit, ridge=ridge, weighting=weighting, tokens=tokens,
           target=target, units=units)
    host.prepare(model)
    num = families.num_layers(model)
    removed = [a + 1 for a in firsts]
    choice = {"trials": trials, "windows": first_rows(windows, choice_windows)} if units == "loss" else None
    first = families.decoder_layers(model)[0]
    sets = choice_sets(attention_layout(model, first).units, trials) if choice else 0
    seen = reduce(torch.tensor(float(sum(int(w.numel()) for w in choice["windows"])) if choice else 0.0,
                               dtype=torch.float64))
    info: dict = {"pairs": [(a, a + 1) for a in firsts], "removed": removed,
                  "kept": [i for i in range(num) if i not in set(removed)], "tokens": tokens,
                  "cost": merge_cost(firsts=firsts, num_layers=num, tokens=tokens, refit=refit, stops=stop,
                                     target=target, sets=sets, choice_tokens=int(round(seen.item()))),
                  "per_pair": [], "sizes": _sizes(model, first)}
    resume, later = list(resume or []), [a + 1 for a in firsts[len(resume or []):]]
    truths = layer_outputs(model, later, windows, stop=stop) if refit and target == "dense" and later else None
    for k, a in enumerate(firsts):
        if k < len(resume):  # done before an interruption
            host.put(model, a, k, resume[k][1])
            info["per_pair"].append(resume[k][0])
            continue
        pair = host.originals(model, a, k) if refit and target == "pair" else None
        if truths is not None:  # each pair's targets are freed once its refit has read them
            pair, truths[k - len(resume)] = truths[k - len(resume)], []
        flat = host.flatten(model, a, k)
        info["per_pair"].append(_cut_pair(model, flat, windows, pair, refit=refit, ridge=ridge, weighting=weighting,
                                          stop=stop, reduce=reduce, choice=choice) | {"pair": (a, a + 1)})
        host.finish(model, flat, a, k)
        if progress is not None:
            progress(k + 1, len(firsts), info["per_pair"][-1])
    return info


def _cut_pair(model, flat: Flat, windows, pair: torch.nn.ModuleList | list | None, *, refit: bool, ridge: float,
              weighting: str, stop: bool, reduce: Reduce, choice: dict | None = None) -> dict:
    """Score, refit (with `refit`) and cut the flattened pair `flat`: what was kept from each block and
    the attention's and MLP's relative output errors on the calibration tokens, dropped and refitted.
    `pair` (the two blocks as they were; None: target "wide"): the MLP's refit aims at their output, on a
    pass after the attention's cut. `choice` ({"trials", "windows"}; None: the energy choice): the attention
    units kept by the loss they leave (merge_choice.py)."""
    unit_scores, channel_scores = scores(model, flat, windows, weighting=weighting, stop=stop, reduce=reduce)
    unit_writes, channel_writes = _writes(model, flat)
    units = _top(unit_scores, unit_writes, flat.attention.units)
    channels = _top(channel_scores, channel_writes, flat.mlp.units)
    if not refit:
        cut_part(model, flat, "attention", keep=units)
        cut_part(model, flat, "mlp", keep=channels)
        return {"units_from": _split(units, flat.attention.units), "channels_from": _split(channels, flat.mlp.units)}
    o_proj, down = _outputs(model, flat)
    width, chosen = flat.attention.output.sizes[0], {}
    summed = torch.arange(2 * flat.attention.units) if choice else units
    attn, mlp = refit_sums(model, flat, windows, units=summed, channels=None if pair is not None else channels,
                           weighting=weighting, stop=stop, reduce=reduce)
    if choice:  # merging.units=loss (merge_choice.py): every candidate cut, refitted from the full-width sums
        def refit_for(keep):
            return _solved(sub_stats(attn, columns(keep, width)), o_proj, columns(keep, width), ridge=ridge,
                           key="attn")[0]

        sets = candidates(units, unit_scores, trials=choice["trials"])
        units, losses = choose_units(model, flat, sets, refit_for, choice["windows"], reduce=reduce, stop=stop)
        attn = sub_stats(attn, columns(units, width))
        chosen = {"unit_losses": losses, "energy_rank": sorted(losses).index(losses[0])}
    got: dict = {"units_from": _split(units, flat.attention.units), "channels_from": _split(channels, flat.mlp.units),
                 **chosen}
    out, errors = _solved(attn, o_proj, columns(units, width), ridge=ridge, key="attn")
    cut_part(model, flat, "attention", keep=units, out=out)
    if pair is not None:
        mlp = pair_mlp_sums(model, flat, windows, pair, channels=channels, weighting=weighting, stop=stop,
                            reduce=reduce)
    out, more = _solved(mlp, down, channels, ridge=ridge, key="mlp")
    cut_part(model, flat, "mlp", keep=channels, out=out)
    return got | errors | more


def _solved(stats: Stats, linear, kept: torch.Tensor, *, ridge: float, key: str) -> tuple[torch.Tensor, dict]:
    """One refit solved from `stats`: the new output weight [d, k] of `linear`'s `kept` input columns, and
    the relative errors on the calibration tokens with plain dropping and with the refit."""
    w0 = linear.weight[:, kept.to(linear.weight.device)].T.double()
    w = solve_refit(stats, w0, ridge=ridge)
    energy = float(stats.yty) or 1.0
    return w.T, {f"{key}_error_drop": stats.residual(w0) / energy, f"{key}_error_refit": stats.residual(w) / energy}


def _split(kept: torch.Tensor, units: int) -> tuple[int, int]:
    """How many of the `kept` wide indices come from block a (below `units`) and from block b."""
    from_a = int((kept < units).sum())
    return from_a, len(kept) - from_a


def _sizes(model, layer) -> dict:
    """The sizes a compute or memory plan of a merge reads, of decoder layer `layer` (every block has the same)."""
    attn, mlp = attention_layout(model, layer), mlp_layout(model, layer)
    hidden = families.text_config(model).hidden_size
    return {"hidden": hidden, "intermediate": mlp.units, "attention_units": attn.units,
            "unit_q_rows": attn.output.sizes[0], "refit_bytes": refit_bytes(
                intermediate=mlp.units, hidden=hidden, attention_width=attn.units * attn.output.sizes[0])}
