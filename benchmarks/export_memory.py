"""Rank 0's peak host memory during a ZeRO-3 export, as a multiple of the largest shard: the
streaming export against the whole-model gather it replaced. SmolLM2-135M, 2 gloo processes, CPU.

    nice -n 15 python benchmarks/export_memory.py [--shard-mb 20] [--workers 2] [--drop 3,4,5,6,7,17,23,26]

Each path runs in fresh processes started by this script (no Ray): the model is loaded partitioned
by ZeRO-3 in fp32 (a CPU run's dtype) and gated, an engine is built (as a run leaves it), then rank
0's peak resident memory is reset (/proc/self/clear_refs) and the export runs; the figure is
VmHWM after it minus VmRSS before it. Paths:
  stream         export_streaming, reload check off: what a 70B export does (over export_reload_max_gb)
  stream+reload  export_streaming with the reload-and-logits check (only for models that fit the host)
  old            the export before issue 10: gather_state_dict to rank 0, from_config, load_state_dict,
                 remove_layers, export_model (save_pretrained + reload)
  gather-only    no export: one GatheredParameters of the largest unit (the floor of any gather on
                 CPU: torch's gloo all_gather stages the full output in a temporary of its own size)
Target: stream <= 2x the largest shard above the baseline.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PATHS = ("old", "stream+reload", "stream", "gather-only")


def _status_kb(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status (Linux only)")


def _old_export(model, *, model_path: str, tokenizer, drop: list[int], output: str, rank: int) -> None:
    """The pre-issue-10 export path, kept here only to be measured (commit c8f7704's worker._export)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from trsp_ray.distributed.collectives import barrier
    from trsp_ray.distributed.engine import gather_state_dict
    from trsp_ray.distributed.export import plain_state_dict
    from trsp_ray.method.surgery import remove_layers
    from trsp_ray.run.export import export_model

    state = gather_state_dict(model, rank=rank)
    if rank == 0:
        plain = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_path), dtype=torch.float32)
        plain.load_state_dict(plain_state_dict(state, "model.layers"), strict=False)
        remove_layers(plain, drop)
        export_model(plain.eval(), tokenizer, output, manifest={"path": "old"}, overwrite=True)
    barrier()


def worker(args) -> None:
    import torch
    from transformers import AutoTokenizer

    from trsp_ray.config.sections import DistributedConfig
    from trsp_ray.distributed import engine as eng
    from trsp_ray.distributed.collectives import barrier
    from trsp_ray.distributed.deepspeed_config import build_ds_config
    from trsp_ray.distributed.export import export_streaming, export_units, gathered, plan_shards
    from trsp_ray.method.gates import attach_gates

    torch.set_num_threads(1)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    drop = [int(x) for x in args.drop.split(",")]
    eng.init_deepspeed(backend="gloo")
    ds = build_ds_config(DistributedConfig(workers=world), batch_size=world, lr=1e-3)
    model = eng.load_sharded(args.model, ds_config=ds, dtype=torch.float32)
    gates = attach_gates(model)
    eng.zero_ready_gates(gates)
    eng.StepperFactory(ds_config=ds, rank=rank, world=world)(model, [{"params": gates.gate_params()}])
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    units = export_units(model, drop)[0]
    shards = plan_shards(model, units, max_shard_bytes=int(args.shard_mb * 10**6))
    largest_unit = max(units, key=lambda u: sum(p.ds_numel for p in u.params()))
    barrier()
    base = _status_kb("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := current RSS
    t0 = time.time()
    if args.path == "gather-only":
        with gathered(largest_unit.params()):
            pass
    elif args.path == "old":
        _old_export(model, model_path=args.model, tokenizer=tokenizer, drop=drop, output=args.output, rank=rank)
    else:
        export_streaming(model, tokenizer=tokenizer, drop=drop, output=args.output, manifest={"path": args.path},
                         max_shard_mb=args.shard_mb, reload_max_gb=1e9 if args.path == "stream+reload" else 0)
    seconds = time.time() - t0
    peak = (_status_kb("VmHWM") - base) * 1024
    print("RESULT " + json.dumps({"rank": rank, "peak_bytes": peak, "baseline_bytes": base * 1024,
                                  "largest_unit": largest_unit.label,
                                  "seconds": seconds, "largest_shard_bytes": max(s.nbytes for s in shards),
                                  "shards": len(shards), "total_bytes": sum(s.nbytes for s in shards)}), flush=True)


def run_path(args, path: str, output: str) -> dict:
    from trsp_ray.distributed.ranks import free_port

    port = free_port()
    cmd = [sys.executable, __file__, "--path", path, "--output", output, "--model", args.model,
           "--shard-mb", str(args.shard_mb), "--drop", args.drop]
    procs = [subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env={**os.environ, "RANK": str(r), "LOCAL_RANK": str(r), "WORLD_SIZE": str(args.workers),
                                   "LOCAL_WORLD_SIZE": str(args.workers), "MASTER_ADDR": "127.0.0.1",
                                   "MASTER_PORT": str(port)})
             for r in range(args.workers)]
    results = []
    for proc in procs:
        out, err = proc.communicate()
        if proc.returncode != 0:
            raise RuntimeError(f"{path} worker failed:\n{err[-3000:]}")
        results.append(json.loads(next(x[7:] for x in out.splitlines() if x.startswith("RESULT "))))
    return next(r for r in results if r["rank"] == 0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shard-mb", type=float, default=20.0)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--drop", default="3,4,5,6,7,17,23,26", help="layers to drop (the README run's TRSP set)")
    parser.add_argument("--model", default=None, help="model directory (default: the embedded SmolLM2-135M)")
    parser.add_argument("--path", choices=PATHS, help=argparse.SUPPRESS)  # set in the worker processes
    parser.add_argument("--output", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.path:
        return worker(args)
    from trsp_ray.data.assets import resolve_model

    args.model = args.model or resolve_model("smollm2-135m")
    root = Path(tempfile.mkdtemp(prefix="trsp-export-memory-"))
    try:
        rows = {path: run_path(args, path, str(root / path.replace("+", "-"))) for path in PATHS}
    finally:
        shutil.rmtree(root, ignore_errors=True)  # three exported models
    largest = rows["stream"]["largest_shard_bytes"]
    mb = lambda b: f"{b / 10**6:8.1f}"
    print(f"\nSmolLM2-135M fp32 under ZeRO-3 on {args.workers} gloo processes, {len(args.drop.split(','))} layers "
          f"dropped; kept weights {mb(rows['stream']['total_bytes']).strip()} MB in {rows['stream']['shards']} "
          f"shards of <= {args.shard_mb:g} MB; largest shard {mb(largest).strip()} MB (a tensor larger than the "
          f"limit gets its own shard); largest unit gathered: {rows['stream']['largest_unit']}")
    print(f"{'path':<14} {'rank-0 peak above baseline MB':>30} {'x largest shard':>16} "
          f"{'baseline MB':>12} {'seconds':>8}")
    for path, r in rows.items():
        print(f"{path:<14} {mb(r['peak_bytes']):>30} {r['peak_bytes'] / largest:>16.2f} "
              f"{mb(r['baseline_bytes']):>12} {r['seconds']:>8.1f}")
    stream, floor = rows["stream"]["peak_bytes"], rows["gather-only"]["peak_bytes"]
    print(f"target stream <= 2x largest shard: {stream / largest:.3f}x "
          f"({'met' if stream <= 2 * largest else 'not met'});"
          f" the export adds {(stream - floor) / 10**6:.1f} MB to one bare gather of its largest unit")
    print("load:", subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip())


if __name__ == "__main__":
    main()
