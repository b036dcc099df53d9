"""Data-parallel removal probes (issue 19): W ranks each score their share of the probe windows
and all-reduce the sums, so they give the one-process score and drop order with 1/W of the
forwards each; positions before `start` do not count."""


import pytest
import torch

from trsp_ray.distributed.ranks import free_port
from trsp_ray.method.gates import attach_gates
from trsp_ray.method.probes import RemovalScorer, recall_positions
from trsp_ray.method.stage1 import run_stage1
from trsp_ray.method.training import Batches, split_over_ranks
from trsp_ray.models.tiny import tiny_model

DROPS = [[], [2], [1, 3], [2, 4]]
STAGE1 = dict(n_drop=2, candidates=[1, 2, 3, 4], lambda1=0.01, lr=0.05, first_round_steps=6, steps_per_round=2,
              probe=3, refine=1)


def _ids():
    return torch.randint(3, 200, (8000,), generator=torch.Generator().manual_seed(0))


def _windows():
    """8 probe windows of 32 tokens as one batch of 8 (the chunk size), as fixed_windows gives them."""
    return [_ids()[:256].view(8, 32)]


def _counting(model) -> list[int]:
    seen = [0]
    model.register_forward_pre_hook(lambda m, args, kwargs: seen.__setitem__(0, seen[0] + kwargs["input_ids"].numel()),
                                    with_kwargs=True)
    return seen


def _probe(rank: int, world: int, all_reduce=None) -> dict:
    torch.set_num_threads(1)
    model = tiny_model("llama", layers=6)
    seen = _counting(model)
    scorer = RemovalScorer(model=model, gates=attach_gates(model), windows=_windows(), rank=rank, world=world,
                           all_reduce=all_reduce)
    scores = [scorer(d) for d in DROPS]
    forwarded = seen[0]
    model = tiny_model("llama", layers=6)
    gates = attach_gates(model)
    scorer = RemovalScorer(model=model, gates=gates, windows=_windows(), rank=rank, world=world, all_reduce=all_reduce)
    result = run_stage1(model=model, gates=gates, batches=Batches(_ids(), seqlen=32, batch_size=4, seed=1),
                        scorer=scorer, **STAGE1)
    return {"scores": scores, "forward_tokens": forwarded, "drop_order": result.drop_order,
            "probes": result.probes, "probe_cost": result.probe_cost}


def _rank_main(rank: int, world: int, port: int, out: str) -> None:
    import torch.distributed as dist

    from trsp_ray.distributed.collectives import sum_over_ranks

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        torch.save(_probe(rank, world, all_reduce=sum_over_ranks), f"{out}.{rank}")
    finally:
        dist.destroy_process_group()


def test_two_gloo_ranks_split_the_probe_windows_and_match_one_process(tmp_path):
    import torch.multiprocessing as mp

    one = _probe(0, 1)
    out = str(tmp_path / "rank")
    mp.spawn(_rank_main, args=(2, free_port(), out), nprocs=2, join=True)
    ranks = [torch.load(f"{out}.{r}", weights_only=False) for r in range(2)]
    window_tokens = 8 * 32
    # one process: a teacher pass, then a student pass per call; each rank half of that
    assert one["forward_tokens"] == window_tokens * (len(DROPS) + 1)
    for r in ranks:
        assert r["forward_tokens"] == one["forward_tokens"] // 2
        assert r["scores"] == pytest.approx(one["scores"], abs=1e-6, rel=0)
        assert r["drop_order"] == one["drop_order"]
        assert r["probe_cost"] == one["probe_cost"]  # every rank counts the compute of all ranks
        for p, q in zip(r["probes"], one["probes"]):
            assert p["scores"] == pytest.approx(q["scores"], abs=1e-6, rel=0)
    assert ranks[0]["scores"] == ranks[1]["scores"]  # bit-identical: every rank takes the same decision
    assert one["scores"][0] == pytest.approx(0.0, abs=1e-6) and min(one["scores"][1:]) > 1e-4


def _uneven_main(rank: int, world: int, port: int, out: str) -> None:
    """3 windows over 2 ranks in chunks of 1: rank 1 has one chunk fewer and runs a padding forward."""
    import torch.distributed as dist

    from trsp_ray.distributed.collectives import sum_over_ranks

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        torch.set_num_threads(1)
        model = tiny_model("llama", layers=6)
        seen = _counting(model)
        windows = list(_ids()[:96].view(3, 32).split(1))
        scorer = RemovalScorer(model=model, gates=attach_gates(model), windows=windows, rank=rank, world=world,
                               all_reduce=sum_over_ranks, teacher_budget_bytes=0)
        torch.save({"scores": [scorer(d) for d in DROPS[1:]], "forward_tokens": seen[0]}, f"{out}.{rank}")
    finally:
        dist.destroy_process_group()


