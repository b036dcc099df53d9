"""End to end on a tiny model with a real tokenizer: `trsp-ray prune` exports, logs to MLflow, and an
interrupted stage 1 resumes (the benchmark's tests are in test_comparison.py)."""

import json
from pathlib import Path

import pytest

from trsp_ray.cli import main
from trsp_ray.config.run_config import load_config

SMALL = ["data.seqlen=32", "data.batch_size=2", "data.eval_seqlen=64", "data.eval_max_windows=4",
         "stage1.first_round_steps=3", "stage1.steps_per_round=2", "stage2.steps=4",
         "baselines.calib_windows=2", "baselines.sleb_windows=2", "threads=1"]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    """A tiny random Llama (8 layers) with SmolLM2's real tokenizer, saved as a model directory."""
    from trsp_ray.models.tiny import tiny_workspace

    return tiny_workspace(tmp_path_factory.mktemp("tiny"), layers=8, calib_chars=40000, eval_chars=12000)


def _args(root: Path, *extra):
    out = ["--model", str(root / "model"), "--calib-text", str(root / "calib.txt"),
           "--eval-text", str(root / "eval.txt")]
    for item in SMALL:
        out += ["--set", item]
    return out + list(extra)


def test_prune_exports_and_logs_to_mlflow(tiny_dir, tmp_path, monkeypatch):
    import mlflow
    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{tmp_path / 'ml.db'}"
    out = tmp_path / "pruned"
    code = main(["prune", *_args(tiny_dir, "--method", "trsp", "--ratio", "0.25", "--output", str(out),
                                 "--set", f"tracking.tracking_uri={uri}", "--set", f"checkpoint_dir={tmp_path}")])
    assert code == 0
    manifest = json.loads((out / "trsp_ray.json").read_text())
    assert manifest["num_layers_original"] == 8 and manifest["num_layers_kept"] == 6
    assert len(manifest["dropped_layers"]) == 2 and set(manifest["dropped_layers"]) <= set(range(1, 7))
    assert manifest["config"]["stage1"]["lambda1"] == 5e-3 and manifest["config"]["stage1"]["lr"] == 5e-2
    assert manifest["metrics"]["heldout_ppl"] > 1.0
    assert json.loads((out / "config.json").read_text())["num_hidden_layers"] == 6
    client = MlflowClient(tracking_uri=uri)
    [run] = client.search_runs([client.get_experiment_by_name("trsp_ray").experiment_id])
    assert run.data.params["stage1.lambda1"] == "0.005"
    assert "gate/01" in run.data.metrics and "stage2/penalty" in run.data.metrics
    gate_steps = client.get_metric_history(run.info.run_id, "gate/03")
    assert len(gate_steps) == 3 + 2  # first round + one more round, one value per step
    artifacts = {a.path for a in client.list_artifacts(run.info.run_id)}
    assert {"stage1_gates.png", "trsp_ray.json", "drop_order.json"} <= artifacts
    mlflow.set_tracking_uri(None)


def test_interrupted_stage1_resumes_after_last_round(tiny_dir, tmp_path, monkeypatch):
    """A run killed in round 2 restarts from round 2's start; a finished run recomputes nothing."""
    from trsp_ray.driver import run
    from trsp_ray.method import stage1 as stage1_module

    cfg = load_config(None, [*SMALL, "tracking.enabled=false", f"checkpoint_dir={tmp_path / 'ck'}"], base={
        "model": str(tiny_dir / "model"), "ratio": 0.375, "method": "trsp-no-stage2",
        "data": {"calib_text": str(tiny_dir / "calib.txt"), "eval_text": str(tiny_dir / "eval.txt")}})
    real_step, calls = stage1_module.TorchStepper.step, {"n": 0}

    def dying_step(self):
        calls["n"] += 1
        if calls["n"] == 3 + 2 + 1:  # first step of round 3
            raise KeyboardInterrupt
        real_step(self)

    monkeypatch.setattr(stage1_module.TorchStepper, "step", dying_step)
    with pytest.raises(KeyboardInterrupt):
        run(cfg)
    monkeypatch.setattr(stage1_module.TorchStepper, "step", real_step)
    resumed = run(cfg)
    assert resumed["stage1_rounds_computed"] == 1  # rounds 1-2 came from the checkpoint
    again = run(cfg)
    assert again["stage1_rounds_computed"] == 0
    assert again["dropped_layers"] == resumed["dropped_layers"] and len(again["dropped_layers"]) == 3
    # The finished stage 1 sits in the one stage-1 store, under the key a search or a reproduction
    # of the same model, text and stage-1 settings would look up; the round checkpoints are gone.
    from trsp_ray.run.content import data_fingerprint
    from trsp_ray.run.stage1_store import Stage1Store, stage1_key

    key = stage1_key(cfg.to_dict(), data_fingerprint(model=cfg.model, calib_text=cfg.data.calib_text))
    stored = Stage1Store(tmp_path / "ck").get(key, 3)
    assert stored is not None and stored.drop_order[:3] == resumed["stage1_drop_order"][:3]
    assert not list((tmp_path / "ck").glob("*.rounds.pt"))
    other = stage1_key(load_config(None, ["stage1.lambda1=0.02"], base=cfg.to_dict()).to_dict(),
                       data_fingerprint(model=cfg.model, calib_text=cfg.data.calib_text))
    assert other != key and Stage1Store(tmp_path / "ck").get(other, 3) is None


