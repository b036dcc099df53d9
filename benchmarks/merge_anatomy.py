"""Where a merge loses against a drop, one pair at a time: each step of the merge and each drop of one
of the pair's layers, applied to that pair alone in the dense model and compared with what the two
blocks did.

For every pair (a, a + 1), on the first W held-out windows (the windows `prune` scores; never fitted on),
with every other layer dense, so each variant's stream entering layer a is the dense one, x:
  flat        the two blocks flattened into one of twice the width (the parallel form, no cut)
  cut         the merge's cut back to one block's heads and channels, no refit
  merge-wide  the cut with both refits aimed at the wide block (merging.target=wide)
  merge       the product's merge (merging.target=pair: the MLP refitted to the two blocks' output)
  drop b+fold layer a + 1 removed, the least-squares fold into layer a (the default's fold)
  drop a+fold layer a removed, the fold into layer a - 1
Columns: the block error, sum ||out - y*||^2 / sum ||y* - x||^2 over every token but each window's
first (its attention sink), with out the stream after the variant's replacement of the pair and y* the
dense stream after layer a + 1 (1.0: as bad as skipping both blocks with nothing written); and the
mean next-token NLL on the same windows minus the dense model's (nats).

    python benchmarks/merge_anatomy.py --pairs 8 12 25 --windows 16

Prints one table per pair and a mean over the pairs; the load average is printed beside the wall time.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

VARIANTS = ("flat", "cut", "merge-wide", "merge", "drop b+fold", "drop a+fold")


def _stream(model, layer_index: int, windows, *, entering: bool) -> list:
    """The stream entering (or leaving) decoder layer `layer_index` of `model` on each window, and the
    model's mean next-token NLL over all windows: (streams, nll)."""
    import torch

    from trsp_ray.method.boundaries import hidden
    from trsp_ray.models import families

    layer = families.decoder_layers(model)[layer_index]
    got, total, count = [], 0.0, 0

    def grab(_m, args, kwargs, output=None):
        x = (args[0] if args else kwargs["hidden_states"]) if output is None else hidden(output)
        got.append(x.detach().float().cpu())  # every variant's streams compared on the host

    hook = (layer.register_forward_pre_hook(lambda m, a, k: grab(m, a, k), with_kwargs=True) if entering else
            layer.register_forward_hook(lambda m, a, k, o: grab(m, a, k, o), with_kwargs=True))
    try:
        with torch.no_grad():
            for w in windows:
                w = w.to(next(model.parameters()).device)
                logits = model(input_ids=w, use_cache=False).logits[:, :-1].float()
                nll = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), w[:, 1:].reshape(-1),
                                                        reduction="sum")
                total, count = total + float(nll), count + w[:, 1:].numel()
    finally:
        hook.remove()
    return got, total / count


def _error(outs, truth, inputs) -> float:
    """sum ||out - y*||^2 / sum ||y* - x||^2 over every token but each window's first."""
    num = sum(float((o - t)[:, 1:].pow(2).sum()) for o, t in zip(outs, truth))
    den = sum(float((t - x)[:, 1:].pow(2).sum()) for t, x in zip(truth, inputs))
    return num / den


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--pairs", type=int, nargs="+", required=True, help="first layer a of each pair (a, a + 1)")
    p.add_argument("--windows", type=int, default=16, help="held-out windows scored")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--set", dest="overrides", action="append", default=[])
    args = p.parse_args()

    import torch

    from trsp_ray.config import registry
    from trsp_ray.config.run_config import load_config
    from trsp_ray.method.merge_blocks import flatten
    from trsp_ray.run.methods import apply_method
    from trsp_ray.run.pipeline import resolve
    from trsp_ray.run.workbench import prepare

    torch.set_num_threads(args.threads)
    base = resolve(load_config(overrides=["tracking.enabled=false", "method=merge", *args.overrides])).cfg
    bench = prepare(base)
    windows = [w.reshape(1, -1) if w.dim() == 1 else w for w in bench.heldout.windows[:args.windows]]
    if bench.num_layers < 3 or any(not 0 <= a < bench.num_layers - 1 for a in args.pairs):
        sys.exit(f"--pairs {args.pairs} is not valid; each a must be in 0..{bench.num_layers - 2}")
    dense = bench.scoring_model()

    def variant(name: str, a: int):
        if name == "flat":
            model = bench.fresh_model()
            flatten(model, a)
            return model
        method, drop, over = {
            "cut": ("merge", [a + 1], {"merging.refit": "false"}),
            "merge-wide": ("merge", [a + 1], {"merging.target": "wide"}),
            "merge": ("merge", [a + 1], {}),
            "drop b+fold": ("shortgpt+comp", [a + 1], {}),
            "drop a+fold": ("shortgpt+comp", [a], {}),
        }[name]
        bench.cfg = resolve(load_config(overrides=["tracking.enabled=false", f"method={method}", *args.overrides,
                                                   *(f"{k}={v}" for k, v in over.items())])).cfg
        try:
            return apply_method(bench, registry.method(method), drop=drop).model
        finally:
            bench.cfg = base

    sums = {v: [0.0, 0.0, 0] for v in VARIANTS}
    t0 = time.time()
    for a in args.pairs:
        inputs, dense_nll = _stream(dense, a, windows, entering=True)
        truth, _ = _stream(dense, a + 1, windows, entering=False)
        print(f"\npair {a}-{a + 1} ({len(windows)} held-out windows, dense NLL {dense_nll:.4f})")
        print("| variant | block error | NLL - dense |")
        print("|---|---|---|")
        for name in VARIANTS:
            if name == "drop a+fold" and a == 0:
                continue
            model = variant(name, a)
            outs, nll = _stream(model, a, windows, entering=False)
            err = _error(outs, truth, inputs)
            sums[name][0] += err
            sums[name][1] += nll - dense_nll
            sums[name][2] += 1
            print(f"| {name} | {err:.3f} | {nll - dense_nll:+.4f} |", flush=True)
            del model
    print(f"\nmean over pairs {args.pairs}")
    print("| variant | block error | NLL - dense |")
    print("|---|---|---|")
    for name, (err, nll, n) in sums.items():
        if n:
            print(f"| {name} | {err / n:.3f} | {nll / n:+.4f} |" + ("" if n == len(args.pairs) else f" ({n} pairs)"))
    print(f"[{time.time() - t0:.0f}s, load {os.getloadavg()[0]:.2f}]")


if __name__ == "__main__":
    main()
