"""Model-family adapter table: where the decoder layers live and which config lists are per layer.

This is the only module that knows attribute paths such as `model.layers`. Everything else asks it.
"""

from __future__ import annotations

from dataclasses import dataclass

from trsp_ray.common.errors import TrspError


@dataclass(frozen=True)
class Family:
    name: str
    layers_path: str  # dotted path from the *ForCausalLM module to the decoder-layer ModuleList
    config_path: str = ""  # dotted path from model.config to the text config ("" = itself)
    per_layer_config: tuple[str, ...] = ("layer_types",)  # config lists with one entry per layer
    # dotted path from a decoder layer to the linear whose output (bias included) the layer adds to
    # its residual stream as the MLP's contribution: a closed-form compensation folds its map there
    mlp_out_path: str = "mlp.down_proj"
    # the same for the attention's contribution (the scalar fold rescales both)
    attn_out_path: str = "self_attn.o_proj"
    # why a map folded into that linear would not reach the residual stream ("" = it does)
    mlp_fold_refusal: str = ""
    # dotted path from a decoder layer to the norm between that linear and the residual add (Gemma 2/3's
    # post_feedforward_layernorm, "" = none), and the constant its scale adds to its weight (Gemma's
    # RMSNorm multiplies by 1 + weight): a compensating map folds there only as a diagonal, into that scale
    mlp_norm_path: str = ""
    norm_offset: float = 0.0
    # where a merge of two blocks (trsp_ray/method/merge.py) finds a block's parts: the linears that read
    # the attention's normed input (q, k, v, or one fused linear), those that read the MLP's (gate and
    # up, one fused [gate; up], or one fc1), and the two norms in front of them
    attn_in_paths: tuple[str, ...] = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")
    mlp_in_paths: tuple[str, ...] = ("mlp.gate_proj", "mlp.up_proj")
    norm_paths: tuple[str, str] = ("input_layernorm", "post_attention_layernorm")
    # a fused q/k/v linear's row order: "stacked" (all q rows, then k, then v: Phi-3) or "per_head"
    # (each head's q, k, v rows together: GPT-NeoX)
    qkv_layout: str = "stacked"
    # why two of its blocks cannot become one ("" = they can)
    merge_refusal: str = ""


_DEFAULT = "model.layers"
# how a run without compensation is asked for: a compensating method (the default shortgpt+comp+heal)
# fits least squares unless compensation.method says otherwise, so its advice names the method too
NO_COMPENSATION = "use compensation.method=none, and --method shortgpt+heal instead of shortgpt+comp+heal"
_POST_FFN_NORM = ("its post_feedforward_layernorm normalises the MLP output before the residual add, "
                  "so a linear map folded into down_proj is undone by the norm")
_QK_NORM = ("its q_norm and k_norm scale every head of a layer by one shared head_dim weight (before the rotary "
            "embedding, so no projection can carry it): heads of two layers cannot share one")
_POST_NORMS = ("its post_attention_layernorm and post_feedforward_layernorm normalise each block's whole attention and "
               "MLP output, so a sum of two blocks' outputs cannot keep each block's norm")
