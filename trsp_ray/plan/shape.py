"""What the planner reads off a model: its parameter counts, from the model built on the meta device
(no weights, no download), and the sizes that set activation memory, from its config fields."""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass, field

from trsp_ray.common.errors import TrspError


@dataclass(frozen=True)
class Counts:
    """Parameter counts read off a model built on the meta device (see `meta_model`)."""

    total: int  # unique parameters: a tied LM head counts once
    layer: int  # the largest decoder layer
    lora_width: int  # in + out features summed over the decoder layers' nn.Linear (LoRA parameters per rank)
    largest_tensor: int  # elements of the largest parameter (the export holds it whole)
    tied: bool  # the LM head shares the input embedding
    head: int = 0  # the LM head's parameters (weight + bias; a tied head is the input embedding)
    mlp_out: int = 0  # one decoder layer's MLP output projection (down_proj; a fold's map target), bias included


@dataclass(frozen=True)
class Shape:
    """What the planner needs of a model: the sizes that set activation memory (config fields) and
    its parameter counts, read off the model's own structure on the meta device (`counts`).

    `read_shape` / `shape_from_config` keep the model's config (`config`). A Shape built by hand from
    the fields alone is a Llama of those sizes, counted by formula (transformers refuses some sizes
    a hand figure uses, e.g. an odd head_dim; the tests check the formula against a meta Llama).
    """

    vocab: int
    hidden: int
    intermediate: int  # the MLP's inner width (OPT's ffn_dim)
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    tied: bool
    config: str = field(default="", repr=False)  # the text config's fields as sorted JSON, with model_type

    @property
    def counts(self) -> Counts:
        return _counts(self.config) if self.config else _llama_counts(self)

    @property
    def layer_params(self) -> int:
        return self.counts.layer

    @property
    def params(self) -> int:
        return self.counts.total

    def lora_params(self, rank: int) -> int:
        """Adapters on every Linear of every decoder layer (training.lora_targets): rank x (in + out) each."""
        return rank * self.counts.lora_width

    def recipe_params(self, trainable: str, *, kept_layers: int, lora_rank: int = 8, tail_layers: int = 3,
                      maps: int = 0) -> int:
        """Parameters a training with `trainable` (heal.py's recipes) updates when `kept_layers` decoder
        layers stay in it (the others removed or frozen): all = every kept weight; lora = the kept
        layers' adapters; tail = lm_head + `tail_layers` layers; map = `maps` MLP output projections.
        The one count every plan (one process, ZeRO-3, checkpoints) sizes a training's state with."""
        if trainable == "lora":
            return self.lora_params(lora_rank) * kept_layers // self.layers
        from trsp_ray.method.recipes import MAP_RECIPE, TAIL_RECIPE, check_tail_layers

        if trainable == TAIL_RECIPE:

            check_tail_layers(tail_layers, kept=kept_layers)
            return self.counts.head + tail_layers * self.layer_params
        if trainable == MAP_RECIPE:
            return maps * self.counts.mlp_out
        return self.params - (self.layers - kept_layers) * self.layer_params


def _llama_counts(s: Shape) -> Counts:
    """A Llama decoder layer: q, k, v, o projections, SwiGLU's gate, up and down, two RMSNorms."""
    q, kv, h, i = s.heads * s.head_dim, s.kv_heads * s.head_dim, s.hidden, s.intermediate
    layer = 2 * h * q + 2 * h * kv + 3 * h * i + 2 * h
    return Counts(total=s.layers * layer + s.vocab * h * (1 if s.tied else 2) + h, layer=layer,
                  lora_width=s.layers * ((h + q) * 2 + (h + kv) * 2 + (h + i) * 3),
                  largest_tensor=max(s.vocab * h, h * i, h * q), tied=s.tied, head=s.vocab * h, mlp_out=h * i)


def _hf_config(config: dict):
    """The transformers config of a text config's fields (`model_type` included): the family's
    defaults fill what the fields leave out, as `from_pretrained` would."""
    from transformers import AutoConfig

    return AutoConfig.for_model(config["model_type"], **{k: v for k, v in config.items() if k != "model_type"})


