"""Issue 51 item 3 on Ray Train workers: ZeRO-3 ranks choose the pairs and merge them (each pair gathered,
flattened on every rank, cut from the sums all-reduced over ranks, written back into its first layer's
partitions, its second layer bypassed), and the merged model's logits are the one process's merge's
(DeepSpeed over gloo, without Ray)."""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import pytest
import torch
from test_distributed_ray import OVERRIDES, _logits, tiny_dir  # noqa: F401
from test_merge import MERGING, _model

from trsp_ray.method.gates import attach_gates
from trsp_ray.method.merge import merge_pairs
from trsp_ray.method.merge_select import merge_select
from trsp_ray.models.tiny import tiny_model

TESTS = Path(__file__).resolve().parent
CANDIDATES = [1, 2, 3, 4]

RANK = r"""
import json, sys, torch
sys.path.insert(0, sys.argv[3])
from gloo_ranks import sharded_gated
from test_merge_workers import CANDIDATES, SETTINGS, probe_batch, windows
from trsp_ray.distributed import engine as eng
from trsp_ray.distributed.collectives import all_reduce_sum
from trsp_ray.distributed.merging import OnRanks, dealt_rows, pairs_on_ranks
from trsp_ray.method.merge import merge_pairs
model_dir, target = sys.argv[1], sys.argv[2]
model, gates, factory, rank, world = sharded_gated(model_dir)
factory(model, [{"params": gates.gate_params(), "lr": 0.0}])  # the engine whose hooks gather each layer
assert eng.is_partitioned(model)
firsts, tokens = pairs_on_ranks(model, gates, windows(), n_pairs=2, candidates=CANDIDATES, rank=rank, world=world)
host = OnRanks(gates, rank=rank)
done = merge_pairs(model=model, firsts=firsts, windows=dealt_rows(windows(), rank=rank, world=world), stop=False,
                   reduce=all_reduce_sum, host=host, target=target, choice_windows=SETTINGS["choice_windows"] // world,
                   **{k: v for k, v in SETTINGS.items() if k != "choice_windows"})
with torch.no_grad():
    logits = model(input_ids=probe_batch(), use_cache=False).logits
print("RESULT " + json.dumps({"firsts": firsts, "tokens": tokens, "bypassed": gates.bypassed(),
                              "per_pair": done["per_pair"], "cost": done["cost"], "logits": logits.tolist()}),
      flush=True)
"""

SETTINGS = {"units": "loss", "trials": 3, "choice_windows": 4}

RESUMING = r"""
import json, os, sys, torch
from pathlib import Path
from types import SimpleNamespace
sys.path.insert(0, sys.argv[3])
from gloo_ranks import sharded_gated
from test_merge_workers import probe_batch, windows
from trsp_ray.config.run_config import load_config
from trsp_ray.distributed.merging import OnRanks, merge_on_ranks
from trsp_ray.run.merge_store import MergeCheckpoints
model_dir, root, phase = sys.argv[1], sys.argv[2], sys.argv[4]
flattened, flatten = [], OnRanks.flatten
OnRanks.flatten = lambda self, model, a, k: flattened.append(a) or flatten(self, model, a, k)
model, gates, factory, rank, world = sharded_gated(model_dir)
factory(model, [{"params": gates.gate_params(), "lr": 0.0}])
cfg = load_config(None, [f"model={model_dir}", f"checkpoint_dir={root}", "method=merge", "merging.unit_trials=3",
                         "merging.choice_windows=4", f"distributed.workers={world}"])
if phase == "first":  # the run a failure ends after its first pair: both stored, the second then lost
    MergeCheckpoints.clear = lambda self: [p.unlink() for p in Path(self.dir).glob("pair-1.pt")]
record, store = merge_on_ranks(cfg, SimpleNamespace(model=model, gates=gates), drop=[2, 4], windows=windows(),
                               rank=rank, world=world)
if store is not None:  # rank 0's, cleared by the caller once nothing after the merge can be interrupted
    store.clear()
with torch.no_grad():
    logits = model(input_ids=probe_batch(), use_cache=False).logits
print("RESULT " + json.dumps({"record": record, "logits": logits.tolist(), "flattened": flattened}), flush=True)
"""


@pytest.mark.slow  # two 2-rank runs: ~80 s
def test_two_zero3_ranks_resume_a_merge_from_rank_0s_stored_pairs(tmp_path):
    """Two ZeRO-3 ranks: a merge whose second stored pair was lost resumes from rank 0's first (the other rank
    told how many, rank 0's weights written into the partitions) and ends with the uninterrupted model."""
    from gloo_ranks import run_ranks

    tiny_model("llama", layers=6).save_pretrained(tmp_path / "model")
    args = [sys.executable, "-c", RESUMING, str(tmp_path / "model"), str(tmp_path / "ck"), str(TESTS)]
    first = run_ranks(args + ["first"], world=2)
    stored = list((tmp_path / "ck" / "merged_pairs").glob("*/pair-*.pt"))
    assert [p.name for p in stored] == ["pair-0.pt"]
    again = run_ranks(args + ["again"], world=2)
    assert [r["flattened"] for r in first + again] == [[1, 3], [1, 3], [3], [3]]
    for r in again:
        assert r["record"] == first[0]["record"]
        assert torch.allclose(torch.tensor(r["logits"]), torch.tensor(first[0]["logits"]), atol=1e-6)
    assert not (tmp_path / "ck" / "merged_pairs").exists()


