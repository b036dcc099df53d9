"""The planner against the measured peak memory of the single-process bf16 path on this CPU:
stage 1, stage 2 (with and without activation checkpointing) and SLEB, SmolLM2-135M.

    python benchmarks/planner_single.py [--seqlen 256] [--batch 4] [--sleb-windows 32] [--sleb-seqlen 512]

Each stage runs in its own process, with glibc told to return every freed block of 64 KiB or more
at once (MALLOC_MMAP_THRESHOLD_=65536): the resident set then follows the live tensors, as
torch.cuda.max_memory_allocated does on a GPU, instead of keeping freed heap that a later
allocation may or may not reuse. The process loads the model (the original, bf16, host memory),
runs one small forward to warm torch up, then resets its peak resident set (Linux VmHWM) and runs
the stage: measured = peak - resident size just before the stage. The planner's figure for the same span is
the stage's total minus the runtime overhead and the original model, which were resident before
(plan/single_plan.py). Goal: within 15%.

SLEB scores every candidate removal on `--sleb-windows` windows of `--sleb-seqlen` tokens in
batches of `--batch`; its memory does not depend on the number of rounds or candidates, so one round
over three candidates is measured. Its budget is the planner's SLEB figure: the working copy, one
batch's inputs to every layer and one forward's logits, whatever the number of windows.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

STAGES = ("stage 1", "stage 1 +ckpt", "stage 2", "stage 2 +ckpt", "sleb")


def _rss_gib(field: str = "VmRSS") -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 2**20
    raise RuntimeError(f"{field} not in /proc/self/status")


def _overrides(args, stage: str) -> list[str]:
    sleb = stage == "sleb"
    return ["model=smollm2-135m", "dtype=bf16", "device=cpu", "threads=2", "tracking.enabled=false",
            f"data.seqlen={args.sleb_seqlen if sleb else args.seqlen}", f"data.batch_size={args.batch}",
            f"distributed.activation_checkpointing={str('ckpt' in stage).lower()}",
            "stage1.first_round_steps=2", "stage1.steps_per_round=1", "ratio=0.07", "stage2.steps=2",
            f"baselines.sleb_windows={args.sleb_windows}", f"method={'sleb' if sleb else 'trsp'}"]


def measure(args, stage: str) -> dict:
    """Run one stage in this process; returns planner and measured GiB of the stage's span."""
    import gc

    import torch

    from trsp_ray.config.run_config import load_config
    from trsp_ray.plan.single_plan import single_plan_for_run
    from trsp_ray.run.workbench import prepare

    cfg = load_config(overrides=_overrides(args, stage))
    bench = prepare(cfg)
    with torch.no_grad():  # warm-up: kernels, thread pools and allocator pools belong to the runtime
        bench.model(input_ids=bench.calib_ids[:16].view(1, 16), use_cache=False)
    gc.collect()
    name = stage.removesuffix(" +ckpt")
    plan = single_plan_for_run(cfg, device="cpu", memory_gb=24.0, methods=("sleb",) if name == "sleb" else None)
    part = next(s for s in plan.stages if s.name == name)
    resident = part.parts["runtime overhead"] + part.parts["model (original, host)"]
    before = _rss_gib()
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := current RSS
    run_stage(bench, name, sleb_windows=args.sleb_windows)
    peak = _rss_gib("VmHWM")
    return {"stage": stage, "planner": part.total - resident, "measured": peak - before,
            "parts": {k: v for k, v in part.parts.items() if k not in ("runtime overhead", "model (original, host)")}}


def run_stage(bench, name: str, *, sleb_windows: int) -> None:
    """One stage as the planner names it, small: stage 1 (2 rounds), stage 2 (its configured steps),
    SLEB (one round over three candidates, every window), evaluation (held-out PPL)."""
    from trsp_ray.config import registry
    from trsp_ray.method.gates import attach_gates
    from trsp_ray.method.selectors import sleb_drop
    from trsp_ray.method.stage1 import Stage1Result
    from trsp_ray.run.methods import _windows, apply_method, run_stage1_for

    if name == "stage 1":
        run_stage1_for(bench)
    elif name == "stage 2":
        drop = bench.candidates()[3:3 + bench.n_drop()]
        apply_method(bench, registry.method("trsp"), stage1=Stage1Result(drop_order=drop, round1_ranking=drop))
    elif name == "sleb":
        model = bench.fresh_model()
        gates = attach_gates(model)
        calib = _windows(bench, sleb_windows)
        sleb_drop(model, gates, calib, n_drop=1, candidates=[12, 13, 14])
    else:
        bench.heldout_ppl()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seqlen", type=int, default=256)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--sleb-windows", type=int, default=32)
    parser.add_argument("--sleb-seqlen", type=int, default=512)
    parser.add_argument("--stage", choices=STAGES, default=None, help="(internal) run one stage, print JSON")
    args = parser.parse_args()
    if args.stage:
        print("RESULT " + json.dumps(measure(args, args.stage)), flush=True)
        return
    rows = []
    for stage in STAGES:
        cmd = [sys.executable, __file__, "--stage", stage, "--seqlen", str(args.seqlen), "--batch", str(args.batch),
               "--sleb-windows", str(args.sleb_windows), "--sleb-seqlen", str(args.sleb_seqlen)]
        env = {**os.environ, "TRANSFORMERS_VERBOSITY": "error", "MALLOC_MMAP_THRESHOLD_": "65536"}
        out = subprocess.run(cmd, capture_output=True, text=True, env=env)
        line = next((x for x in out.stdout.splitlines() if x.startswith("RESULT ")), None)
        if line is None:
            sys.exit(f"{stage} failed:\n{out.stdout[-2000:]}\n{out.stderr[-4000:]}")
        rows.append(json.loads(line[len("RESULT "):]))
        r = rows[-1]
        print(f"{stage}: " + ", ".join(f"{k} {v:.3f}" for k, v in r["parts"].items()), flush=True)
    print(f"\nSmolLM2-135M, bf16, CPU; training batches {args.batch} x {args.seqlen} tokens; SLEB on "
          f"{args.sleb_windows} x {args.sleb_seqlen}-token windows in batches of {args.batch}")
    print(f"{'stage':<16}{'planner GiB':>12}{'measured GiB':>14}{'error':>8}")
    for r in rows:
        print(f"{r['stage']:<16}{r['planner']:>12.3f}{r['measured']:>14.3f}"
              f"{(r['planner'] - r['measured']) / r['measured']:>+8.0%}")
    sleb = next(r for r in rows if r["stage"] == "sleb")
    verdict = "under" if sleb["measured"] <= sleb["planner"] else "OVER"
    print(f"SLEB budget (planner: working copy + one batch's layer inputs + one forward): {sleb['planner']:.3f} GiB; "
          f"measured {sleb['measured']:.3f} GiB ({verdict} budget)")
    held_before = args.sleb_windows * args.sleb_seqlen * 30 * 2 * 576 / 2**30  # 30 layers, bf16, hidden 576
    print(f"(before streaming, SLEB held every batch's layer inputs: {held_before:.3f} GiB more, per round)")
    print(f"(load average: {' '.join(f'{x:.2f}' for x in os.getloadavg())})")


if __name__ == "__main__":
    main()
