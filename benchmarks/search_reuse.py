"""Wall time of the 3 ratios x 2 lambda1 x 1 lambda2 grid with stage-1 reuse against without.

    python benchmarks/search_reuse.py [--first-round-steps 24 --steps-per-round 8 --stage2-steps 4]

Tiny 8-layer Llama on CPU, one local Ray instance for both searches (so Ray start-up is not
counted), ASHA off (so both searches run the same trials to the end). Prints the stage-1 counts
from the run log and `reuse/no-reuse wall-time ratio`; the goal is <= 0.6. Reuse saves stage-1
work only, so the ratio depends on the stage-1 : stage-2 step budget (the flags set it) and on the
fixed cost of a search that reuse cannot touch (trial actors' start, the evaluation pool, ~30 s on
2 cores); the trial phase alone is printed too. With 2 trial slots the bound for this grid, when
stage 1 is everything, is S(3) / (S(1) + S(2) + S(3)) of the stage-1 steps for 1, 2, 3 dropped layers.

Measured on a quiet 2-core machine (whole search / trial phase):
    --first-round-steps 24  --steps-per-round 8     0.876
    --first-round-steps 128 --steps-per-round 64    0.763
    --first-round-steps 256 --steps-per-round 128   0.660 / 0.613
    --first-round-steps 512 --steps-per-round 256   0.558 / 0.530
The goal holds once stage 1 is most of a search's cost; at the project's default stage-1 : stage-2
budget (about equal) the ratio cannot go below ~0.75 for this grid.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

GRID = {"params": {"ratio": [0.125, 0.25, 0.375], "stage1.lambda1": [1e-3, 5e-3], "stage2.lambda2": [1e-3]}}


def trial_phase_seconds(search_dir: Path) -> float:
    """From the run log: search start to the last finished trial (before the evaluation pool,
    MLflow and registry work, which reuse does not touch)."""
    import json

    events = [json.loads(line) for line in (search_dir / "events.jsonl").read_text().splitlines() if line.strip()]
    start = next(e["time"] for e in events if e["event"] == "search_started")
    return max(e["time"] for e in events if e["event"] == "trial_finished") - start


def timed_search(base, *, root: Path, reuse: bool) -> tuple[float, dict]:
    from trsp_ray.search.run import SearchOptions, run_search
    from trsp_ray.search.space import parse_space

    opts = SearchOptions(search_dir=str(root / ("reuse" if reuse else "no-reuse")), name="bench", reuse=reuse,
                         asha=False, val_windows=2, register_name=None)
    start = time.perf_counter()
    summary = run_search(base, parse_space(GRID), opts, log=lambda msg: None)
    return time.perf_counter() - start, summary


def main() -> int:
    import ray
    import torch

    from trsp_ray.config.run_config import load_config
    from trsp_ray.models.tiny import tiny_workspace

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--first-round-steps", type=int, default=24)
    p.add_argument("--steps-per-round", type=int, default=8)
    p.add_argument("--stage2-steps", type=int, default=4)
    args = p.parse_args()
    torch.set_num_threads(1)
    root = Path(tempfile.mkdtemp(prefix="search_reuse-"))
    ws = tiny_workspace(root / "assets", layers=8)
    base = load_config(overrides=[
        f"model={ws / 'model'}", f"data.calib_text={ws / 'calib.txt'}", f"data.eval_text={ws / 'eval.txt'}",
        "data.seqlen=32", "data.batch_size=2", "data.eval_seqlen=64", "data.eval_max_windows=4", "threads=1",
        f"stage1.first_round_steps={args.first_round_steps}", f"stage1.steps_per_round={args.steps_per_round}",
        f"stage2.steps={args.stage2_steps}", "tracking.enabled=false",
        # without swap refinement one stage 1 serves every smaller ratio (with it, each n_drop has its own)
        "stage1.refine=0",
        "method=trsp"])  # the grid searches lambda2, which acts only in the paper's stage 2
    # its own temp dir: ray.init would otherwise join the latest Ray cluster started on this machine
    ray_tmp = tempfile.mkdtemp(prefix="ray-", dir="/tmp")
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, _temp_dir=ray_tmp)
    try:
        with_reuse, a = timed_search(base, root=root, reuse=True)
        without, b = timed_search(base, root=root, reuse=False)
    finally:
        ray.shutdown()
        shutil.rmtree(ray_tmp, ignore_errors=True)
    print(f"stage-1 settings: first_round_steps={args.first_round_steps} steps_per_round={args.steps_per_round}, "
          f"stage2.steps={args.stage2_steps}")
    print(f"with reuse:    {with_reuse:7.1f} s, stage-1 computations {a['stage1_computed']}, "
          f"stage-2 runs {a['stage2_runs']}")
    print(f"without reuse: {without:7.1f} s, stage-1 computations {b['stage1_computed']}, "
          f"stage-2 runs {b['stage2_runs']}")
    print(f"reuse/no-reuse wall-time ratio: {with_reuse / without:.3f} (goal <= 0.6)")
    trials_a, trials_b = trial_phase_seconds(root / "reuse"), trial_phase_seconds(root / "no-reuse")
    print(f"trial phase only (start -> last trial finished): {trials_a:.1f} s vs {trials_b:.1f} s, "
          f"ratio {trials_a / trials_b:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
