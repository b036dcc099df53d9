"""The 70B figures the docs quote are the plan's, and the plan's host memory per node counts the
fit's maps: `trsp-ray plan --model-config cluster/models/llama-2-70b.json --workers 16
--gpu-memory-gb 80 --activation-checkpointing` (the default pipeline, shortgpt+comp+heal)."""

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

from trsp_ray.plan import memory

REPO = Path(__file__).resolve().parents[1]
PLAN = [sys.executable, "-m", "trsp_ray.cli", "plan", "--model-config", str(REPO / "cluster/models/llama-2-70b.json"),
        "--workers", "16", "--gpu-memory-gb", "80", "--activation-checkpointing"]
D, BLOCKS = 8192, 20  # Llama-2-70B's hidden size; 20 of 80 layers dropped, at most 20 separate blocks


def _plan(*extra: str) -> str:
    done = subprocess.run([*PLAN, *extra], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return done.stdout


@pytest.fixture(scope="module")
def plan_out() -> dict[str, float]:
    """The default pipeline's figures as `trsp-ray plan` prints them."""
    out = _plan()
    patterns = {"stage1": r"stage 1: ([\d.]+) GB per worker", "stage2": r"stage 2 \(all weights\): ([\d.]+) GB",
                "fit": r"compensation \(lstsq, after the selection\): ([\d.]+) GB per worker \(fits\)",
                "fit_host": r"after the selection\): [\d.]+ GB per worker \(fits\), host ([\d.]+) GB",
                "working_set": r"the fit's working set \(sums \+ its largest phase\): ([\d.]+) GB",
                "node": r"host memory per node: ([\d.]+) GB", "checkpoint": r"checkpoint: ([\d.]+) GB per save",
                "export": r"export host memory: ([\d.]+) GB"}
    found = {k: re.search(p, out) for k, p in patterns.items()}
    assert all(found.values()), (out, [k for k, v in found.items() if not v])
    return {k: float(m.group(1)) for k, m in found.items()}


def _figures(text: str, patterns: dict[str, str]) -> dict[str, float]:
    text = " ".join(text.split())  # the docs wrap lines anywhere
    found = {k: re.search(p, text) for k, p in patterns.items()}
    assert all(found.values()), [k for k, v in found.items() if not v]
    return {k: float(m.group(1)) for k, m in found.items()}


def test_the_70b_job_quotes_the_plans_figures(plan_out):
    doc = ast.get_docstring(ast.parse((REPO / "jobs/prune_70b.py").read_text()))
    # the superseded 41.0 GB counted the fit's sums differently, 36.6 left out the embedding output a
    # forward holds to its end (issue 40); the plan prints 36.8
    assert _figures(doc, {"fit": r"need ([\d.]+) GB per GPU before the heal's optimizer exists"}) \
        == {"fit": plan_out["fit"]} == {"fit": 36.8}
    quoted = _figures(doc, {"stage1": r"forward-only \(([\d.]+) GB per GPU with stage 1's state\)",
                            "fit": r"need ([\d.]+) GB per GPU before the heal's optimizer exists",
                            "fit_host": r"([\d.]+) GB of host memory per worker for the maps",
                            "node": r"maps \(([\d.]+) GB of host memory per node",
                            "stage2": r"model state: ([\d.]+) GB per GPU on 16 GPUs",
                            "checkpoint": r"checkpoints, ([\d.]+) GB each"})
    assert quoted["checkpoint"] == round(plan_out["checkpoint"])  # "580 GB each"
    del quoted["checkpoint"]
    assert quoted == {k: plan_out[k] for k in quoted}


def test_the_cluster_docs_quote_the_plans_figures(plan_out):
    readme = (REPO / "docs" / "cluster.md").read_text()  # the 70B tables moved there from the README
    assert _figures(readme, {"fit": r"its least-squares fit, before the heal, needs ([\d.]+) GB per GPU"}) \
        == {"fit": plan_out["fit"]}
    quoted = _figures(readme, {
        "stage2": r"at 16 x 80 GB with checkpointing ([\d.]+) GB per GPU instead of",
        "checkpoint": r"and ([\d.]+) GB per checkpoint instead of",
        "fit": r"its least-squares fit, before the heal, needs ([\d.]+) GB per GPU",
        "working_set": r"the fit's working set of ([\d.]+) GB at its largest phase",
        "sums": r"the pass: ([\d.]+) GB of float64 sums for the worst case of 20 separate blocks",
        "fit_host": r"([\d.]+) GB of host memory per worker for the maps",
        "node": r"for the maps, ([\d.]+) GB per node while the fit holds them"})
    assert quoted["sums"] == round(BLOCKS * 2 * D * D * 8 / memory.GB, 1) == 20.0  # M^T M and M^T Y per block
    del quoted["sums"]
    assert quoted == {k: round(plan_out[k], 1) for k in quoted}


def test_host_memory_per_node_counts_the_fits_maps_at_70b(plan_out):
    """8 workers a node, each holding its 20 float64 8192 x 8192 maps (10.0 GB) from the fit to the
    fold beside its baseline: 128.0 GB, more than the heal's 8 x 6.0 GB + the export (57.3 GB)."""
    base = memory.HOST_BASE_GB["gpu"]
    assert plan_out["fit_host"] == round(BLOCKS * D * D * 8 / memory.GB, 1) == 10.0
    assert plan_out["node"] == round(8 * (plan_out["fit_host"] + base), 1) == 128.0
    assert 8 * base + plan_out["export"] == pytest.approx(57.3, abs=0.05)  # the figure it printed before
    # no fit, no maps: the heal's workers and the export
    heal = re.search(r"host memory per node: ([\d.]+) GB", _plan("--method", "shortgpt+heal"))
    assert float(heal.group(1)) == pytest.approx(8 * base + plan_out["export"], abs=0.05)


def test_the_larger_phase_is_the_nodes_figure():
    """host_and_disk: the maps are dropped once folded, before the heal and the export, so a node needs
    the larger of its workers during the fit and its workers + the export after it, not their sum."""
    from trsp_ray.plan import shape, zero3_plan, zero3_setup

    s = shape.Shape(32000, D, 28672, 80, 64, 8, 128, False)
    base = memory.HOST_BASE_GB["gpu"]
    st = zero3_setup.Setup(workers=16, activation_checkpointing=True, export_shard_gb=5.0)
    plain = zero3_plan.plan(s, st).host()
    fit = zero3_plan.plan(s, st).host(fit_host_gb=10.0)
    assert plain.host_per_node_gb == pytest.approx(8 * base + 10.0) and plain.fit_host_per_worker_gb == 0
    assert fit.host_per_node_gb == pytest.approx(8 * (10.0 + base)) and fit.fit_host_per_worker_gb == 10.0 + base
    # with the optimizer offloaded the heal's host state outweighs the maps
    off = zero3_setup.Setup(workers=8, activation_checkpointing=True, offload_optimizer=True, export_shard_gb=5.0)
    heal = zero3_plan.plan(s, off).host()
    assert zero3_plan.plan(s, off).host(fit_host_gb=10.0).host_per_node_gb == pytest.approx(heal.host_per_node_gb)
    assert heal.host_per_node_gb > 8 * (10.0 + base)
