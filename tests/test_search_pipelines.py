"""The search searches pipelines (issue 32 item 4): `method` and any config key are dimensions, a key
acting in only some pipelines is dropped from the others and their duplicates merged, a compute budget
gives every trial the same total compute within one heal step (and is refused before any trial when a
selection alone exceeds it), selections are shared through the store, and the objective is the
calibration mixture's held-out tail."""

import json
import math
from pathlib import Path

import pytest

from trsp_ray.common.errors import TrspError
from trsp_ray.config.run_config import load_config
from trsp_ray.search.space import parse_space

PIPELINES = ["shortgpt+heal", "tail+heal", "trsp+heal"]
# 8 layers, ratio 0.25: 2 dropped. A heal step is 3 x 2 x 32 = 192 dense-forward tokens; Block Influence
# scores stage 1's 3 x 64 tokens (192); tail costs nothing; stage 1's gate training 2 x 64 x 2 + 64 x 2 x 7/8
SMALL = ["data.seqlen=32", "data.batch_size=2", "data.eval_seqlen=64", "data.eval_max_windows=2",
         "stage1.first_round_steps=2", "stage1.steps_per_round=1", "stage1.refine=0", "stage1.probe=0", "threads=1"]
STEP = 3 * 2 * 32


@pytest.fixture(scope="module")
def config_dir(tmp_path_factory):
    from trsp_ray.models.tiny import tiny_config

    path = tmp_path_factory.mktemp("cfg")
    tiny_config("llama", layers=8).save_pretrained(path)
    return str(path)


def _plan_base(config_dir, *extra):
    return load_config(overrides=[f"model={config_dir}", "method=trsp+heal", *SMALL, *extra])


def heal_lr_key() -> str:
    """The config key a heal method's learning rate is read from (methods.method_heal)."""
    from trsp_ray.run.methods import method_heal

    return "stage2.lr" if method_heal(load_config(overrides=["method=shortgpt+heal", "stage2.lr=0.123"])).lr == 0.123 \
        else "heal.lr"


def test_method_and_keys_of_any_section_are_dimensions(config_dir):
    from trsp_ray.search.run import plan_trials
    from trsp_ray.search.space import searchable

    assert all(searchable(k) for k in ("method", "heal.trainable", "compensation.windows", "data.batch_size",
                                       "heal.compute_budget", "baselines.sleb_windows"))
    assert not any(searchable(k) for k in ("model", "tracking.enabled", "distributed.workers", "heal.nope"))
    space = parse_space({"params": {"method": ["shortgpt+heal", "shortgpt+comp+heal", "tail+heal"],
                                    "compensation.windows": [48, 64]}})
    plan = plan_trials(_plan_base(config_dir), space)
    # the fit's windows act only where a fit runs: 2 fitted trials + one each of the plain heals
    assert [p["method"] for p in plan.points] == ["shortgpt+heal", "shortgpt+comp+heal", "shortgpt+comp+heal",
                                                  "tail+heal"]
    assert plan.ignored[0] == {"compensation.windows": 48} and len(plan.merged) == 2 and plan.n_drop == {}
    with pytest.raises(TrspError, match="method='nope' is not valid") as info:
        plan_trials(_plan_base(config_dir), parse_space({"params": {"method": ["tail+heal", "nope"]}}))
    assert "\n" not in str(info.value)


def test_a_key_acting_in_some_pipelines_is_dropped_from_the_others(config_dir):
    from trsp_ray.search.run import plan_trials

    lr = heal_lr_key()
    space = parse_space({"params": {"method": PIPELINES, lr: [1e-4, 3e-4], "stage1.lambda1": [1e-3, 5e-3]}})
    plan = plan_trials(_plan_base(config_dir, "heal.compute_budget=3000"), space)
    # 12 grid points: lambda1 acts only in trsp+heal, so the 8 baseline points are 4 trials
    assert len(plan.points) == 8 and len(plan.merged) == 4
    baseline = [(p, i) for p, i in zip(plan.points, plan.ignored) if p["method"] != "trsp+heal"]
    assert all("stage1.lambda1" not in p and i == {"stage1.lambda1": 1e-3} for p, i in baseline)
    assert len(plan.n_drop) == 2  # one stage 1 per lambda1
    with pytest.raises(TrspError, match="'stage1.lambda1' changes nothing in the searched pipeline.s. "
                                        "shortgpt.heal, tail.heal;"):
        plan_trials(_plan_base(config_dir), parse_space({"params": {"method": PIPELINES[:2],
                                                                    "stage1.lambda1": [1e-3, 5e-3]}}))
    # under a budget the heal's steps are the budget's: stage2.steps is a dimension that changes nothing
    with pytest.raises(TrspError, match="'stage2.steps' changes nothing"):
        plan_trials(_plan_base(config_dir, "heal.compute_budget=3000"),
                    parse_space({"params": {"method": PIPELINES, "stage2.steps": [4, 8]}}))


