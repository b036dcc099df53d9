"""Issue 20: MLflow keeps one folder (artifacts beside the database), and the search's registered
best model loads back with mlflow.transformers.load_model and generates."""

from pathlib import Path

import pytest


def test_artifacts_lie_beside_the_database_not_in_the_working_directory(tmp_path, monkeypatch):
    from trsp_ray.run.tracking import make_tracker

    store, cwd = tmp_path / "runs", tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    monkeypatch.setenv("TRSP_RAY_MLFLOW_DIR", str(store))
    tracker = make_tracker(experiment="artifact-location")  # the default store: <dir>/mlflow.db
    with tracker.run("r"):
        tracker.log_dict({"a": 1}, "a.json")
    assert tracker.tracking_uri == f"sqlite:///{store.resolve() / 'mlflow.db'}"
    assert list((store / "artifacts").rglob("a.json")), sorted(p.name for p in store.rglob("*"))
    assert not any(cwd.iterdir())  # no ./mlruns


@pytest.fixture(scope="module")
def export_dir(tmp_path_factory):
    """A real trsp_ray export (manifest included) of a tiny random Llama with SmolLM2's tokenizer."""
    from transformers import AutoTokenizer

    from trsp_ray.data.assets import smollm2_dir
    from trsp_ray.method.surgery import remove_layers
    from trsp_ray.models.tiny import tiny_model
    from trsp_ray.run.export import export_model, pruned_manifest

    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir())
    model = tiny_model("llama", layers=3, vocab=len(tokenizer))
    remove_layers(model, [1])
    out = tmp_path_factory.mktemp("export") / "trial-best"
    export_model(model, tokenizer, str(out), manifest=pruned_manifest(method="trsp", drop=[1], num_layers_original=3),
                 verify=False)  # tests/test_export.py checks the reload
    return out


def test_registered_best_model_loads_with_mlflow_transformers_and_generates(tmp_path, export_dir):
    import mlflow
    import mlflow.transformers

    from trsp_ray.search.lineage import _client, register_best

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client, exp = _client(uri, "registry-test")
    run_id = client.create_run(exp, run_name="trial-best").info.run_id
    best = {"model_dir": str(export_dir), "config": {"ratio": 0.25}, "trial_key": "abc123"}
    version = register_best(client, run_id, best, "trsp-test-best")
    assert not any(p.name.startswith(".mlflow-") for p in Path(export_dir).parent.iterdir())  # staging removed
    mlflow.set_tracking_uri(uri)
    pipe = mlflow.transformers.load_model(f"models:/trsp-test-best/{version}")
    out = pipe("The capital of France is", max_new_tokens=4, do_sample=False)
    assert out[0]["generated_text"].startswith("The capital of France is")
    assert len(pipe.model.model.layers) == 2  # the pruned model, not a fresh one
    tags = client.get_model_version("trsp-test-best", version).tags
    assert tags["trsp.trial_key"] == "abc123" and '"dropped_layers": [1]' in tags["manifest"]
