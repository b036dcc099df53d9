"""Issue 21 item 3: the compensation's float64 sums, solve and fold in the ZeRO-3 plan
(distributed/compensation_plan.py), at d = 8192 (Llama-2-70B: 512 MiB per d x d float64 matrix),
and printed by `trsp-ray plan --compensation lstsq`."""

import subprocess
import sys
from pathlib import Path

import pytest

from trsp_ray.distributed import planner
from trsp_ray.distributed.compensation_plan import compensation_plan, max_blocks

MODELS = Path(__file__).resolve().parents[1] / "cluster" / "models"
LLAMA2_70B = str(MODELS / "llama-2-70b.json")


def test_the_most_blocks_a_drop_set_can_have():
    assert max_blocks(n_drop=20, candidates=78) == 20  # every dropped layer alone
    assert max_blocks(n_drop=3, candidates=4) == 2  # 4 candidates, 3 dropped: two runs at most
    assert max_blocks(n_drop=4, candidates=4) == 1
    assert max_blocks(n_drop=0, candidates=4) == 0


def test_llama2_70b_compensation_memory_at_d_8192():
    s = planner.read_shape(LLAMA2_70B)
    assert (s.hidden, s.intermediate) == (8192, 28672)
    st = planner.Setup(workers=16, gpu_memory_gb=80, activation_checkpointing=True)
    cp = compensation_plan(s, st, ratio=0.25, protect_head=1, protect_tail=1)
    matrix = 8192 * 8192 * 8 / 2**30
    assert matrix == 0.5  # 512 MiB: one d x d float64 matrix
    assert (cp.n_drop, cp.blocks) == (20, 20)
    parts = cp.memory.parts
    assert parts["sums M^T M, M^T Y (float64, 20 blocks)"] == 20 * 2 * matrix == 20.0
    assert parts["solve (reduced sums, eye, ridge copy, LU, T in float64)"] == 6 * matrix
    assert parts["fold (gathered projection, T^T W in float64)"] == pytest.approx(8192 * 28672 * 18 / 2**30)
    assert cp.host_gb == 20 * matrix  # the maps kept from the fit to the fold
    assert "activations" not in parts  # a no-grad pass under stage 1's engine
    assert cp.memory.total == pytest.approx(41.0, abs=0.05)


def test_plan_command_prints_the_compensation_only_when_asked():
    args = [sys.executable, "-m", "trsp_ray.cli", "plan", "--model-config", LLAMA2_70B, "--workers", "16",
            "--gpu-memory-gb", "80", "--activation-checkpointing"]
    with_comp = subprocess.run([*args, "--compensation", "lstsq"], capture_output=True, text=True, timeout=300)
    assert with_comp.returncode == 0, with_comp.stderr
    for figure in ("compensation (lstsq, after stage 1): 41.0 GB per worker (fits), host 10.0 GB",
                   "sums M^T M, M^T Y (float64, 20 blocks): 20.00 GB", "solve (reduced sums, eye, ridge copy, "
                   "LU, T in float64): 3.00 GB"):
        assert figure in with_comp.stdout, figure
    plain = subprocess.run(args, capture_output=True, text=True, timeout=300)
    assert plain.returncode == 0 and "compensation" not in plain.stdout
    small = subprocess.run([*args[:-3], "--gpu-memory-gb", "30", "--activation-checkpointing", "--compensation",
                            "lstsq"], capture_output=True, text=True, timeout=300)
    assert "compensation (lstsq, after stage 1): " in small.stdout and "(DOES NOT FIT)" in small.stdout