def test_uneven_shares_keep_the_ranks_in_step_and_score_every_window(tmp_path):
    import torch.multiprocessing as mp

    model = tiny_model("llama", layers=6)
    windows = list(_ids()[:96].view(3, 32).split(1))
    one = RemovalScorer(model=model, gates=attach_gates(model), windows=windows, teacher_budget_bytes=0)
    expected = [one(d) for d in DROPS[1:]]
    out = str(tmp_path / "rank")
    mp.spawn(_uneven_main, args=(2, free_port(), out), nprocs=2, join=True)
    ranks = [torch.load(f"{out}.{r}", weights_only=False) for r in range(2)]
    for r in ranks:
        assert r["scores"] == pytest.approx(expected, abs=1e-6, rel=0)
    # teacher recomputed every call (budget 0): 2 chunks x 2 passes x 3 calls on each rank
    assert ranks[0]["forward_tokens"] == ranks[1]["forward_tokens"] == 2 * 2 * 3 * 32
    assert one.cost == 3 * 2 * 96  # the scored tokens: teacher + student per call


@pytest.mark.parametrize("rows, world, chunk", [(8, 2, 8), (3, 2, 1), (5, 2, 2), (7, 3, 2), (9, 4, 4), (2, 4, 1),
                                              (1, 2, 3)])
def test_the_probes_split_their_windows_as_every_data_parallel_forward(rows, world, chunk):
    """RemovalScorer's chunks and forwards per call are training.split_over_ranks' (the one split of
    the fit and Block Influence too) on every rank, a rank without a window included (it runs only
    padding forwards, never a forward of no rows); every window is scored once; the recall masks
    follow the chunks row for row."""
    model = tiny_model("llama", layers=2)
    gates = attach_gates(model)
    windows = list(_ids()[:rows * 32].view(rows, 32).split(chunk))
    scored, passes = [], set()
    for rank in range(world):
        scorer = RemovalScorer(model=model, gates=gates, windows=windows, criterion="recall", rank=rank,
                               world=world, common=set())
        mine, padding = split_over_ranks(windows, rank=rank, world=world)
        assert [c.shape for c in scorer.chunks] == [c.shape for c in mine] and all(
            torch.equal(a, b) for a, b in zip(scorer.chunks, mine))
        assert scorer.passes == len(mine) + padding and all(c.shape[0] for c in scorer.chunks)
        assert [m.shape[0] for m in scorer.masks] == [c.shape[0] for c in mine]
        if mine:
            assert torch.equal(torch.cat(scorer.masks), recall_positions(torch.cat(windows), common=set())[rank::world])
        scored += [row.tolist() for c in scorer.chunks for row in c]
        passes.add(scorer.passes)
    assert sorted(scored) == sorted(torch.cat(windows).tolist()) and len(passes) == 1  # the ranks stay in step


def test_teacher_recomputed_in_the_model_dtype_scores_like_the_cached_one():
    """Above the budget the dense log-probs are recomputed every call, rounded to the model's
    dtype as the cached ones are: the first and later calls, cached or not, agree exactly."""
    model = tiny_model("llama", layers=6).to(torch.bfloat16)
    gates = attach_gates(model)
    cached = RemovalScorer(model=model, gates=gates, windows=_windows())
    recomputed = RemovalScorer(model=model, gates=gates, windows=_windows(), teacher_budget_bytes=0)
    assert cached.cache_teacher and not recomputed.cache_teacher
    first = [cached(d) for d in DROPS]
    assert [cached(d) for d in DROPS] == first == [recomputed(d) for d in DROPS]
    assert cached._teacher[0].dtype == torch.bfloat16 and cached._teacher[0].device == torch.device("cpu")
    assert cached.cost == 256 * (2 * len(DROPS) + 1) and recomputed.cost == 256 * 2 * len(DROPS)


