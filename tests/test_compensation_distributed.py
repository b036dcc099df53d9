"""Issue 21 item 3: the closed-form compensation on ZeRO-3 workers (distributed/compensate.py) gives
the single-process maps: each rank sums its own windows, the sums are all-reduced, every rank folds
the same map into its shard of the kept layer before each block, and the streaming export writes
the folded weights."""

import json
import os
import subprocess
import sys

import pytest
import torch

from trsp_ray.common.errors import TrspError
from trsp_ray.distributed import compensate
from trsp_ray.distributed.ranks import free_port
from trsp_ray.method import compensation
from trsp_ray.method.surgery import remove_layers
from trsp_ray.method.training import split_over_ranks
from trsp_ray.models.tiny import VOCAB, tiny_model
from trsp_ray.run.workbench import copy_model

DROP = [2, 4]  # two blocks: maps folded into layers 1 and 3


def _windows():
    """3 windows of 32 tokens in batches of 2: rank 0 gets windows 0 and 2, rank 1 window 1 and a
    padding forward (96 tokens, above the tiny model's hidden size 64)."""
    gen = torch.Generator().manual_seed(3)
    return list(torch.randint(0, VOCAB, (3, 32), generator=gen).split(2))


def test_the_fit_splits_windows_like_the_probes_and_pads_the_short_rank():
    windows = _windows()
    rows = torch.cat(windows)
    mine0, pad0 = split_over_ranks(windows, rank=0, world=2)
    mine1, pad1 = split_over_ranks(windows, rank=1, world=2)
    assert torch.equal(torch.cat(mine0), rows[[0, 2]]) and torch.equal(torch.cat(mine1), rows[[1]])
    assert (len(mine0) + pad0, len(mine1) + pad1) == (1, 1)  # one forward each: the batch size is 2
    assert split_over_ranks(windows, rank=3, world=4) == ([], 1)


def test_what_the_workers_cannot_serve_is_refused_before_they_start():
    from trsp_ray.config.run_config import load_config

    compensate.check_for_workers(load_config(overrides=["compensation.method=lstsq"]))
    with pytest.raises(TrspError, match="not run on Ray Train workers"):
        compensate.check_for_workers(load_config(overrides=["compensation.method=lstsq",
                                                            "compensation.activations=sequential"]))
    with pytest.raises(TrspError, match="stage1.train_base=true trains them"):
        compensate.check_for_workers(load_config(overrides=["compensation.method=lstsq", "stage1.train_base=true"]))
    compensate.check_for_workers(load_config(overrides=["method=shortgpt+heal",  # no compensation
                                                        "compensation.activations=sequential"]))
    from trsp_ray.distributed.train import check_worker_settings  # prepare_run's refusals, before Ray starts

    with pytest.raises(TrspError, match="not run on Ray Train workers"):
        check_worker_settings(load_config(overrides=["compensation.method=lstsq",
                                                     "compensation.activations=sequential"]))


