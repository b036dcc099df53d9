"""The search on a local Ray instance: stage-1 reuse counted from the run log, resume, MLflow tree,
the registered model loading with plain transformers, Optuna multi-objective."""

import json
from pathlib import Path

import pytest

from trsp_ray.config.run_config import load_config
from trsp_ray.search.space import parse_space

GRID = {"params": {"ratio": [0.125, 0.25, 0.375], "stage1.lambda1": [1e-3, 5e-3], "stage2.lambda2": [1e-3]}}
SMALL = ["method=trsp", "data.seqlen=32", "data.batch_size=2", "data.eval_seqlen=64", "data.eval_max_windows=4",
         "stage1.first_round_steps=2", "stage1.steps_per_round=1", "stage2.steps=4", "threads=1"]


def make_assets(root):
    """An 8-layer tiny Llama with SmolLM2's tokenizer and short calibration / held-out text files."""
    from trsp_ray.models.tiny import tiny_workspace

    return tiny_workspace(root, layers=8, calib_chars=60000, eval_chars=20000)


def base_config(assets, tmp_path, extra=()):
    return load_config(overrides=[f"model={assets / 'model'}", f"data.calib_text={assets / 'calib.txt'}",
                                  f"data.eval_text={assets / 'eval.txt'}",
                                  f"tracking.tracking_uri=sqlite:///{tmp_path / 'mlflow.db'}", *SMALL, *extra])


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    return make_assets(tmp_path_factory.mktemp("search_assets"))


@pytest.fixture
def local_ray(private_ray):
    private_ray(num_cpus=2)


@pytest.mark.ray
def test_grid_reuses_stage1_resumes_and_registers(assets, tmp_path, local_ray):
    import mlflow
    from mlflow.tracking import MlflowClient
    from transformers import AutoModelForCausalLM

    from trsp_ray.search.run import SearchOptions, run_search

    # without swap refinement a stage 1 serves every smaller ratio (one per lambda1); with it, each
    # n_drop gets its own (tests/test_stage1_store.py), so this grid would compute all six
    base = base_config(assets, tmp_path, ["stage1.refine=0"])
    opts = SearchOptions(search_dir=str(tmp_path / "search"), name="grid", val_every=1, val_windows=2)
    first = run_search(base, parse_space(GRID), opts)
    assert (first["stage1_computed"], first["stage2_runs"], first["trials_run"]) == (2, 6, 6)
    assert first["stage1_reused"] == 4
    again = run_search(base, parse_space(GRID), opts)
    assert (again["stage1_computed"], again["stage2_runs"], again["trials_run"]) == (0, 0, 0)
    assert again["parent_run"] == first["parent_run"]

    uri = base.tracking.tracking_uri
    client = MlflowClient(tracking_uri=uri)
    exp = client.get_experiment_by_name(base.tracking.experiment).experiment_id
    children = client.search_runs([exp], f"tags.mlflow.parentRunId = '{first['parent_run']}'")
    assert len(children) == 6
    evals = [client.search_runs([exp], f"tags.mlflow.parentRunId = '{c.info.run_id}'") for c in children]
    finished = [c for c in children if c.data.tags["trsp.status"] == "finished"]
    assert sum(len(e) for e in evals) == len(finished) >= 1
    assert all(e[0].data.tags["trsp.kind"] == "evaluation" and "ppl" in e[0].data.metrics for e in evals if e)
    artifacts = {a.path for a in client.list_artifacts(first["parent_run"])}
    assert {"pareto.png", "gates_heatmap.png"} <= artifacts

    version = client.get_model_version(opts.register_name, first["model_version"])
    assert "manifest" in version.tags and "config" in version.tags
    local = mlflow.artifacts.download_artifacts(version.source, tracking_uri=uri, dst_path=str(tmp_path / "dl"))
    model = AutoModelForCausalLM.from_pretrained(Path(local) / "model")  # an MLflow transformers model's weights
    best = json.loads((tmp_path / "search" / "trials" / f"{first['best_trial']}.json").read_text())
    assert model.config.num_hidden_layers == 8 - len(best["drop"])


@pytest.mark.ray
def test_optuna_pareto_search(assets, tmp_path, local_ray):
    pytest.importorskip("optuna")
    from trsp_ray.search.run import SearchOptions, run_search

    space = parse_space({"algorithm": "optuna", "num_samples": 3, "objectives": ["val_ppl", "kept_parameters"],
                         "params": {"ratio": [0.125, 0.25], "stage1.lambda1": {"loguniform": [1e-4, 1e-2]}}})
    opts = SearchOptions(search_dir=str(tmp_path / "search"), name="optuna", asha=False, val_windows=2)
    summary = run_search(base_config(assets, tmp_path), space, opts)
    assert summary["trials_run"] == 3 and summary["stage2_runs"] == 3
    assert run_search(base_config(assets, tmp_path), space, opts)["trials_run"] == 0
