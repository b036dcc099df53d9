"""Which layers Block Influence would drop on each calibration domain, and how close the choice is.

    python benchmarks/selection_by_domain.py [--mix SPEC ...] [--model smollm2-135m] [--ratio 0.25]
        [--set gates.protect_head=1 ...]

For each mixture (default: the product's mixture, then every domain alone) it scores ShortGPT's
Block Influence on the windows `prune` would score (same count, same stream) and prints, per
mixture, the drop set and the margin at the cut: the Block Influence of the last layer in and of the
first layer out. A margin of a few thousandths means the data decides between two layers by noise,
and which of them goes is a question for a paired accuracy run (benchmarks/calibration_paired.py),
not for Block Influence. This is how the default's early-layer drop on SmolLM2 was found (layer 3
against 26 within 0.003 on every domain but Wikipedia; docs/results.md).
"""

from __future__ import annotations

import argparse
import os


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mix", action="append", default=None, help="a calibration mixture (repeatable)")
    p.add_argument("--model", default=None)
    p.add_argument("--ratio", type=float, default=None)
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config override")
    args = p.parse_args(argv)

    import torch

    from trsp_ray.common.table import render
    from trsp_ray.config.run_config import load_config, replace
    from trsp_ray.data import domains
    from trsp_ray.method import selectors
    from trsp_ray.method.gates import attach_gates, detach_gates
    from trsp_ray.method.training import SELECTION_STREAM
    from trsp_ray.run.methods import fixed_windows, shortgpt_windows
    from trsp_ray.run.workbench import prepare

    torch.set_num_threads(os.cpu_count() or 1)
    overrides = list(args.set) + ([f"model={args.model}"] if args.model else []) + (
        [f"ratio={args.ratio}"] if args.ratio else [])
    base = load_config(None, overrides)
    mixes = args.mix or [domains.DEFAULT_MIX] + [f"{d}:1" for d in domains.DOMAIN_NAMES]
    rows, model, ranked = [], None, {}
    for mix in mixes:
        cfg = replace(base, **{"data.calib_mix": mix})
        bench = prepare(cfg)
        model = model if model is not None else bench.fresh_model()
        gates = attach_gates(model, gate_mode=cfg.gates.gate)
        n_drop, candidates = bench.n_drop(), bench.candidates()
        windows = shortgpt_windows(cfg, n_drop)
        bi = selectors.block_influence(model, gates, fixed_windows(bench.batches(SELECTION_STREAM), windows))
        detach_gates(model)
        order = sorted(candidates, key=lambda i: bi[i])
        last_in, first_out = order[n_drop - 1], order[n_drop]
        ranked[mix] = set(order[:n_drop])
        rows.append({"calibration": mix, "windows": windows, "drop set": " ".join(map(str, sorted(order[:n_drop]))),
                     "last in (BI)": f"{last_in} ({bi[last_in]:.4f})", "first out (BI)": f"{first_out} "
                     f"({bi[first_out]:.4f})", "margin": f"{bi[first_out] - bi[last_in]:.4f}",
                     "next 3 out": " ".join(map(str, order[n_drop:n_drop + 3]))})
        print(f"{mix}: drop {sorted(order[:n_drop])}", flush=True)
    print(f"\nBlock Influence per calibration ({base.model}, {n_drop} of {bench.num_layers} layers, candidates "
          f"{candidates[0]}..{candidates[-1]}): the drop set and its margin at the cut")
    print(render(rows, list(rows[0])))
    common = set.intersection(*ranked.values())
    print(f"dropped on every calibration: {sorted(common)}; contested: {sorted(set.union(*ranked.values()) - common)}")
    print(f"load average: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
