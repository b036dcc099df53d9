"""Throughput of the evaluation pool: K candidates on 1 actor (all cores) vs on 2 actors (half each).

    python benchmarks/eval_pool.py [--candidates 4] [--limit 20] [--ppl-windows 4]

Candidates are SmolLM2-135M with 8 of 30 layers removed at K different places (saved once under a
temp dir). Each candidate gets held-out PPL and two zero-shot tasks; speed is skipped so the
measured work is what a search loop runs most. Wall time covers actor start-up, candidate loads and
evaluation (Ray itself is started once beforehand). Goal: 2 actors >= 1.6x the throughput of 1.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")


def make_candidates(root: Path, k: int, n_drop: int = 8) -> list[str]:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from trsp_ray.assets import smollm2_dir
    from trsp_ray.surgery import remove_layers

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


def timed_pool(paths: list[str], settings, *, actors: int, cpus: int) -> float:
    from trsp_ray.evaluation.pool import ActorResources, evaluate_pool

    start = time.perf_counter()
    results = evaluate_pool(paths, settings=settings, actors=actors, resources=ActorResources(num_cpus=cpus))
    seconds = time.perf_counter() - start
    failed = [r for r in results if r["status"] != "ok"]
    if failed:
        raise SystemExit(f"benchmark candidate failed: {failed[0]['error']}")
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--candidates", type=int, default=4)
    parser.add_argument("--limit", type=int, default=20)
    parser.add_argument("--ppl-windows", type=int, default=4)
    args = parser.parse_args()

    import ray

    from trsp_ray.evaluation.evaluator import EvalSettings

    cores = os.cpu_count() or 2
    settings = EvalSettings(tasks=("piqa", "arc_easy"), limit=args.limit, ppl_windows=args.ppl_windows,
                            speed=None)
    with tempfile.TemporaryDirectory(prefix="trsp-eval-bench-") as tmp:
        paths = make_candidates(Path(tmp), args.candidates)
        ray.init(num_cpus=cores, include_dashboard=False, log_to_driver=False)
        try:
            one = timed_pool(paths, settings, actors=1, cpus=cores)
            two = timed_pool(paths, settings, actors=2, cpus=max(1, cores // 2))
        finally:
            ray.shutdown()
    k = args.candidates
    print(f"{k} SmolLM2 candidates (22 layers), PPL {args.ppl_windows}x256 tokens + piqa/arc_easy "
          f"limit {args.limit}, {cores} cores")
    print(f"1 actor  x {cores} threads: {one:.1f} s ({k / one * 60:.2f} candidates/min)")
    print(f"2 actors x {max(1, cores // 2)} threads: {two:.1f} s ({k / two * 60:.2f} candidates/min)")
    print(f"throughput ratio 2 vs 1 actors: {one / two:.2f}x (goal >= 1.6x)")
    print(f"load average after the run: {os.getloadavg()[0]:.1f} on {cores} cores (other users' work "
          "shares these cores and slows both configurations)")


if __name__ == "__main__":
    main()
