"""The streaming export (trsp_ray/distributed/export.py, shards.py) without Ray: world size 1 on plain
models of every family, and DeepSpeed ZeRO-3 over gloo in 1 and 2 processes. The Ray run of the
same path is in test_distributed_ray.py."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from trsp_ray.common.errors import TrspError
from trsp_ray.distributed import export as dexport
from trsp_ray.distributed.export import export_streaming, reload_fits, timeout_for
from trsp_ray.distributed.shards import ShardWriter, TensorSpec, plan_shards, verify_shards
from trsp_ray.method.gates import attach_gates
from trsp_ray.method.surgery import remove_layers
from trsp_ray.models.families import FAMILIES
from trsp_ray.models.tiny import tiny_model
from trsp_ray.run.export import MANIFEST, export_model

DROP = [1, 4]


def _tensors(directory) -> dict[str, torch.Tensor]:
    from safetensors import safe_open

    out = {}
    for path in sorted(Path(directory).glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as fh:
            out.update({k: fh.get_tensor(k) for k in fh.keys()})
    return out


def _gated(family: str, **kwargs):
    model = tiny_model(family, **kwargs)
    attach_gates(model)  # what a run exports: the gated model, drop set still in place
    return model


def test_plan_keeps_order_and_the_size_limit():
    specs = [TensorSpec(f"t{i}", (n,), torch.float32) for i, n in enumerate([10, 10, 30, 5, 5, 5])]
    shards = plan_shards(specs, max_shard_bytes=80)
    assert [[t.name for t in s.tensors] for s in shards] == [["t0", "t1"], ["t2"], ["t3", "t4", "t5"]]
    assert [s.file for s in shards] == [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    assert max(s.nbytes for s in shards) == 120  # a 120-byte tensor over an 80-byte limit gets its own shard
    assert [s.file for s in plan_shards(specs, max_shard_bytes=10**6)] == ["model.safetensors"]


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_streamed_files_equal_save_pretrained(tmp_path, family):
    """Same tensor names (renumbered, tied lm_head once, GPT-NeoX's embed_out), same bytes, same
    config.json as export_model's save_pretrained of the in-memory pruned model; several shards."""
    done = export_streaming(_gated(family), tokenizer=None, drop=DROP, output=str(tmp_path / "s"),
                            manifest={"method": "test"}, max_shard_mb=0.1)
    pruned = tiny_model(family)
    remove_layers(pruned, DROP)
    export_model(pruned, None, str(tmp_path / "r"), manifest={})
    streamed, saved = _tensors(tmp_path / "s"), _tensors(tmp_path / "r")
    assert sorted(streamed) == sorted(saved)
    assert all(torch.equal(streamed[k], saved[k]) for k in saved)
    config = lambda d: json.loads((tmp_path / d / "config.json").read_text())
    assert config("s") == config("r") and config("s")["num_hidden_layers"] == 4
    check = done["export_check"]
    assert (check["shards"] > 1
            and check["largest_shard_bytes"] <= max(10**5, max(t.numel() * 4 for t in saved.values())))
    assert check["tensors"] == len(saved) and check["max_abs_logit_diff"] <= check["atol"] == 1e-5
    index = json.loads((tmp_path / "s" / "model.safetensors.index.json").read_text())
    assert sorted(index["weight_map"]) == sorted(saved)
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in saved.values())


def test_manifest_has_the_single_process_keys(tmp_path):
    from trsp_ray.run.export import pruned_manifest

    export_streaming(_gated("llama"), tokenizer=None, drop=DROP, output=str(tmp_path / "s"),
                     manifest={"method": "trsp", "config": {"ratio": 0.34}, "workers": 2})
    manifest = json.loads((tmp_path / "s" / MANIFEST).read_text())
    single = pruned_manifest(method="trsp", drop=DROP, num_layers_original=6, config={}, metrics={})
    assert set(single) <= set(manifest)
    assert (manifest["dropped_layers"], manifest["drop_order"], manifest["kept_layers"]) == (DROP, DROP, [0, 2, 3, 5])
    assert (manifest["num_layers_original"], manifest["num_layers_kept"], manifest["workers"]) == (6, 4, 2)
    assert "torch" in manifest["versions"] and manifest["export_check"]["checksum"] == "sha256"


