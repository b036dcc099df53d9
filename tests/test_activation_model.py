"""The planner's activation model (plan/activations.py) equals what autograd keeps for
backward, counted by saved-tensor hooks (benchmarks/activation_check.py's counter), per token and
decoder layer: stage 1 and stage 2, in one process and with DeepSpeed ZeRO-3's Linear, on a tiny
Llama whose attention width differs from its hidden size (q = 4 x 24 = 96, h = 64, kv = 48)."""

import importlib.util
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]


def _counter():
    spec = importlib.util.spec_from_file_location("activation_check", REPO / "benchmarks" / "activation_check.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.saved_bytes


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=160, num_hidden_layers=8,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=24, max_position_embeddings=128)
    path = tmp_path_factory.mktemp("act") / "llama"
    LlamaForCausalLM(config).save_pretrained(path)
    return str(path)


@pytest.mark.parametrize("dtype, e", [(torch.float32, 4), (torch.bfloat16, 2)])
@pytest.mark.parametrize("trained, gated, zero3", [(False, True, False), (False, True, True), (True, False, False),
                                                   (True, False, True)],
                         ids=["stage1", "stage1-zero3", "stage2", "stage2-zero3"])
def test_the_activation_model_is_what_autograd_keeps(llama_dir, dtype, e, trained, gated, zero3):
    if zero3:
        pytest.importorskip("deepspeed")
    from trsp_ray.plan.activations import layer_activation_bytes
    from trsp_ray.plan.shape import read_shape

    saved_bytes = _counter()
    tokens = (2, 32)
    kw = {"dtype": dtype, "trained": trained, "gated": gated, "zero3": zero3, "tokens": tokens}
    per_layer = (saved_bytes(llama_dir, layers=6, **kw) - saved_bytes(llama_dir, layers=2, **kw)) / 4 / 64
    s = read_shape(llama_dir)
    assert (s.hidden, s.heads * s.head_dim, s.kv_heads * s.head_dim) == (64, 96, 48)
    # exact up to a few bytes per layer that do not grow with tokens (the gate cast to the dtype)
    assert layer_activation_bytes(s, e, trained=trained, gated=gated, zero3=zero3) == pytest.approx(per_layer, abs=0.1)
