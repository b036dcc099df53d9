"""The exported model is a plain Hugging Face model: it reloads in a process that never imports
trsp_ray, gives the in-memory pruned model's logits, and generates with a KV cache."""

import json
import subprocess
import sys

import pytest
import torch

from trsp_ray.common.errors import TrspError
from trsp_ray.method.surgery import remove_layers
from trsp_ray.models.families import FAMILIES
from trsp_ray.models.tiny import tiny_model
from trsp_ray.run.export import MANIFEST, export_model

CHECK = r"""
import json, sys, torch
from transformers import AutoModelForCausalLM
cases = json.loads(open(sys.argv[1]).read())
out = {}
for name, case in cases.items():
    model = AutoModelForCausalLM.from_pretrained(case["dir"], dtype=torch.float32).eval()
    ids = torch.tensor(case["ids"])
    with torch.no_grad():
        logits = model(input_ids=ids, use_cache=False).logits
        diff = (logits - torch.tensor(case["logits"])).abs().max().item()
        cached = model.generate(ids[:1, :6], max_new_tokens=8, do_sample=False, use_cache=True,
                                pad_token_id=0)[0, 6:].tolist()
        seq = ids[:1, :6]
        for _ in range(8):  # greedy decoding without a cache, as the reference
            nxt = model(input_ids=seq, use_cache=False).logits[0, -1].argmax()
            seq = torch.cat([seq, nxt.view(1, 1)], dim=1)
    out[name] = {"diff": diff, "cached": cached, "nocache": seq[0, 6:].tolist(),
                 "layers": model.config.num_hidden_layers}
out["trsp_ray_imported"] = "trsp_ray" in sys.modules
print(json.dumps(out))
"""


def test_export_reloads_without_trsp_ray(tmp_path):
    cases, drops = {}, {}
    ids = torch.randint(3, 256, (2, 40), generator=torch.Generator().manual_seed(3))
    for family in sorted(FAMILIES):
        model = tiny_model(family)
        drops[family] = [1, 4]
        remove_layers(model, drops[family])
        with torch.no_grad():
            logits = model(input_ids=ids, use_cache=False).logits
        out = export_model(model, None, str(tmp_path / family), manifest={"method": "test", "dropped_layers": [1, 4]})
        cases[family] = {"dir": str(out), "ids": ids.tolist(), "logits": logits.tolist()}
        manifest = json.loads((out / MANIFEST).read_text())
        assert manifest["dropped_layers"] == [1, 4]
        assert manifest["export_check"]["max_abs_logit_diff"] <= 1e-5
        assert "torch" in manifest["versions"]
    (tmp_path / "cases.json").write_text(json.dumps(cases))
    proc = subprocess.run([sys.executable, "-c", CHECK, str(tmp_path / "cases.json")], capture_output=True, text=True,
                          timeout=600, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result.pop("trsp_ray_imported") is False
    for family, r in result.items():
        assert r["diff"] <= 1e-5, family
        assert r["layers"] == 4, family
        assert r["cached"] == r["nocache"], family
        assert len(r["cached"]) == 8, family


def test_export_refuses_existing_dir_and_leaves_nothing(tmp_path):
    model = tiny_model("llama", layers=3)
    target = tmp_path / "out"
    target.mkdir()
    (target / "keep.txt").write_text("user data")
    with pytest.raises(TrspError, match="already exists"):
        export_model(model, None, str(target), manifest={})
    assert [p.name for p in target.iterdir()] == ["keep.txt"]


def test_failed_export_leaves_no_directory(tmp_path, monkeypatch):
    model = tiny_model("llama", layers=3)

    def broken_save(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(model, "save_pretrained", broken_save)
    with pytest.raises(OSError):
        export_model(model, None, str(tmp_path / "out"), manifest={})
    assert list(tmp_path.iterdir()) == []


def test_overwrite_replaces_atomically(tmp_path):
    target = tmp_path / "out"
    export_model(tiny_model("llama", layers=3), None, str(target), manifest={"v": 1})
    export_model(tiny_model("llama", layers=2), None, str(target), manifest={"v": 2}, overwrite=True)
    assert json.loads((target / MANIFEST).read_text())["v"] == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
