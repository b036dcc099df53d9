"""The prepared GPU check (issue 12): one CUDA GPU, under 8 minutes, nothing downloaded.

    python benchmarks/gpu_check.py [--out DIR] [--skip-pytest] [--device cpu]

1. `pytest -m gpu` (tests/test_gpu.py: one model copy on the device, checkpointed gradients,
   fp32 masters, the export check on the device, SLEB and perplexity against CPU, a tiny bf16 prune).
2. SmolLM2-135M in bf16, single process, activation checkpointing: `driver.run` (stage 1,
   stage 2, removal, export with its on-device logit check, held-out PPL with the BOS convention).
3. Planner vs torch.cuda.max_memory_allocated per single-process stage: stage 1 and stage 2 with
   and without checkpointing, SLEB on 32 x 512-token windows, evaluation (planner figure = the
   stage's total less the runtime overhead, which the allocator does not see).
4. One ZeRO-3 Ray Train worker on NCCL, bf16: stage 1, stage 2 and the export (run_distributed),
   with the ZeRO-3 planner against each stage's peak the worker reports.
Each part is timed and runs even when an earlier one failed; a summary ends the output and the
exit code is 1 when any part failed. Without a GPU it prints why and exits 0 (skipped).
`--device cpu` runs parts 2-4 on CPU (gloo, smaller budgets) to check the script itself.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))


def _env(device: str) -> None:
    import torch

    print(f"torch {torch.__version__}, CUDA available: {torch.cuda.is_available()}, "
          f"CUDA build: {torch.version.cuda}", flush=True)
    if device == "cuda":
        props = torch.cuda.get_device_properties(0)
        print(f"GPU 0: {props.name}, {props.total_memory / 2**30:.1f} GiB, NCCL {torch.cuda.nccl.version()}, "
              f"bf16 supported: {torch.cuda.is_bf16_supported()}", flush=True)
    for pkg in ("transformers", "deepspeed", "ray"):
        try:
            import importlib.metadata as md

            print(f"{pkg} {md.version(pkg)}", flush=True)
        except Exception as exc:  # report, do not stop: later parts say what is missing
            print(f"{pkg}: {exc}", flush=True)


def part_pytest(args) -> str:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    if args.device == "cpu":
        env["TRSP_GPU_TESTS_ON_CPU"] = "1"
    cmd = [sys.executable, "-m", "pytest", "-m", "gpu", "tests/test_gpu.py", "-q", "-p", "no:cacheprovider"]
    out = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    print(out.stdout[-3000:], out.stderr[-2000:], flush=True)
    if out.returncode != 0:
        raise RuntimeError(f"pytest -m gpu exited {out.returncode}")
    return out.stdout.strip().splitlines()[-1]


def _cfg(args, *extra: str):
    from trsp_ray.config.run_config import load_config

    cpu = args.device == "cpu"
    return load_config(overrides=[
        "model=smollm2-135m", f"device={args.device}", "dtype=bf16", "tracking.enabled=false",
        f"data.seqlen={128 if cpu else 512}", f"data.batch_size={4 if cpu else 8}", "data.eval_seqlen=256",
        f"data.eval_max_windows={8 if cpu else 32}", f"checkpoint_dir={args.out / 'stage1-checkpoints'}",
        *extra])


def part_prune(args) -> str:
    from trsp_ray.driver import run

    cpu = args.device == "cpu"
    out = args.out / "smollm2-trsp-bf16"
    cfg = _cfg(args, "method=trsp", "ratio=0.25", "distributed.activation_checkpointing=true", f"output={out}",
               f"stage1.first_round_steps={2 if cpu else 16}", f"stage1.steps_per_round={1 if cpu else 3}",
               f"stage2.steps={2 if cpu else 20}")
    results = run(cfg, overwrite=True)
    manifest = json.loads((out / "trsp_ray.json").read_text())
    check = manifest["export_check"]
    if not check["device"].startswith(args.device):
        raise RuntimeError(f"export check ran on {check['device']}, not on {args.device}")
    return (f"dense PPL {results['dense_ppl']:.2f} -> pruned {results['heldout_ppl']:.2f} "
            f"({manifest['num_layers_kept']}/{manifest['num_layers_original']} layers, "
            f"drop {results['dropped_layers']}); "
            f"export check on {check['device']} {check['dtype']}: max |dlogit| {check['max_abs_logit_diff']:.3g} "
            f"<= {check['atol']:.3g}")


def part_memory(args) -> str:
    import torch
    from planner_single import run_stage

    from trsp_ray.plan.single_plan import single_plan_for_run
    from trsp_ray.run.workbench import device_kind, prepare

    rows = []
    for stage in ("stage 1", "stage 1 +ckpt", "stage 2", "stage 2 +ckpt", "sleb", "evaluation"):
        name = stage.removesuffix(" +ckpt")
        extra = [f"distributed.activation_checkpointing={str('ckpt' in stage).lower()}",
                 "stage1.first_round_steps=2", "stage1.steps_per_round=1", "ratio=0.07", "stage2.steps=2"]
        if name == "sleb":
            extra += ["method=sleb", "data.seqlen=512", "data.batch_size=4", "baselines.sleb_windows=32"]
        else:  # the paper's method plans a "stage 2"; the heal methods plan a "heal" instead
            extra += ["method=trsp"]
        cfg = _cfg(args, *extra)
        bench = prepare(cfg)
        kind, memory = device_kind(cfg)
        plan = single_plan_for_run(cfg, device=kind, memory_gb=memory,
                                   methods=("sleb",) if name == "sleb" else None)
        part = next((s for s in plan.stages if s.name == name), None)
        if part is None:
            raise RuntimeError(f"the plan of {cfg.method} has no stage {name!r}: {[s.name for s in plan.stages]}")
        before_parts = ("runtime overhead", "model (original, host)")
        estimate = part.total - sum(part.parts.get(k, 0.0) for k in before_parts)
        gc.collect()
        if args.device == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
            before = torch.cuda.memory_allocated()
        run_stage(bench, name, sleb_windows=32)
        measured = (torch.cuda.max_memory_allocated() - before) / 2**30 if args.device == "cuda" else float("nan")
        rows.append((stage, estimate, measured))
        print(f"  {stage}: planner {estimate:.3f} GiB, measured {measured:.3f} GiB", flush=True)
        del bench
    print(f"{'stage':<16}{'planner GiB':>12}{'measured GiB':>14}{'error':>8}")
    for stage, est, got in rows:
        print(f"{stage:<16}{est:>12.3f}{got:>14.3f}{(est - got) / got:>+8.0%}")
    worst = max(abs(e - g) / g for _, e, g in rows) if args.device == "cuda" else float("nan")
    return f"planner vs max_memory_allocated, worst error {worst:.0%} over {len(rows)} stages"


def part_zero3(args) -> str:
    import ray

    from trsp_ray.config.run_config import replace
    from trsp_ray.data import assets
    from trsp_ray.distributed.deepspeed_config import build_ds_config
    from trsp_ray.distributed.train import run_distributed
    from trsp_ray.plan.memory import OVERHEAD_GB
    from trsp_ray.plan.zero3_plan import plan_for_run

    gpu = args.device == "cuda"
    cfg = _cfg(args, "method=trsp", "ratio=0.07", "stage1.first_round_steps=4", "stage1.steps_per_round=2",
               "stage2.steps=4", "distributed.workers=1", f"distributed.use_gpu={str(gpu).lower()}",
               "distributed.activation_checkpointing=true", "distributed.checkpoint_every=2",
               f"distributed.storage_path={args.out / 'ray-storage'}", f"output={args.out / 'zero3-export'}")
    if not gpu:
        cfg = replace(cfg, dtype="fp32")  # the CPU ZeRO-3 path is fp32 (gloo)
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    temp = tempfile.mkdtemp(prefix="ray-", dir="/tmp")
    ray.init(num_cpus=max(2, min(8, os.cpu_count() or 2)), num_gpus=1 if gpu else 0, include_dashboard=False,
             _temp_dir=temp)
    try:
        t0 = time.time()
        result = run_distributed(cfg, overwrite=True, name=f"gpu-check-{int(t0)}")
    finally:
        ray.shutdown()
    peaks = {e["event"]: e.get("peak_gb") for e in result.events if e["event"] in ("stage1_done", "stage2_done")}
    ds_config = build_ds_config(cfg.distributed, batch_size=cfg.data.batch_size, lr=cfg.stage1.lr)
    est = plan_for_run(cfg, assets.resolve_model(cfg.model), ds_config)
    overhead = OVERHEAD_GB["gpu" if gpu else "cpu"]
    for stage, key in zip(est.stages, ("stage1_done", "stage2_done")):
        got = peaks.get(key)
        print(f"  ZeRO-3 {stage.name}: planner {stage.total:.2f} GB (without the {overhead:g} GB overhead "
              f"{stage.total - overhead:.2f}), worker peak {got if got is None else round(got, 3)} GiB", flush=True)
    manifest = json.loads(Path(result.output, "trsp_ray.json").read_text())
    return (f"1 worker, {'NCCL' if gpu else 'gloo'}: drop {result.drop_order}, attempts {result.attempts()}, "
            f"export {result.output} ({manifest.get('num_layers_kept')} layers; check "
            f"{json.dumps(manifest.get('export_check'))}), {time.time() - t0:.0f}s")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None, help="output folder (default: $OUT or a temp dir)")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--skip-pytest", action="store_true")
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        print("gpu_check: skipped: no CUDA device is visible", flush=True)
        return 0
    args.out = (args.out
                or Path(os.environ.get("OUT") or tempfile.mkdtemp(prefix="gpu-check-"))).resolve() / "gpu_check"
    args.out.mkdir(parents=True, exist_ok=True)
    _env(args.device)
    parts = [("pytest -m gpu", part_pytest), ("SmolLM2 bf16 prune + export + eval", part_prune),
             ("planner vs measured, single process", part_memory), ("ZeRO-3 worker: stage 1, 2, export", part_zero3)]
    if args.skip_pytest:
        parts = parts[1:]
    summary, start = [], time.time()
    for title, fn in parts:
        print(f"\n=== {title} ===", flush=True)
        t0 = time.time()
        try:
            summary.append((title, "ok", fn(args), time.time() - t0))
        except Exception as exc:
            traceback.print_exc()
            summary.append((title, "FAILED", f"{type(exc).__name__}: {' '.join(str(exc).split())[:300]}",
                            time.time() - t0))
        gc.collect()
    print(f"\n=== summary ({time.time() - start:.0f}s, load average {os.getloadavg()[0]:.2f}) ===")
    for title, status, detail, seconds in summary:
        print(f"[{status}] {title} ({seconds:.0f}s): {detail}")
    (args.out / "summary.json").write_text(json.dumps(
        [{"part": t, "status": s, "detail": d, "seconds": round(x, 1)} for t, s, d, x in summary], indent=1))
    return 0 if all(s == "ok" for _, s, _, _ in summary) else 1


if __name__ == "__main__":
    sys.exit(main())
