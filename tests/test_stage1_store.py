"""One content-keyed stage-1 store for the search and the reproduction: a changed stage-1 setting
recomputes in both, and every TRSP row of a reproduced model prunes from one stage-1 run, also a
row whose stage 2 runs on Ray Train."""

import json
from pathlib import Path

import pytest
from test_reproduce_resume import tiny_preset

from trsp_ray.config import registry
from trsp_ray.reproduce.grid import read_events
from trsp_ray.reproduce.run import run_reproduce


@pytest.fixture(autouse=True)
def _no_token_cache(monkeypatch):
    from trsp_ray.data import calibration
    from trsp_ray.data.perplexity import encode

    monkeypatch.setattr(calibration, "encode_cached", encode)  # keep ~/.cache out of it


def _trial_config(search_dir: Path, run: dict, point: dict) -> dict:
    from trsp_ray.search.pipeline import search_fingerprint

    return {"run": run, "point": point, "search_dir": str(search_dir), "invocation": "test", "reuse": True,
            "search_fp": search_fingerprint(run), "plan_n_drop": {}, "default_plan_n_drop": 0, "val_every": 1,
            "val_windows": 1, "threads": 1}


def test_changing_lambda1_recomputes_stage1_in_the_search_store(tmp_path):
    from trsp_ray.config.run_config import load_config
    from trsp_ray.search.cache import RunLog
    from trsp_ray.search.trial import _execute

    preset = tiny_preset(tmp_path)
    # the search runs any pipeline now; this is TRSP's, whose stage 1 the store holds
    run = load_config(overrides=[f"model={preset.models[0].model}", "method=trsp"], base=preset.run).to_dict()
    search = tmp_path / "search"
    for point in ({"stage1.lambda1": 1e-3}, {"stage1.lambda1": 1e-3, "ratio": 0.5}, {"stage1.lambda1": 2e-2}):
        _execute(_trial_config(search, run, point), report=lambda metrics: None)
    events = RunLog(search).read()
    assert not [e for e in events if e["event"] == "stage1_reused"]
    computed = [e for e in events if e["event"] == "stage1_computed"]
    # ratio 0.25 -> 1 layer; ratio 0.5 at the same lambda1 needs 2 (longer than stored: recomputed
    # under the same key); lambda1 changed -> a new key, recomputed
    assert [(e["n_drop"]) for e in computed] == [1, 2, 1]
    assert computed[0]["key"] == computed[1]["key"] != computed[2]["key"]
    records = [json.loads(p.read_text()) for p in (search / "stage1").glob("*.json")]
    # swap refinement is on by default: one record per n_drop (1 and 2 layers at lambda1 1e-3)
    assert sorted(r["content"]["stage1"]["lambda1"] for r in records) == [1e-3, 1e-3, 2e-2]
    _execute(_trial_config(search, run, {"stage1.lambda1": 2e-2, "ratio": 0.25}), report=lambda metrics: None)
    assert RunLog(search).count("stage1_computed") == 3 and RunLog(search).count("stage1_reused") == 1


def test_changing_lambda1_recomputes_stage1_and_the_cell_in_the_reproduction_store(tmp_path):
    preset, out = tiny_preset(tmp_path), tmp_path / "out"
    first = run_reproduce(preset, out=str(out), methods=["trsp-no-stage2"], use_ray=False)
    assert first["computed"] == ["tiny__trsp-no-stage2__r0.250"] and len(list((out / "stage1").glob("*.json"))) == 1
    changed = run_reproduce(preset, out=str(out), methods=["trsp-no-stage2"], use_ray=False,
                            overrides=["stage1.lambda1=0.02"])
    assert changed["computed"] == ["tiny__trsp-no-stage2__r0.250"] and changed["skipped"] == []
    stored = [json.loads(p.read_text()) for p in (out / "stage1").glob("*.json")]
    assert sorted(r["content"]["config"]["stage1"]["lambda1"] for r in stored) == [5e-3, 0.02]
    run_ids = list(dict.fromkeys(e["run_id"] for e in read_events(out)))
    second = [e for e in read_events(out) if e["run_id"] == run_ids[1]]
    assert [e["cell"] for e in second if e["event"] == "stale"] == ["tiny__trsp-no-stage2__r0.250"]
    again = run_reproduce(preset, out=str(out), methods=["trsp-no-stage2"], use_ray=False,
                          overrides=["stage1.lambda1=0.02"])
    assert again["computed"] == [] and again["skipped"] == ["tiny__trsp-no-stage2__r0.250"]
    assert again["results"][0]["cell_key"] == changed["results"][0]["cell_key"] != first["results"][0]["cell_key"]