def windows_() -> list[torch.Tensor]:
    """Eight calibration windows of 16 tokens, in batches of two."""
    g = torch.Generator().manual_seed(7)
    return list(torch.randint(0, 200, (8, 16), generator=g).split(2))


windows = windows_


def probe_batch() -> torch.Tensor:
    return torch.randint(0, 200, (2, 12), generator=torch.Generator().manual_seed(11))


@pytest.mark.parametrize("family", MERGING)
def test_the_ranks_host_merges_every_family_into_the_in_place_merge_without_removing_a_layer(family):
    """The workers' host on a plain gated model (one rank, nothing partitioned): each pair's layers copied into
    blocks of their own class, the wide block run by a hook in the bypassed pair's place, the merged block
    written back into the pair's first layer. Every family's logits equal the one-process merge's, the model
    keeps all its layers with the pairs' second layers bypassed, and the merge changed the first layers."""
    from trsp_ray.distributed.merging import OnRanks
    from trsp_ray.models import families

    model = _model(family)  # random biases, norm scales and shifts
    windows = [w % model.config.vocab_size for w in windows_()]
    probe = probe_batch() % model.config.vocab_size
    firsts = [1, 3]
    expected_model = copy.deepcopy(model)
    expected = merge_pairs(model=expected_model, firsts=firsts, windows=windows, target="dense", **SETTINGS)
    before = [p.detach().clone() for p in families.decoder_layers(model)[1].parameters()]
    gates = attach_gates(model)
    done = merge_pairs(model=model, firsts=firsts, windows=windows, target="dense", stop=False,
                       host=OnRanks(gates, rank=0), **SETTINGS)
    assert families.num_layers(model) == 6 and gates.bypassed() == [2, 4] and done["removed"] == [2, 4]
    for got, want in zip(done["per_pair"], expected["per_pair"]):  # the trials' losses: the pair's b not run
        assert got["unit_losses"] == pytest.approx(want["unit_losses"], rel=1e-6)
    after = list(families.decoder_layers(model)[1].layer.parameters())
    assert any(not torch.equal(b, a) for b, a in zip(before, after))
    with torch.no_grad():
        got = model(input_ids=probe, use_cache=False).logits
        want = expected_model(input_ids=probe, use_cache=False).logits
    assert torch.allclose(got, want, atol=1e-5), float((got - want).abs().max())


def test_an_interrupted_merge_on_the_ranks_resumes_after_its_last_stored_pair(tmp_path, monkeypatch, capsys):
    """merge_on_ranks (one rank, nothing partitioned) stopped after its first pair: a rerun puts the stored pair
    back without flattening it again, merges the second, and ends with the uninterrupted merge's model and
    record; the store is gone once the caller clears it."""
    from types import SimpleNamespace

    from trsp_ray.config.run_config import load_config
    from trsp_ray.distributed import merging as ranks_merging
    from trsp_ray.run import merging

    tiny_model("llama", layers=6).save_pretrained(tmp_path / "model")
    cfg = load_config(None, [f"model={tmp_path / 'model'}", f"checkpoint_dir={tmp_path / 'ck'}", "method=merge",
                             "merging.unit_trials=3", "merging.choice_windows=4"])

    def merged(progress=None):
        model = tiny_model("llama", layers=6)
        bench = SimpleNamespace(model=model, gates=attach_gates(model))
        record, store = ranks_merging.merge_on_ranks(cfg, bench, drop=[2, 4], windows=windows_(), rank=0, world=1)
        store.clear()
        with torch.no_grad():
            return record, model(input_ids=probe_batch(), use_cache=False).logits

    whole, logits = merged()
    real = merging.pair_progress

    def stopping(*args, **kwargs):
        show = real(*args, **kwargs)

        def once(k, n, pair):
            show(k, n, pair)
            raise KeyboardInterrupt  # after the first pair is stored
        return once

    monkeypatch.setattr(merging, "pair_progress", stopping)
    with pytest.raises(KeyboardInterrupt):
        merged()
    monkeypatch.setattr(merging, "pair_progress", real)
    flattened = []
    flatten = ranks_merging.OnRanks.flatten
    monkeypatch.setattr(ranks_merging.OnRanks, "flatten",
                        lambda self, model, a, k: flattened.append(a) or flatten(self, model, a, k))
    capsys.readouterr()
    record, resumed = merged()
    assert flattened == [3] and "merge: resuming after pair 1 of 2" in capsys.readouterr().out
    assert record == whole and torch.equal(resumed, logits)
    assert not (tmp_path / "ck" / "merged_pairs").exists()


