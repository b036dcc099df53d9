"""Scaling of the evaluation pool the way a cluster scales: K actors with c CPUs each against one
actor with the same c CPUs (not one actor holding all the cores).

    python benchmarks/eval_pool.py [--actors 2] [--cpus-per-actor 1] [--candidates 4] [--repeats 2]

Candidates are SmolLM2-135M with 8 of 30 layers removed at different places (saved once under a
temp dir). Each gets held-out PPL and two zero-shot tasks; speed is skipped, so the measured work
is what a search loop runs most. Each pool is started and warmed (every actor scores one candidate:
imports, lm-eval task build and the tokenised held-out text are per-actor one-time costs a long
search pays once), then timed on `--candidates` candidates; start-up is printed separately. The
1-actor and K-actor pools alternate (1, K, K, 1, ...) so load drift hits both alike.
Goal: K actors >= 0.9 x K times the candidates per minute of one actor.

Measured on this 2-core machine, defaults (K = 2, c = 1), two runs with load average 0.9-2.0 (the
benchmark's own actors; nobody else's work): 8.04 vs 4.23 and 8.26 vs 4.35 candidates/min, 1.90x
= 0.95 x K both times; a pool's start-up + warm-up is ~19 s (1 actor) / ~20 s (2 actors).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")


def make_candidates(root: Path, k: int, n_drop: int = 8) -> list[str]:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from trsp_ray.data.assets import smollm2_dir
    from trsp_ray.method.surgery import remove_layers

    tok = AutoTokenizer.from_pretrained(smollm2_dir())
    paths = []
    for i in range(k):
        model = AutoModelForCausalLM.from_pretrained(smollm2_dir(), dtype=torch.float32)
        total = model.config.num_hidden_layers
        start = 1 + i * (total - n_drop - 2) // max(1, k - 1)  # K different contiguous drop sets
        drop = list(range(start, start + n_drop))
        remove_layers(model, drop)
        path = root / f"cand{i}-drop{start}-{start + n_drop - 1}"
        model.save_pretrained(path)
        tok.save_pretrained(path)
        (path / "trsp_ray.json").write_text(json.dumps({"method": "benchmark", "dropped_layers": drop,
                                                       "num_layers_original": total,
                                                       "num_layers_kept": total - n_drop}))
        paths.append(str(path))
    return paths


def timed_pool(paths: list[str], settings, *, actors: int, cpus: float) -> tuple[float, float]:
    """(start-up + warm-up seconds, seconds to score `paths` on the warm pool)."""
    from trsp_ray.evaluation.pool import ActorResources, actor_pool

    start = time.perf_counter()
    with actor_pool(settings=settings, actors=actors, resources=ActorResources(num_cpus=cpus),
                    log=lambda m: None) as run:
        _check(run(paths[:actors]))  # one candidate per actor: the per-actor one-time costs
        warm = time.perf_counter()
        _check(run(paths))
        end = time.perf_counter()
    return warm - start, end - warm


def _check(results: list[dict]) -> None:
    failed = [r for r in results if r["status"] != "ok"]
    if failed:
        raise SystemExit(f"benchmark candidate failed: {failed[0]['error']}")


def _load() -> str:
    one, five, _ = os.getloadavg()
    return f"{one:.2f} (1 min) / {five:.2f} (5 min)"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--actors", type=int, default=2, help="K")
    parser.add_argument("--cpus-per-actor", type=int, default=None, help="c (default: cores // K)")
    parser.add_argument("--candidates", type=int, default=4, help="timed candidates per pool run")
    parser.add_argument("--repeats", type=int, default=2, help="timed runs of each pool (alternating)")
    parser.add_argument("--limit", type=int, default=20)
    parser.add_argument("--ppl-windows", type=int, default=4)
    args = parser.parse_args()

    import ray

    from trsp_ray.evaluation.evaluator import EvalSettings

    cores = os.cpu_count() or 2
    k = args.actors
    c = args.cpus_per_actor or max(1, cores // k)
    settings = EvalSettings(tasks=("piqa", "arc_easy"), limit=args.limit, ppl_windows=args.ppl_windows, speed=None)
    print(f"load average at the start: {_load()} on {cores} cores", flush=True)
    times: dict[int, list[float]] = {1: [], k: []}
    startup: dict[int, list[float]] = {1: [], k: []}
    with tempfile.TemporaryDirectory(prefix="trsp-eval-bench-") as tmp:
        paths = make_candidates(Path(tmp), max(args.candidates, k))[:args.candidates]
        # its own temp dir: ray.init would otherwise join the latest Ray cluster started on this machine
        ray_tmp = tempfile.mkdtemp(prefix="ray-", dir="/tmp")
        ray.init(num_cpus=k * c, include_dashboard=False, log_to_driver=False,
                 _temp_dir=ray_tmp)
        try:
            order = [n for r in range(args.repeats) for n in ((1, k) if r % 2 == 0 else (k, 1))]
            for n in order:
                up, seconds = timed_pool(paths, settings, actors=n, cpus=c)
                startup[n].append(up)
                times[n].append(seconds)
                print(f"  {n} actor(s) x {c} CPU: {seconds:.1f} s for {len(paths)} candidates "
                      f"(start-up + warm-up {up:.1f} s); load {_load()}", flush=True)
        finally:
            ray.shutdown()
            shutil.rmtree(ray_tmp, ignore_errors=True)
    one, many = statistics.median(times[1]), statistics.median(times[k])
    n = len(paths)
    print(f"{n} SmolLM2 candidates (22 layers), PPL {args.ppl_windows}x256 tokens + piqa/arc_easy limit "
          f"{args.limit}; warm pools, median of {args.repeats} runs each")
    print(f"1 actor  x {c} CPU: {one:.1f} s ({n / one * 60:.2f} candidates/min)")
    print(f"{k} actors x {c} CPU: {many:.1f} s ({n / many * 60:.2f} candidates/min)")
    print(f"throughput {k} vs 1 actor: {one / many:.2f}x = {one / many / k:.2f} x K (goal >= 0.9 x K); "
          f"start-up + warm-up per pool: {statistics.median(startup[1]):.1f} s (1 actor), "
          f"{statistics.median(startup[k]):.1f} s ({k} actors)")
    print(f"load average at the end: {_load()} on {cores} cores")


if __name__ == "__main__":
    main()