def meta_model(config: dict):
    """The *ForCausalLM of a text config's fields (`model_type` included) on the meta device: every
    parameter has its shape and no storage, so a 70B model costs ~1 s and a few MB."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(_hf_config(config))


@functools.lru_cache(maxsize=64)
def _counts(config_json: str) -> Counts:
    """Counts of one config (sorted JSON); cached, as plans ask for them in loops (`min_workers`)."""
    from torch import nn

    from trsp_ray.models import families

    model = meta_model(json.loads(config_json))
    layers = families.decoder_layers(model)
    params = list(model.parameters())  # a tied weight is yielded once
    head = model.get_output_embeddings()
    try:
        mlp_out = sum(p.numel() for p in families.map_module(layers[0], model).parameters())
    except TrspError:  # no fold reaches this family's MLP output: no map to train
        mlp_out = 0
    return Counts(total=sum(p.numel() for p in params),
                  layer=max(sum(p.numel() for p in layer.parameters()) for layer in layers),
                  lora_width=sum(m.in_features + m.out_features for layer in layers for m in layer.modules()
                                 if isinstance(m, nn.Linear)),
                  largest_tensor=max(p.numel() for p in params),
                  tied=head is not None and head.weight is model.get_input_embeddings().weight,
                  head=0 if head is None else sum(p.numel() for p in head.parameters()), mlp_out=mlp_out)


def read_shape(path: str) -> Shape:
    """Shape from a config.json file, a model directory holding one, or a hub id (its cached or
    downloaded config.json, see trsp_ray.data.hub); no weights are read."""
    from trsp_ray.data import hub

    return shape_from_config(hub.read_config(path), source=path)


_REQUIRED = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads")


def shape_from_config(c: dict, *, source: str = "config") -> Shape:
    """Shape from the fields of a config.json (a multimodal config's text_config is used). Fields
    without `model_type` (a hand-written config, a preset's sizes) are read as a Llama, and then
    must give intermediate_size too (LlamaConfig's default would pass unnoticed)."""
    from trsp_ray.models.families import FAMILIES

    c = c.get("text_config", c)
    required = _REQUIRED if "model_type" in c else (*_REQUIRED, "intermediate_size")
    c = {"model_type": "llama", **c}
    kind = c["model_type"]
    if kind not in FAMILIES:
        raise TrspError(f"model config {source!r} has model_type {kind!r}, which the planner cannot build; "
                        f"supported: {', '.join(sorted(FAMILIES))}")
    missing = [k for k in required if k not in c]
    if missing:
        raise TrspError(f"model config {source!r} lacks {missing[0]!r}; the planner needs a decoder LLM config")
    # Private keys (_comment, _name_or_path) and quantization say nothing about the parameters' shapes.
    fields = {k: v for k, v in c.items() if not k.startswith("_") and k != "quantization_config"}
    key = json.dumps(fields, sort_keys=True)
    try:
        hf, counts = _hf_config(fields), _counts(key)
    except Exception as exc:  # noqa: BLE001 - transformers' config validators raise several types
        why = " ".join(str(exc).split()) or type(exc).__name__  # one line
        raise TrspError(f"model config {source!r} does not build a {kind} model: {why}") from None
    # Activation sizes as the model has them: OPT calls the MLP width ffn_dim; GPT-NeoX and OPT
    # have no key/value heads or head_dim of their own.
    hidden, heads = hf.hidden_size, hf.num_attention_heads
    return Shape(vocab=hf.vocab_size, hidden=hidden,
                 intermediate=getattr(hf, "intermediate_size", None) or getattr(hf, "ffn_dim", None) or 4 * hidden,
                 layers=hf.num_hidden_layers, heads=heads, kv_heads=getattr(hf, "num_key_value_heads", None) or heads,
                 head_dim=getattr(hf, "head_dim", None) or hidden // heads, tied=counts.tied, config=key)

