"""The least-squares fit's memory plan against its measured peak, per rank: a tiny Llama on 2 gloo ZeRO-3
ranks on CPU, fitted by distributed/compensate.fit as a Ray Train worker runs it (issue 33 item 4).

    python benchmarks/fit_memory.py [--hidden 512] [--intermediate 1536] [--layers 6] [--seqlen 512]
        [--windows 32] [--batch 16] [--drop 2,4] [--json]

Each rank runs with glibc told to return every freed block of 64 KiB or more at once
(MALLOC_MMAP_THRESHOLD_=65536, as benchmarks/planner_single.py): its resident set then follows the live
tensors, as torch.cuda.max_memory_allocated does on a GPU. It loads the model partitioned (fp32),
builds stage 1's engine over the gates, runs one warm-up forward, then resets its peak resident set
(Linux VmHWM) and runs the fit: measured = peak - resident set just before the fit (RSS delta, not
tracemalloc, which does not see torch's allocations). The plan's figure for the same span is what
compensation_plan adds to what was resident before (the partition, the runtime): the fit's working
set (sums + its largest phase) and the parameters its forwards gather. Goal: within 15%.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

FIELDS = ("hidden", "intermediate", "layers", "seqlen", "windows", "batch")


def _status_gib(field: str) -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 2**20
    raise RuntimeError(f"{field} not in /proc/self/status")


def _config(args):
    import transformers as tf

    heads = max(1, args.hidden // 64)
    return tf.LlamaConfig(vocab_size=256, hidden_size=args.hidden, intermediate_size=args.intermediate,
                          num_hidden_layers=args.layers, num_attention_heads=heads,
                          num_key_value_heads=max(1, heads // 2), max_position_embeddings=args.seqlen)


def rank_main(args) -> None:
    """One rank (RANK / WORLD_SIZE from the environment): the fit and its peak resident set."""
    import torch

    from trsp_ray.config.sections import DistributedConfig
    from trsp_ray.distributed import compensate
    from trsp_ray.distributed import engine as eng
    from trsp_ray.distributed.deepspeed_config import build_ds_config
    from trsp_ray.method.gates import attach_gates

    torch.set_num_threads(1)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    eng.init_deepspeed(backend="gloo")
    ds = build_ds_config(DistributedConfig(workers=world), batch_size=args.batch, lr=1e-3)
    model = eng.load_sharded(str(Path(args.work) / "model"), ds_config=ds, dtype=torch.float32)
    gates = attach_gates(model)
    eng.zero_ready_gates(gates)
    eng.StepperFactory(ds_config=ds, rank=rank, world=world)(model, [{"params": gates.gate_params()}])
    windows = torch.load(Path(args.work) / "windows.pt")
    with torch.no_grad():  # torch's kernels, gloo and DeepSpeed's trace warmed up
        model(input_ids=windows[0][:1], use_cache=False, logits_to_keep=1)
    gc.collect()
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
    before = _status_gib("VmRSS")
    info = compensate.fit(model=model, gates=gates, drop=args.drop, windows=windows, rank=rank, world=world,
                          ridge=1e-2, minimum=1.0)
    peak = _status_gib("VmHWM")
    print("RESULT " + json.dumps({"rank": rank, "before_gib": before, "peak_gib": peak, "delta_gib": peak - before,
                                  "blocks": info["blocks"], "tokens": info["tokens"], "seconds": info["seconds"]}),
          flush=True)


def planned(args) -> dict:
    """The plan's figures for this fit (compensation_plan, as `trsp-ray plan` calls it)."""
    from trsp_ray.method.boundaries import blocks
    from trsp_ray.plan.compensation_plan import WORKING_SET, compensation_plan
    from trsp_ray.plan.shape import shape_from_config
    from trsp_ray.plan.zero3_setup import Setup

    s = shape_from_config(_config(args).to_dict())
    st = Setup(workers=2, dtype_bytes=4, micro_batch=args.batch // 2, seqlen=args.seqlen, device="cpu")
    cp = compensation_plan(s, st, ratio=len(args.drop) / args.layers, windows=args.windows, protect_head=1,
                           protect_tail=1)
    if cp.blocks != len(blocks(args.drop, args.layers)):
        raise SystemExit(f"--drop {args.drop} has {len(blocks(args.drop, args.layers))} blocks, the plan "
                         f"{cp.blocks}; choose a drop set with as many blocks as the plan's worst case")
    parts = cp.memory.parts
    fit = parts[WORKING_SET] + parts["gathered parameters"]
    return {"fit_gib": fit, "working_set_gib": parts[WORKING_SET], "gathered_gib": parts["gathered parameters"],
            "phases": cp.phases, "rows": cp.rows, "total_gib": cp.memory.total}


def run_ranks(args) -> list[dict]:
    import torch

    from trsp_ray.distributed.ranks import free_port
    from trsp_ray.models.tiny import VOCAB

    work = Path(tempfile.mkdtemp(prefix="trsp-fit-memory-"))
    torch.manual_seed(0)
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_config(_config(args)).save_pretrained(work / "model")
    gen = torch.Generator().manual_seed(3)
    torch.save(list(torch.randint(0, VOCAB, (args.windows, args.seqlen), generator=gen).split(args.batch)),
               work / "windows.pt")
    port = free_port()
    cmd = [sys.executable, __file__, "--rank-of", str(work), *_flags(args)]
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env={**env, "RANK": str(r), "LOCAL_RANK": str(r)}) for r in range(2)]
    results = []
    for proc in procs:
        try:
            out, err = proc.communicate(timeout=900)
        finally:
            if proc.poll() is None:
                proc.kill()
        if proc.returncode != 0:
            raise SystemExit(f"a rank exited {proc.returncode}:\n{err[-3000:]}")
        results.append(json.loads(next(line[7:] for line in out.splitlines() if line.startswith("RESULT "))))
    return results


