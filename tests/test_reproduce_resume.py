"""The reproduction grid on a tiny model: an interrupted run, rerun, redoes no finished cell."""

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from trsp_ray.reproduce.grid import read_events
from trsp_ray.reproduce.presets import LOCAL, ModelSpec
from trsp_ray.reproduce.run import run_reproduce

METHODS = ["dense", "trsp", "trsp-no-stage2", "shortgpt"]


def tiny_preset(root: Path):
    """LOCAL with a 4-layer random Llama (SmolLM2's tokenizer), short texts and tiny budgets."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from trsp_ray.data import domains
    from trsp_ray.data.assets import smollm2_dir

    tok = AutoTokenizer.from_pretrained(smollm2_dir())
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                      num_attention_heads=2, num_key_value_heads=1)
    LlamaForCausalLM(cfg).save_pretrained(root / "tiny")
    tok.save_pretrained(root / "tiny")
    calibration, heldout = domains.texts("wiki")
    (root / "calib.txt").write_text(calibration[:12000])
    (root / "eval.txt").write_text(heldout[:4000])
    run = {"device": "cpu", "threads": 1, "tracking": {"enabled": False},
           "data": {"seqlen": 32, "batch_size": 2, "eval_seqlen": 32, "eval_max_windows": 4,
                    "calib_text": str(root / "calib.txt"), "eval_text": str(root / "eval.txt")},
           "stage1": {"first_round_steps": 2, "steps_per_round": 1}, "stage2": {"steps": 1},
           "baselines": {"calib_windows": 2, "sleb_windows": 2}}
    evaluation = {"tasks": (), "limit": None, "ppl_seqlen": 32, "ppl_windows": 4, "dtype": "float32", "speed": None}
    return dataclasses.replace(LOCAL, name="tiny", models=(ModelSpec("tiny", str(root / "tiny")),),
                               run=run, evaluation=evaluation, keep_models=True)


class Interrupt(KeyboardInterrupt):
    pass


def _interrupt_after(n: int):
    seen = []

    def on_cell(cell, record):
        seen.append(cell.id)
        if len(seen) == n:
            raise Interrupt()
    return on_cell


def _check_resume(tmp_path: Path, use_ray: bool) -> None:
    preset = tiny_preset(tmp_path)
    out = tmp_path / "out"
    with pytest.raises(Interrupt):
        run_reproduce(preset, out=str(out), methods=METHODS, use_ray=use_ray, on_cell=_interrupt_after(2))
    first = read_events(out)
    done_first = [e["cell"] for e in first if e["event"] == "computed"]
    pruned_first = [e["cell"] for e in first if e["event"] == "pruned"]
    assert len(done_first) == 2 and len(list((out / "cells").glob("*.json"))) == 2

    result = run_reproduce(preset, out=str(out), methods=METHODS, use_ray=use_ray)
    second = [e for e in read_events(out) if e["run_id"] != first[0]["run_id"]]
    skipped = [e["cell"] for e in second if e["event"] == "skipped"]
    computed = [e["cell"] for e in second if e["event"] == "computed"]
    pruned = [e["cell"] for e in second if e["event"] == "pruned"]
    assert sorted(skipped) == sorted(done_first) == sorted(result["skipped"])
    assert not set(computed) & set(done_first), "a finished cell was computed again"
    assert not set(pruned) & set(pruned_first), "an exported cell was pruned again"
    assert len(set(done_first) | set(computed)) == len(result["results"]) == 4
    assert second[-1]["event"] == "end" and second[-1]["complete"]
    (stored,) = (out / "stage1").glob("*.json")  # one shared stage-1 run, by content key
    stage1 = json.loads(stored.read_text())
    trsp = next(r for r in result["results"] if r["method"] == "trsp")
    assert trsp["dropped"] == sorted(stage1["drop_order"][:1]) and trsp["layers"] == 3
    dense = next(r for r in result["results"] if r["method"] == "dense")
    assert dense["layers"] == 4 and dense["ppl"] > 1
    for name in ("results.md", "results.csv", "results.txt", "ppl.png"):
        assert (out / name).is_file()
    assert "NOT WikiText-2" in (out / "results.md").read_text()

    third = run_reproduce(preset, out=str(out), methods=METHODS, use_ray=use_ray)
    assert third["computed"] == [] and len(third["skipped"]) == 4 and third["missing"] == []


def test_interrupted_run_resumes_without_redoing_cells_in_process(tmp_path, monkeypatch):
    from trsp_ray.data import calibration
    from trsp_ray.data.perplexity import encode

    # The on-disk token cache is not what this test is about; keep its files out of ~/.cache.
    monkeypatch.setattr(calibration, "encode_cached", encode)
    _check_resume(tmp_path, use_ray=False)


@pytest.mark.ray
def test_interrupted_run_resumes_without_redoing_cells_on_ray(tmp_path, monkeypatch, private_ray):
    monkeypatch.setenv("RAY_ENABLE_UV_RUN_RUNTIME_ENV", "0")
    private_ray(num_cpus=2)  # run_reproduce uses the running instance (and leaves it running)
    _check_resume(tmp_path, use_ray=True)