def test_fewer_windows_than_workers_is_refused_before_any_work(tmp_path, monkeypatch, capsys):
    """Issue 33 item 2: a rank with no calibration window never enters the fit's batch loop, where the
    other ranks' first lookup of a ZeRO-3 projection is a collective: a hang. Refused in one line where
    a run is checked (prepare_run), routed (`prune` and its dry run) and planned (`trsp-ray plan`)."""
    from types import SimpleNamespace

    from trsp_ray import cli, driver
    from trsp_ray.config.run_config import load_config
    from trsp_ray.distributed.train import check_worker_settings
    from trsp_ray.models.tiny import tiny_config
    from trsp_ray.plan import route
    from trsp_ray.run import workbench

    few = load_config(overrides=["compensation.windows=3", "distributed.workers=4"])  # the default compensates
    for check in (compensate.check_for_workers, check_worker_settings):
        with pytest.raises(TrspError, match="compensation.windows=3 is fewer than the 4 workers.*windows >= 4") as err:
            check(few)
        assert "\n" not in str(err.value)
    compensate.check_for_workers(few, workers=3)  # a window per rank
    compensate.check_for_workers(load_config(overrides=["compensation.windows=3", "distributed.workers=4",
                                                        "method=shortgpt+heal"]))  # no fit, nothing to wait on
    # the route (what `prune` and `prune --dry-run` call) sends the run to 4 workers: refused there
    for name in ("resolve_device", "check_inputs"):
        monkeypatch.setattr(workbench, name, lambda *a, **k: None)
    monkeypatch.setattr(workbench, "device_kind", lambda cfg: ("gpu", 80.0))
    monkeypatch.setattr(route, "route", lambda cfg, **kw: SimpleNamespace(workers=4))
    with pytest.raises(TrspError, match="compensation.windows=3 is fewer than the 4 workers"):
        driver.route_for(load_config(overrides=["compensation.windows=3"]))
    assert driver.route_for(load_config(overrides=["compensation.windows=4"])).workers == 4
    tiny_config("llama").save_pretrained(tmp_path)  # config.json: all `trsp-ray plan` reads
    # compensation.windows 0 sizes the fit to 28 tokens per column: 28 x 64 / 128 = 14 windows of the tiny model
    assert cli.main(["plan", "--model-config", str(tmp_path), "--workers", "15", "--seqlen", "128"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "compensation.windows=14 is fewer than the 15 workers" in err


def test_whole_passes_cost_one_dense_forward_per_token():
    assert compensation.cost(drop=DROP, num_layers=6, tokens=96, stops=False) == 96
    assert compensation.cost(drop=DROP, num_layers=6, tokens=96) == pytest.approx(96 * 5 / 6)


ZERO3_WORKER = r"""
import json, os, sys, torch
from trsp_ray.config.run_config import DistributedConfig
from trsp_ray.distributed import compensate, engine as eng
from trsp_ray.distributed.deepspeed_config import build_ds_config
from trsp_ray.distributed.export import export_streaming
from trsp_ray.method.gates import attach_gates
torch.set_num_threads(1)
model_dir, windows_file, out, reduce = sys.argv[1:5]
rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
eng.init_deepspeed(backend="gloo")
ds = build_ds_config(DistributedConfig(workers=world), batch_size=world, lr=1e-3)
model = eng.load_sharded(model_dir, ds_config=ds, dtype=torch.float32)
gates = attach_gates(model)
eng.zero_ready_gates(gates)
eng.StepperFactory(ds_config=ds, rank=rank, world=world)(model, [{"params": gates.gate_params()}])
assert eng.is_partitioned(model)
# as stage 1 leaves it: gated, gates away from 1, the drop set bypassed; the fit must see the dense model
gates.set_gated(True)
with gates.gather(gates.gate_params()), torch.no_grad():
    for p in gates.gate_params():
        p.fill_(0.5)
gates.set_bypass([2, 4])
kwargs = {} if reduce == "sum" else {"reduce": lambda t: t.double().clone()}  # "none": no all-reduce
info = compensate.fit(model=model, gates=gates, drop=[2, 4], windows=torch.load(windows_file), rank=rank,
                      world=world, ridge=1e-4, **kwargs)
compensate.fold(model=model, maps=info["maps"])
done = export_streaming(model, tokenizer=None, drop=[2, 4], output=out, manifest={"method": "random"})
print("RESULT " + json.dumps({"tokens": info["tokens"], "cost": info["cost"], "blocks": info["blocks"],
                              "check": done["export_check"]}), flush=True)
"""


def _run_ranks(tmp_path, reduce: str) -> list[dict]:
    port = free_port()
    args = [sys.executable, "-c", ZERO3_WORKER, str(tmp_path / "model"), str(tmp_path / "windows.pt"),
            str(tmp_path / f"export-{reduce}"), reduce]
    procs = [subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env={**os.environ, "RANK": str(r), "LOCAL_RANK": str(r), "WORLD_SIZE": "2",
                                   "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
             for r in range(2)]
    results = []
    for proc in procs:
        try:
            stdout, stderr = proc.communicate(timeout=600)
        finally:
            if proc.poll() is None:
                proc.kill()
        assert proc.returncode == 0, stderr[-3000:]
        results.append(json.loads(next(line[7:] for line in stdout.splitlines() if line.startswith("RESULT "))))
    return results


def _exported_down_proj(folder, new_index: int) -> torch.Tensor:
    from safetensors.torch import load_file

    state = {}
    for f in sorted(folder.glob("*.safetensors")):
        state.update(load_file(f))
    return state[f"model.layers.{new_index}.mlp.down_proj.weight"]


@pytest.mark.slow  # two spawned DeepSpeed interpreters, twice: ~1-2 min on a loaded 2-core machine
def test_zero3_gloo_ranks_fold_the_one_process_maps_and_export_them(tmp_path):
    dense = tiny_model("llama", layers=6)
    dense.save_pretrained(tmp_path / "model")
    windows = _windows()
    torch.save(windows, tmp_path / "windows.pt")
    one = copy_model(dense, torch.device("cpu"))
    remove_layers(one, DROP)
    info = compensation.compensate(model=one, dense=dense, drop=DROP, windows=windows, ridge=1e-4)  # the ranks' ridge
    assert info["tokens"] == 96
    kept = {1: 1, 3: 2}  # original index -> index after removal
    for rank_result in _run_ranks(tmp_path, "sum"):
        assert rank_result["tokens"] == 96 and rank_result["cost"] == 96
        assert rank_result["blocks"] == [[2, 2], [4, 4]]
        assert rank_result["check"]["max_abs_logit_diff"] <= rank_result["check"]["atol"]
    for original, new in kept.items():
        expected = one.model.layers[new].mlp.down_proj.weight
        assert not torch.allclose(dense.model.layers[original].mlp.down_proj.weight, expected, atol=1e-4)
        got = _exported_down_proj(tmp_path / "export-sum", new)
        assert torch.allclose(got, expected, rtol=1e-5, atol=1e-6), (got - expected).abs().max()
    # without the all-reduce each rank solves its own shard: the export (rank 0's fold) differs
    _run_ranks(tmp_path, "none")
    got = _exported_down_proj(tmp_path / "export-none", 1)
    assert not torch.allclose(got, one.model.layers[1].mlp.down_proj.weight, rtol=1e-3, atol=1e-4)
