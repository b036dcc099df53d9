"""Issue 32 item 0: a pipeline is resolved once, where a run starts, into one object (pipeline.Pipeline)
that every path reads: its mapping (YAML) form, the decisions it carries, and the entry points that
start from it."""

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from trsp_ray.common.errors import TrspError
from trsp_ray.config import registry
from trsp_ray.config.run_config import load_config
from trsp_ray.models.tiny import tiny_workspace
from trsp_ray.run import pipeline

SMALL = ["data.seqlen=32", "data.eval_seqlen=64", "data.eval_max_windows=2", "threads=1", "tracking.enabled=false",
         "baselines.calib_windows=2", "stage2.steps=2", "ratio=0.34"]


@pytest.fixture(scope="module")
def ws(tmp_path_factory):
    return tiny_workspace(tmp_path_factory.mktemp("pipe") / "ws", layers=6, calib_chars=30000, eval_chars=8000)


def _overrides(ws, *more):
    return [f"model={ws / 'model'}", f"data.calib_text={ws / 'calib.txt'}", f"data.eval_text={ws / 'eval.txt'}",
            *SMALL, *more]


@pytest.mark.parametrize("spec, name", [
    ({"selector": "tail", "fit": "cosine", "heal": "tail"}, "tail+cos+heal.tail"),
    ({"selector": "shortgpt", "fit": "lstsq", "heal": True}, "shortgpt+comp+heal"),
    ({"selector": "angular", "fit": "comp", "heal": "map"}, "angular+comp+heal.map"),
    ({"selector": "sleb", "heal": "lora"}, "sleb+heal.lora"),
    ({"selector": "shortgpt"}, "shortgpt"),
    ({"name": "trsp-oneshot"}, "trsp-oneshot"),
])
def test_the_mapping_form_reads_into_the_pipeline_name(spec, name):
    assert registry.name_of(spec) == name
    assert registry.method(name).name == name


@pytest.mark.parametrize("spec, says", [
    ({"selector": "magic"}, "selector='magic' is not valid"),
    ({"selector": "tail", "fit": "ridge"}, "fit='ridge' is not valid"),
    ({"selector": "tail", "heal": "map"}, "names no fit"),
    ({"selector": "tail", "steps": 3}, "unknown key(s) steps"),
    ({"heal": "all"}, "takes the keys selector"),
    (["tail"], "must be a YAML mapping"),
])
def test_a_bad_mapping_is_one_line_naming_it(spec, says):
    with pytest.raises(TrspError) as err:
        registry.name_of(spec)
    assert says in str(err.value) and "\n" not in str(err.value)