def test_a_grid_point_its_pipeline_refuses_is_left_out_and_recorded(config_dir):
    from trsp_ray.search.run import plan_trials

    try:
        load_config(overrides=["heal.trainable=map"])
    except TrspError:
        pytest.skip("no map heal recipe in this tree")
    space = parse_space({"params": {"method": ["shortgpt+heal", "shortgpt+comp+heal"],
                                    "heal.trainable": ["all", "map"]}})
    plan = plan_trials(_plan_base(config_dir), space)
    # the map recipe trains the fold's maps: without a fit (shortgpt+heal) the config refuses it
    assert plan.points == [{"method": "shortgpt+heal", "heal.trainable": "all"},
                           {"method": "shortgpt+comp+heal", "heal.trainable": "all"},
                           {"method": "shortgpt+comp+heal", "heal.trainable": "map"}]
    assert [p for p, _ in plan.refused] == [{"method": "shortgpt+heal", "heal.trainable": "map"}]
    with pytest.raises(TrspError, match="every search point is refused by its pipeline") as info:
        plan_trials(_plan_base(config_dir), parse_space({"params": {"method": ["shortgpt+heal", "tail+heal"],
                                                                    "heal.trainable": ["map"]}}))
    assert "\n" not in str(info.value)


def test_optuna_refuses_a_key_that_acts_in_only_some_pipelines(config_dir):
    pytest.importorskip("optuna")
    from trsp_ray.search.run import plan_trials

    space = parse_space({"algorithm": "optuna", "num_samples": 2,
                         "params": {"method": PIPELINES, "stage1.lambda1": {"loguniform": [1e-4, 1e-2]}}})
    with pytest.raises(TrspError, match="changes nothing in shortgpt.heal, tail.heal; algorithm=optuna"):
        plan_trials(_plan_base(config_dir), space)


@pytest.mark.parametrize("budget, refused", [(300, "shortgpt+heal"), (500, "trsp+heal")])
def test_a_budget_a_selection_alone_exceeds_fails_before_any_trial(config_dir, tmp_path, monkeypatch, budget,
                                                                    refused):
    from trsp_ray.search import run

    monkeypatch.setattr(run, "_run_tune", lambda *a, **k: pytest.fail("a trial started"))
    monkeypatch.setattr(run.ray_session, "connect", lambda *a, **k: pytest.fail("Ray started"))
    # Block Influence costs 192 and TRSP's gates at least 368: 300 leaves shortgpt no heal step, 500 TRSP none
    base = _plan_base(config_dir, f"heal.compute_budget={budget}")
    with pytest.raises(TrspError, match=f"cannot meet {refused.replace('+', '.')}: its selection costs") as info:
        run.run_search(base, parse_space({"params": {"method": PIPELINES}}),
                       run.SearchOptions(search_dir=str(tmp_path)))
    assert "\n" not in str(info.value) and not (tmp_path / "events.jsonl").exists()
    with pytest.raises(TrspError, match="does not heal"):
        run.plan_trials(base, parse_space({"params": {"method": ["tail+heal", "shortgpt"]}}))


def test_the_compute_budget_flag_reaches_every_trial(config_dir):
    import argparse

    from trsp_ray.search.cli import register, search_config

    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    args = parser.parse_args(["search", "--model", config_dir, "--compute-budget", "3000", "--space",
                              "method=shortgpt+heal,tail+heal,trsp+heal"])
    cfg, space = search_config(args)
    assert cfg.heal.compute_budget == 3000 and space.dims[0].values == tuple(PIPELINES)


