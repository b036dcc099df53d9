"""Prefill-latency and generation speed-up of SmolLM2-135M with 25% of its layers removed.

    python benchmarks/speed.py [--prompt-len 512] [--rounds 4] [--threads 1]

Dense (30 layers) and pruned (22 layers: round(0.25 * 30) = 8 dropped) are timed side by side in
one process (trsp_ray.evaluation.speed.compare_speed), by wall and by CPU time.
Goal: prefill speed-up >= 0.9 x 30/22.
Which layers are dropped does not change the cost, so the middle ones are taken.
"""

from __future__ import annotations

import argparse
import copy
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--ratio", type=float, default=0.25)
    args = parser.parse_args()

    import torch
    from transformers import AutoModelForCausalLM

    from trsp_ray.assets import smollm2_dir
    from trsp_ray.evaluation.speed import SpeedSettings, compare_speed
    from trsp_ray.surgery import remove_layers

    torch.set_num_threads(args.threads)
    dense = AutoModelForCausalLM.from_pretrained(smollm2_dir(), dtype=torch.float32).eval()
    layers = dense.config.num_hidden_layers
    n_drop = round(args.ratio * layers)
    start = (layers - n_drop) // 2
    pruned = copy.deepcopy(dense)
    remove_layers(pruned, list(range(start, start + n_drop)))
    settings = SpeedSettings(prompt_len=args.prompt_len, rounds=args.rounds)
    r = compare_speed(dense, pruned, settings)
    print(f"SmolLM2-135M, {layers} -> {r['layers_kept']} layers, {args.threads} torch threads, {settings}")
    for label, sfx in (("wall", ""), ("CPU", "_cpu")):
        print(f"[{label} time] prefill (batch 1, {args.prompt_len} tokens): dense {r[f'dense_prefill{sfx}_ms']:.1f} ms, "
              f"pruned {r[f'prefill{sfx}_ms']:.1f} ms | generation ({settings.gen_batch} x {settings.new_tokens} "
              f"tokens): dense {r[f'dense_tokens_per{sfx}_s']:.1f} tok/s, pruned {r[f'tokens_per{sfx}_s']:.1f} tok/s")
    ideal = r["ideal_speedup"]
    for label, sfx in (("wall", ""), ("CPU", "_cpu")):
        print(f"[{label} time] prefill speed-up {r[f'prefill_speedup{sfx}']:.3f}x | throughput speed-up "
              f"{r[f'throughput_speedup{sfx}']:.3f}x | ideal L/L_kept {ideal:.3f}x | prefill / ideal = "
              f"{r[f'prefill_speedup{sfx}'] / ideal:.3f} (goal >= 0.9)")
    print(f"load average during the run: {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores "
          "(CPU time is the steadier figure on a shared machine)")

if __name__ == "__main__":
    main()
