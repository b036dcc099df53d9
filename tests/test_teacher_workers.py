"""Issue 50 item 2 on Ray Train workers: the ZeRO-3 ranks fill the teacher store from the sharded
dense model (no second model in memory) and each rank's distillation loss, read from the store for
its rows of the batch, is the one-process loss on those rows (DeepSpeed over gloo, without Ray)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from trsp_ray.method.distill import StoredDistillLoss
from trsp_ray.method.gates import attach_gates
from trsp_ray.models.tiny import tiny_model
from trsp_ray.run.teacher_store import TeacherStore, dense_compute

TESTS = Path(__file__).resolve().parent

ZERO3_WORKER = r"""
import json, sys, torch
from types import SimpleNamespace
sys.path.insert(0, sys.argv[3])
from gloo_ranks import sharded_gated
from test_teacher_store import CFG, _stream
from trsp_ray.distributed import engine as eng
from trsp_ray.distributed.recovery import fill_on_ranks
from trsp_ray.method.distill import StoredDistillLoss
from trsp_ray.run.teacher_store import TeacherStore
model_dir, root = sys.argv[1], sys.argv[2]
model, gates, factory, rank, world = sharded_gated(model_dir)
bench = SimpleNamespace(model=model, gates=gates, factory=factory, world=world)
store = TeacherStore(root, _stream(), k=8, temperature=2.0, cfg=CFG, model="tiny-llama", shard_windows=4)
computed = fill_on_ranks(bench, store, windows=6, rank=rank, world=world)
again = fill_on_ranks(bench, store, windows=6, rank=rank, world=world)
factory.objective = StoredDistillLoss(store.lookup, temperature=2.0, ce_weight=0.25)
stepper = factory(model, [{"params": gates.gate_params(), "lr": 0.0}])
assert eng.is_partitioned(model)
losses = []
with gates.state(gated=False, bypass=[1]):  # the student: layer 1 dropped
    for _ in range(2):
        losses.append(float(stepper.forward(store.stream.next())))
print("RESULT " + json.dumps({"computed": computed, "again": again, "losses": losses}), flush=True)
"""


@pytest.mark.slow
@pytest.mark.parametrize("world", [1, 2])
def test_zero3_ranks_fill_the_store_and_give_the_one_process_distillation_loss(tmp_path, world):
    """One (and two) ZeRO-3 ranks over gloo: the shards they store are the one process's, and each
    rank's loss on its rows of two heal batches is the one-process loss on those rows."""
    from gloo_ranks import run_ranks
    from test_teacher_store import CFG, _stream

    tiny_model("llama", layers=3).save_pretrained(tmp_path / "model")
    args = [sys.executable, "-c", ZERO3_WORKER, str(tmp_path / "model"), str(tmp_path / "workers"), str(TESTS)]
    results = run_ranks(args, world=world)

    # one process: the plain model fills its own store and distils the same student
    model = tiny_model("llama", layers=3)
    one = TeacherStore(str(tmp_path / "one"), _stream(), k=8, temperature=2.0, cfg=CFG, model="tiny-llama",
                       shard_windows=4)
    one.fill(dense_compute(model, k=8, temperature=2.0, batch_size=2), windows=6)
    workers = TeacherStore(str(tmp_path / "workers"), _stream(), k=8, temperature=2.0, cfg=CFG, model="tiny-llama",
                           shard_windows=4)
    assert workers.missing(6) == [] and one.key(0) == workers.key(0)
    mine, theirs = one.records(list(range(8))), workers.records(list(range(8)))
    assert torch.allclose(mine[0].float(), theirs[0].float(), atol=2e-3)  # fp16 log-probs of the same forward
    assert torch.equal(mine[1], theirs[1])
    assert [r["computed"] for r in results] == [2] * world and [r["again"] for r in results] == [0] * world

    gates = attach_gates(model)
    loss = StoredDistillLoss(one.lookup, temperature=2.0, ce_weight=0.25)
    m = 2 // world
    with torch.no_grad(), gates.state(gated=False, bypass=[1]):
        for step in range(2):
            batch = one.stream.next()
            for rank, r in enumerate(results):
                rows = slice(rank * m, (rank + 1) * m)
                expected = float(loss(model, batch[rows], rows=rows))
                assert r["losses"][step] == pytest.approx(expected, rel=1e-5, abs=1e-7)
    assert results[0]["losses"][0] > 1e-3  # the dropped layer costs something: the match is not of zeros