def test_a_config_file_may_give_the_pipeline_as_a_mapping(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("method:\n  selector: tail\n  fit: cos\n  heal: tail\nratio: 0.3\n")
    cfg = load_config(str(path))
    assert (cfg.method, cfg.ratio) == ("tail+cos+heal.tail", 0.3)


def test_prune_reads_a_pipeline_yaml_and_refuses_a_bad_one_on_one_line(ws, tmp_path):
    good, bad = tmp_path / "good.yaml", tmp_path / "bad.yaml"
    good.write_text("selector: tail\nfit: cos\nheal: tail\n")
    bad.write_text("selector: tail\nfit: magic\n")
    args = [sys.executable, "-m", "trsp_ray.cli", "prune", "--model", str(ws / "model"), "--calib-text",
            str(ws / "calib.txt"), "--eval-text", str(ws / "eval.txt"), "--no-mlflow", "--dry-run",
            "--set", "data.seqlen=32", "--set", "ratio=0.34"]
    done = subprocess.run([*args, "--method", str(good)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "pipeline tail+cos+heal.tail: selector tail, fit lstsq (cosine) on " in done.stdout
    refused = subprocess.run([*args, "--method", str(bad)], capture_output=True, text=True, timeout=300)
    last = refused.stderr.strip().splitlines()[-1]
    assert refused.returncode == 2 and "fit='magic' is not valid" in last, refused.stderr[-2000:]


def test_resolve_sizes_the_fit_and_splits_a_budget_within_one_heal_step(ws):
    """The resolved pipeline carries the fit's calibration sized from the hidden size (28 tokens per map
    column by default: ceil(28 x 64 / 32) = 56 windows on the tiny model) and the heal steps a compute
    budget buys after the selection's and the fit's planned cost (one pass and, for each of 2 blocks at
    most, the float64 sums and solve: compute.fit_solve_cost)."""
    from trsp_ray.plan import compute

    budget = 40000.0
    pipe = pipeline.resolve(load_config(overrides=_overrides(ws, f"heal.compute_budget={budget}")))
    c = pipe.cfg.compensation
    assert (pipe.name, pipe.fit, pipe.recipe, pipe.hidden, pipe.num_layers) == (
        "shortgpt+comp+heal", "lstsq (mse)", "all", 64, 6)
    assert c.windows == math.ceil(28 * 64 / 32) == 56
    split = pipe.compute()
    step = 3 * pipe.cfg.data.batch_size * 32
    solve = compute.fit_solve_cost(compute.model_shape(pipe.cfg.model), tokens=56 * 32, blocks=2)
    assert split["fit"] == pytest.approx(56 * 32 + solve) and solve > 0
    assert split["heal_steps"] == pipe.cfg.stage2.steps >= 1
    assert split["total"] == split["select"] + split["fit"] + split["heal_steps"] * step
    assert budget - step < split["total"] <= budget
    record = pipe.to_dict()
    assert (record["requested"], record["compute_total"]) == ("shortgpt+comp+heal", split["total"])
    json.dumps(record)  # plain values: the manifest and MLflow take it as it is


def test_a_family_no_fold_reaches_falls_back_once_and_says_why(ws, monkeypatch):
    from trsp_ray.models import families

    monkeypatch.setattr(families, "fold_refusal", lambda config: "a norm after down_proj")
    pipe = pipeline.resolve(load_config(overrides=_overrides(ws)))
    assert (pipe.requested, pipe.name, pipe.fit) == ("shortgpt+comp+heal", "shortgpt+heal", None)
    assert "a norm after down_proj" in pipe.fallback and "asked for shortgpt+comp+heal" in pipe.describe()
    # a fit asked for by name is never dropped: it is refused where it runs, not silently changed here
    named = pipeline.resolve(load_config(overrides=_overrides(ws, "compensation.method=lstsq")))
    assert (named.name, named.fallback) == ("shortgpt+comp+heal", None)


def test_every_entry_point_starts_from_the_resolved_pipeline(ws, monkeypatch, tmp_path):
    """driver.run (prune), the benchmark's rows and the plan call pipeline.resolve; the prune's manifest
    records the resolved pipeline. Fails if an entry point decides the pipeline on its own again."""
    from trsp_ray import driver
    from trsp_ray.benchmark import jobs

    calls = []
    real = pipeline.resolve
    monkeypatch.setattr(pipeline, "resolve", lambda cfg, **kw: calls.append(cfg.method) or real(cfg, **kw))
    out = tmp_path / "out"
    results = driver.run(load_config(overrides=_overrides(ws, "method=tail+cos+heal", f"output={out}")))
    assert calls == ["tail+cos+heal"]
    manifest = json.loads((out / "trsp_ray.json").read_text())
    assert manifest["metrics"]["pipeline"]["name"] == results["pipeline"]["name"] == "tail+cos+heal"
    assert manifest["metrics"]["pipeline"]["fit"] == "lstsq (cosine)"
    assert sorted(results["dropped_layers"]) == [3, 4]  # tail: the last two candidates before the final layer

    calls.clear()
    cfg = jobs.row_config(load_config(overrides=_overrides(ws)), registry.ROWS["shortgpt+cos+heal"])
    assert calls == ["shortgpt+cos+heal"] and (cfg.method, cfg.compensation.objective) == ("shortgpt+cos+heal",
                                                                                         "cosine")
    calls.clear()
    cfg = jobs.row_config(load_config(overrides=_overrides(ws)), registry.ROWS["shortgpt+heal"])
    assert calls == ["shortgpt+heal"] and cfg.compensation.method == "none"

    calls.clear()
    from trsp_ray import cli

    llama70b = str(Path(__file__).resolve().parents[1] / "cluster" / "models" / "llama-2-70b.json")
    assert cli.main(["plan", "--model-config", llama70b, "--workers", "16", "--gpu-memory-gb", "80",
                     "--activation-checkpointing", "--method", "tail+cos+heal.tail"]) == 0
    assert calls == ["tail+cos+heal.tail"]
