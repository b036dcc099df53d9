"""Issue 18: a total compute budget for `prune` (heal.compute_budget, dense-forward tokens): the heal
of a heal method gets what the budget leaves after the planned selection, and a budget the
selection cannot meet is refused in one line before any model is loaded."""

import json

import pytest
from test_first_hour import _one_error_line, no_work  # noqa: F401
from test_pipeline import SMALL, _args, tiny_dir  # noqa: F401

from trsp_ray.cli import main
from trsp_ray.config import registry

# SMALL: ShortGPT scores baselines.calib_windows=2 windows of 32 tokens; a heal step is 2 x 32 tokens
# of a full heal (3 dense-forward tokens each); the default's compensation is planned at one dense pass
# over its 4 x 32 calibration tokens plus the float64 sums and solves of 2 blocks (8 layers, ratio 0.25)
SELECT, PASSES, STEP = 2 * 32, 4 * 32, 3 * 2 * 32
FOUR = ["--set", "compensation.windows=4", "--set", "compensation.min_tokens_per_column=1"]  # 2 per column


@pytest.fixture(scope="module")
def comp(tiny_dir):  # noqa: F811
    """The planned cost of the default's fit on the tiny model: its pass and its float64 solve."""
    from trsp_ray.plan import compute

    solve = compute.fit_solve_cost(compute.model_shape(str(tiny_dir / "model")), tokens=PASSES, blocks=2)
    assert 0 < solve < PASSES
    return PASSES + solve


def test_the_budget_buys_the_heal_steps_the_selection_and_compensation_leave(tiny_dir, tmp_path, comp):  # noqa: F811
    from trsp_ray.plan.compute import fit_spent, total_cost

    out = tmp_path / "pruned"
    budget = int(SELECT + comp + 5 * STEP + STEP - 1)  # one token short of a sixth step
    code = main(["prune", *_args(tiny_dir, "--ratio", "0.25", "--output", str(out), "--no-mlflow", *FOUR,
                                 "--compute-budget", str(budget), "--set", f"checkpoint_dir={tmp_path / 'ckpt'}")])
    assert code == 0
    manifest = json.loads((out / "trsp_ray.json").read_text())
    metrics = manifest["metrics"]
    assert manifest["method"] == "shortgpt+comp+heal" and metrics["heal_steps"] == 5  # stage2.steps=4 is replaced
    assert metrics["select_cost"] == SELECT and metrics["weight_tokens"] == 5 * 2 * 32
    assert metrics["heal_cost"] == 3 * metrics["weight_tokens"] and metrics["compensation_solve_cost"] > 0
    assert 0 < fit_spent(metrics) <= comp  # the plan bounds what the fit spends
    assert total_cost(metrics) <= budget  # the fit spent at most its plan (one block of two here)
    assert manifest["config"]["heal"]["compute_budget"] == budget


def test_without_the_compensation_the_same_budget_buys_more_heal(tiny_dir, tmp_path, comp):  # noqa: F811
    out = tmp_path / "pruned"
    budget = int(SELECT + comp + 5 * STEP + STEP - 1)
    code = main(["prune", *_args(tiny_dir, "--ratio", "0.25", "--output", str(out), "--no-mlflow", *FOUR,
                                 "--method", "shortgpt+heal", "--compute-budget", str(budget),
                                 "--set", f"checkpoint_dir={tmp_path / 'ckpt'}")])
    assert code == 0
    metrics = json.loads((out / "trsp_ray.json").read_text())["metrics"]
    # (budget - SELECT) // STEP: the compensation's planned cost and the 191 left over buy a sixth step
    assert metrics["heal_steps"] == 6 and "compensation_tokens" not in metrics


@pytest.mark.parametrize("argv,message", [
    ([*FOUR, "--compute-budget", str(SELECT + PASSES + STEP - 1)], f"one heal step {STEP}; raise it to at least "),
    (["--compute-budget", "1M", "--method", "trsp+heal"], "known only after it runs"),
    (["--compute-budget", "1M", "--method", "shortgpt"], "does not heal"),
])
def test_a_budget_that_cannot_be_met_is_one_line_before_any_work(tiny_dir, tmp_path, capsys, no_work,  # noqa: F811
                                                                  argv, message):
    code = main(["prune", *_args(tiny_dir, "--ratio", "0.25", "--output", str(tmp_path / "out"), "--no-mlflow",
                                 *argv)])
    assert code == 2
    line = _one_error_line(capsys, "trsp-ray")
    assert message in line, line
    assert not (tmp_path / "out").exists()


def test_a_budget_that_is_not_a_token_count_is_an_argparse_error(capsys):
    with pytest.raises(SystemExit) as done:
        main(["prune", "--compute-budget", "lots"])
    assert done.value.code == 2
    assert capsys.readouterr().err.strip().splitlines()[-1].endswith(
        "argument --compute-budget: 'lots' is not a token count; pass e.g. 200000, 200k or 1.5M")


def test_the_benchmark_refuses_a_prune_budget():
    from trsp_ray.benchmark.comparison import check_request
    from trsp_ray.common.errors import TrspError
    from trsp_ray.config.run_config import load_config

    with pytest.raises(TrspError, match="--budgets"):
        check_request(load_config(None, ["heal.compute_budget=1e6"]), ["dense"], 1, 0)


def test_the_planned_compensation_cost_bounds_what_the_compensation_spends():
    """Sequential least squares runs two passes per block: the bound counts every block a drop set
    of n_drop layers can have, so the budget is never overrun by the fit."""
    from trsp_ray.config.run_config import for_method, load_config
    from trsp_ray.method import compensation
    from trsp_ray.method.stage1 import n_drop_for
    from trsp_ray.plan.compute import fit_solve_cost, model_shape
    from trsp_ray.run.budget import planned_compensation_cost

    for activations in ("dense", "sequential"):
        cfg = load_config(None, ["ratio=0.25", "data.seqlen=32", "compensation.method=lstsq", "compensation.windows=4",
                                 f"compensation.activations={activations}"])
        bound = planned_compensation_cost(cfg, spec=registry.method(cfg.method), num_layers=12)
        for drop in ([1, 2, 3], [1, 3, 5], [8, 9, 10], [2, 6, 10]):  # 3 of 12 layers, 1 to 3 blocks
            spent = compensation.cost(drop=drop, num_layers=12, tokens=4 * 32, activations=activations)
            assert spent <= bound, (activations, drop, spent, bound)
    plain = load_config(None, ["method=shortgpt+heal"])
    assert planned_compensation_cost(plain, spec=registry.method(plain.method), num_layers=12) == 0.0
    default = for_method(load_config(None, ["data.seqlen=32", "compensation.windows=4"]))  # compensates
    solve = fit_solve_cost(model_shape(default.model), tokens=4 * 32, blocks=n_drop_for(default.ratio, 12))
    planned = planned_compensation_cost(default, spec=registry.method(default.method), num_layers=12)
    assert planned == pytest.approx(4 * 32 + solve) and solve > 0
