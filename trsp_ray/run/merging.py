"""A merge as a step of a run (--method merge, merge+heal; issue 51): the pairs a selection chose are
merged into one block each (trsp_ray/method/merge.py) where a drop would remove their second layers.

A merge's drop set is the second layer of every pair (the layers the merged model no longer has), in the
selection's order, so the manifest, the export, the tables and the plans read it as any drop set; the
pair of a dropped layer d is (d - 1, d). Its compute is the row's fit (compute.fit_spent): the scoring
and refit passes (merge_costs.merge_cost) and the float64 sums and solves of the refits (`solve_cost`).
"""

from __future__ import annotations

from trsp_ray.common.logs import log
from trsp_ray.models import families
from trsp_ray.plan.compute import FLOAT64_SLOWDOWN, forward_weights, model_shape
from trsp_ray.plan.merge_plan import merge_windows, shape_widths
from trsp_ray.plan.shape import Shape
from trsp_ray.run.content import checkpoint_root
from trsp_ray.run.merge_store import MergeCheckpoints, merge_key

# The refits' float64 work per pair (merge.refit_sums, solve_refit) in FLOPs: per token and refit
# 2 k (k + d) for Z^T Z and Z^T Y (k the kept inputs: the MLP's channels, the attention's q rows); per
# refit a solve of k columns against d right-hand sides, k^3 / 3 + 2 k^2 d
SUMS, FACTOR, SOLVE = 2.0, 1.0 / 3.0, 2.0


def solve_cost(shape: Shape, *, tokens: float, pairs: int, sets: int = 0) -> float:
    """Dense-forward tokens of the refits' float64 work for `pairs` pairs on `tokens` calibration tokens
    (FLOPs x compute.FLOAT64_SLOWDOWN over a dense forward's FLOPs per token); `sets` > 0 (merging.units=loss):
    the attention's sums over the wide block's columns and one solve per unit set tried."""
    d = float(shape.hidden)
    mlp, attn = map(float, shape_widths(shape))
    flops = SUMS * mlp * (mlp + d) * tokens + FACTOR * mlp ** 3 + SOLVE * mlp * mlp * d
    summed = 2 * attn if sets else attn
    flops += SUMS * summed * (summed + d) * tokens + max(sets, 1) * (FACTOR * attn ** 3 + SOLVE * attn * attn * d)
    return pairs * flops * FLOAT64_SLOWDOWN / (2.0 * forward_weights(shape))


def choice(cfg, shape: Shape) -> dict:
    """merge_cost's and solve_cost's count of merging.units=loss's trials: {"sets", "choice_tokens"} ({} for
    the energy choice)."""
    m = cfg.merging
    if not (m.refit and m.units == "loss"):
        return {}
    from trsp_ray.method.merge_costs import choice_sets

    return {"sets": choice_sets(shape.kv_heads, m.unit_trials), "choice_tokens": m.choice_windows * cfg.data.seqlen}


def planned_cost(cfg, shape: Shape, *, n_pairs: int) -> float:
    """An upper bound of a merge's compute before its pairs are known: merge_costs.merge_cost on the deepest
    pairs `n_pairs` non-overlapping pairs can be (the last two layers, the two before them, ...), each
    pass stopping after its pair as merge_pairs runs it in one process (whole passes on ZeRO-3 workers,
    distributed/merging.py), and the refits' float64 work. Any pairs cost at most this: a pair's passes grow
    with its depth, and the k-th pair from the top is at most 2k layers from the end; units=loss's trials
    shrink with depth, and are bounded on the shallowest pairs (0-1, 2-3, ...)."""
    from trsp_ray.method.merge_costs import merge_cost, trial_cost

    tokens, stops = merge_windows(cfg, shape) * cfg.data.seqlen, not cfg.distributed.workers
    deepest = [shape.layers - 2 * k for k in range(1, n_pairs + 1)]
    trials = choice(cfg, shape)
    passes = merge_cost(firsts=deepest, num_layers=shape.layers, tokens=tokens, refit=cfg.merging.refit,
                        target=cfg.merging.target, stops=stops)
    if trials and cfg.merging.refit:  # the trials run from each pair's block on: the shallowest pairs bound them
        passes += trial_cost(firsts=[2 * k for k in range(n_pairs)], num_layers=shape.layers, stops=stops, **trials)
    sets = trials.get("sets", 0)
    return passes + (solve_cost(shape, tokens=tokens, pairs=n_pairs, sets=sets) if cfg.merging.refit else 0.0)


def drop_cost(cfg, *, drop: list[int], num_layers: int) -> float:
    """A merge's compute once its drop set is known: the passes merge_pairs runs (merge_costs.merge_cost, each
    stopping after its pair) and the refits' float64 work, on merge_windows' tokens."""
    from trsp_ray.method.merge_costs import merge_cost

    shape = model_shape(cfg.model)
    tokens = merge_windows(cfg, shape) * cfg.data.seqlen
    trials = choice(cfg, shape)
    passes = merge_cost(firsts=[d - 1 for d in drop], num_layers=num_layers, tokens=tokens, refit=cfg.merging.refit,
                        target=cfg.merging.target, stops=not cfg.distributed.workers, **trials)
    sets = trials.get("sets", 0)
    return passes + (solve_cost(shape, tokens=tokens, pairs=len(drop), sets=sets) if cfg.merging.refit else 0.0)