def test_heal_steps_report_the_validation_loss_to_asha(monkeypatch):
    from trsp_ray.search import trial

    monkeypatch.setattr(trial, "validation_loss", lambda bench, model, windows: 2.0)
    reports, curve = [], []
    on_metrics = trial._stage2_reporter(None, ["model"], every=3, steps=8, windows=2, report=reports.append,
                                        curve=curve)
    for step in range(1, 9):
        on_metrics({"heal/ce": 3.0 - 0.1 * step}, step)
    on_metrics({"select/ignored": 1.0}, 9)
    assert [r["stage2_step"] for r in reports] == [3, 6, 8] and {r["phase"] for r in reports} == {"heal"}
    assert reports[0]["val_loss"] == 2.0 and reports[0]["stage2_ce"] == pytest.approx(2.7)


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    """The tiny workspace, its calibration text cut into two sources: the calibration is a mixture."""
    from trsp_ray.models.tiny import tiny_workspace

    root = tiny_workspace(tmp_path_factory.mktemp("pipelines"), layers=8, calib_chars=60000, eval_chars=8000)
    text = (root / "calib.txt").read_text()
    (root / "a.txt").write_text(text[: len(text) // 2])
    (root / "b.txt").write_text(text[len(text) // 2:])
    return root


def _mix(root: Path) -> str:
    return f"{root / 'a.txt'}:1,{root / 'b.txt'}:1"


def _independent_val_ppl(model_dir: str, *, root: Path, windows: int) -> tuple[float, set]:
    """exp(mean NLL) of an exported model over the first `windows` 64-token windows of the mixture's
    held-out tail, with plain transformers; and which sources the tail's chunks come from."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from trsp_ray.data import calibration
    from trsp_ray.data.perplexity import bos_token

    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    tok = AutoTokenizer.from_pretrained(model_dir)
    bos = bos_token(tok)
    cal = calibration.load(tok, calib_text=None, calib_mix=_mix(root), seqlen=32, bos=bos)
    sources = {}
    for name in ("a", "b"):  # a source's chunks, as the mixture cuts them
        ids = calibration.encode_cached(tok, (root / f"{name}.txt").read_text()).tolist()
        sources[name] = {tuple(ids[i:i + cal.chunk]) for i in range(0, len(ids) - cal.chunk + 1, cal.chunk)}
    tail = cal.val_ids.view(-1, cal.chunk).tolist()
    seen = {name for row in tail for name, chunks in sources.items() if tuple(row) in chunks}
    body = cal.chunk  # a window is one chunk of the tail: one source's text (issue 49)
    nll, count = 0.0, 0
    with torch.no_grad():
        for w in range(windows):
            ids = cal.val_ids[w * body:(w + 1) * body]
            ids = torch.cat([torch.tensor([bos]), ids]) if bos is not None else ids
            logits = model(input_ids=ids[None]).logits[0].float()
            nll += torch.nn.functional.cross_entropy(logits[:-1], ids[1:], reduction="sum").item()
            count += ids.numel() - 1
    return math.exp(nll / count), seen


@pytest.mark.ray
def test_pipelines_at_one_budget_share_selections_and_score_the_calibration_tail(assets, tmp_path, private_ray):
    from mlflow.tracking import MlflowClient

    from trsp_ray.search.cache import RunLog
    from trsp_ray.search.run import SearchOptions, run_search

    private_ray(num_cpus=2)
    budget, lr = 3000, heal_lr_key()
    base = load_config(overrides=[f"model={assets / 'model'}", f"data.calib_mix={_mix(assets)}",
                                  f"data.eval_text={assets / 'eval.txt'}", f"heal.compute_budget={budget}",
                                  f"tracking.tracking_uri=sqlite:///{tmp_path / 'mlflow.db'}", "method=trsp+heal",
                                  *SMALL])
    space = parse_space({"params": {"method": PIPELINES, lr: [1e-4, 3e-4]}})
    opts = SearchOptions(search_dir=str(tmp_path / "search"), name="pipelines", asha=False, val_windows=2)
    summary = run_search(base, space, opts)
    records = [json.loads(f.read_text()) for f in sorted((tmp_path / "search" / "trials").glob("*.json"))]
    assert summary["trials_run"] == 6 and all(r["status"] == "finished" for r in records), summary

    # equal total compute within one heal step: each total in (budget - step, budget]
    totals = {r["method"]: [] for r in records}
    for r in records:
        c = r["compute"]
        assert c["total"] == pytest.approx(c["select"] + c["fit"] + c["heal"])
        assert c["heal"] == 3 * c["heal_steps"] * 2 * 32
        assert budget - STEP < c["total"] <= budget, (r["method"], c)
        totals[r["method"]].append(c)
    assert max(r["compute"]["total"] for r in records) - min(r["compute"]["total"] for r in records) < STEP
    # the budget, not a fixed step count, set the heals: tail (free) heals longest, TRSP (stage 1) least
    steps = {m: cs[0]["heal_steps"] for m, cs in totals.items()}
    assert steps == {"tail+heal": 15, "shortgpt+heal": 14, "trsp+heal": 13}, totals

    # each selection computed once, reused by the trial with the other learning rate
    events = RunLog(tmp_path / "search").read(invocation=summary["invocation"])
    computed = sorted(e["selector"] for e in events if e["event"] == "selection_computed")
    assert computed == ["shortgpt", "tail"] and summary["selection_reused"] == 2
    assert (summary["stage1_computed"], summary["stage1_reused"]) == (1, 1)
    assert len({tuple(r["drop"]) for r in records if r["method"] == "shortgpt+heal"}) == 1

    # the objective: the mixture's held-out tail, recomputed on one trial's export with plain transformers
    one = next(r for r in records if r["method"] == "shortgpt+heal")
    ppl, seen = _independent_val_ppl(one["model_dir"], root=assets, windows=one["objective"]["windows"])
    assert one["val_ppl"] == pytest.approx(ppl, rel=1e-4) and seen == {"a", "b"}
    assert one["heldout_ppl"] != pytest.approx(one["val_ppl"], rel=1e-3)  # eval.txt is scored, not tuned on

    client = MlflowClient(tracking_uri=base.tracking.tracking_uri)
    assert {"pareto.png", "ranking.json"} <= {a.path for a in client.list_artifacts(summary["parent_run"])}
    assert summary["model_version"] is not None
    best = min(records, key=lambda r: r["val_ppl"])
    assert summary["best_trial"] == best["trial_key"]
    # every trial scored on the same windows: the ranking pairs each with the best
    ranking = json.loads((tmp_path / "search" / "ranking.json").read_text())
    assert len(ranking) == 6 and ranking[0]["trials"] == [best["trial_key"]]
    assert all(r["se"] is not None and r["se"] > 0 for r in ranking[1:])
    assert summary["tied_with_best"] == [k for r in ranking[1:] if abs(r["diff"]) <= 2 * r["se"] for k in r["trials"]]


def test_selector_fit_and_heal_recipe_are_dimensions_that_compose_the_pipeline(config_dir):
    """--space selector=... --space fit=... --space heal=...: each grid point runs the pipeline its parts
    compose (registry.name_of); a combination no pipeline spells (a map heal without a fit) is left out
    and recorded, not fatal."""
    from trsp_ray.search.run import plan_trials
    from trsp_ray.search.space import apply_point

    space = parse_space({"params": {"selector": ["shortgpt", "tail"], "fit": ["none", "comp", "cos"],
                                    "heal": ["all", "map"]}})
    plan = plan_trials(_plan_base(config_dir), space)
    base = _plan_base(config_dir).to_dict()
    methods = [apply_point(base, p)["method"] for p in plan.points]
    assert methods == ["shortgpt+heal", "shortgpt+comp+heal", "shortgpt+comp+heal.map", "shortgpt+cos+heal",
                       "shortgpt+cos+heal.map", "tail+heal", "tail+comp+heal", "tail+comp+heal.map",
                       "tail+cos+heal", "tail+cos+heal.map"]
    assert sorted(apply_point(base, p)["method"] for p, _ in plan.refused) == ["shortgpt+heal.map", "tail+heal.map"]
    # a part the point leaves out comes from the base method (trsp+heal here)
    assert apply_point(base, {"fit": "cos"})["method"] == "trsp+cos+heal"


def test_a_stopped_trial_records_its_pipeline_and_the_step_asha_stopped_it_at(tmp_path, config_dir):
    """A trial ASHA stopped has a partial heal: its record names the pipeline its point composed and the
    heal step its PPL was measured at, so a table never reads it as a finished trial's."""
    from types import SimpleNamespace

    from trsp_ray.search.run import _collect

    base = _plan_base(config_dir).to_dict()
    result = SimpleNamespace(config={"point": {"selector": "tail", "fit": "cos", "heal": "tail"}}, error=None,
                             metrics={"val_loss": 4.0, "val_ppl": math.exp(4.0), "stage2_step": 6})
    (record,) = _collect([result], tmp_path, base)
    assert (record["status"], record["method"], record["stopped_at_step"]) == ("stopped", "tail+cos+heal.tail", 6)
    assert json.loads(next((tmp_path / "trials").glob("*.json")).read_text())["stopped_at_step"] == 6


def test_a_search_refuses_a_selection_by_recovery_before_any_trial(config_dir):
    """Issue 50: a recover pipeline runs its own Ray Tune trials; as a search trial it would start
    Tune inside Tune. The plan refuses it in one line, and keeps the pipelines it auditions."""
    from trsp_ray.search.run import plan_trials

    with pytest.raises(TrspError, match="cannot be a search trial") as info:
        plan_trials(_plan_base(config_dir), parse_space({"params": {"method": ["tail+heal", "recover+comp+heal"]}}))
    assert "\n" not in str(info.value) and "method=recover+comp+heal" in str(info.value)
    plan = plan_trials(_plan_base(config_dir), parse_space({"params": {"method": ["tail+heal", "shortgpt+heal"]}}))
    assert [p["method"] for p in plan.points] == ["tail+heal", "shortgpt+heal"]
