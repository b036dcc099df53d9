"""Prefill-latency and generation speed-up of SmolLM2-135M with 25% of its layers removed.

    python benchmarks/speed.py [--threads 1] [--rounds N] [--warmup N] [--prompt-len T] [--new-tokens N]

Dense (30 layers) and pruned (22 layers: round(0.25 * 30) = 8 dropped) are timed side by side in
one process with the settings the evaluation pool's speed column uses (SpeedSettings defaults for
the device, see trsp_ray/evaluation/speed.py); a flag overrides one of them. Goal: prefill speed-up
>= 0.9 x 30/22, and two consecutive runs within 3% of each other. Which layers are dropped does not
change the cost, so the middle ones are taken. Run it on a quiet machine: the load average at the
start and the end is printed beside the figures.

Measured here, two consecutive runs at load average 0.93-1.00 (the benchmark alone): prefill
1.346x / 1.368x, generation 1.332x / 1.327x (ideal 1.364x). Per-round ratios still span about
1.24-1.44: this VM's timing noise is large even when idle, hence 16 paired rounds and medians.
"""

from __future__ import annotations

import argparse
import copy
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def _load() -> str:
    one, five, _ = os.getloadavg()
    return f"{one:.2f} (1 min) / {five:.2f} (5 min) on {os.cpu_count()} cores"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--ratio", type=float, default=0.25)
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    for name in ("prompt-len", "gen-batch", "gen-prompt-len", "new-tokens", "warmup", "rounds"):
        parser.add_argument(f"--{name}", type=int, default=None, help="default: the device's (speed.DEFAULTS)")
    parser.add_argument("--clock", default="auto", choices=("auto", "wall", "cpu"))
    args = parser.parse_args()

    import torch
    from transformers import AutoModelForCausalLM

    from trsp_ray.data.assets import smollm2_dir
    from trsp_ray.evaluation.speed import SpeedSettings, compare_speed
    from trsp_ray.method.stage1 import n_drop_for
    from trsp_ray.method.surgery import remove_layers

    torch.set_num_threads(args.threads)
    start_load = _load()
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    dense = AutoModelForCausalLM.from_pretrained(smollm2_dir(), dtype=dtype).to(args.device).eval()
    layers = dense.config.num_hidden_layers
    n_drop = n_drop_for(args.ratio, layers)
    first = (layers - n_drop) // 2
    pruned = copy.deepcopy(dense)
    remove_layers(pruned, list(range(first, first + n_drop)))
    settings = SpeedSettings(prompt_len=args.prompt_len, gen_batch=args.gen_batch, gen_prompt_len=args.gen_prompt_len,
                             new_tokens=args.new_tokens, warmup=args.warmup, rounds=args.rounds, clock=args.clock)
    r = compare_speed(dense, pruned, settings)
    s = r["settings"]
    ideal = r["ideal_speedup"]
    print(f"SmolLM2-135M on {args.device}, {layers} -> {r['layers_kept']} layers, {args.threads} torch threads; "
          f"{s['warmup']} warm-up + {s['rounds']} timed rounds, {s['clock']} time, medians")
    print(f"prefill (batch 1, {s['prompt_len']} tokens): dense {r['dense_prefill_ms']:.1f} ms, "
          f"pruned {r['prefill_ms']:.1f} ms")
    print(f"generation ({s['gen_batch']} x {s['new_tokens']} new tokens after {s['gen_prompt_len']}-token prompts): "
          f"dense {r['dense_tokens_per_s']:.1f} tok/s, pruned {r['tokens_per_s']:.1f} tok/s")
    print(f"prefill speed-up    {r['prefill_speedup']:.3f}x (rounds {r['prefill_speedup_min']:.3f}-"
          f"{r['prefill_speedup_max']:.3f}) = {r['prefill_speedup'] / ideal:.3f} x ideal L/L_kept {ideal:.3f}")
    print(f"throughput speed-up {r['throughput_speedup']:.3f}x (rounds {r['throughput_speedup_min']:.3f}-"
          f"{r['throughput_speedup_max']:.3f}) = {r['throughput_speedup'] / ideal:.3f} x ideal")
    print(f"load average: {start_load} at the start, {_load()} at the end")


if __name__ == "__main__":
    main()
