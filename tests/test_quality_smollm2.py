"""Stage 1 on a real model: the layers it drops must cost less than chance (slow tier: ~8 minutes on
2 CPU cores; SmolLM2-135M, 8 of 30 layers, scored on the calibration tail that no selection saw)."""

import math
import random

import pytest

from trsp_ray.config.run_config import load_config
from trsp_ray.method.gates import attach_gates
from trsp_ray.run.methods import run_stage1_for
from trsp_ray.run.workbench import prepare

pytestmark = pytest.mark.slow


def test_stage1_drop_set_costs_less_than_the_median_random_set_on_smollm2():
    bench = prepare(load_config(None, []))
    result = run_stage1_for(bench, model=bench.model)
    gates = attach_gates(bench.model)  # clean state: every layer runs, nothing gated

    def tail_ce(drop):
        with gates.state(gated=False, bypass=drop):
            return math.log(bench.validation_ppl(bench.model))

    n_drop, candidates = bench.n_drop(), bench.candidates()
    assert len(result.drop_order) == n_drop == 8
    chosen = tail_ce(result.drop_order)
    rng = random.Random(0)
    random_ces = sorted(tail_ce(rng.sample(candidates, n_drop)) for _ in range(20))
    median = (random_ces[9] + random_ces[10]) / 2
    dense = tail_ce([])
    print(f"tail CE: dense {dense:.3f}, stage 1 {chosen:.3f}, random median {median:.3f}, "
          f"best random {random_ces[0]:.3f}")
    assert dense < chosen < median
