"""Start `world` local processes as the ranks of one torch.distributed (gloo) group and collect the
one `RESULT <json>` line each prints: the harness of the tests that compare ZeRO-3 ranks with one
process."""

from __future__ import annotations

import json
import os
import subprocess

from trsp_ray.distributed.ranks import free_port


def run_ranks(args: list[str], *, world: int, timeout: float = 600) -> list:
    """Run `args` once per rank (RANK, WORLD_SIZE, MASTER_ADDR/PORT set) and return each rank's
    RESULT, in rank order; a rank that fails fails the test with the end of its stderr."""
    port = free_port()
    procs = [subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env={**os.environ, "RANK": str(r), "LOCAL_RANK": str(r), "WORLD_SIZE": str(world),
                                   "LOCAL_WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1",
                                   "MASTER_PORT": str(port)})
             for r in range(world)]
    results = []
    for proc in procs:
        stdout, stderr = proc.communicate(timeout=timeout)
        assert proc.returncode == 0, stderr[-3000:]
        results.append(json.loads(next(line[7:] for line in stdout.splitlines() if line.startswith("RESULT "))))
    return results


def sharded_gated(model_dir: str):
    """In a rank process that run_ranks started: the gloo group, the model of `model_dir` partitioned under
    ZeRO-3 (fp32), its gates attached and ready, and a stepper factory; (model, gates, factory, rank, world)."""
    import torch

    from trsp_ray.config.sections import DistributedConfig
    from trsp_ray.distributed import engine as eng
    from trsp_ray.distributed.deepspeed_config import build_ds_config
    from trsp_ray.method.gates import attach_gates

    torch.set_num_threads(1)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    eng.init_deepspeed(backend="gloo")
    ds = build_ds_config(DistributedConfig(workers=world), batch_size=2, lr=1e-3)
    model = eng.load_sharded(model_dir, ds_config=ds, dtype=torch.float32)
    gates = attach_gates(model)
    eng.zero_ready_gates(gates)
    return model, gates, eng.StepperFactory(ds_config=ds, rank=rank, world=world), rank, world