@pytest.mark.parametrize("world,target", [pytest.param(1, "dense", marks=pytest.mark.slow), (2, "dense"),
                                          pytest.param(2, "pair", marks=pytest.mark.slow)])
def test_zero3_ranks_merge_the_one_process_pairs_into_the_same_model(tmp_path, world, target):
    """One and two ZeRO-3 ranks: the pairs chosen, the unit sets tried and their losses, and the merged
    model's logits are those of the one process's merge on all the windows; the merge is not a drop."""
    from gloo_ranks import run_ranks

    tiny_model("llama", layers=6).save_pretrained(tmp_path / "model")
    results = run_ranks([sys.executable, "-c", RANK, str(tmp_path / "model"), target, str(TESTS)], world=world)

    model = tiny_model("llama", layers=6)
    firsts = merge_select(model, attach_gates(model), windows(), n_pairs=2, candidates=CANDIDATES)
    dropped = tiny_model("llama", layers=6)
    gates = attach_gates(dropped)
    with torch.no_grad(), gates.state(gated=False, bypass=[a + 1 for a in firsts]):
        drop_logits = dropped(input_ids=probe_batch(), use_cache=False).logits
    done = merge_pairs(model=model, firsts=firsts, windows=windows(), target=target, **SETTINGS)
    with torch.no_grad():
        expected = model(input_ids=probe_batch(), use_cache=False).logits
    for r in results:
        assert r["firsts"] == firsts and r["tokens"] == 8 * 16
        assert r["bypassed"] == sorted(a + 1 for a in firsts)
        for got, want in zip(r["per_pair"], done["per_pair"]):
            assert got["units_from"] == list(want["units_from"])
            assert got["unit_losses"] == pytest.approx(want["unit_losses"], rel=1e-5)
            assert got["mlp_error_refit"] == pytest.approx(want["mlp_error_refit"], rel=1e-4, abs=1e-7)
        logits = torch.tensor(r["logits"])
        assert torch.allclose(logits, expected, atol=2e-5), float((logits - expected).abs().max())
        # a merge whose write-back were lost would leave the two layers' plain drop
        assert float((logits - drop_logits).abs().max()) > 100 * float((logits - expected).abs().max()) + 1e-3


@pytest.mark.ray
@pytest.mark.slow  # a 2-worker Ray Train run with a restart, and one process: ~10 min on a loaded 2-core machine
def test_two_ray_workers_merge_heal_and_export_the_one_process_model(tiny_dir, tmp_path):  # noqa: F811
    """merge+heal end to end on 2 ZeRO-3 workers, a worker lost after heal step 2: the restart reads every merged
    pair back from rank 0's store instead of merging again and resumes the heal from its step-2 checkpoint; the
    pairs, the merge's record in the manifest and the exported model (stock, fewer layers) are one process's, and
    the store is gone once the heal is done."""
    import json

    from test_compensation_ray import _on_workers

    from trsp_ray.config.run_config import load_config
    from trsp_ray.driver import run

    base = [f"model={tiny_dir}"] + OVERRIDES + ["method=merge+heal", "merging.windows=16", "merging.choice_windows=4",
                                                 "merging.unit_trials=3"]
    result = _on_workers(base + [f"checkpoint_dir={tmp_path / 'wck'}", "distributed.max_failures=1"], tmp_path,
                         fault=[{"stage2_step": 2}])
    assert result.attempts() == 2
    pairs = len(result.drop_order)
    assert [e["merged_here"] for e in result.events if e["event"] == "merged"] == [pairs, 0]
    assert not (tmp_path / "wck" / "merged_pairs").exists()
    single = run(load_config(overrides=base + [f"output={tmp_path / 'single'}", f"checkpoint_dir={tmp_path / 's1'}",
                                               "distributed.workers=0", "data.eval_max_windows=2"]))
    assert result.drop_order == single["dropped_layers"]
    merged = next(e for e in result.events if e["event"] == "merged")
    metrics = json.loads((tmp_path / "ray" / "trsp_ray.json").read_text())["metrics"]
    assert merged["merge_pairs"] == metrics["merge_pairs"] == sorted([d - 1, d] for d in result.drop_order)
    assert metrics["merge_tokens"] == single["merge_tokens"] == 16 * 32
    assert metrics["merge_units_from"] == single["merge_units_from"]
    config = json.loads((tmp_path / "ray" / "config.json").read_text())
    assert config["num_hidden_layers"] == 6 - len(result.drop_order)
    diff = (_logits(tmp_path / "single") - _logits(tmp_path / "ray")).abs().max().item()
    assert diff < 1e-4