def heal_left(cfg, *, spec, heal, drop: list[int], info: dict):
    """`heal` with the steps heal.compute_budget leaves after what this run's selection and merge spent
    (`info`'s select_cost and merge costs, on `drop`): the budget's steps were resolved on planned_cost,
    a bound over the deepest pairs, and shallower pairs spend less (SmolLM2 at 8 of 30, 1M: the bound
    856k, the angular pairs 546k, so 10 steps become 35). Unchanged without a budget, for a pipeline that
    does not heal, or where the selection did not run here (a drop set handed in)."""
    if not (cfg.heal.compute_budget and spec.heal) or "select_cost" not in info:
        return heal
    import dataclasses

    from trsp_ray.plan.compute import fit_spent, heal_steps

    steps = heal_steps(cfg, spec=spec, select=info["select_cost"], comp=fit_spent(info), drop=drop)
    log(f"{cfg.method}: the merge spent {fit_spent(info) / 1e3:.0f}k dense-forward tokens of the "
        f"{cfg.heal.compute_budget / 1e3:.0f}k budget; the heal gets the {steps} steps left (planned {heal.steps})")
    return dataclasses.replace(heal, steps=steps)


def pair_progress(model, store, merged=None):
    """merge_pairs' progress: one line a pair, its time and what it kept (a merge runs for minutes a pair
    on a CPU; SmolLM2's 8 took 37 min on 2 cores), and the pair stored in `store` (merge_store.py; None: not
    stored). `merged(a, k)`: the merged block of the k-th pair (0-based) starting at a (default: the model's
    layer a - k, where one process merges: the k earlier pairs are one layer each by now)."""
    import time

    last = [time.monotonic()]
    merged = merged or (lambda a, k: families.decoder_layers(model)[a - k])

    def show(k: int, n: int, pair: dict) -> None:
        now, a = time.monotonic(), pair["pair"][0]
        if store is not None:
            store.save(k - 1, pair, merged(a, k - 1))
        losses = pair.get("unit_losses")
        chose = (f"; the KV groups kept leave loss {min(losses):.3f} on the choice windows (the energy choice "
                 f"{losses[0]:.3f}, {pair['energy_rank'] + 1} of {len(losses)})") if losses else ""
        refit = (f"; MLP error {pair['mlp_error_drop']:.3f} dropped, {pair['mlp_error_refit']:.3f} refitted"
                 if "mlp_error_refit" in pair else "")
        log(f"merge: pair {k}/{n} ({a}, {a + 1}) done in {now - last[0]:.0f}s{chose}{refit}")
        last[0] = now

    return show


def merge_layers(model, *, drop: list[int], windows, cfg, info: dict) -> tuple[list[int], MergeCheckpoints]:
    """Merge the pair (d - 1, d) of `model` for every d of `drop` (in place, gates detached) on the
    calibration `windows` (token ids [B, S] each) with cfg.merging's settings; returns the original index
    behind each layer left and the store of the merged pairs, and adds to `info` what the manifest and the
    tables record of the merge. The caller clears the store once nothing after the merge can be interrupted
    (after the heal: a heal resumed from its checkpoint needs the merged model back, not a merge redone)."""
    from trsp_ray.method.merge import merge_pairs

    m = cfg.merging
    store = MergeCheckpoints(checkpoint_root(cfg.checkpoint_dir),
                             merge_key(cfg.to_dict(), drop=drop, stage2="stage2_steps" in info))
    resume = store.finished()
    if resume:
        log(f"merge: resuming after pair {len(resume)} of {len(drop)} from {store.dir}")
    done = merge_pairs(model=model, firsts=[d - 1 for d in drop], windows=windows, refit=m.refit, ridge=m.ridge,
                       weighting=m.weighting, target=m.target, units=m.units, trials=m.unit_trials,
                       choice_windows=m.choice_windows, progress=pair_progress(model, store), resume=resume)
    info.update(merge_record(cfg, done))
    log(f"merged pairs {info['merge_pairs']} on {done['tokens']} calibration tokens"
        + (" with refits" if m.refit else " without refits"))
    return done["kept"], store


def merge_record(cfg, done: dict) -> dict:
    """What the manifest and the tables record of a merge, from merge_pairs' result `done`: the pairs, tokens,
    passes' and solves' compute, what each pair kept from each block, and the refits' errors."""
    m, pairs = cfg.merging, done["per_pair"]
    shape = model_shape(cfg.model)
    sets = choice(cfg, shape).get("sets", 0)
    solve = solve_cost(shape, tokens=done["tokens"], pairs=len(pairs), sets=sets) if m.refit else 0.0
    got = {"merge_pairs": [list(p["pair"]) for p in pairs], "merge_tokens": done["tokens"],
           "merge_cost": done["cost"], "merge_solve_cost": solve, "merge_refit": m.refit,
           "merge_units_from": [list(p["units_from"]) for p in pairs],
           "merge_channels_from": [list(p["channels_from"]) for p in pairs]}
    if m.refit:
        got["merge_mlp_error"] = [[p["mlp_error_drop"], p["mlp_error_refit"]] for p in pairs]
        got["merge_attn_error"] = [[p["attn_error_drop"], p["attn_error_refit"]] for p in pairs]
    return got
