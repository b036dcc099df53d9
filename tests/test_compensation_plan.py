"""Issue 21 item 3: the compensation's float64 sums, solve and fold in the ZeRO-3 plan
(plan/compensation_plan.py), at d = 8192 (Llama-2-70B: 512 MiB per d x d float64 matrix),
and printed by `trsp-ray plan --compensation lstsq`."""

import subprocess
import sys
from pathlib import Path

import pytest

from trsp_ray.config import registry
from trsp_ray.plan import shape, zero3_plan, zero3_setup
from trsp_ray.plan.compensation_plan import WORKING_SET, compensation_plan, fit_phases, max_blocks
from trsp_ray.plan.memory import GB

MODELS = Path(__file__).resolve().parents[1] / "cluster" / "models"
LLAMA2_70B = str(MODELS / "llama-2-70b.json")


def test_the_most_blocks_a_drop_set_can_have():
    assert max_blocks(n_drop=20, candidates=78) == 20  # every dropped layer alone
    assert max_blocks(n_drop=3, candidates=4) == 2  # 4 candidates, 3 dropped: two runs at most
    assert max_blocks(n_drop=4, candidates=4) == 1
    assert max_blocks(n_drop=0, candidates=4) == 0


class _NewBytes:
    """Bytes of the tensor storages an op creates while this dispatch mode is on (meta tensors
    included), freed ones subtracted at the next op: `peak` is the most held at once. A storage that
    existed before (an op's input, an in-place op's output) is not counted."""

    def __init__(self):
        from torch.utils._python_dispatch import TorchDispatchMode

        counter = self

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                counter.seen(args, kwargs, out)
                return out

        self.mode, self.held, self.live, self.peak = Mode(), {}, 0, 0

    def seen(self, args, kwargs, out) -> None:
        import torch
        from torch.multiprocessing.reductions import StorageWeakRef
        from torch.utils._pytree import tree_leaves

        for key, (ref, size) in list(self.held.items()):
            if ref.expired():
                del self.held[key]
                self.live -= size
        inputs = {t.untyped_storage()._cdata for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for t in (t for t in tree_leaves(out) if isinstance(t, torch.Tensor)):
            storage = t.untyped_storage()
            if storage._cdata not in self.held and storage._cdata not in inputs:
                self.held[storage._cdata] = (StorageWeakRef(storage), storage.nbytes())
                self.live += storage.nbytes()
        self.peak = max(self.peak, self.live)

    def __enter__(self):
        self.mode.__enter__()
        return self

    def __exit__(self, *exc):
        return self.mode.__exit__(*exc)


def test_llama2_70b_compensation_memory_at_d_8192():
    """The default's 112 windows on 16 workers: 7 windows x 2048 tokens per forward (issue 33 item 4).
    Counted, not restated: one block's sums are the tensors compensation._add makes from rows of
    Llama-2-70B's width (meta tensors), the solve's and the fold's working bytes are counted op by op
    while compensation_forms.solve and compensation.fold run on meta tensors of its shapes (d = 8192,
    I = 28672, bf16 weights). The pass by hand:
        one layer's forward at its largest 2 B x (4 x 8192 + 3 x 28672)   = 237,568 B per token
          (the MLP's three [n, I] beside the layer's input, residual, normed stream and the
          embedding output; counted on a CPU Llama by tests/test_forward_memory.py)
        layer a-1's output and MLP output  2 x 8192 x 2 B                 =  32,768 B per token
        (its rows in float64, 2 x 8192 x 8 B = 131,072, + layer b's input and output and the
         embedding output 49,152: 180,224 < 237,568)                        = 270,336 B per token
        x 7 x 2048 = 14,336 tokens = 3,875,536,896 B = 3.609375 GiB, beside 20 blocks' sums."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from trsp_ray.method import compensation
    from trsp_ray.method.compensation_forms import solve
    from trsp_ray.models import families

    s = shape.read_shape(LLAMA2_70B)
    assert (s.hidden, s.intermediate) == (8192, 28672)
    st = zero3_setup.Setup(workers=16, gpu_memory_gb=80, activation_checkpointing=True)
    cp = compensation_plan(s, st, ratio=0.25, windows=112, protect_head=1, protect_tail=1)
    assert (cp.n_drop, cp.blocks, cp.rows) == (20, 20, 7)

    rows = torch.empty(4, 8192, dtype=torch.bfloat16, device="meta")
    stats = compensation._add(None, (1, 1), rows, rows, rows, weighting="norm")
    sums = 20 * sum(t.untyped_storage().nbytes() for t in (stats.mtm, stats.mty))
    assert sums == 20 * 2**30  # 20 blocks x 2 x 512 MiB
    with _NewBytes() as counted:
        t = solve(stats.mtm, stats.mty, ridge=1e-2)
    solve_bytes = counted.peak
    config = LlamaConfig(hidden_size=8192, intermediate_size=28672, num_hidden_layers=1, num_attention_heads=64,
                         num_key_value_heads=8, vocab_size=32000)
    with torch.device("meta"):
        model = LlamaForCausalLM(config).to(torch.bfloat16)
    layer = families.decoder_layers(model)[0]
    weight = families.map_output(layer, model)[0].weight
    with _NewBytes() as counted:
        compensation.fold(model=model, layer=layer, t=t)
    fold_bytes = counted.peak
    maps = t.untyped_storage().nbytes()

    assert cp.phases["solve"] * GB == pytest.approx(sums + solve_bytes, abs=2**20)  # the LU's 32 KB of pivots aside
    # a ZeRO-3 worker gathers the projection to fold it, after the fit: the sums freed
    assert cp.phases["fold"] * GB == pytest.approx(weight.untyped_storage().nbytes() + fold_bytes + maps, abs=2**20)
    assert cp.phases["pass"] * GB == sums + 3_875_536_896
    assert cp.memory.parts[WORKING_SET] == max(cp.phases.values()) == cp.phases["pass"]
    assert cp.host_gb * GB == 20 * maps  # the maps, from the fit to the fold
    assert "activations" not in cp.memory.parts  # a no-grad pass under stage 1's engine
    # one process folds each block after its solve, beside the sums, into a weight it holds already
    one = fit_phases(s, dtype_bytes=2, tokens=7 * 2048, blocks=20, sharded=False)
    assert one["fold"] * GB == pytest.approx(sums + fold_bytes + maps, abs=2**20)


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
        for figure in ("compensation (lstsq, after the selection): 36.8 GB per worker (fits), host 10.0 GB",
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
    from trsp_ray.common.errors import TrspError
    from trsp_ray.config.run_config import load_config
    from trsp_ray.distributed.train import check_plan

    common = ["distributed.workers=16", "distributed.use_gpu=true", "distributed.activation_checkpointing=true",
              "data.batch_size=16", "data.seqlen=2048", "method=trsp-no-stage2", "compensation.windows=16"]
    at = lambda gb, comp: load_config(None, [*common, f"distributed.gpu_memory_gb={gb}", f"compensation.method={comp}"])
    assert zero3_plan.plan_for_run(at(34, "lstsq"), LLAMA2_70B, spec=registry.method(at(34, "lstsq").method)).fits
    with pytest.raises(TrspError, match=r"compensation needs 35\.[0-9] GB per worker") as err:
        check_plan(at(34, "lstsq"), LLAMA2_70B)
    assert "\n" not in str(err.value) and "compensation.method=scalar" in str(err.value)
    check_plan(at(34, "scalar"), LLAMA2_70B)
    check_plan(at(36, "lstsq"), LLAMA2_70B)
