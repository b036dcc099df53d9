"""Search space parsing, stage-1 planning, the stage-1 cache and the run log: fast, no Ray."""

import json

import pytest

from trsp_ray.common.errors import TrspError
from trsp_ray.config.run_config import load_config
from trsp_ray.method.stage1 import Stage1Result
from trsp_ray.run.stage1_store import Stage1Store, stage1_key
from trsp_ray.search.cache import RunLog
from trsp_ray.search.space import grid_points, parse_space, sample_points, trial_key

GRID = {"params": {"ratio": [0.125, 0.25, 0.375], "stage1.lambda1": [1e-3, 5e-3], "stage2.lambda2": [1e-3]}}


@pytest.fixture(scope="module")
def config_dir(tmp_path_factory):
    """An 8-layer Llama config.json alone: enough for every check made before a trial starts."""
    from trsp_ray.models.tiny import tiny_config

    path = tmp_path_factory.mktemp("cfg")
    tiny_config("llama", layers=8).save_pretrained(path)
    return str(path)


def test_grid_points_cover_the_product_in_a_stable_order():
    points = grid_points(parse_space(GRID))
    assert len(points) == 6
    assert points[0] == {"ratio": 0.125, "stage1.lambda1": 1e-3, "stage2.lambda2": 1e-3}
    assert len({json.dumps(p, sort_keys=True) for p in points}) == 6


def test_random_points_repeat_with_the_seed():
    space = parse_space({"algorithm": "random", "num_samples": 4, "seed": 3,
                         "params": {"stage1.lambda1": {"loguniform": [1e-4, 1e-2]}, "ratio": [0.25, 0.375]}})
    a, b = sample_points(space), sample_points(space)
    assert a == b and len(a) == 4
    assert all(1e-4 <= p["stage1.lambda1"] <= 1e-2 for p in a)


@pytest.mark.parametrize("spec, message", [
    ({"params": {}}, "search space is empty"),
    ({"params": {"stage1.lambda1": []}}, "has no values"),
    ({"params": {"stage1.lambda1": [1e-3, 1e-3]}}, "lists a value twice"),
    ({"params": {"model": ["a"]}}, "is not searchable"),
    ({"params": {"stage1.lambda1": {"uniform": [0.1, 0.01]}}}, "is empty; low must be < high"),
    ({"params": {"stage1.lambda1": {"loguniform": [0.0, 0.01]}}}, "loguniform needs low > 0"),
    ({"params": {"stage1.lambda1": {"uniform": [0.0, 0.01]}}}, "grid search cannot sample"),
    ({"algorithm": "random", "objectives": ["val_ppl", "kept_parameters"], "params": {"ratio": [0.25]}},
     "needs algorithm=optuna"),
    ({"algorithm": "annealing", "params": {"ratio": [0.25]}}, "is not valid"),
    ({"params": {"ratio": [0.25]}, "trials": 3}, "unknown search setting"),
])
def test_bad_spaces_fail_on_one_line(spec, message):
    with pytest.raises(TrspError, match=message) as info:
        parse_space(spec)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("ratios, message", [([0.01, 0.25], "drops round"), ([0.25, 0.9], "only 6 are candidates")])
def test_ratios_out_of_range_fail_before_any_trial(config_dir, tmp_path, monkeypatch, ratios, message):
    from trsp_ray.search import run

    monkeypatch.setattr(run, "_run_tune", lambda *a, **k: pytest.fail("a trial started"))
    base = load_config(overrides=[f"model={config_dir}", "method=trsp"])
    space = parse_space({"params": {"ratio": ratios}})
    with pytest.raises(TrspError, match=message):
        run.run_search(base, space, run.SearchOptions(search_dir=str(tmp_path)))
    assert not (tmp_path / "events.jsonl").exists()


def test_bad_values_and_keys_that_act_nowhere_fail_before_any_trial(config_dir):
    from trsp_ray.search.run import plan_trials

    base = load_config(overrides=[f"model={config_dir}", "method=trsp"])
    with pytest.raises(TrspError, match=r"search point .*stage1.lambda1=-1"):
        plan_trials(base, parse_space({"params": {"stage1.lambda1": [1e-3, -1]}}))
    # Block Influence reads no lambda1: a dimension that would make trials differing in nothing
    with pytest.raises(TrspError, match="'stage1.lambda1' changes nothing in the searched pipeline.s. shortgpt;"):
        plan_trials(load_config(overrides=[f"model={config_dir}", "method=shortgpt"]), parse_space(GRID))
    # trsp+heal heals after stage 1: lambda2 would be a dimension that changes nothing
    heal = load_config(overrides=[f"model={config_dir}", "method=trsp+heal"])
    with pytest.raises(TrspError, match="'stage2.lambda2' changes nothing in the searched pipeline.s. trsp\\+heal"):
        plan_trials(heal, parse_space({"params": {"ratio": [0.25], "stage2.lambda2": [1e-3, 1e-2]}}))
    assert len(plan_trials(heal, parse_space({"params": {"ratio": [0.25, 0.375]}})).points) == 2


