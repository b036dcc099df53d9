"""Evaluator (plain) and the Ray evaluation pool: numbers, streaming, retries, bad candidates, MLflow."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

import argparse
import json
from pathlib import Path

import pytest
import torch

from trsp_ray.common.errors import TrspError
from trsp_ray.evaluation.evaluator import EvalSettings, Evaluator, check_candidate, load_candidate
from trsp_ray.evaluation.speed import SpeedSettings

FAST_SPEED = SpeedSettings(prompt_len=16, gen_batch=1, gen_prompt_len=4, new_tokens=2, rounds=1)


def make_candidates(root: Path) -> dict[str, str]:
    """A tiny 4-layer Llama ("dense") and a copy with layer 2 removed ("pruned"), as exported dirs."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from trsp_ray.data.assets import smollm2_dir

    tok = AutoTokenizer.from_pretrained(smollm2_dir())
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2)
    model = LlamaForCausalLM(cfg).eval()
    paths = {"dense": root / "dense", "pruned": root / "pruned"}
    model.save_pretrained(paths["dense"])
    tok.save_pretrained(paths["dense"])
    kept = [0, 1, 3]
    model.model.layers = torch.nn.ModuleList(model.model.layers[i] for i in kept)
    for new, layer in enumerate(model.model.layers):
        layer.self_attn.layer_idx = new  # the KV cache indexes layers by position
    model.config.num_hidden_layers = len(kept)
    if getattr(model.config, "layer_types", None):
        model.config.layer_types = [model.config.layer_types[i] for i in kept]
    model.save_pretrained(paths["pruned"])
    tok.save_pretrained(paths["pruned"])
    (paths["pruned"] / "trsp_ray.json").write_text(json.dumps(
        {"method": "test", "dropped_layers": [2], "num_layers_original": 4, "num_layers_kept": 3}))
    return {k: str(v) for k, v in paths.items()}


@pytest.fixture(scope="module")
def candidates(tmp_path_factory):
    return make_candidates(tmp_path_factory.mktemp("cands"))


def broken_candidate(root: Path, like: str) -> str:
    """A directory that passes the cheap checks but whose weights file is garbage."""
    bad = root / "broken"
    bad.mkdir()
    for f in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        if (Path(like) / f).exists():
            (bad / f).write_bytes((Path(like) / f).read_bytes())
    (bad / "model.safetensors").write_bytes(b"not a safetensors file")
    return str(bad)


