"""GPU tier (`pytest -m gpu`): the single-process bf16 path on a CUDA device. Skipped without one.

`TRSP_GPU_TESTS_ON_CPU=1 python -m pytest -m gpu tests/test_gpu.py` runs the same bodies on CPU, to
check the tests themselves on a machine without a GPU (the CUDA-only assertions are then skipped).
The ZeRO-3 worker on NCCL runs in benchmarks/gpu_check.py (it needs Ray and a minute).
"""

import json
import os

import pytest
import torch

from trsp_ray.method.gates import attach_gates
from trsp_ray.method.training import TorchStepper, causal_lm_loss, freeze, set_checkpointing
from trsp_ray.models.tiny import tiny_model

pytestmark = pytest.mark.gpu


@pytest.fixture
def device():
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    if os.environ.get("TRSP_GPU_TESTS_ON_CPU") == "1":
        return torch.device("cpu")
    pytest.skip("needs a CUDA device")


def _bench(model, device, **overrides):
    from trsp_ray.config.run_config import load_config
    from trsp_ray.run.workbench import Workbench

    cfg = load_config(overrides=[f"{k}={v}" for k, v in overrides.items()])
    return Workbench(cfg=cfg, model=model, tokenizer=None, calib_ids=torch.arange(10),
                     texts=None, device=str(device))


def test_fresh_model_holds_one_copy_on_the_device(device):
    original = tiny_model("llama", layers=4, vocab=4096).to(torch.bfloat16)
    size = sum(p.numel() * p.element_size() for p in original.parameters())
    bench = _bench(original, device)
    base = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
    first = bench.fresh_model()
    assert {p.device for p in first.parameters()} == {device}
    assert {p.device.type for p in original.parameters()} == {"cpu"}  # the original stays in host memory
    if device.type == "cuda":
        assert torch.cuda.memory_allocated(device) - base == pytest.approx(size, rel=0.05)
        del first
        second = bench.fresh_model()  # the previous copy is gone: still one copy on the device
        assert torch.cuda.memory_allocated(device) - base == pytest.approx(size, rel=0.05)
        del second


def test_checkpointing_keeps_gradients_on_the_device(device):
    plain, ckpt = tiny_model("llama", layers=4).to(device), tiny_model("llama", layers=4).to(device)
    set_checkpointing(ckpt, True)
    batch = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))
    grads = []
    for model in (plain, ckpt):
        gates = attach_gates(model)
        gates.set_gated(True)
        freeze(model, except_params=gates.gate_params())
        (causal_lm_loss(model, batch) + 0.01 * gates.l1(range(1, 4))).backward()
        grads.append(torch.stack([g.grad for g in gates.gate_params()[1:4]]))
    assert torch.allclose(grads[0], grads[1], rtol=1e-5, atol=1e-7)


def test_bf16_stepper_uses_fp32_masters_on_the_device(device):
    model = tiny_model("llama", layers=2).to(device=device, dtype=torch.bfloat16)
    freeze(model, except_params=list(model.parameters()))
    stepper = TorchStepper(model, [{"params": list(model.parameters()), "lr": 1e-3}])
    assert all(m.device == device and m.dtype == torch.float32 for _, m in stepper.masters)
    batch = torch.randint(0, 256, (4, 32), generator=torch.Generator().manual_seed(1))
    losses = []
    for _ in range(8):
        loss = stepper.forward(batch)
        stepper.backward(loss)
        stepper.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0]
    for p, master in stepper.masters:
        assert torch.equal(p, master.to(p.dtype))  # the bf16 weights are the rounded masters


def test_export_check_runs_on_the_model_device(device, tmp_path):
    from transformers import AutoModelForCausalLM

    from trsp_ray.method.surgery import remove_layers
    from trsp_ray.run.export import export_model

    tiny_model("llama", layers=4).save_pretrained(tmp_path / "src")  # loaded in bf16 as load_model does
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "src", dtype=torch.bfloat16).to(device).eval()
    attach_gates(model)
    remove_layers(model, [1])
    export_model(model, None, str(tmp_path / "out"), manifest={"method": "test"})
    check = json.loads((tmp_path / "out" / "trsp_ray.json").read_text())["export_check"]
    assert check["device"].startswith(device.type) and check["dtype"] == "bfloat16"
    assert check["max_abs_logit_diff"] <= check["atol"] < 1.0


def test_sleb_and_perplexity_agree_with_cpu(device):
    from trsp_ray.data.perplexity import perplexity
    from trsp_ray.method.selectors import sleb_drop

    ids = torch.randint(0, 256, (600,), generator=torch.Generator().manual_seed(2))
    batches = [ids[k * 96:(k + 1) * 96].view(3, 32) for k in range(4)]
    out = {}
    for where in ("cpu", device):
        model = tiny_model("llama", layers=5, seed=4).to(where)
        gates = attach_gates(model)
        drop = sleb_drop(model, gates, batches, n_drop=2, candidates=[1, 2, 3])
        out[str(where)] = (drop, perplexity(model, ids, seqlen=64, batch_size=2, bos=1))
    (cpu_drop, cpu_ppl), (dev_drop, dev_ppl) = out["cpu"], out[str(device)]
    assert dev_drop == cpu_drop and dev_ppl == pytest.approx(cpu_ppl, rel=1e-4)


def test_prune_bf16_single_process_end_to_end(device, tmp_path):
    from trsp_ray.config.run_config import load_config
    from trsp_ray.driver import run
    from trsp_ray.models.tiny import tiny_workspace

    root = tiny_workspace(tmp_path, layers=6, calib_chars=30000, eval_chars=10000)
    cfg = load_config(overrides=[
        f"model={root / 'model'}", f"data.calib_text={root / 'calib.txt'}", f"data.eval_text={root / 'eval.txt'}",
        f"device={device.type}", "dtype=bf16", "distributed.activation_checkpointing=true", "ratio=0.34",
        "data.seqlen=64", "data.batch_size=4", "data.eval_seqlen=64", "data.eval_max_windows=8",
        "stage1.first_round_steps=4", "stage1.steps_per_round=2", "stage2.steps=4", "tracking.enabled=false",
        f"checkpoint_dir={tmp_path / 'ckpt'}", f"output={tmp_path / 'pruned'}"])
    results = run(cfg)
    manifest = json.loads((tmp_path / "pruned" / "trsp_ray.json").read_text())
    assert manifest["num_layers_kept"] == 4 and manifest["export_check"]["device"].startswith(device.type)
    assert manifest["config"]["dtype"] == "bf16" and 1.0 < results["heldout_ppl"] < 1e6