def test_stage1_plan_shares_one_computation_per_lambda1_at_the_largest_ratio(config_dir):
    from trsp_ray.search.run import plan_trials

    plan = plan_trials(load_config(overrides=[f"model={config_dir}", "method=trsp"]), parse_space(GRID))
    assert plan.num_layers == 8 and len(plan.points) == 6 and not plan.merged
    assert sorted(plan.n_drop.values()) == [3, 3]  # two lambda1 values, each planned for round(0.375 * 8)


def test_keys_ignore_what_does_not_change_the_result():
    base = load_config().to_dict()
    other_ratio = {**base, "ratio": 0.5}
    assert stage1_key(base, "d") == stage1_key(other_ratio, "d")
    assert stage1_key(base, "d") != stage1_key(base, "other data")
    assert stage1_key(base, "d") != stage1_key({**base, "stage1": {**base["stage1"], "lambda1": 1.0}}, "d")
    assert stage1_key(base, "d") != stage1_key({**base, "dtype": "bf16"}, "d")
    held_out = {**base, "data": {**base["data"], "eval_seqlen": 64, "eval_max_windows": 2}}
    assert stage1_key(base, "d") == stage1_key(held_out, "d")  # stage 1 never reads the held-out settings
    assert trial_key(base) != trial_key(other_ratio)
    assert trial_key(base) == trial_key({**base, "tracking": {"enabled": False}})


def test_store_serves_prefixes_only_up_to_the_computed_length(tmp_path):
    store = Stage1Store(tmp_path)
    result = Stage1Result(drop_order=[4, 2, 5], round1_ranking=[4, 5, 2, 1], gate_history=[[1.0, 0.5]],
                          round_ends=[1, 2, 3], steps=3, tokens=30)
    assert store.get("k", 1) is None
    computed = []
    compute = lambda n: computed.append(n) or result
    assert store.obtain("k", need=2, plan=3, compute=compute, content={}) == (result, True)
    assert store.get("k", 3).drop_order == [4, 2, 5] and computed == [3]  # computed once, for the plan
    assert store.obtain("k", need=1, compute=compute, content={})[1] is False and computed == [3]
    assert store.get("k", 4) is None  # a larger ratio than was computed needs a new stage 1


def test_run_log_counts_events_per_invocation(tmp_path):
    RunLog(tmp_path, invocation="a").write("stage1_computed", key="k")
    RunLog(tmp_path, invocation="b").write("stage1_computed", key="k")
    log = RunLog(tmp_path)
    assert log.count("stage1_computed") == 2
    assert log.count("stage1_computed", invocation="a") == 1


def test_cli_space_flags(tmp_path):
    from trsp_ray.search.cli import parse_space_args

    spec = parse_space_args(["ratio=0.25,0.375", "stage1.lambda1=loguniform:1e-4:1e-2"], algorithm="optuna",
                            num_samples=4, seed=None, objectives="val_ppl,kept_parameters", space_file=None)
    assert spec["params"] == {"ratio": [0.25, 0.375], "stage1.lambda1": {"loguniform": [1e-4, 1e-2]}}
    assert spec["objectives"] == ["val_ppl", "kept_parameters"]
    with pytest.raises(TrspError, match="a range is"):
        parse_space_args(["stage1.lambda1=uniform:1"], algorithm=None, num_samples=None, seed=None,
                         objectives=None, space_file=None)


def test_the_compensation_choice_is_searchable_and_shares_stage1(config_dir):
    """Issue 21 item 4: a search over compensation.method (and its ridge) gives each trial its form,
    validated like any point, while the trials share one stage 1 (the form acts after selection)."""
    from trsp_ray.search.run import plan_trials
    from trsp_ray.search.space import apply_point

    space = parse_space({"params": {"compensation.method": ["none", "scalar", "lstsq"],
                                    "compensation.ridge": [1e-4, 1e-2]}})
    base = load_config(overrides=[f"model={config_dir}", "method=trsp-no-stage2"])
    plan = plan_trials(base, space)
    # the ridge acts only in least squares: the none and scalar trials run once each, ridge dropped
    assert len(plan.points) == 4 and len(plan.merged) == 2 and len(plan.n_drop) == 1  # one stage 1 for all
    assert plan.ignored == [{"compensation.ridge": 1e-4}, {"compensation.ridge": 1e-4}, {}, {}]
    configs = [apply_point(base.to_dict(), p) for p in plan.points]
    assert {c["compensation"]["method"] for c in configs} == {"none", "scalar", "lstsq"}
    assert len({stage1_key(c, "d") for c in configs}) == 1 and len({trial_key(c) for c in configs}) == 4
    with pytest.raises(TrspError, match="compensation.method='full' is not valid"):
        plan_trials(base, parse_space({"params": {"compensation.method": ["scalar", "full"]}}))