def _flags(args) -> list[str]:
    out = [f"--{f}={getattr(args, f)}" for f in FIELDS]
    return out + [f"--drop={','.join(map(str, args.drop))}"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--intermediate", type=int, default=1536)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--seqlen", type=int, default=512)
    parser.add_argument("--windows", type=int, default=32, help="calibration windows over both ranks")
    parser.add_argument("--batch", type=int, default=16, help="the run's batch size (windows per forward at most)")
    parser.add_argument("--drop", type=lambda t: [int(x) for x in t.split(",")], default=[2, 4])
    parser.add_argument("--json", action="store_true", help="also print one JSON line (the test reads it)")
    parser.add_argument("--measure-only", action="store_true", help="no plan (e.g. an older checkout's fit)")
    parser.add_argument("--rank-of", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank_of:
        args.work = args.rank_of
        rank_main(args)
        return
    if args.measure_only:
        for r in run_ranks(args):
            print(f"rank {r['rank']}: measured {r['delta_gib']:.3f} GiB over the fit ({r['seconds']:.1f} s)")
        return
    plan = planned(args)
    ranks = run_ranks(args)
    print(f"fit: {len(args.drop)} dropped layers of {args.layers}, hidden {args.hidden}, {args.windows} windows x "
          f"{args.seqlen} tokens over 2 ranks, {plan['rows']} windows per forward")
    print("plan's phases beside the model state (GiB): "
          + ", ".join(f"{k} {v:.3f}" for k, v in plan["phases"].items()))
    print(f"plan's fit figure: working set {plan['working_set_gib']:.3f} + gathered parameters "
          f"{plan['gathered_gib']:.3f} = {plan['fit_gib']:.3f} GiB (stage total {plan['total_gib']:.3f})")
    print(f"\n{'rank':<6}{'planned GiB':>12}{'measured GiB':>14}{'plan / measured':>17}{'fit s':>8}")
    for r in ranks:
        print(f"{r['rank']:<6}{plan['fit_gib']:>12.3f}{r['delta_gib']:>14.3f}{plan['fit_gib'] / r['delta_gib']:>17.3f}"
              f"{r['seconds']:>8.1f}")
    print("measured: peak resident set (VmHWM) during compensate.fit minus the resident set just before it")
    if args.json:
        print("JSON " + json.dumps({"plan": plan, "ranks": ranks}))


if __name__ == "__main__":
    main()