def test_one_unit_per_gather_and_dropped_layers_never_gathered(tmp_path, monkeypatch):
    model = _gated("llama")
    layers = model.model.layers
    per_layer = {i: {id(p) for p in layers[i].parameters()} for i in range(6)}
    seen: list[set[int]] = []
    real = dexport.gathered
    monkeypatch.setattr(dexport, "gathered", lambda params: seen.append({id(p) for p in params}) or real(params))
    export_streaming(model, tokenizer=None, drop=DROP, output=str(tmp_path / "s"), manifest={})
    dropped = per_layer[1] | per_layer[4]
    assert all(not (ids & dropped) for ids in seen)
    layer_gathers = [ids for ids in seen if any(ids <= per_layer[i] for i in range(6))]
    assert len(layer_gathers) == 4  # one gather per kept layer, each within a single layer
    assert max(len(ids) for ids in seen) == len(per_layer[0]) - 1  # a whole layer at most (its gate is not exported)


CHECK = r"""
import json, sys, torch
from transformers import AutoModelForCausalLM
case = json.loads(open(sys.argv[1]).read())
model = AutoModelForCausalLM.from_pretrained(case["dir"], dtype=torch.float32).eval()
ids = torch.tensor(case["ids"])
with torch.no_grad():
    diff = (model(input_ids=ids, use_cache=False).logits - torch.tensor(case["logits"])).abs().max().item()
    cached = model.generate(ids[:, :6], max_new_tokens=8, do_sample=False, use_cache=True, pad_token_id=0)[0, 6:]
    seq = ids[:, :6]
    for _ in range(8):
        seq = torch.cat([seq, model(input_ids=seq, use_cache=False).logits[:, -1].argmax(-1, keepdim=True)], dim=1)
print(json.dumps({"diff": diff, "cached": cached.tolist(), "nocache": seq[0, 6:].tolist(),
                  "layers": model.config.num_hidden_layers, "trsp_ray_imported": "trsp_ray" in sys.modules}))
"""


