"""Export from a ZeRO-3 run: the weights gathered to rank 0 become a plain model, the drop set is
cut with the same surgery as the single-process path, and `export_model` writes it (temp dir +
rename, reload with plain transformers, logit check, manifest)."""

from __future__ import annotations

from pathlib import Path

import torch

from trsp_ray.errors import TrspError


def plain_state_dict(state: dict[str, torch.Tensor], layers_path: str) -> dict[str, torch.Tensor]:
    """Keys of a gated model mapped to the plain model's: `<layers>.<i>.layer.x` -> `<layers>.<i>.x`,
    gate scalars dropped (stage 2 resets them to 1, a no-op)."""
    prefix = layers_path + "."
    out = {}
    for key, value in state.items():
        if key.startswith(prefix):
            index, _, rest = key[len(prefix):].partition(".")
            if rest == "gate":
                continue
            if rest.startswith("layer."):
                key = f"{prefix}{index}.{rest[len('layer.'):]}"
        out[key] = value
    return out


def _tied(model) -> set[str]:
    """Parameter names that share storage with an earlier name (e.g. lm_head tied to the embedding)."""
    seen, tied = {}, set()
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in seen:
            tied.add(name)
        seen.setdefault(id(p), name)
    return tied


def build_plain(state: dict[str, torch.Tensor], *, model_path: str):
    """An ordinary (unpartitioned, ungated) *ForCausalLM holding `state`."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from trsp_ray import families

    config = AutoConfig.from_pretrained(model_path)
    dtype = next(iter(state.values())).dtype
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    clean = plain_state_dict(state, families.family_of(model).layers_path)
    missing, unexpected = model.load_state_dict(clean, strict=False)
    missing = [k for k in missing if k not in _tied(model)]
    if missing or unexpected:
        raise RuntimeError(f"gathered weights do not match {model_path}: missing {missing[:5]}, "
                           f"unexpected {unexpected[:5]}")
    return model.eval()


def export_gathered(state: dict[str, torch.Tensor], *, model_path: str, tokenizer, drop: list[int],
                    output: str, manifest: dict, overwrite: bool = True) -> Path:
    """Rank 0: plain model from the gathered `state`, drop set removed, exported and verified."""
    from trsp_ray.export import export_model
    from trsp_ray.surgery import remove_layers

    if state is None:
        raise TrspError("export_gathered runs on rank 0 only (other ranks hold no gathered state)")
    model = build_plain(state, model_path=model_path)
    kept = remove_layers(model, list(drop))
    info = {**manifest, "drop": list(drop), "kept": kept, "exported_from": "deepspeed zero3 gather"}
    return export_model(model, tokenizer, output, manifest=info, overwrite=overwrite)
