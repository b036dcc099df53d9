"""Gates are a no-op at 1.0, a bypassed layer equals a removed layer, for every supported family."""

import pytest
import torch

from trsp_ray.common.errors import TrspError
from trsp_ray.method.gates import GatedLayer, attach_gates, detach_gates
from trsp_ray.method.surgery import remove_layers
from trsp_ray.models.families import FAMILIES, decoder_layers, family_of, per_layer_lists
from trsp_ray.models.tiny import tiny_model

FAMILY_NAMES = sorted(FAMILIES)


def _ids(seed=0, batch=2, length=40):
    # longer than the tiny sliding window (16) so sliding and full layers really differ
    return torch.randint(3, 256, (batch, length), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_gates_at_one_reproduce_logits_exactly(family):
    model = tiny_model(family)
    ids = _ids()
    with torch.no_grad():
        ref = model(ids).logits
        gates = attach_gates(model, gate_mode="delta")
        gates.set_gated(True)
        delta = model(ids).logits
        gates.set_gated(True, mode="output")
        output = model(ids).logits
    assert torch.equal(delta, ref)
    assert torch.equal(output, ref)
    assert all(isinstance(layer, GatedLayer) for layer in decoder_layers(model))


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_gates_change_logits_when_moved(family):
    model = tiny_model(family)
    ids = _ids()
    gates = attach_gates(model)
    gates.set_gated(True)
    with torch.no_grad():
        ref = model(ids).logits
        gates[2].gate.fill_(0.0)
        half = model(ids).logits
        gates.set_bypass([2])
        gates[2].gate.fill_(1.0)
        bypass = model(ids).logits
    assert (half - ref).abs().max() > 1e-4  # the gate really acts on the layer
    torch.testing.assert_close(half, bypass, rtol=0, atol=1e-5)  # delta gate 0 == bypass


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_bypassed_layer_equals_removed_layer(family):
    model = tiny_model(family)
    ids = _ids(1)
    drop = [1, 4]  # shifts the sliding/full pattern of the layers after them
    with torch.no_grad():
        gates = attach_gates(model)
        gates.set_bypass(drop)
        bypassed = model(ids).logits
        before_types = list(getattr(model.config, "layer_types", None) or [])
        kept = remove_layers(model, drop)
        removed = model(ids).logits
    assert torch.equal(bypassed, removed)
    assert kept == [0, 2, 3, 5]
    assert model.config.num_hidden_layers == 4
    assert len(decoder_layers(model)) == 4
    if before_types:
        assert list(model.config.layer_types) == [before_types[i] for i in kept]
    for new_index, layer in enumerate(decoder_layers(model)):
        idx = [m.layer_idx for m in layer.modules() if isinstance(getattr(m, "layer_idx", None), int)]
        assert idx and set(idx) == {new_index}


def test_detach_restores_original_modules():
    model = tiny_model("llama")
    originals = list(decoder_layers(model))
    attach_gates(model)
    detach_gates(model)
    assert list(decoder_layers(model)) == originals


def test_unsupported_architecture_lists_supported():
    from transformers import GPT2Config, GPT2LMHeadModel

    model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64))
    with pytest.raises(TrspError) as err:
        family_of(model)
    msg = str(err.value)
    assert "'gpt2'" in msg and "llama" in msg and "gpt_neox" in msg and "\n" not in msg


def test_generic_per_layer_list_is_found():
    from transformers import LlamaConfig

    config = LlamaConfig(num_hidden_layers=4)
    config.no_rope_layers = [1, 0, 1, 1]
    config.some_vector = [0.5, 0.5]
    assert per_layer_lists(config, 4, ("layer_types",)) == ["no_rope_layers"]


def test_remove_rejects_bad_drop_sets():
    model = tiny_model("llama", layers=3)
    with pytest.raises(TrspError, match=r"\[5\]"):
        remove_layers(model, [5])
    with pytest.raises(TrspError, match="at least one must remain"):
        remove_layers(model, [0, 1, 2])


def test_gate_gradient_ema_sees_each_backward_once():
    """The tie-break EMA is a real EMA of dLoss/ds: one update per backward, no hooks left behind."""
    import torch

    from trsp_ray.method.gates import attach_gates
    from trsp_ray.models.tiny import tiny_model

    model = tiny_model("llama", layers=4)
    gates = attach_gates(model)
    gates.set_gated(True)
    x = torch.randint(0, 200, (2, 16))
    expected = 0.0
    for _ in range(5):
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
        g = gates[2].gate.grad.item()
        expected = 0.8 * expected + 0.2 * g
        gates[2].gate.grad = None
    assert gates[2].grad_ema == pytest.approx(expected, rel=1e-6, abs=1e-12)
    assert abs(expected) > 0  # a real gradient flowed
    assert not gates[2].gate._backward_hooks  # nothing registered on the Parameter itself