def test_bad_candidates_and_settings_fail_on_one_line(tmp_path, candidates):
    with pytest.raises(TrspError, match="is not a directory"):
        check_candidate(str(tmp_path / "nope"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(TrspError, match="has no config.json"):
        check_candidate(str(tmp_path / "empty"))
    with pytest.raises(TrspError, match=r"does not load: \w+"):
        load_candidate(broken_candidate(tmp_path, candidates["dense"]))
    for kwargs, msg in (({"limit": 0}, "limit=0"), ({"tasks": ("piqa", "nope")}, "unknown task 'nope'"),
                        ({"batch_size": 0}, "batch_size=0"), ({"dense": str(tmp_path / "x")}, "not a directory"),
                        ({"eval_text": str(tmp_path / "t.txt")}, "is not a file")):
        with pytest.raises(TrspError, match=msg) as info:
            EvalSettings(**kwargs)
        assert "\n" not in str(info.value)


def test_evaluator_measures_ppl_tasks_and_speed(candidates):
    from trsp_ray.data.domains import load_texts
    from trsp_ray.data.heldout import text_windows
    from trsp_ray.data.perplexity import nlls_of, ppl_of

    settings = EvalSettings(tasks=("piqa", "arc_easy"), limit=3, ppl_windows=2, ppl_seqlen=64,
                            speed=FAST_SPEED, dense=candidates["dense"])
    ev = Evaluator(EvalSettings.from_dict(settings.to_dict()).to_dict(), threads=1)
    result = ev.evaluate(candidates["pruned"])
    assert result["status"] == "ok" and result["layers"] == 3 and result["layers_original"] == 4
    assert result["manifest"]["dropped_layers"] == [2]
    model, tok = load_candidate(candidates["pruned"])
    held = text_windows(tok, load_texts(), seqlen=64, max_windows=2)  # two held-out articles
    assert held.clusters == 2
    expected = ppl_of(nlls_of(model, held.windows))
    assert result["ppl"] == pytest.approx(expected, rel=1e-6)
    assert result["ppl"] > 1000  # a random model: the number is real, not a placeholder
    assert set(result["tasks"]) == {"piqa", "arc_easy"}
    for scores in result["tasks"].values():
        assert scores["n"] == 3 and 0.0 <= scores["acc"] <= 1.0 and "acc_norm" in scores
        assert scores["acc"] * 3 == pytest.approx(round(scores["acc"] * 3))  # k of 3 items right
    speed = result["speed"]
    assert speed["ideal_speedup"] == pytest.approx(4 / 3) and speed["layers_kept"] == 3
    assert speed["prefill_speedup"] == pytest.approx(speed["dense_prefill_ms"] / speed["prefill_ms"])
    assert speed["tokens_per_s"] > 0 and speed["dense_tokens_per_s"] > 0


@pytest.mark.ray
def test_pool_streams_results_retries_and_reports_failures(tmp_path, candidates, private_ray):
    import mlflow

    from trsp_ray.evaluation.pool import ActorResources, evaluate_pool
    from trsp_ray.run.tracking import make_tracker

    broken = broken_candidate(tmp_path, candidates["dense"])
    models = [candidates["pruned"], str(tmp_path / "missing"), broken, candidates["dense"]]
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    tracker = make_tracker(tracking_uri=uri, experiment="pool-test")
    settings = EvalSettings(tasks=("piqa",), limit=2, ppl_windows=1, ppl_seqlen=32, speed=None)
    lines, streamed = [], []
    private_ray(num_cpus=2)
    with tracker.run("eval"):
        results = evaluate_pool(models, settings=settings, actors=2, resources=ActorResources(num_cpus=1),
                                tracker=tracker, log=lines.append, on_result=streamed.append)
    assert [r["status"] for r in results] == ["ok", "failed", "failed", "ok"]
    assert results[0]["layers"] == 3 and results[3]["layers"] == 4 and results[0]["ppl"] > 1000
    assert results[1]["attempts"] == 0 and "is not a directory" in results[1]["error"]  # before starting
    assert results[2]["attempts"] == 2 and "does not load" in results[2]["error"]  # retried once
    assert all("\n" not in r.get("error", "") for r in results if r["status"] == "failed")
    assert any("retrying" in line for line in lines) and len(streamed) == 4
    assert [line.split("]")[0] for line in lines if line.startswith("[")] == ["[1/4", "[2/4", "[3/4", "[4/4"]
    threads = {r["where"].split("(")[1] for r in results if r["status"] == "ok"}
    assert threads == {"1 threads)"}  # torch threads follow the actor's CPUs
    runs = mlflow.search_runs(experiment_names=["pool-test"], output_format="list")
    names = sorted(r.info.run_name for r in runs)
    assert names == sorted(["eval", "pruned", "missing", "broken", "dense"])  # one run per candidate
    pruned = next(r for r in runs if r.info.run_name == "pruned")
    assert pruned.data.metrics["ppl"] == pytest.approx(results[0]["ppl"])
    assert pruned.data.tags["status"] == "ok"


@pytest.mark.ray
def test_cli_eval_writes_tables_and_exit_code(tmp_path, candidates, capsys, own_ray_tmpdir):
    from trsp_ray.evaluation.cli import register

    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    out = tmp_path / "out"
    # a candidate whose weights do not load fails in its actor; a missing one is refused before the
    # pool starts (tests/test_first_hour.py)
    broken = broken_candidate(tmp_path, candidates["pruned"])
    args = parser.parse_args(["eval", "--models", candidates["pruned"], broken,
                              "--tasks", "boolq", "--limit", "2", "--actors", "1", "--ppl-windows", "1",
                              "--no-speed", "--out", str(out), "--tracking-uri", f"sqlite:///{tmp_path}/m.db",
                              "--placement-group", "--cpus-per-actor", "1"])
    assert args.func(args) == 1  # one candidate failed, the other finished (in a placement group)
    csv_text = (out / "results.csv").read_text()
    assert "boolq.acc" in csv_text and "does not load" in csv_text
    assert "pruned" in capsys.readouterr().out
    from trsp_ray.cli import main

    assert main(["eval", "--models", candidates["pruned"], "--limit", "0"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("trsp-ray: error: ") and "limit=0" in err[0], err


def test_unknown_stock_task_is_named_in_the_error(candidates):
    from trsp_ray.evaluation.harness import run_tasks

    model, tok = load_candidate(candidates["pruned"])
    with pytest.raises(TrspError, match="lm-eval does not know task.*lm_eval:no_such_task"):
        run_tasks(model, tok, tasks=["piqa", "lm_eval:no_such_task"], limit=1)
