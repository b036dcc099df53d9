"""Issue 41, item 2: a training step costs what its recipe runs (plan/compute.py), not 3 dense-forward
tokens per trained token whatever it trains; a distillation pays for its teacher and the cosine fit for
its float64 Gauss-Newton steps; a --compute-budget buys each recipe the steps its own cost allows.

SmolLM2-135M (the offline default) at ratio 0.25 drops 8 of 30 layers: the pruned forward multiplies by
22 layers x 3,540,096 + lm_head 28,311,552 = 106,193,664 weights, of which a tail heal (lm_head + 3
layers) trains 38,931,840 (0.3666) and back-propagates through the same depth: 1 + 2 x 0.3666."""

import pytest

from trsp_ray.config.run_config import load_config
from trsp_ray.run import budget, pipeline

SMOL_TAIL = 1 + 2 * 38_931_840 / 106_193_664  # 1.7332
SMOL_LORA = 1 + 1 + 8 * 305_280 * 22 / 30 / 106_193_664  # adapters' weight gradients: 2.0169
TOKENS = 2 * 64  # data.batch_size x data.seqlen below


def _pipe(method: str, *extra: str):
    return pipeline.resolve(load_config(None, [f"method={method}", "ratio=0.25", "data.batch_size=2",
                                               "data.seqlen=64", "stage2.steps=10", *extra]))


def _per_token(method: str, *extra: str) -> float:
    """Planned dense-forward tokens per trained token of `method`'s heal (the manifest's compute_heal)."""
    split = _pipe(method, *extra).compute()
    assert split["heal_steps"] == 10
    return split["heal"] / (10 * TOKENS)


def test_a_tail_heal_step_costs_less_than_a_full_heal_step():
    full, tail = _per_token("shortgpt+heal"), _per_token("shortgpt+heal.tail")
    assert full == pytest.approx(3.0)  # SPEC's heal token: forward 1, backward with weight gradients 2
    assert tail == pytest.approx(SMOL_TAIL, rel=1e-9) and tail < 0.6 * full


def test_a_kd_step_costs_more_than_a_ce_step_by_the_teachers_forward():
    for method in ("shortgpt+heal", "shortgpt+heal.tail"):
        ce, kd = _per_token(method), _per_token(method, "recovery.objective=kd")
        assert kd == pytest.approx(ce + 1.0)  # the dense teacher runs the whole depth once per token


def test_a_lora_step_costs_less_than_a_full_step():
    lora = _per_token("shortgpt+heal.lora")
    assert lora == pytest.approx(SMOL_LORA, rel=1e-9) and lora < _per_token("shortgpt+heal")


def test_the_cosine_fits_steps_are_counted():
    """Same calibration, same blocks: the cosine fit adds its curvature pass and Gauss-Newton steps
    (float64) to least squares' passes and sums; on Llama-2-70B with 20 one-layer blocks those steps
    are about 0.8 of the fit's forward in FLOPs, as the issue measured."""
    from trsp_ray.plan import compute
    from trsp_ray.plan.shape import read_shape

    lstsq, cosine = _pipe("shortgpt+comp+heal"), _pipe("shortgpt+cos+heal")
    assert lstsq.cfg.compensation.windows == cosine.cfg.compensation.windows > 0
    passes = lstsq.cfg.compensation.windows * 64
    fit_lstsq = budget.planned_compensation_cost(lstsq.cfg, spec=lstsq.spec, num_layers=30)
    fit_cosine = budget.planned_compensation_cost(cosine.cfg, spec=cosine.spec, num_layers=30)
    assert passes < fit_lstsq < fit_cosine
    assert fit_cosine - passes > 10 * (fit_lstsq - passes)  # 10 steps of 8 d^2 per token beside 4 d^2

    big = read_shape("cluster/models/llama-2-70b.json")
    tokens = 28 * 8192
    steps = (compute.fit_solve_cost(big, tokens=tokens, blocks=20, cosine_steps=10)
             - compute.fit_solve_cost(big, tokens=tokens, blocks=20)) / compute.FLOAT64_SLOWDOWN / tokens
    assert 0.75 < steps < 0.9


def test_a_budget_buys_a_tail_heal_more_steps_than_a_full_heal():
    """The same budget and selection (ShortGPT, no fit): a step of the tail recipe costs 1.73 / 3 of
    a full one, so it gets about 3 / 1.73 as many."""
    cfgs = {m: load_config(None, [f"method={m}", "ratio=0.25", "data.batch_size=2", "data.seqlen=64",
                                  "baselines.calib_windows=2", "heal.compute_budget=100000"])
            for m in ("shortgpt+heal", "shortgpt+heal.tail", "shortgpt+heal.lora")}
    pipes = {m: pipeline.resolve(c, budget_layers=False) for m, c in cfgs.items()}
    steps = {m: budget.resolve(p.cfg, spec=p.spec, num_layers=30).stage2.steps for m, p in pipes.items()}
    left = 100000 - 2 * 64  # ShortGPT's one forward over its 2 windows
    assert steps["shortgpt+heal"] == left // (3 * TOKENS) == 260
    assert steps["shortgpt+heal.tail"] == int(left // (SMOL_TAIL * TOKENS)) == 450
    assert steps["shortgpt+heal"] < steps["shortgpt+heal.lora"] < steps["shortgpt+heal.tail"]


def test_the_shares_come_from_the_models_config():
    """The same recipe on Llama-2-70B: its lm_head is 0.4% of the forward (27% on SmolLM2), so a tail
    heal of lm_head + 3 of 60 layers is cheap; a map heal trains only down_proj maps, back-propagated
    down to the lowest one."""
    from trsp_ray.plan import compute
    from trsp_ray.plan.shape import read_shape

    big = read_shape("cluster/models/llama-2-70b.json")
    layer, head = 855_654_400, 262_144_000
    forward = 60 * layer + head
    assert compute.train_token_cost(big, recipe="all", kept_layers=60) == pytest.approx(3.0)
    assert compute.train_token_cost(big, recipe="tail", kept_layers=60) == pytest.approx(
        1 + 2 * (head + 3 * layer) / forward)  # 1.110
    assert compute.train_token_cost(big, recipe="map", kept_layers=60, maps=2, first_trained=30) == pytest.approx(
        1 + (head + 30 * layer) / forward + 2 * 8192 * 28672 / forward)  # 1.506
    assert compute.train_token_cost(big, recipe="tail", kept_layers=60, kd=True) == pytest.approx(2.110, abs=1e-3)


def test_what_a_row_spent_reads_each_parts_cost():
    from trsp_ray.plan.compute import extra_heal_steps, recovery_cost, total_cost

    info = {"select_cost": 100.0, "weight_tokens": 10, "heal_cost": 17.3, "compensation_cost": 7.0,
            "compensation_solve_cost": 2.5}
    assert recovery_cost(info) == pytest.approx(26.8) and total_cost(info) == pytest.approx(126.8)
    assert extra_heal_steps(1000.0, step_cost=3 * 128) == 3 and extra_heal_steps(1000.0, step_cost=1.7332 * 128) == 5
