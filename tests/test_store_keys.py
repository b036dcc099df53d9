"""The one key of every store (run/content.py): a benchmark row, the dense reference's scores and a
stage-1 result are read back only by a run that would compute them again, so a changed text,
library or resolved precision gives another key, never a stale row."""

import dataclasses
import json
from importlib import metadata
from types import SimpleNamespace

import pytest
import torch

from trsp_ray.config.run_config import load_config


@pytest.fixture
def inputs(tmp_path, monkeypatch):
    """A model directory (config.json is all a key reads), calibration and evaluation texts, a scored
    domain whose source file is ours, and LAMBADA data of ours."""
    monkeypatch.setenv("TRSP_RAY_CACHE", str(tmp_path / "cache"))
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"model_type": "llama"}))
    files = {name: tmp_path / f"{name}.txt" for name in ("calib", "eval", "news", "lambada")}
    for name, f in files.items():
        f.write_text(f"{name} text\n\nsecond document\n")
    from trsp_ray.data import domains
    from trsp_ray.evaluation import tasks

    monkeypatch.setitem(domains.DOMAINS, "news", dataclasses.replace(domains.DOMAINS["news"],
                                                                     files=lambda: [files["news"]]))
    monkeypatch.setattr(tasks, "source_files", lambda name: [files["lambada"]])
    cfg = load_config(None, ["data.eval_domains=news"], base={
        "model": str(model), "data": {"calib_text": str(files["calib"]), "eval_text": str(files["eval"])}})
    return cfg.to_dict(), files


def _row_key(cfg, **options):
    from trsp_ray.benchmark.comparison import Job, RowCache

    return RowCache(cfg, {"lambada": 0, **options}).path(Job("row", "shortgpt+heal", 0)).name


def _grow(path):
    path.write_text(path.read_text() + "one more line\n")


@pytest.mark.parametrize("text", ["calib", "eval", "news", "lambada"])
def test_a_row_key_changes_with_the_bytes_of_every_text_the_row_reads(inputs, text):
    cfg, files = inputs
    before = _row_key(cfg, lambada=5)
    _grow(files[text])
    assert _row_key(cfg, lambada=5) != before
    if text == "lambada":  # a row that scores no LAMBADA does not read its data
        assert _row_key(cfg) == _row_key(cfg)


def _keys(cfg):
    """(row key, dense reference key, stage-1 key) of `cfg`, where each store would put its entry."""
    from trsp_ray.benchmark import jobs
    from trsp_ray.config.run_config import from_dict
    from trsp_ray.run.content import data_fingerprint
    from trsp_ray.run.stage1_store import stage1_key

    written = []
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr("trsp_ray.common.atomic.write_text", lambda path, text: written.append(path.name))
        jobs._dense_cached(SimpleNamespace(cfg=from_dict(cfg)), {"task": "x"}, lambda: {"acc": 1.0})
    d = cfg["data"]
    return (_row_key(cfg), written[0],
            stage1_key(cfg, data_fingerprint(model=cfg["model"], calib_text=d["calib_text"], calib_mix=d["calib_mix"])))


def test_every_store_key_changes_with_a_library_version(inputs, monkeypatch):
    cfg, _ = inputs
    before = _keys(cfg)
    real = metadata.version
    monkeypatch.setattr(metadata, "version", lambda name: "99.0" if name == "transformers" else real(name))
    after = _keys(cfg)
    assert all(a != b for a, b in zip(before, after))


def test_every_store_key_changes_with_the_precision_auto_resolves_to(inputs, monkeypatch):
    """device=auto, dtype=auto is fp32 on a CPU and bf16 on a GPU: one config, two results."""
    cfg = {**inputs[0], "device": "auto", "dtype": "auto"}
    on_cpu = _keys(cfg)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    on_gpu = _keys(cfg)
    assert all(a != b for a, b in zip(on_cpu, on_gpu))
    from trsp_ray.run.content import precision

    assert precision(cfg) == {"device": "cuda", "dtype": "bf16"}
    assert precision({**cfg, "dtype": "fp32"}) == {"device": "cuda", "dtype": "fp32"}


def test_a_key_is_stable_for_unchanged_inputs(inputs):
    cfg, _ = inputs
    assert _keys(cfg) == _keys(json.loads(json.dumps(cfg)))