FAMILIES: dict[str, Family] = {
    "llama": Family("llama", _DEFAULT),
    "mistral": Family("mistral", _DEFAULT),
    "qwen2": Family("qwen2", _DEFAULT),
    "qwen3": Family("qwen3", _DEFAULT, merge_refusal=_QK_NORM),
    "gemma2": Family("gemma2", _DEFAULT, mlp_fold_refusal=_POST_FFN_NORM, mlp_norm_path="post_feedforward_layernorm",
                     norm_offset=1.0, merge_refusal=_POST_NORMS),
    "gemma3_text": Family("gemma3_text", _DEFAULT, mlp_fold_refusal=_POST_FFN_NORM,
                          mlp_norm_path="post_feedforward_layernorm", norm_offset=1.0, merge_refusal=_POST_NORMS),
    "phi3": Family("phi3", _DEFAULT, attn_in_paths=("self_attn.qkv_proj",), mlp_in_paths=("mlp.gate_up_proj",)),
    # OPTDecoderLayer adds fc2's output straight to the residual (its LayerNorm comes first)
    "opt": Family("opt", "model.decoder.layers", mlp_out_path="fc2", attn_out_path="self_attn.out_proj",
                  mlp_in_paths=("fc1",), norm_paths=("self_attn_layer_norm", "final_layer_norm")),
    # with use_parallel_residual the layer writes x + attn + mlp, without it (x + attn) + mlp: either
    # way the layer's output minus the projection's output is the stream the MLP output joins
    "gpt_neox": Family("gpt_neox", "gpt_neox.layers", mlp_out_path="mlp.dense_4h_to_h",
                       attn_out_path="attention.dense", attn_in_paths=("attention.query_key_value",),
                       mlp_in_paths=("mlp.dense_h_to_4h",), qkv_layout="per_head"),
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


def fold_refusal(config) -> str:
    """Why a model of this config.json (a transformers config) cannot take a compensating map's fold
    (a norm after its layer outputs); "" when it can, when its MLP norm takes a diagonal map
    (map_output), or when its family is unknown (family_of refuses that)."""
    family = FAMILIES.get(getattr(config, "model_type", None))
    if family is not None and family.mlp_norm_path:
        return ""
    return _projection_refusal(config)


def _projection_refusal(config) -> str:
    """Why the layers' output projections cannot take a fold (a norm after them); "" when they can."""
    family = FAMILIES.get(getattr(config, "model_type", None))
    if family is None:
        return ""
    return family.mlp_fold_refusal or _post_norm(config, family)


def _post_norm(config, family: Family) -> str:
    """Why an OPT config's norms follow the residual adds (do_layer_norm_before=False); "" otherwise."""
    if family.name == "opt" and not getattr(_get(config, family.config_path), "do_layer_norm_before", True):
        return "with do_layer_norm_before=False its final_layer_norm follows the residual add"
    return ""


def merge_refusal(config) -> str:
    """Why no two blocks of a model of this config can be merged into one (Family.merge_refusal, or norms
    after the residual adds); "" when they can or the family is unknown (family_of refuses that)."""
    family = FAMILIES.get(getattr(config, "model_type", None))
    if family is None:
        return ""
    return family.merge_refusal or _post_norm(config, family)


def _refuse_fold(model) -> None:
    """A one-line error for a family whose layer outputs a fold cannot reach (a norm after them)."""
    family = family_of(model)
    reason = _projection_refusal(model.config)
    if reason:
        raise TrspError(f"compensation cannot fold into family {family.name!r}: {reason}; {NO_COMPENSATION}")


def _linear(layer, path: str, family: Family, what: str):
    try:
        module = _get(layer, path)
    except AttributeError:
        module = None
    if getattr(getattr(module, "weight", None), "dim", lambda: 0)() != 2:
        raise TrspError(f"family {family.name!r} has no separate {what} output projection at "
                        f"{path!r}; {NO_COMPENSATION}")
    return module


def residual_writers(layer, model) -> list:
    """The nn.Linears of decoder `layer` whose outputs (bias included) are everything the layer adds
    to its residual stream: the attention's and the MLP's output projections. Scaling both by s
    scales the layer's contribution by s (the scalar fold); families where a norm sits between
    them and the add get a one-line error."""
    family = family_of(model)
    _refuse_fold(model)
    return [_linear(layer, family.attn_out_path, family, "attention"),
            _linear(layer, family.mlp_out_path, family, "MLP")]


def mlp_output(layer, model):
    """The nn.Linear of decoder `layer` (of `model`) whose output is the MLP's contribution to the
    residual stream, unchanged up to the add: right-multiplying that output by a d x d map can be
    folded into the linear's weight and bias. Families where it cannot get a one-line error."""
    family = family_of(model)
    _refuse_fold(model)
    return _linear(layer, family.mlp_out_path, family, "MLP")


def map_output(layer, model):
    """(module, kind) where a compensating map of decoder `layer`'s MLP contribution folds: ("linear",
    mlp_output) where the projection's output reaches the residual add unchanged (any map folds); ("norm",
    the norm after it) where a norm sits between (only a diagonal map D folds, exactly: rmsnorm(z) (c + w) D
    = rmsnorm(z) (c + w'), w' = (c + w) D - c, c = Family.norm_offset). Other families: a one-line error."""
    family = family_of(model)
    if family.mlp_norm_path:
        return _get(layer, family.mlp_norm_path), "norm"
    return mlp_output(layer, model), "linear"


def map_module(layer, model):
    """The module a compensating map of decoder `layer`'s MLP contribution was folded into (map_output):
    what a `map` heal trains (the down_proj, or on Gemma 2/3 the norm after it)."""
    return map_output(layer, model)[0]


def norm_offset(model) -> float:
    """The constant `model`'s norms add to their weight (Family.norm_offset)."""
    return family_of(model).norm_offset


def hidden_size(config) -> int:
    """The hidden size of a model's config.json (AutoConfig), through its family's text config."""
    return _get(config, FAMILIES[config.model_type].config_path).hidden_size


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
