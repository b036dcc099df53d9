"""Prefill-latency and generation speed-up of SmolLM2-135M with 25% of its layers removed.

    python benchmarks/speed.py [--prompt-len 512] [--rounds 3] [--threads 2]

Dense (30 layers) and pruned (22 layers: round(0.25 * 30) = 8 dropped) are timed side by side in
one process (trsp_ray.evaluation.speed.compare_speed). Goal: prefill speed-up >= 0.9 x 30/22.
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
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=os.cpu_count())
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
    print(f"prefill (batch 1, {args.prompt_len} tokens): dense {r['dense_prefill_ms']:.1f} ms, "
          f"pruned {r['prefill_ms']:.1f} ms")
    print(f"generation ({settings.gen_batch} x {settings.new_tokens} tokens): dense "
          f"{r['dense_tokens_per_s']:.1f} tok/s, pruned {r['tokens_per_s']:.1f} tok/s")
    ideal = r["ideal_speedup"]
    print(f"prefill speed-up {r['prefill_speedup']:.3f}x | throughput speed-up {r['throughput_speedup']:.3f}x "
          f"| ideal L/L_kept {ideal:.3f}x | prefill / ideal = {r['prefill_speedup'] / ideal:.3f} (goal >= 0.9)")


if __name__ == "__main__":
    main()
