"""The parts of the GPU check (benchmarks/gpu_check.py), one per process:

    python benchmarks/gpu_parts.py PART CONTEXT.json

gpu_check.py writes CONTEXT.json (device, model directory, texts, work folder, where the part's record
goes) and runs each part under its own time limit. A part prints what it measures, writes its record
(`figure`: the one line of the summary table, plus its details) and exits 0; any exception fails it.
On `device: cpu` (the smoke mode) every size is cut so that a part takes seconds, not minutes.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))
GIB = 2**30
SHAPES = {  # Llama-3 shapes; the vocabulary is the tokenizer's (SmolLM2's 49152)
    "1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
               num_key_value_heads=8, tie_word_embeddings=True),
    "3b": dict(hidden_size=3072, intermediate_size=8192, num_hidden_layers=28, num_attention_heads=24,
               num_key_value_heads=8, tie_word_embeddings=True),
    "8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
               num_key_value_heads=8, tie_word_embeddings=False),
    # the CPU smoke shape: every part in seconds
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=8, num_attention_heads=4,
                 num_key_value_heads=2, tie_word_embeddings=True),
}


def smoke(ctx: dict) -> bool:
    return ctx["device"] == "cpu"


def llama_config(shape: str, vocab: int):
    """A random-init config: a SHAPES name (Llama), or a config.json path (its vocabulary grown to the tokenizer's)."""
    import transformers as tf

    if shape in SHAPES:
        return tf.LlamaConfig(vocab_size=vocab, max_position_embeddings=4096, bos_token_id=1, eos_token_id=2,
                              pad_token_id=2, rope_parameters={"rope_theta": 500000.0, "rope_type": "default"},
                              **SHAPES[shape])
    fields = json.loads(Path(shape).read_text())
    config = tf.AutoConfig.for_model(fields.pop("model_type", "llama"), **fields)
    if config.vocab_size < vocab:  # the tokenizer's ids must index the embedding
        print(f"{shape}: vocab_size {config.vocab_size} -> the tokenizer's {vocab}", flush=True)
        config.vocab_size = vocab
    return config


def part_model(ctx: dict) -> dict:
    """The random-init model of the shape, bf16, with the tokenizer beside it (reused when it exists)."""
    import torch
    import transformers as tf

    out = Path(ctx["model"])
    if (out / "config.json").exists():
        return {"figure": f"reused {out}"}
    tokenizer = tf.AutoTokenizer.from_pretrained(ctx["tokenizer"])
    config = llama_config(ctx["shape"], len(tokenizer))
    torch.manual_seed(0)
    with torch.device("cuda" if ctx["device"] == "cuda" else "cpu"):
        model = tf.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    params = sum(p.numel() for p in model.parameters())
    tmp = out.with_name(out.name + ".tmp")
    model.save_pretrained(tmp, max_shard_size="5GB")
    tokenizer.save_pretrained(tmp)
    os.replace(tmp, out)
    return {"figure": f"{params / 1e9:.3f} B params, {config.num_hidden_layers} layers, bf16", "params": params}


def part_pytest(ctx: dict) -> dict:
    env = {**os.environ, "TRSP_GPU_TESTS_ON_CPU": "1" if smoke(ctx) else "0"}
    done = subprocess.run([sys.executable, "-m", "pytest", "-m", "gpu", "tests/test_gpu.py", "-q",
                           "-p", "no:cacheprovider"], cwd=REPO, env=env, capture_output=True, text=True)
    print(done.stdout[-4000:], done.stderr[-2000:], flush=True)
    last = (done.stdout.strip().splitlines() or ["no output"])[-1]
    if done.returncode != 0:
        raise RuntimeError(f"pytest -m gpu exited {done.returncode}: {last}")
    return {"figure": last.strip("= ")}


def prune_argv(ctx: dict, method: str | None, tag: str) -> list[str]:
    """`trsp-ray prune` on the check's model and texts: bf16 on the device; short stages in the smoke mode."""
    work = Path(ctx["work"])
    seq, windows = (64, 4) if smoke(ctx) else (1024, 16)
    argv = ["prune", "--model", ctx["model"], "--ratio", "0.25", "--calib-text", ctx["calib"],
            "--eval-text", ctx["eval"], "--no-mlflow", "--overwrite", "--output", str(work / f"pruned-{tag}")]
    sets = [f"device={ctx['device']}", "dtype=bf16", f"data.seqlen={seq}", "data.batch_size=4",
            f"data.eval_seqlen={seq}", f"data.eval_max_windows={windows}", f"checkpoint_dir={work / f'ckpt-{tag}'}"]
    if smoke(ctx):
        sets += ["stage1.first_round_steps=2", "stage1.steps_per_round=1", "stage1.refine=0", "stage2.steps=2"]
    return argv + (["--method", method] if method else []) + [a for s in sets for a in ("--set", s)]


def manifest_of(output: str | Path) -> dict:
    path = Path(output) / "trsp_ray.json"
    if not path.exists():
        raise RuntimeError(f"no manifest at {path}: the export did not happen")
    return json.loads(path.read_text())


def check_line(manifest: dict, device: str) -> str:
    """The export check in one line; raises when it did not pass or ran on another device than the run's."""
    check = manifest.get("export_check") or {}
    diff, atol = check.get("max_abs_logit_diff"), check.get("atol")
    if diff is None or atol is None or not diff <= atol:
        raise RuntimeError(f"export check did not pass: {json.dumps(check)[:300]}")
    where = check.get("device", "")
    if where and not where.startswith(device):
        raise RuntimeError(f"the export check ran on {where}, not on {device}")
    return f"export check {where or 'reload'} |dlogit| {diff:.3g} <= {atol:.3g}"


def peak_gib() -> float | None:
    import torch

    return torch.cuda.max_memory_allocated() / GIB if torch.cuda.is_available() else None


def _prune(ctx: dict, method: str | None, tag: str) -> dict:
    from trsp_ray.cli import main as cli_main

    argv = prune_argv(ctx, method, tag)
    t0 = time.time()
    rc = cli_main(argv)
    if rc:
        raise RuntimeError(f"trsp-ray prune exited {rc}")
    manifest, peak = manifest_of(Path(ctx["work"]) / f"pruned-{tag}"), peak_gib()
    metrics = manifest.get("metrics", {})
    figure = (f"{time.time() - t0:.0f}s, kept {manifest.get('num_layers_kept')}/{manifest.get('num_layers_original')}"
              f"{'' if peak is None else f', peak {peak:.1f} GiB'}, {check_line(manifest, ctx['device'])}")
    return {"figure": figure, "peak_gib": peak, "dense_ppl": metrics.get("dense_ppl"),
            "heldout_ppl": metrics.get("heldout_ppl"), "export_check": manifest.get("export_check")}


def part_prune_default(ctx: dict) -> dict:
    return _prune(ctx, None, "default")


def part_prune_trsp(ctx: dict) -> dict:
    return _prune(ctx, "trsp", "trsp")


KD_LIMIT = 1.5  # issue 40: a KD heal step within 1.5x of a CE step (the teacher's forward on the device)


def part_kd(ctx: dict) -> dict:
    """A KD heal step against a CE heal step on the same pruned model, one process on the device: the
    teacher is a device copy (methods.recovery_stepper); the first GPU run's host teacher made it ~20x."""
    from dataclasses import replace

    from trsp_ray.config.run_config import load_config
    from trsp_ray.config.run_config import replace as with_settings
    from trsp_ray.run.methods import apply_method
    from trsp_ray.run.pipeline import named
    from trsp_ray.run.workbench import prepare

    seq = 64 if smoke(ctx) else 1024
    steps = 2 if smoke(ctx) else 6
    cfg = load_config(overrides=[f"model={ctx['model']}", "method=shortgpt+heal", "ratio=0.25",
                                 f"data.calib_text={ctx['calib']}", f"data.eval_text={ctx['eval']}",
                                 f"device={ctx['device']}", "dtype=bf16", f"data.seqlen={seq}", "data.batch_size=4"])
    bench = prepare(cfg)
    spec, n = named(cfg).spec, bench.num_layers
    drop = list(range(n // 2 - n // 8, n // 2 - n // 8 + bench.n_drop()))  # a fixed middle block: no selection
    per_step, first_loss = {}, {}
    for objective in ("ce", "kd", "ce"):  # ce twice: the first one also warms the kernels up
        run = replace(bench, cfg=with_settings(cfg, **{"recovery.objective": objective}))
        losses = []  # each heal step's loss of its objective (heal/ce carries the objective's value)
        info = apply_method(run, spec, drop=drop, heal_cfg=replace(cfg.heal, steps=steps),
                            report=lambda metrics, step, seen=losses: seen.append(metrics["heal/ce"])
                            if "heal/ce" in metrics else None).info
        per_step[objective] = info["heal_seconds"] / info["heal_steps"]
        first_loss.setdefault(objective, []).append(losses[0])
    ratio = per_step["kd"] / per_step["ce"]
    figure = (f"heal step ce {per_step['ce']:.3f} s, kd {per_step['kd']:.3f} s: x{ratio:.2f} "
              f"(limit x{KD_LIMIT} on a GPU), {steps} steps of 4 x {seq} tokens; first step's loss "
              f"ce {first_loss['ce'][0]:.4f}, kd {first_loss['kd'][0]:.4f}")
    if ctx["device"] == "cuda" and ratio > KD_LIMIT:
        raise RuntimeError(figure)
    # the two ce heals start from the same pruned model on the same batches, the kd heal on its teacher's loss
    return {"figure": figure, "ce_step_s": per_step["ce"], "kd_step_s": per_step["kd"], "ratio": ratio,
            "ce_first_loss": first_loss["ce"], "kd_first_loss": first_loss["kd"][0]}


def part_memory(ctx: dict) -> dict:
    from gpu_memory import planner_vs_measured

    return planner_vs_measured(prune_argv(ctx, None, "memory"), tolerance=ctx["memory_tolerance"])


def part_speed(ctx: dict) -> dict:
    """compare_speed (evaluation/speed.py): the dense model against it with the middle 25% of its layers removed."""
    import copy

    import torch
    import transformers as tf

    from trsp_ray.evaluation.speed import SpeedSettings, compare_speed
    from trsp_ray.method.stage1 import n_drop_for
    from trsp_ray.method.surgery import remove_layers

    if ctx.get("speed_shape"):
        config = llama_config(ctx["speed_shape"], len(tf.AutoTokenizer.from_pretrained(ctx["tokenizer"])))
    else:
        config = tf.AutoConfig.from_pretrained(ctx["model"])
    torch.manual_seed(0)
    with torch.device(ctx["device"]):  # made on the device: nothing read from or written to disk
        dense = tf.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).eval()
    layers = config.num_hidden_layers
    n_drop = n_drop_for(0.25, layers)
    first = (layers - n_drop) // 2
    pruned = copy.deepcopy(dense)
    remove_layers(pruned, list(range(first, first + n_drop)))
    settings = (SpeedSettings(prompt_len=32, gen_batch=2, gen_prompt_len=8, new_tokens=4, warmup=1, rounds=2)
                if smoke(ctx) else SpeedSettings(new_tokens=64, rounds=5))  # an 8B shape within its limit
    r = compare_speed(dense, pruned, settings)
    ideal = r["ideal_speedup"]
    figure = (f"{layers}->{r['layers_kept']} layers: prefill x{r['prefill_speedup']:.3f} "
              f"({r['prefill_speedup'] / ideal:.2f} of ideal {ideal:.3f}), decode x{r['throughput_speedup']:.3f}")
    print(figure, json.dumps(r, default=str), flush=True)
    return {"figure": figure, "compare": r}


def zero3_config(ctx: dict, tag: str, method: str, *extra: str):
    """A ZeRO-3 run config on the check's model: bf16 on NCCL; fp32 on gloo in the smoke mode."""
    from trsp_ray.config.run_config import load_config, replace

    work, gpu, cut = Path(ctx["work"]) / f"zero3-{tag}", ctx["device"] == "cuda", smoke(ctx)
    cfg = load_config(overrides=[
        f"model={ctx['model']}", f"device={ctx['device']}", "dtype=bf16", "tracking.enabled=false",
        f"data.calib_text={ctx['calib']}", f"data.eval_text={ctx['eval']}", f"data.seqlen={64 if cut else 1024}",
        "data.batch_size=4", f"data.eval_seqlen={64 if cut else 256}", "data.eval_max_windows=4",
        f"checkpoint_dir={work / 'stage1'}", f"method={method}", "ratio=0.25",
        f"stage1.first_round_steps={2 if cut else 8}", f"stage1.steps_per_round={1 if cut else 2}",
        f"stage2.steps={4 if cut else 8}", "distributed.activation_checkpointing=true",
        f"distributed.use_gpu={str(gpu).lower()}", f"distributed.storage_path={work / 'storage'}",
        f"output={work / 'out'}", *extra])
    return cfg if gpu else replace(cfg, dtype="fp32")  # the CPU ZeRO-3 path is fp32 (gloo)


def run_zero3(ctx: dict, cfg, *, tag: str, fault=None):
    """run_distributed in a Ray instance of this process's own (never a cluster left on the machine)."""
    from trsp_ray.distributed.ray_session import session
    from trsp_ray.distributed.train import run_distributed

    gpus = cfg.distributed.workers if ctx["device"] == "cuda" else 0
    try:
        with session("local", num_cpus=max(2, min(8, os.cpu_count() or 2)), num_gpus=gpus,
                     _temp_dir=os.environ.get("RAY_TMPDIR") or "/tmp/ray"):
            return run_distributed(cfg, overwrite=True, fault=fault, name=f"gpu-check-{tag}-{int(time.time())}")
    finally:  # a 1B run's checkpoints (fp32 masters + Adam moments) are ~20 GB each: the disk holds few
        shutil.rmtree(cfg.distributed.storage_path, ignore_errors=True)


def zero3_plan_vs_peaks(cfg, events: list[dict], *, gpu: bool) -> list[dict]:
    """The ZeRO-3 plan's first stage, its fit (when it has one) and its last stage (less the runtime overhead)
    against the worker's stage1_done, compensation and stage2_done peaks (max_memory_allocated on a GPU, the
    resident set on a CPU)."""
    from trsp_ray.data import assets
    from trsp_ray.distributed.deepspeed_config import build_ds_config
    from trsp_ray.plan.memory import OVERHEAD_GB
    from trsp_ray.plan.zero3_plan import plan_for_run
    from trsp_ray.run.pipeline import named

    ds_config = build_ds_config(cfg.distributed, batch_size=cfg.data.batch_size, lr=cfg.stage1.lr)
    plan = plan_for_run(cfg, assets.resolve_model(cfg.model), ds_config, spec=named(cfg).spec)
    stages = plan.stages
    peaks = {e["event"]: e["peak_gb"] for e in events if e.get("peak_gb") is not None}
    rows = []
    fits = [(fit, "compensation")] if (fit := _fit_plan(cfg, plan)) is not None else []
    for stage, event in ((stages[0], "stage1_done"), *fits, (stages[-1], "stage2_done")):
        planned, peak = stage.total - OVERHEAD_GB["gpu" if gpu else "cpu"], peaks.get(event)
        rows.append({"stage": stage.name, "event": event, "plan_gib": round(planned, 3), "peak_gib": peak,
                     "error": None if not peak else round((planned - peak) / peak, 3)})
    return rows


def _fit_plan(cfg, plan):
    """The ZeRO-3 plan of the least-squares fit the run's pipeline runs (None without one), as route.py plans it."""
    from trsp_ray.config.run_config import for_method, sized
    from trsp_ray.plan.compensation_plan import compensation_plan

    c = sized(for_method(cfg), hidden=plan.shape.hidden).compensation
    if c.method != "lstsq":
        return None
    return compensation_plan(plan.shape, plan.setup, ratio=cfg.ratio, protect_head=cfg.gates.protect_head,
                             protect_tail=cfg.gates.protect_tail, objective=c.objective, windows=c.windows).memory


def _zero3(ctx: dict, method: str, tag: str, workers: int) -> dict:
    t0 = time.time()
    gpu = ctx["device"] == "cuda"
    cfg = zero3_config(ctx, tag, method, f"distributed.workers={workers}", "distributed.checkpoint_every=100")
    result = run_zero3(ctx, cfg, tag=tag)
    manifest, plan = manifest_of(result.output), zero3_plan_vs_peaks(cfg, result.events, gpu=gpu)
    versus = ", ".join(f"{r['stage']} {r['plan_gib']:.2f} vs {r['peak_gib'] or 0:.2f} GiB" for r in plan)
    figure = (f"{workers} worker{'s' if workers > 1 else ''}, {'NCCL' if gpu else 'gloo'}, {time.time() - t0:.0f}s: "
              f"drop {result.drop_order}, plan vs peak {versus}, {check_line(manifest, '')}")
    return {"figure": figure, "drop": result.drop_order, "plan_vs_peak": plan, "output": result.output,
            "export_check": manifest.get("export_check")}


def part_zero3_default(ctx: dict) -> dict:
    return _zero3(ctx, "shortgpt+comp+heal", "default", 1)


def part_zero3_trsp(ctx: dict) -> dict:
    return _zero3(ctx, "trsp", "trsp", 1)


def part_zero3_2w(ctx: dict) -> dict:
    return _zero3(ctx, "trsp", "2w", 2)


def part_export(ctx: dict) -> dict:
    """The streaming export of the zero3-trsp part: its manifest's checks, then a reload and a forward on the device."""
    import torch
    import transformers as tf

    out = Path(ctx["work"]) / "zero3-trsp" / "out"
    manifest = manifest_of(out)
    line = check_line(manifest, "")
    check = manifest["export_check"]
    model = tf.AutoModelForCausalLM.from_pretrained(out, dtype=torch.bfloat16).to(ctx["device"]).eval()
    layers = model.config.num_hidden_layers
    if layers != manifest.get("num_layers_kept"):
        raise RuntimeError(f"the export has {layers} layers, its manifest says {manifest.get('num_layers_kept')}")
    with torch.no_grad():
        logits = model(torch.arange(1, 33, device=ctx["device"])[None]).logits
    if not torch.isfinite(logits).all():
        raise RuntimeError("the reloaded export's logits are not finite")
    return {"figure": f"{layers} layers, {check.get('shards')} shards, {check.get('bytes', 0) / 1e9:.2f} GB, {line}, "
                      f"reload forward finite", "export_check": check}


def part_job(ctx: dict) -> dict:
    """jobs/prune_70b.py --workers 1, as a user submits it (its own process, its own Ray)."""
    work, cut = Path(ctx["work"]) / "job", smoke(ctx)
    argv = [sys.executable, "jobs/prune_70b.py", "--model", ctx["model"], "--workers", "1", "--device", ctx["device"],
            "--gpu-memory-gb", str(ctx["gpu_memory_gb"]), "--ratio", "0.25", "--no-tracking", "--max-failures", "0",
            "--storage-path", str(work / "storage"), "--output", str(work / "out"), "--overwrite",
            "--set", f"data.calib_text={ctx['calib']}", "--set", f"data.eval_text={ctx['eval']}",
            "--set", "data.batch_size=4", "--set", f"data.seqlen={64 if cut else 1024}",
            "--set", f"stage2.steps={2 if cut else 8}"]
    done = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, env={**os.environ, "RAY_ADDRESS": "local"})
    print(done.stdout[-6000:], done.stderr[-4000:], flush=True)
    shutil.rmtree(work / "storage", ignore_errors=True)
    if done.returncode != 0:
        last = (done.stderr.strip() or "?").splitlines()[-1]
        raise RuntimeError(f"jobs/prune_70b.py exited {done.returncode}: {last}")
    last = json.loads([line for line in done.stdout.splitlines() if line.startswith("{")][-1])
    return {"figure": f"rc 0: drop {last['drop_order']}, attempts {last['attempts']}, "
                      f"{check_line(manifest_of(work / 'out'), '')}", "result": last}


def part_fault(ctx: dict) -> dict:
    """The default pipeline on one ZeRO-3 worker, killed right after heal step 2's checkpoint: Ray Train restarts
    it, it resumes from that checkpoint and finishes the heal and the export."""
    # one checkpoint (step 2 of 4): a 1B heal's is ~20 GB, the disk holds few
    cfg = zero3_config(ctx, "fault", "shortgpt+comp+heal", "distributed.workers=1", "distributed.checkpoint_every=2",
                       "distributed.max_failures=1", "stage2.steps=4", "distributed.keep_checkpoints=1")
    result = run_zero3(ctx, cfg, tag="fault", fault={"stage2_step": 2, "rank": 0, "marker": "gpu-check-kill"})
    starts = [e.get("resumed_from") for e in result.events if e["event"] == "start"]
    steps = [e.get("steps_computed") for e in result.events if e["event"] == "stage2_done"]
    if result.attempts() != 2 or starts != [None, "stage2-step2"]:
        raise RuntimeError(f"expected one kill and a resume from stage2-step2; attempts {result.attempts()}, "
                           f"resumed from {starts}")
    line = check_line(manifest_of(result.output), "")
    return {"figure": f"killed after heal step 2, resumed from {starts[1]}, then {steps[-1]} heal steps, "
                      f"{line}", "starts": starts, "steps_computed": steps}


PARTS = {name.removeprefix("part_").replace("_", "-"): fn for name, fn in globals().items()
         if name.startswith("part_") and callable(fn)}


def main() -> int:
    name, ctx = sys.argv[1], json.loads(Path(sys.argv[2]).read_text())
    from trsp_ray.common.logs import quiet_libraries

    quiet_libraries(verbose=False)
    try:
        record = PARTS[name](ctx)
        Path(ctx["record"]).write_text(json.dumps(record, default=str, indent=1))
        print(f"[{name}] {record['figure']}", flush=True)
        rc = 0
    except BaseException as exc:  # noqa: BLE001 - the one line the summary shows
        traceback.print_exc()
        Path(ctx["record"]).write_text(json.dumps({"figure": f"{type(exc).__name__}: {' '.join(str(exc).split())}"}))
        rc = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(rc)  # no module teardown (Ray, NCCL threads): the record is written, the rc is the verdict


if __name__ == "__main__":
    main()
