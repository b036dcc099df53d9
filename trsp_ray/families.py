"""Model-family adapter table: where the decoder layers live and which config lists are per layer.

This is the only module that knows attribute paths such as `model.layers`. Everything else asks it.
"""

from __future__ import annotations

from dataclasses import dataclass

from trsp_ray.errors import TrspError


@dataclass(frozen=True)
class Family:
    name: str
    layers_path: str  # dotted path from the *ForCausalLM module to the decoder-layer ModuleList
    config_path: str = ""  # dotted path from model.config to the text config ("" = itself)
    per_layer_config: tuple[str, ...] = ("layer_types",)  # config lists with one entry per layer


_DEFAULT = "model.layers"
FAMILIES: dict[str, Family] = {
    "llama": Family("llama", _DEFAULT),
    "mistral": Family("mistral", _DEFAULT),
    "qwen2": Family("qwen2", _DEFAULT),
    "qwen3": Family("qwen3", _DEFAULT),
    "gemma2": Family("gemma2", _DEFAULT),
    "gemma3_text": Family("gemma3_text", _DEFAULT),
    "phi3": Family("phi3", _DEFAULT),
    "opt": Family("opt", "model.decoder.layers"),
    "gpt_neox": Family("gpt_neox", "gpt_neox.layers"),
}


def family_of(model) -> Family:
    """The adapter for `model` (a *ForCausalLM); unsupported architectures get a one-line error."""
    model_type = getattr(model.config, "model_type", None)
    if model_type not in FAMILIES:
        raise TrspError(
            f"model_type {model_type!r} is not supported; supported: {', '.join(sorted(FAMILIES))}"
        )
    return FAMILIES[model_type]


def _get(obj, dotted: str):
    for part in filter(None, dotted.split(".")):
        obj = getattr(obj, part)
    return obj


def decoder_layers(model):
    """The torch.nn.ModuleList of decoder layers of `model`."""
    return _get(model, family_of(model).layers_path)


def set_decoder_layers(model, layers) -> None:
    path = family_of(model).layers_path
    parent_path, _, leaf = path.rpartition(".")
    setattr(_get(model, parent_path), leaf, layers)


def text_config(model):
    """The config object that holds num_hidden_layers (the text config for multimodal wrappers)."""
    return _get(model.config, family_of(model).config_path)


def num_layers(model) -> int:
    return len(decoder_layers(model))


def per_layer_lists(config, num_hidden_layers: int, named: tuple[str, ...]) -> list[str]:
    """Config attributes that hold one entry per layer: the named ones plus any list of length L.

    The generic scan catches per-layer lists a family adds later (e.g. `no_rope_layers`) so that a
    pruned config never keeps an entry for a layer that no longer exists.
    """
    found = [name for name in named if isinstance(getattr(config, name, None), (list, tuple))]
    for name, value in vars(config).items():
        if name in found or name.startswith("_"):
            continue
        if isinstance(value, (list, tuple)) and len(value) == num_hidden_layers and num_hidden_layers > 1:
            if all(isinstance(v, (str, bool, int, float, type(None))) for v in value):
                found.append(name)
    return found