@pytest.mark.parametrize("criterion", ["kl", "ce"])
def test_start_scores_only_the_late_positions(criterion):
    """`start` = s: the score is the mean over positions >= s only (CE: predictions made at them);
    start 0 is the whole-window score."""
    import torch.nn.functional as F

    model = tiny_model("llama", layers=6)
    gates = attach_gates(model)
    windows = _windows()
    drop = [2, 4]
    late = RemovalScorer(model=model, gates=gates, windows=windows, criterion=criterion, start=20)(drop)
    whole = RemovalScorer(model=model, gates=gates, windows=windows, criterion=criterion)(drop)
    w = windows[0]
    with torch.no_grad():
        with gates.state(gated=False, bypass=drop):
            lp = torch.log_softmax(model(input_ids=w).logits.float(), -1)
        with gates.state(gated=False, bypass=[]):
            lt = torch.log_softmax(model(input_ids=w).logits.float(), -1)
    if criterion == "kl":
        per_token = (lt.exp() * (lt - lp)).sum(-1)  # [8, 32]
    else:
        per_token = F.cross_entropy(lp[:, :-1].transpose(1, 2), w[:, 1:], reduction="none")  # [8, 31]
    assert late == pytest.approx(per_token[:, 20:].mean().item(), rel=1e-5)
    assert whole == pytest.approx(per_token.mean().item(), rel=1e-5)
    assert late != pytest.approx(whole, rel=1e-3)
    with pytest.raises(Exception, match="start=32"):
        RemovalScorer(model=model, gates=gates, windows=windows, criterion=criterion, start=32)



# ---- the same under DeepSpeed ZeRO-3 over gloo (each forward is a collective), without Ray ----

ZERO3_WORKER = r"""
import json, os, sys, torch
from trsp_ray.config.run_config import DistributedConfig
from trsp_ray.distributed import engine as eng
from trsp_ray.distributed.deepspeed_config import build_ds_config
from trsp_ray.distributed.collectives import sum_over_ranks
from trsp_ray.method.gates import attach_gates
from trsp_ray.method.stage1 import RemovalScorer
torch.set_num_threads(1)
model_dir, windows_file = sys.argv[1], sys.argv[2]
rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
eng.init_deepspeed(backend="gloo")
ds = build_ds_config(DistributedConfig(workers=world), batch_size=world, lr=1e-3)
model = eng.load_sharded(model_dir, ds_config=ds, dtype=torch.float32)
gates = attach_gates(model)
eng.zero_ready_gates(gates)
eng.StepperFactory(ds_config=ds, rank=rank, world=world)(model, [{"params": gates.gate_params()}])
assert eng.is_partitioned(model)
windows = torch.load(windows_file)
scores = {}
for budget in (2 ** 31, 0):
    scorer = RemovalScorer(model=model, gates=gates, windows=windows, rank=rank, world=world,
                           all_reduce=sum_over_ranks, teacher_budget_bytes=budget)
    scores[budget] = [scorer(d) for d in [[2], [1, 3], [2, 4]]]
print("RESULT " + json.dumps(scores), flush=True)
"""


@pytest.mark.slow
def test_zero3_gloo_ranks_split_the_windows_and_match_one_process(tmp_path):
    """3 windows in chunks of 2 over 2 ZeRO-3 ranks (rank 1 pads one forward): both ranks get the
    one-process scores, with the teacher cached and recomputed."""
    import json
    import os
    import subprocess
    import sys

    tiny_model("llama", layers=6).save_pretrained(tmp_path / "model")
    windows = list(_ids()[:96].view(3, 32).split(2))
    torch.save(windows, tmp_path / "windows.pt")
    model = tiny_model("llama", layers=6)
    one = RemovalScorer(model=model, gates=attach_gates(model), windows=windows)
    expected = [one(d) for d in [[2], [1, 3], [2, 4]]]
    port = free_port()
    args = [sys.executable, "-c", ZERO3_WORKER, str(tmp_path / "model"), str(tmp_path / "windows.pt")]
    procs = [subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env={**os.environ, "RANK": str(r), "LOCAL_RANK": str(r), "WORLD_SIZE": "2",
                                   "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
             for r in range(2)]
    results = []
    for proc in procs:
        stdout, stderr = proc.communicate(timeout=600)
        assert proc.returncode == 0, stderr[-3000:]
        results.append(json.loads(next(line[7:] for line in stdout.splitlines() if line.startswith("RESULT "))))
    for r in results:
        for scores in r.values():
            assert scores == pytest.approx(expected, abs=1e-6, rel=0)
