"""Issue 13: one manifest builder. Every export path (single process, Ray Train streaming export,
search trial, reproduction cell and dense model, benchmark row) writes the same `trsp_ray.json`
fields, and a distributed cell's kept-layer count reaches the reproduction table."""

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from trsp_ray.common.errors import TrspError
from trsp_ray.config.run_config import RunConfig
from trsp_ray.method.gates import attach_gates
from trsp_ray.method.surgery import remove_layers
from trsp_ray.models.tiny import tiny_model
from trsp_ray.run.export import MANIFEST, MANIFEST_KEYS, pruned_manifest

DROP = [4, 1]  # in drop order: the manifest keeps it, the kept list follows the layer order
KEPT = [0, 2, 3, 5]


def _read(path) -> dict:
    return json.loads((path / MANIFEST).read_text())


def _pruned():
    model = tiny_model("llama", layers=6)
    remove_layers(model, DROP)
    return model


def _exports(tmp_path, monkeypatch) -> dict[str, dict]:
    from trsp_ray.benchmark import jobs as comparison
    from trsp_ray.data import assets
    from trsp_ray.distributed.export import export_streaming
    from trsp_ray.reproduce import work
    from trsp_ray.search import trial

    cfg = RunConfig()
    bench = SimpleNamespace(num_layers=6, tokenizer=None, cfg=cfg, model=tiny_model("llama", layers=6))
    outcome = SimpleNamespace(model=_pruned(), drop=list(DROP), kept=list(KEPT))
    gated = tiny_model("llama", layers=6)
    attach_gates(gated)
    export_streaming(gated, tokenizer=None, drop=DROP, output=str(tmp_path / "zero3"),
                     manifest={"method": cfg.method, "config": cfg.to_dict(), "workers": 2})  # as train.py passes
    record = {"config": cfg.to_dict(), "val_ppl": 9.5, "kept_parameters": 10, "kept_fraction": 0.7,
              "total_compute": 100.0}  # a trial record carries its total compute (search/trial.py)
    trial_dir = trial._export(outcome, bench, tmp_path / "search", "t0", record)
    cell_dir = work.export_cell(outcome, bench, method="shortgpt+heal", config=cfg.to_dict(), info={"x": 1},
                                target=str(tmp_path / "cell"))
    row_dir = comparison.export_row(outcome.model, bench, row_name="shortgpt", drop=DROP,
                                      target=str(tmp_path / "row"), metrics={"held-out PPL": 9.0})
    monkeypatch.setattr(assets, "resolve_model", lambda name: "org/not-a-directory")
    dense_dir = work._dense_dir(bench, tmp_path / "dense")
    return {"zero3": _read(tmp_path / "zero3"), "search": _read(Path(trial_dir)), "cell": _read(Path(cell_dir)),
            "row": _read(Path(row_dir)), "dense": _read(Path(dense_dir))}


def test_every_export_path_writes_the_same_manifest_fields(tmp_path, monkeypatch):
    made = _exports(tmp_path, monkeypatch)
    for path, manifest in made.items():
        assert set(MANIFEST_KEYS) <= set(manifest), f"{path} lacks {set(MANIFEST_KEYS) - set(manifest)}"
        assert manifest["num_layers_kept"] + len(manifest["dropped_layers"]) == manifest["num_layers_original"] == 6
        assert "versions" in manifest
    pruned = {k: v for k, v in made.items() if k != "dense"}
    for path, manifest in pruned.items():
        assert (manifest["dropped_layers"], manifest["drop_order"], manifest["kept_layers"]) == (DROP, DROP, KEPT), path
    assert made["dense"]["kept_layers"] == list(range(6)) and made["dense"]["dropped_layers"] == []
    # No path keeps a second spelling of the layer fields (the Ray Train export used to add drop/kept).
    assert not any({"drop", "kept"} & set(m) for m in made.values())
    assert made["search"]["search_trial"] == "t0" and made["cell"]["info"] == {"x": 1}


def test_builder_refuses_a_drop_set_outside_the_model_and_overwriting_its_fields():
    with pytest.raises(TrspError, match=r"drop set \[1, 6\].*6-layer"):
        pruned_manifest(method="m", drop=[1, 6], num_layers_original=6)
    with pytest.raises(TrspError, match="drop set"):
        pruned_manifest(method="m", drop=[1, 1], num_layers_original=6)
    with pytest.raises(TrspError, match="kept_layers"):
        pruned_manifest(method="m", drop=[1], num_layers_original=6, kept_layers=[0])


def test_a_distributed_cell_reports_its_kept_layers_in_the_reproduction_table(tmp_path):
    from transformers import AutoConfig

    from trsp_ray.distributed.export import export_streaming
    from trsp_ray.evaluation.evaluator import read_manifest
    from trsp_ray.reproduce.grid import Cell
    from trsp_ray.reproduce.report import table_rows
    from trsp_ray.reproduce.work import cell_record

    gated = tiny_model("llama", layers=6)
    attach_gates(gated)
    out = tmp_path / "cell"
    export_streaming(gated, tokenizer=None, drop=DROP, output=str(out), manifest={"method": "trsp", "workers": 2})
    # What the evaluator reports of the exported directory, and what prune_distributed returns.
    scored = {"layers": AutoConfig.from_pretrained(out).num_hidden_layers, "manifest": read_manifest(out), "ppl": 5.0}
    pruned = {"drop": list(DROP), "info": {"workers": 2}}
    record = cell_record(Cell("tiny", "trsp", 0.34), pruned, scored, None, key="k")
    assert (record["layers"], record["layers_original"], record["dropped"]) == (4, 6, [1, 4])
    assert table_rows([record])[0]["layers"] == "4/6"