@pytest.mark.parametrize("family", ["llama", "gemma2"])
def test_export_loads_in_plain_transformers_and_generates(tmp_path, family):
    export_streaming(_gated(family), tokenizer=None, drop=DROP, output=str(tmp_path / "s"), manifest={},
                     max_shard_mb=0.2)
    pruned = tiny_model(family)
    remove_layers(pruned, DROP)
    ids = torch.randint(3, 256, (1, 32), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        logits = pruned(input_ids=ids, use_cache=False).logits
    case = tmp_path / "case.json"
    case.write_text(json.dumps({"dir": str(tmp_path / "s"), "ids": ids.tolist(), "logits": logits.tolist()}))
    proc = subprocess.run([sys.executable, "-c", CHECK, str(case)], capture_output=True, text=True, timeout=600,
                          cwd=tmp_path, env={**os.environ, "PYTHONPATH": ""})
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["trsp_ray_imported"] is False and result["layers"] == 4
    assert result["diff"] <= 1e-5
    assert result["cached"] == result["nocache"] and len(result["cached"]) == 8


def test_checksums_catch_a_corrupted_shard(tmp_path):
    """verify_shards on a finished export, then one flipped byte in the middle of one shard."""
    model = tiny_model("llama")
    from trsp_ray.distributed.export import export_units, plan_shards

    units, _, _ = export_units(model, DROP)
    shards = plan_shards(model, units, max_shard_bytes=10**5)
    writer = ShardWriter(tmp_path, shards)
    for unit in units:
        for name, tensor in unit.entries:
            writer.write(name, tensor)
    writer.close()
    assert verify_shards(tmp_path, shards, writer.digests) == sum(len(s.tensors) for s in shards)
    victim = tmp_path / shards[2].file
    data = bytearray(victim.read_bytes())
    data[-100] ^= 0x01
    victim.write_bytes(bytes(data))
    with pytest.raises(RuntimeError, match=f"checksum check failed.*{shards[2].tensors[-1].name} in {shards[2].file}"):
        verify_shards(tmp_path, shards, writer.digests)


def test_corruption_during_export_fails_it_and_leaves_nothing(tmp_path, monkeypatch):
    """A shard corrupted on disk after it was written (as a bad disk or a concurrent writer would):
    the export raises, nothing exists at the target, no temp dir is left, an old export survives."""
    target = tmp_path / "out"
    export_streaming(_gated("llama", layers=3), tokenizer=None, drop=[1], output=str(target), manifest={"v": 1})
    real_close = ShardWriter._close_file

    def corrupting_close(self):
        path = Path(self._file.name)
        real_close(self)
        if path.name.startswith("model-00002"):
            data = bytearray(path.read_bytes())
            data[-1] ^= 0xFF
            path.write_bytes(bytes(data))

    monkeypatch.setattr(ShardWriter, "_close_file", corrupting_close)
    with pytest.raises(RuntimeError, match="sha256 of the file differs"):
        export_streaming(_gated("llama"), tokenizer=None, drop=DROP, output=str(target), manifest={"v": 2},
                         max_shard_mb=0.1)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
    assert json.loads((target / MANIFEST).read_text())["v"] == 1
    with pytest.raises(RuntimeError, match="sha256"):
        export_streaming(_gated("llama"), tokenizer=None, drop=DROP, output=str(tmp_path / "new"), manifest={},
                         max_shard_mb=0.1)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_interrupted_export_leaves_nothing(tmp_path, monkeypatch):
    """Ctrl-C (or a failing disk) after some shards are on disk: no target, no temp dir."""
    real_write, calls = ShardWriter.write, []

    def write(self, name, tensor):
        calls.append(name)
        if len(calls) == 20:
            raise KeyboardInterrupt
        real_write(self, name, tensor)

    monkeypatch.setattr(ShardWriter, "write", write)
    with pytest.raises(KeyboardInterrupt):
        export_streaming(_gated("llama"), tokenizer=None, drop=DROP, output=str(tmp_path / "out"), manifest={},
                         max_shard_mb=0.1)
    assert len(calls) == 20 and list(tmp_path.iterdir()) == []


def test_bad_drop_set_and_existing_output_are_refused(tmp_path):
    with pytest.raises(TrspError, match=r"drop set \[1, 9\] is not valid for 6 layers"):
        export_streaming(_gated("llama"), tokenizer=None, drop=[1, 9], output=str(tmp_path / "s"), manifest={})
    (tmp_path / "s").mkdir()
    (tmp_path / "s" / "keep.txt").write_text("user data")
    with pytest.raises(TrspError, match="already exists"):
        export_streaming(_gated("llama"), tokenizer=None, drop=DROP, output=str(tmp_path / "s"), manifest={},
                         overwrite=False)
    assert [p.name for p in (tmp_path / "s").iterdir()] == ["keep.txt"]


def test_reload_check_only_where_the_model_fits(tmp_path):
    ok, note = reload_fits(10 * 2**30, max_gb=16.0, device=torch.device("cpu"))
    assert ok == (10 * 2**30 < dexport._host_available_bytes() / 2)
    assert reload_fits(140 * 10**9, max_gb=16.0, device=torch.device("cpu")) == (
        False, "skipped: 130.4 GiB > distributed.export_reload_max_gb=16.0")
    done = export_streaming(_gated("llama"), tokenizer=None, drop=DROP, output=str(tmp_path / "s"), manifest={},
                            reload_max_gb=0)
    check = done["export_check"]
    assert check["reload_check"].startswith("skipped") and "max_abs_logit_diff" not in check
    assert check["tensors"] == 39  # the checksums still cover every tensor


def test_bad_export_settings_are_one_line_errors():
    from trsp_ray.config.run_config import load_config

    for override, message in [("distributed.export_shard_mb=0", "distributed.export_shard_mb=0 is not valid"),
                              ("distributed.export_timeout_s=-5", "distributed.export_timeout_s=-5 is not valid")]:
        with pytest.raises(TrspError, match=message):
            load_config(overrides=[override])
    assert load_config(overrides=["distributed.export_shard_mb=20"]).distributed.export_shard_mb == 20


def test_timeout_is_sized_from_the_bytes():
    # 70B with 25% of the layers dropped, bf16: ~105 GB written, re-read and (if it fit) reloaded.
    assert timeout_for(105 * 10**9, reload=False) == 600 + 4200
    assert timeout_for(105 * 10**9, reload=True) == 600 + 6300
    assert timeout_for(0, reload=True) == 600


# ---- DeepSpeed ZeRO-3 over gloo, without Ray ---------------------------------------------------

WORKER = r"""
import json, os, sys, torch
from trsp_ray.config.run_config import DistributedConfig
from trsp_ray.distributed import engine as eng
from trsp_ray.distributed.deepspeed_config import build_ds_config
from trsp_ray.distributed.export import export_streaming
from trsp_ray.method.gates import attach_gates
torch.set_num_threads(1)
model_dir, out = sys.argv[1], sys.argv[2]
world = int(os.environ["WORLD_SIZE"])
eng.init_deepspeed(backend="gloo")
ds = build_ds_config(DistributedConfig(workers=world), batch_size=world, lr=1e-3)
model = eng.load_sharded(model_dir, ds_config=ds, dtype=torch.float32)
gates = attach_gates(model)
eng.zero_ready_gates(gates)
# The engine installs ZeRO-3's forward hooks (the reference logits need them), as in a run.
eng.StepperFactory(ds_config=ds, rank=int(os.environ["RANK"]), world=world)(model, [{"params": gates.gate_params()}])
assert eng.is_partitioned(model)
done = export_streaming(model, tokenizer=None, drop=[1, 4], output=out, manifest={"method": "zero3"}, max_shard_mb=0.1)
print("RESULT " + json.dumps(done), flush=True)
"""


def _zero3_export(model_dir, out, world: int) -> list[dict]:
    from gloo_ranks import run_ranks

    return run_ranks([sys.executable, "-c", WORKER, str(model_dir), str(out)], world=world)


@pytest.mark.parametrize("world", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_zero3_gloo_export_equals_the_plain_export(tmp_path, world):
    """A tied-embedding model (Gemma 2) partitioned by ZeRO-3: every rank gets rank 0's outcome, the
    files are bit-identical to the single-process streaming export and to save_pretrained's."""
    tiny_model("gemma2").save_pretrained(tmp_path / "model")
    results = _zero3_export(tmp_path / "model", tmp_path / "zero3", world)
    assert len(results) == world and all(r == results[0] for r in results)
    assert results[0]["export_check"]["max_abs_logit_diff"] <= 1e-5
    export_streaming(_gated("gemma2"), tokenizer=None, drop=DROP, output=str(tmp_path / "plain"), manifest={},
                     max_shard_mb=0.1)
    zero3, plain = _tensors(tmp_path / "zero3"), _tensors(tmp_path / "plain")
    assert sorted(zero3) == sorted(plain) and "lm_head.weight" not in zero3
    assert all(torch.equal(zero3[k], plain[k]) for k in plain)
    assert (sorted(p.name for p in (tmp_path / "zero3").iterdir())
            == sorted(p.name for p in (tmp_path / "plain").iterdir()))
