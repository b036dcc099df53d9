"""Layer removal: delete decoder layers, renumber per-layer indices, shorten per-layer config lists."""

from __future__ import annotations

from types import SimpleNamespace

from torch import nn

from trsp_ray.common.errors import TrspError
from trsp_ray.method.gates import detach_gates
from trsp_ray.models import families

# Attributes holding a layer's own index, used by the KV cache (`cache.update(..., layer_idx)`).
_INDEX_ATTRS = ("layer_idx", "layer_id")


def _renumber(layer: nn.Module, new_index: int) -> None:
    for module in layer.modules():
        for attr in _INDEX_ATTRS:
            if isinstance(module.__dict__.get(attr), int):
                setattr(module, attr, new_index)


def remove_layers(model, drop: list[int]) -> list[int]:
    """Delete the decoder layers at original indices `drop` in place; returns the kept indices.

    Gates are detached first. The config's `num_hidden_layers` and every per-layer list are
    shortened so the model saves and reloads as a normal Hugging Face model of the new depth.
    """
    detach_gates(model)
    layers = families.decoder_layers(model)
    total = len(layers)
    bad = [i for i in drop if not 0 <= i < total]
    if bad or len(set(drop)) != len(drop):
        raise TrspError(f"drop set {drop} is not valid; indices must be distinct and in [0, {total})")
    if len(drop) >= total:
        raise TrspError(f"cannot drop {len(drop)} of {total} layers; at least one must remain")
    kept = [i for i in range(total) if i not in set(drop)]
    new_layers = nn.ModuleList([layers[i] for i in kept])
    for new_index, layer in enumerate(new_layers):
        _renumber(layer, new_index)
    families.set_decoder_layers(model, new_layers)
    shorten_config(model.config, kept=kept, total=total)
    return kept


def shorten_config(config, *, kept: list[int], total: int) -> None:
    """Edit a *ForCausalLM `config` in place to describe only the layers `kept` (original indices
    of `total`): per-layer lists keep their entries, `num_hidden_layers = len(kept)`. Also used by
    exports that write the kept layers themselves and never cut a model."""
    holder = SimpleNamespace(config=config)  # the family table looks configs up through a model
    family, text = families.family_of(holder), families.text_config(holder)
    for name in families.per_layer_lists(text, total, family.per_layer_config):
        value = getattr(text, name)
        setattr(text, name, type(value)(value[i] for i in kept))
    text.num_hidden_layers = len(kept)
