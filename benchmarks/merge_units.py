"""Which attention units a merge should keep, one pair at a time: every candidate set's refit error and the
held-out loss it leaves (the measurement behind merging.units=loss, trsp_ray/method/merge_choice.py).

For pair (a, a + 1) of the default model, flattened alone (every other layer dense, the MLP left wide): the
attention's refit sums over the wide block's columns on C calibration windows (the merge's own stream), then
for each candidate set (every way to keep half the wide block's units when there are at most --trials, else
the energy choice and its nearest swaps) the attention cut and refitted in closed form, and scored on the
first W held-out windows (never fitted on): the refit's error relative to the wide output's energy on the
calibration tokens, and the mean next-token loss in nats. The energy choice (what merging.units=energy keeps)
is marked.

    python benchmarks/merge_units.py --pair 8 --calib 64 --windows 16

With --choice N every set is also scored where the merge scores it, on the first N calibration windows
(merging.choice_windows; the refit's own tokens): by the mean next-token loss (what merging.units=loss
ranks by) and by the KL divergence from the dense model's next-token distribution. Each criterion's pick
(and the energy choice's, and the lowest refit error's) is printed with its held-out loss and rank, and
each criterion's Spearman correlation with the held-out loss over the sets.

Prints one table, sorted by loss, and the load average beside the wall time. With --compare-whole the trials
run twice, side by side: from the block on, the stream entering it stored once (as the merge runs them in
one process), and as whole passes (as on ZeRO-3 ranks); it prints both wall times, their ratio and the
largest difference between the two runs' losses.
"""

from __future__ import annotations