def _route_trsp_to_ray_train(monkeypatch, workers: int = 1):
    """Route the stage-2 rows (trsp, trsp-oneshot) to Ray Train, as the planner does for 7B on 80 GB."""
    from trsp_ray.config.run_config import replace
    from trsp_ray.plan import zero3_plan
    from trsp_ray.plan.route import Route
    from trsp_ray.reproduce import run as run_module

    original = run_module.cell_route

    def route(preset, spec, cfg, method, *, shape=None):
        r = original(preset, spec, cfg, method, shape=shape)
        if method not in ("trsp", "trsp-oneshot"):
            return r
        plan = zero3_plan.zero3_plan(replace(cfg, **{"distributed.workers": workers}), r.plan.shape,
                                     spec=registry.method(cfg.method))
        return Route(workers, "cpu", plan)

    monkeypatch.setattr(run_module, "cell_route", route)


def test_a_ray_train_cell_gets_the_shared_stage1_and_reports_its_kept_layers(tmp_path, monkeypatch):
    """The driver hands the model's one stage-1 result to the Ray Train cell (here a stand-in that
    prunes in process from what it is handed, and writes a manifest like a ZeRO-3 export's)."""
    from trsp_ray.reproduce import run as run_module

    handed = []

    def fake_prune_distributed(cfg, *, cell_id, target, workers, stage1, n_drop, selection=None):
        assert selection is None  # a TRSP cell prunes from the shared stage 1, no handed drop set
        import dataclasses

        from trsp_ray.run.export import export_model
        from trsp_ray.run.methods import apply_method
        from trsp_ray.run.stage1_store import result_from
        from trsp_ray.run.workbench import prepare

        handed.append((cell_id, stage1["drop_order"]))
        bench = prepare(cfg)
        out = apply_method(dataclasses.replace(bench, cfg=cfg), registry.method(cfg.method), stage1=result_from(stage1))
        export_model(out.model, bench.tokenizer, target, overwrite=True,
                     manifest={"method": cfg.method, "config": cfg.to_dict(), "workers": workers, "drop": out.drop})
        return {"cell_id": cell_id, "model_dir": target, "drop": out.drop, "info": {"workers": workers},
                "prune_seconds": 0.0, "stage1_shared": True}

    _route_trsp_to_ray_train(monkeypatch)
    monkeypatch.setattr(run_module, "prune_distributed", fake_prune_distributed)
    preset, out = tiny_preset(tmp_path), tmp_path / "out"
    result = run_reproduce(preset, out=str(out), methods=["trsp", "trsp-no-stage2", "trsp-oneshot"], use_ray=False)
    rows = {r["method"]: r for r in result["results"]}
    (stored,) = [json.loads(p.read_text()) for p in (out / "stage1").glob("*.json")]  # one stage-1 run
    assert [cid for cid, _ in handed] == ["tiny__trsp__r0.250", "tiny__trsp-oneshot__r0.250"]
    assert all(order == stored["drop_order"] for _, order in handed)
    assert rows["trsp"]["dropped"] == rows["trsp-no-stage2"]["dropped"] == sorted(stored["drop_order"][:1])
    assert rows["trsp-oneshot"]["dropped"] == sorted(stored["round1_ranking"][:1])
    assert rows["trsp"]["route"] == "1 x CPU (Ray Train)" and rows["trsp-no-stage2"]["route"] == "1 CPU"
    # the Ray Train export's manifest has no num_layers_original: kept + dropped gives it
    assert (rows["trsp"]["layers"], rows["trsp"]["layers_original"]) == (3, 4)
    table = (out / "results.txt").read_text()
    assert "3/4" in table and "*" not in table.split("\n\n")[0]


@pytest.mark.ray
@pytest.mark.slow
def test_ray_train_cell_prunes_from_the_shared_stage1_on_gloo(tmp_path, monkeypatch, private_ray):
    _route_trsp_to_ray_train(monkeypatch)
    preset, out = tiny_preset(tmp_path), tmp_path / "out"
    preset = preset.__class__(**{**preset.__dict__, "run": {**preset.run, "distributed": {
        "storage_path": str(tmp_path / "ray")}}})
    private_ray(num_cpus=2)
    result = run_reproduce(preset, out=str(out), methods=["trsp", "trsp-no-stage2"], use_ray=False)
    rows = {r["method"]: r for r in result["results"]}
    assert rows["trsp"]["route"] == "1 x CPU (Ray Train)" and rows["trsp"]["stage1_shared"] is True
    assert rows["trsp"]["dropped"] == rows["trsp-no-stage2"]["dropped"]
    assert (rows["trsp"]["layers"], rows["trsp"]["layers_original"]) == (3, 4)
