"""Throughput of stage 1's removal probes (probes.RemovalScorer) on 2 data-parallel ranks vs 1.

    python benchmarks/probe_throughput.py [--model smollm2-135m] [--windows 8] [--seqlen 128] [--calls 6]

Each rank is one process with one thread (a worker with its own device, as on a GPU cluster where
every rank has one GPU); the 2 ranks split the probe windows (k % 2 == rank) and all-reduce their
sums over gloo, as the Ray Train workers do. Both sides score the same drop sets on the same
windows; the first call (which also computes the dense teacher) is a warm-up and is not timed.
Prints the scorer calls per second of each, their ratio (target >= 1.8x), the scores' agreement,
and the load average (a busy machine lowers the 2-rank figure first: it needs both cores).
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

DROPS = [[], [12], [12, 13], [12, 13, 14], [3, 12, 13, 14], [3, 7, 12, 13, 14], [3, 7, 12, 13, 14, 25],
         [3, 7, 12, 13, 14, 25, 26]]


def _score(rank: int, world: int, args, all_reduce=None) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    from trsp_ray.data.assets import resolve_model
    from trsp_ray.method.gates import attach_gates
    from trsp_ray.method.probes import RemovalScorer

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(resolve_model(args.model), dtype=torch.float32).eval()
    vocab = model.config.vocab_size
    rows = torch.randint(10, vocab, (args.windows, args.seqlen), generator=torch.Generator().manual_seed(1))
    scorer = RemovalScorer(model=model, gates=attach_gates(model), windows=list(rows.split(args.chunk)), rank=rank,
                           world=world, all_reduce=all_reduce)
    drops = [d for d in DROPS if all(i < model.config.num_hidden_layers for i in d)]
    scorer(drops[0])  # warm-up: the dense teacher pass and the first student pass
    calls = [drops[1 + k % (len(drops) - 1)] for k in range(args.calls)]
    t0 = time.perf_counter()
    scores = [scorer(d) for d in calls]
    return {"seconds": time.perf_counter() - t0, "scores": scores, "calls": len(calls)}


def _rank_main(rank: int, world: int, port: int, out: str, args) -> None:
    import torch
    import torch.distributed as dist

    from trsp_ray.distributed.collectives import sum_over_ranks

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        torch.save(_score(rank, world, args, all_reduce=sum_over_ranks), f"{out}.{rank}")
    finally:
        dist.destroy_process_group()


def main() -> None:
    import torch
    import torch.multiprocessing as mp

    from trsp_ray.distributed.ranks import free_port

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--windows", type=int, default=8, help="probe windows (split across the ranks)")
    p.add_argument("--seqlen", type=int, default=128)
    p.add_argument("--chunk", type=int, default=2, help="windows per forward")
    p.add_argument("--calls", type=int, default=6, help="timed scorer calls (drop sets) per side")
    args = p.parse_args()

    load0 = os.getloadavg()[0]
    one = _score(0, 1, args)
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "rank")
        mp.spawn(_rank_main, args=(2, free_port(), out, args), nprocs=2, join=True)
        ranks = [torch.load(f"{out}.{r}", weights_only=False) for r in range(2)]
    two_seconds = max(r["seconds"] for r in ranks)
    rate1, rate2 = one["calls"] / one["seconds"], ranks[0]["calls"] / two_seconds
    worst = max(abs(a - b) for r in ranks for a, b in zip(r["scores"], one["scores"]))
    print(f"{'ranks':>5} {'threads each':>12} {'calls':>5} {'seconds':>8} {'calls/s':>8}")
    print(f"{1:>5} {1:>12} {one['calls']:>5} {one['seconds']:>8.2f} {rate1:>8.3f}")
    print(f"{2:>5} {1:>12} {ranks[0]['calls']:>5} {two_seconds:>8.2f} {rate2:>8.3f}")
    print(f"speed-up at 2 ranks: {rate2 / rate1:.2f}x (target >= 1.8x); max |score difference| vs one process "
          f"{worst:.2e}; {args.windows} windows x {args.seqlen} tokens in forwards of {args.chunk}; "
          f"load average {load0:.2f} before, {os.getloadavg()[0]:.2f} after")


if __name__ == "__main__":
    main()
