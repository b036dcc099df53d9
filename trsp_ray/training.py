"""Training plumbing shared by stage 1, stage 2 and heal: batches, the optimizer step, LoRA.

A *stepper* owns the forward/backward/step of one training phase. The single-process default is
`TorchStepper` (AdamW); the distributed package supplies one built on a DeepSpeed engine, so the
stage loops run unchanged on one CPU or on a ZeRO-3 cluster.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch
from torch import nn

from trsp_ray import families
from trsp_ray.perplexity import windows

Report = Callable[[dict, int], None]


def null_report(metrics: dict, step: int) -> None:
    """The report callable for runs that log nothing."""


class Batches:
    """A deterministic, resumable stream of calibration windows, each batch shape [B, seqlen].

    Windows are non-overlapping, shuffled once by `seed`, and cycled; `position` counts batches.
    """

    def __init__(self, ids: torch.Tensor, *, seqlen: int, batch_size: int, seed: int = 0,
                 max_windows: int | None = None):
        self.windows = windows(ids, seqlen, max_windows)
        gen = torch.Generator().manual_seed(seed)
        self.order = torch.randperm(self.windows.shape[0], generator=gen)
        self.batch_size = batch_size
        self.seqlen = seqlen
        self.position = 0

    def next(self) -> torch.Tensor:
        n = self.order.numel()
        idx = [(self.position * self.batch_size + k) % n for k in range(self.batch_size)]
        self.position += 1
        return self.windows[self.order[idx]]

    @property
    def tokens_per_batch(self) -> int:
        return self.batch_size * self.seqlen


class Stepper(Protocol):
    def forward(self, batch: torch.Tensor) -> torch.Tensor: ...  # mean next-token CE, scalar
    def backward(self, loss: torch.Tensor) -> None: ...
    def step(self) -> None: ...  # optimizer step + zero grad


def causal_lm_loss(model, batch: torch.Tensor) -> torch.Tensor:
    device = next(model.parameters()).device
    batch = batch.to(device)
    return model(input_ids=batch, labels=batch, use_cache=False).loss


class TorchStepper:
    """AdamW over explicit param groups, with gradient-norm clipping."""

    def __init__(self, model, param_groups: list[dict], *, clip: float = 1.0):
        self.model = model
        self.params = [p for g in param_groups for p in g["params"]]
        self.optimizer = torch.optim.AdamW(param_groups, weight_decay=0.0)
        self.clip = clip

    def forward(self, batch: torch.Tensor) -> torch.Tensor:
        return causal_lm_loss(self.model, batch)

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def step(self) -> None:
        if self.clip:
            torch.nn.utils.clip_grad_norm_(self.params, self.clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def state_dict(self) -> dict:
        return self.optimizer.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.optimizer.load_state_dict(state)


MakeStepper = Callable[[nn.Module, list[dict]], Stepper]


def freeze(model, *, except_params: list[nn.Parameter] = ()) -> None:
    keep = {id(p) for p in except_params}
    for p in model.parameters():
        p.requires_grad_(id(p) in keep)


def layer_param_groups(model, gates, *, lr: float, special: set[int], special_lr: float) -> list[dict]:
    """All trainable weights except gates: layers in `special` at `special_lr`, the rest at `lr`."""
    gate_ids = {id(p) for p in gates.gate_params()}
    special_ids = {id(p) for w in gates.wrappers if w.index in special for p in w.layer.parameters()}
    normal, boosted = [], []
    for p in model.parameters():
        if id(p) in gate_ids or not p.requires_grad:
            continue
        (boosted if id(p) in special_ids else normal).append(p)
    groups = [{"params": normal, "lr": lr}]
    if boosted:
        groups.append({"params": boosted, "lr": special_lr})
    return groups


def lora_targets(model) -> list[str]:
    """Full names of the nn.Linear modules inside the decoder layers (the LoRA targets)."""
    layers = families.decoder_layers(model)
    layer_ids = {id(m) for layer in layers for m in layer.modules() if isinstance(m, nn.Linear)}
    return [name for name, m in model.named_modules() if id(m) in layer_ids]


def add_lora(model, *, rank: int):
    """Wrap the decoder-layer Linears with LoRA adapters (peft); only adapters train."""
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(r=rank, lora_alpha=2 * rank, lora_dropout=0.0, target_modules=lora_targets(model))
    return get_peft_model(model, config)


def merge_lora(peft_model):
    """Fold the adapters into the base weights and return the plain model."""
    return peft_model.merge_and_unload()
