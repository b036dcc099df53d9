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
        "argument --compute-budget: 'lots' is not a token count; pass e.g. 200000, 200k, 1.5M or 1B")


def test_a_budget_takes_the_suffixes_of_gpu_scale():
    from trsp_ray.cli import _tokens

    assert [_tokens(t) for t in ("70k", "4M", "1B", "1.5b", "16m", "300000")] == [7e4, 4e6, 1e9, 1.5e9, 16e6, 3e5]


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


@pytest.mark.parametrize("budget, objective", [(1e6, "kd"), (3e5, "ce"), (2e7, "kd")])
def test_a_budgets_selection_fit_teacher_and_heal_add_up_to_it(budget, objective):
    """budget.Budget, split once from the resolved pipeline: its parts add up to the budget within one
    heal step, the teacher's forward is one dense forward per heal token, and the heal's windows are
    the ones the heal stream reads."""
    from trsp_ray.config import registry
    from trsp_ray.config.run_config import load_config
    from trsp_ray.plan import compute
    from trsp_ray.run.pipeline import resolve

    cfg = load_config(None, [f"heal.compute_budget={budget}", f"recovery.objective={objective}",
                             "tracking.enabled=false"])
    pipe = resolve(cfg)
    b = pipe.budget
    assert b.total == budget and b.steps == pipe.cfg.stage2.steps
    assert (b.seqlen, b.batch) == compute.heal_shape(pipe.cfg)
    step = compute.step_cost(pipe.cfg, spec=registry.method(pipe.cfg.method))
    assert b.selection > 0 and b.fit > 0
    assert budget - step < b.selection + b.fit + b.teacher + b.heal == b.spent <= budget
    assert b.teacher == (b.tokens if objective == "kd" else 0.0)
    assert pipe.compute()["total"] == b.spent and pipe.compute()["heal_tokens"] == b.tokens


def test_prune_with_a_budget_runs_the_default_measured_best_at_the_nearest_budget(capsys):
    """`prune --compute-budget B` without --method runs budgets.BUDGET_DEFAULTS' entry nearest B
    (log scale) and says so on its first line; an explicit --method is kept."""
    import math

    from trsp_ray.cli import build_parser, prune_config
    from trsp_ray.config import budgets

    for budget, _, _ in budgets.BUDGET_DEFAULTS:
        for asked in (budget, budget * 1.2):
            nearest = min(budgets.BUDGET_DEFAULTS, key=lambda e: abs(math.log(asked / e[0])))
            cfg = prune_config(build_parser().parse_args(["prune", "--compute-budget", str(asked)]))
            assert (cfg.method, cfg.recovery.objective) == nearest[1:]
    assert "the default measured best at" in capsys.readouterr().out
    cfg = prune_config(build_parser().parse_args(["prune", "--compute-budget", "1M", "--method", "tail+heal"]))
    assert cfg.method == "tail+heal" and cfg.recovery.objective == "ce"
    assert budgets.budget_default(1e9)[0] == max(b for b, _, _ in budgets.BUDGET_DEFAULTS)


def test_the_default_pipeline_on_a_gpu_gets_a_budget_sized_for_a_real_heal(monkeypatch):
    import torch

    from trsp_ray.cli import build_parser, prune_config
    from trsp_ray.config import budgets

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    for device in ("cuda", "auto"):
        cfg = prune_config(build_parser().parse_args(["prune", "--set", f"device={device}"]), gpu_default=True)
        assert cfg.heal.compute_budget == budgets.GPU_DEFAULT_BUDGET
    assert cfg.method == budgets.budget_default(budgets.GPU_DEFAULT_BUDGET)[1]
    args = build_parser().parse_args(["prune", "--method", "shortgpt+heal", "--set", "device=cuda"])
    kept = prune_config(args, gpu_default=True)
    assert kept.heal.compute_budget == 0  # a chosen pipeline keeps its configured steps
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    on_cpu = prune_config(build_parser().parse_args(["prune", "--set", "device=auto"]), gpu_default=True)
    assert on_cpu.heal.compute_budget == 0  # CPU: today's short heal


def test_a_budget_sized_heal_scales_its_learning_rate_with_its_batch_up_to_twice():
    """Issue 50: at 1M the heal's batch doubles (HEAL_SHAPES) and its rate with it (measured: every
    domain's perplexity lower at 2x); beyond 2x the rate is not measured and stays at 2x; a configured
    batch, or a budget that keeps data.batch_size, keeps stage2.lr."""
    from trsp_ray.config.run_config import load_config
    from trsp_ray.run.methods import method_heal

    def lr(*extra):
        return method_heal(load_config(overrides=["method=shortgpt+comp+heal", "stage2.lr=1e-4", *extra])).lr

    assert lr() == pytest.approx(1e-4) and lr("heal.compute_budget=300000") == pytest.approx(1e-4)
    assert lr("heal.compute_budget=1000000") == pytest.approx(2e-4)
    assert lr("heal.compute_budget=100000000") == pytest.approx(2e-4)  # batch 8x, rate capped at 2x
    assert lr("heal.compute_budget=1000000", "heal.batch_size=8") == pytest.approx(1e-4)


def test_the_least_budget_prices_its_step_at_itself_across_a_heal_shape():
    """A heal step costs more from 1M on (HEAL_SHAPES doubles the batch): a fit ending just below 1M needs the
    1M step, and the named least budget is enough when passed back."""
    from trsp_ray.config.run_config import load_config, replace
    from trsp_ray.plan import compute

    cfg = load_config(None, [])
    spec = registry.method(cfg.method)
    below, above = (compute.step_cost(replace(cfg, **{"heal.compute_budget": b}), spec=spec) for b in (999_000, 1e6))
    assert above > 1.5 * below
    least = compute.least_budget(cfg, spec=spec, select=0.0, comp=999_000 - below / 2)
    assert least == pytest.approx(999_000 - below / 2 + above)
    assert compute.heal_steps(replace(cfg, **{"heal.compute_budget": least}), spec=spec, select=0.0,
                              comp=999_000 - below / 2) == 1