import argparse
import os
import time


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--pair", type=int, required=True, help="first layer a of the pair (a, a + 1)")
    p.add_argument("--calib", type=int, default=64, help="calibration windows the refit is summed on")
    p.add_argument("--windows", type=int, default=16, help="held-out windows scored")
    p.add_argument("--trials", type=int, default=100, help="at most this many unit sets")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--compare-whole", action="store_true", help="also run the trials as whole passes, timed")
    p.add_argument("--choice", type=int, default=0,
                   help="also score every set on the first N calibration windows: loss and KL to dense")
    args = p.parse_args()

    import torch

    from trsp_ray.config.run_config import load_config
    from trsp_ray.method import merge
    from trsp_ray.method.merge_blocks import flatten
    from trsp_ray.method.merge_choice import candidates, choose_units, first_rows, mean_loss, sub_stats
    from trsp_ray.method.training import FIT_STREAM
    from trsp_ray.run.methods import fixed_windows
    from trsp_ray.run.pipeline import resolve
    from trsp_ray.run.workbench import prepare

    torch.set_num_threads(args.threads)
    t0 = time.time()
    bench = prepare(resolve(load_config(overrides=["tracking.enabled=false", "method=merge"])).cfg)
    if not 0 <= args.pair < bench.num_layers - 1:
        raise SystemExit(f"--pair {args.pair} is not valid; use 0..{bench.num_layers - 2}")
    calib = fixed_windows(bench.batches(FIT_STREAM), args.calib)
    held = [w.reshape(1, -1) if w.dim() == 1 else w for w in bench.heldout.windows[:args.windows]]
    same = lambda t: t  # noqa: E731 (one process)
    dense = mean_loss(bench.scoring_model(), held, reduce=same)
    model = bench.fresh_model()
    with torch.no_grad():
        flat = flatten(model, args.pair)
        wide_loss = mean_loss(model, held, reduce=same)
        unit_scores, _ = merge.scores(model, flat, calib)
        energy = merge._top(unit_scores, merge._writes(model, flat)[0], flat.attention.units)
        attn, _ = merge.refit_sums(model, flat, calib, units=torch.arange(2 * flat.attention.units), channels=None)
        o_proj, width = merge._outputs(model, flat)[0], flat.attention.output.sizes[0]
        errors = {}

        def refit(keep):
            out, err = merge._solved(sub_stats(attn, merge.columns(keep, width)), o_proj, merge.columns(keep, width),
                                     ridge=1e-2, key="attn")
            errors[tuple(keep.tolist())] = err["attn_error_refit"]
            return out

        sets = candidates(energy, unit_scores, trials=args.trials)
        t1 = time.time()
        _, losses = choose_units(model, flat, sets, refit, held, reduce=same)
        tail_s = time.time() - t1
        if args.compare_whole:
            t1 = time.time()
            _, whole = choose_units(model, flat, sets, refit, held, reduce=same, stop=False)
            whole_s = time.time() - t1
        scored = {}
        if args.choice:
            choice = first_rows(calib, args.choice)
            reference = [torch.log_softmax(bench.scoring_model()(input_ids=b, use_cache=False).logits[:, :-1].float(),
                                           -1) for b in choice]
            _, scored["choice loss"] = choose_units(model, flat, sets, refit, choice, reduce=same)
            _, scored["choice KL"] = choose_units(model, flat, sets, refit, choice, reduce=same,
                                                  score=lambda m, w, reduce: kl_to(m, w, reference))
    print(f"pair {args.pair}-{args.pair + 1}: {len(sets)} unit sets of {flat.attention.units} of "
          f"{2 * flat.attention.units}; {args.calib} calibration windows, {len(held)} held-out windows; "
          f"dense loss {dense:.4f}, flattened {wide_loss:.4f}")
    print("| units kept | refit error | held-out loss |" + "".join(f" {k} |" for k in scored) + " |")
    print("|---|---|---|" + "---|" * len(scored) + "---|")
    for i, (units, loss) in sorted(enumerate(zip(sets, losses)), key=lambda t: t[1][1]):
        mark = "energy choice" if units == sets[0] else ""
        print(f"| {','.join(map(str, units))} | {errors[units]:.3f} | {loss:.4f} |"
              + "".join(f" {v[i]:.4f} |" for v in scored.values()) + f" {mark} |")
    if scored:
        criteria = {"energy": [0.0] + [1.0] * (len(sets) - 1), "refit error": [errors[u] for u in sets], **scored}
        rank = {i: r + 1 for r, i in enumerate(sorted(range(len(sets)), key=losses.__getitem__))}
        for name, values in criteria.items():
            pick = min(range(len(sets)), key=values.__getitem__)
            rho = "" if name == "energy" else f"; Spearman with the held-out loss {spearman(values, losses):+.2f}"
            print(f"{name} picks {','.join(map(str, sets[pick]))}: held-out loss {losses[pick]:.4f}, "
                  f"rank {rank[pick]} of {len(sets)}{rho}")
    if args.compare_whole:
        gap = max(abs(a - b) for a, b in zip(losses, whole))
        print(f"trials from the block on {tail_s:.1f}s, as whole passes {whole_s:.1f}s (ratio "
              f"{tail_s / whole_s:.2f}; {bench.num_layers - args.pair} of {bench.num_layers} layers' worth a trial); "
              f"largest loss difference {gap:.2e}; load {os.getloadavg()[0]:.2f}")
    print(f"[{time.time() - t0:.0f}s, load {os.getloadavg()[0]:.2f}]")


def kl_to(model, windows, reference) -> float:
    """Mean KL(dense || model) over the next-token positions of `windows`, the dense model's log-probabilities
    `reference` (one tensor a batch, in order: the trials' stored stream is consumed one pass a batch)."""
    import torch

    total, count = 0.0, 0
    with torch.no_grad():
        for batch, dense in zip(windows, reference, strict=True):
            logp = torch.log_softmax(model(input_ids=batch, use_cache=False).logits[:, :-1].float(), -1)
            total += float((dense.exp() * (dense - logp)).sum())
            count += dense.shape[0] * dense.shape[1]
    return total / count


def spearman(a: list[float], b: list[float]) -> float:
    """Spearman's rank correlation of two score lists (ties in average rank)."""
    import statistics

    def ranks(v: list[float]) -> list[float]:
        order = sorted(range(len(v)), key=v.__getitem__)
        got = [0.0] * len(v)
        for value in set(v):
            where = [r for r, i in enumerate(order) if v[i] == value]
            for r in where:
                got[order[r]] = sum(where) / len(where)
        return got

    return statistics.correlation(ranks(a), ranks(b))


if __name__ == "__main__":
    main()