def test_trsp_heal_is_trsp_selection_then_a_heal_with_stage2s_budget(tiny_dir, tmp_path):
    """trsp+heal runs stage 1, skips stage 2 and heals the pruned model for stage2.steps batches at
    stage2.lr."""
    import torch
    from safetensors.torch import load_file

    out = tmp_path / "pruned"
    code = main(["prune", *_args(tiny_dir, "--method", "trsp+heal", "--ratio", "0.25", "--output", str(out),
                                 "--no-mlflow", "--set", f"checkpoint_dir={tmp_path / 'ckpt'}")])
    assert code == 0
    manifest = json.loads((out / "trsp_ray.json").read_text())
    metrics = manifest["metrics"]
    assert manifest["method"] == "trsp+heal" and metrics["heal_steps"] == 4 and metrics["weight_tokens"] == 4 * 2 * 32
    assert "stage2_steps" not in metrics and metrics["stage1_rounds_computed"] == 2
    # stage 1 runs before apply_method's clock; the selection's time includes it (issue 20)
    assert metrics["select_seconds"] >= metrics["stage1_seconds"] > 0.1
    assert metrics["seconds"] >= metrics["select_seconds"] + metrics["heal_seconds"] - 1e-6
    # the kept layers were trained: the first kept layer's weights differ from the original's
    first_kept = metrics["kept_layers"][0]
    original = load_file(str(tiny_dir / "model" / "model.safetensors"))
    pruned = load_file(str(out / "model.safetensors"))
    key = "model.layers.{}.mlp.down_proj.weight"
    assert not torch.equal(pruned[key.format(0)], original[key.format(first_kept)])


def test_default_prune_is_shortgpt_selection_compensation_then_a_heal_with_stage2s_budget(tiny_dir, tmp_path):
    """The default method (shortgpt+comp+heal, the best pipeline at equal total compute) drops the
    layers whose input and output are most alike, computed here from transformers' own hidden
    states on the same calibration windows, runs no stage 1, folds the norm-weighted least-squares
    compensation with no compensation setting given, and heals for stage2.steps batches."""
    import torch
    from transformers import AutoModelForCausalLM

    from trsp_ray.run.methods import _windows, shortgpt_windows
    from trsp_ray.run.workbench import prepare

    cfg = load_config(None, [])
    assert cfg.method == "shortgpt+comp+heal" and cfg.compensation.method == "auto"  # the method decides: lstsq
    out = tmp_path / "pruned"
    code = main(["prune", *_args(tiny_dir, "--ratio", "0.25", "--output", str(out), "--no-mlflow",
                                 "--set", f"checkpoint_dir={tmp_path / 'ckpt'}")])
    assert code == 0
    manifest = json.loads((out / "trsp_ray.json").read_text())
    metrics = manifest["metrics"]
    assert manifest["method"] == "shortgpt+comp+heal" and metrics["heal_steps"] == 4
    assert (metrics["compensation"], metrics["compensation_weighting"]) == ("lstsq", "norm")
    # compensation.windows 0: 28 tokens per column of the hidden size 64 = 56 windows of data.seqlen 32
    assert metrics["compensation_tokens"] == 56 * 32
    assert manifest["config"]["compensation"]["method"] == "lstsq"  # the config recorded is the one that ran
    assert metrics["weight_tokens"] == 4 * 2 * 32 and "stage1_rounds_computed" not in metrics
    bench = prepare(load_config(None, [f"model={tiny_dir / 'model'}", f"data.calib_text={tiny_dir / 'calib.txt'}",
                                       f"data.eval_text={tiny_dir / 'eval.txt'}", *SMALL]))
    windows = torch.cat(_windows(bench, shortgpt_windows(bench.cfg, bench.n_drop())))
    assert windows.shape[0] == 2  # baselines.calib_windows
    model = AutoModelForCausalLM.from_pretrained(tiny_dir / "model").eval()
    with torch.no_grad():
        hidden = model(input_ids=windows, output_hidden_states=True).hidden_states
    # layer i maps hidden[i] to hidden[i + 1]; the last entry is after the final norm, and the last
    # layer is protected (gates.protect_tail) anyway, as is the first (protect_head)
    sims = {i: torch.nn.functional.cosine_similarity(hidden[i], hidden[i + 1], dim=-1).mean().item()
            for i in range(1, 7)}
    expected = sorted(sims, key=lambda i: -sims[i])[:2]
    assert sorted(manifest["dropped_layers"]) == sorted(expected)
