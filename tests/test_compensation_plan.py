"""Issue 21 item 3: the compensation's float64 sums, solve and fold in the ZeRO-3 plan
(distributed/compensation_plan.py), at d = 8192 (Llama-2-70B: 512 MiB per d x d float64 matrix),
and printed by `trsp-ray plan --compensation lstsq`."""

import subprocess
import sys
from pathlib import Path

import pytest

from trsp_ray.distributed import planner
from trsp_ray.distributed.compensation_plan import WORKING_SET, compensation_plan, max_blocks

MODELS = Path(__file__).resolve().parents[1] / "cluster" / "models"
LLAMA2_70B = str(MODELS / "llama-2-70b.json")


def test_the_most_blocks_a_drop_set_can_have():
    assert max_blocks(n_drop=20, candidates=78) == 20  # every dropped layer alone
    assert max_blocks(n_drop=3, candidates=4) == 2  # 4 candidates, 3 dropped: two runs at most
    assert max_blocks(n_drop=4, candidates=4) == 1
    assert max_blocks(n_drop=0, candidates=4) == 0


def test_llama2_70b_compensation_memory_at_d_8192():
    """The default's 112 windows on 16 workers: 7 windows x 2048 tokens per forward (issue 33 item 4)."""
    s = planner.read_shape(LLAMA2_70B)
    assert (s.hidden, s.intermediate) == (8192, 28672)
    st = planner.Setup(workers=16, gpu_memory_gb=80, activation_checkpointing=True)
    cp = compensation_plan(s, st, ratio=0.25, windows=112, protect_head=1, protect_tail=1)
    matrix = 8192 * 8192 * 8 / 2**30
    assert matrix == 0.5  # 512 MiB: one d x d float64 matrix
    assert (cp.n_drop, cp.blocks, cp.rows) == (20, 20, 7)
    sums = 20 * 2 * matrix
    assert cp.phases["solve"] == sums + 4 * matrix  # the ridge's two copies, the LU factors and T
    assert cp.phases["fold"] == pytest.approx(8192 * 28672 * 18 / 2**30 + matrix)  # after the fit: sums freed
    assert cp.phases["pass"] > cp.phases["solve"]  # 14,336 tokens per forward: more than the solve's 2 GB
    assert cp.memory.parts[WORKING_SET] == max(cp.phases.values())
    assert cp.host_gb == 20 * matrix  # the maps, from the fit to the fold
    assert "activations" not in cp.memory.parts  # a no-grad pass under stage 1's engine


def test_plan_command_prints_the_compensation_the_method_runs():
    """The default method compensates, so its plan counts the least-squares sums with no flag; a
    method that does not compensate counts them only when asked; a plan that would leave out the
    default's compensation is refused."""
    args = [sys.executable, "-m", "trsp_ray.cli", "plan", "--model-config", LLAMA2_70B, "--workers", "16",
            "--gpu-memory-gb", "80", "--activation-checkpointing"]
    default = subprocess.run(args, capture_output=True, text=True, timeout=300)
    asked = subprocess.run([*args, "--method", "shortgpt+heal", "--compensation", "lstsq"], capture_output=True,
                           text=True, timeout=300)
    for run in (default, asked):
        assert run.returncode == 0, run.stderr
        for figure in ("compensation (lstsq, after the selection): 36.6 GB per worker (fits), host 10.0 GB",
                       "pass: sums M^T M, M^T Y of 20 blocks (float64) + 7 windows x 2048 tokens per forward "
                       "(112 windows / 16 workers", "solve: sums M^T M, M^T Y of 20 blocks (float64) + the ridge's "
                       "two copies, LU factors and T (float64, d x d): 22.00 GB"):
            assert figure in run.stdout, figure
    plain = subprocess.run([*args, "--method", "shortgpt+heal"], capture_output=True, text=True, timeout=300)
    assert plain.returncode == 0 and "compensation" not in plain.stdout
    refused = subprocess.run([*args, "--compensation", "none"], capture_output=True, text=True, timeout=300)
    assert refused.returncode == 2 and "--method shortgpt+heal for no compensation" in refused.stderr
    small = subprocess.run([*args[:-3], "--gpu-memory-gb", "30", "--activation-checkpointing", "--compensation",
                            "lstsq"], capture_output=True, text=True, timeout=300)
    assert "compensation (lstsq, after the selection): " in small.stdout and "(DOES NOT FIT)" in small.stdout


def test_a_run_whose_compensation_does_not_fit_is_refused_before_any_worker():
    """Llama-2-70B on 16 x 34 GB: stage 1 (17 GB) and its probes fit, the least-squares sums of its
    20 possible blocks (35.2 GB with the solve) do not; the scalar fold has no d x d sums."""
    from trsp_ray.config import load_config
    from trsp_ray.distributed.train import check_plan
    from trsp_ray.errors import TrspError

    common = ["distributed.workers=16", "distributed.use_gpu=true", "distributed.activation_checkpointing=true",
              "data.batch_size=16", "data.seqlen=2048", "method=trsp-no-stage2", "compensation.windows=16"]
    at = lambda gb, comp: load_config(None, [*common, f"distributed.gpu_memory_gb={gb}", f"compensation.method={comp}"])
    assert planner.plan_for_run(at(34, "lstsq"), LLAMA2_70B).fits
    with pytest.raises(TrspError, match=r"compensation needs 35\.[0-9] GB per worker") as err:
        check_plan(at(34, "lstsq"), LLAMA2_70B)
    assert "\n" not in str(err.value) and "compensation.method=scalar" in str(err.value)
    check_plan(at(34, "scalar"), LLAMA2_70B)
    check_plan(at(36, "lstsq"), LLAMA2_70B)
