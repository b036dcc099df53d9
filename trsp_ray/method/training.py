"""Training plumbing shared by stage 1, stage 2 and heal: batches, the optimizer step, LoRA.

A *stepper* owns the forward/backward/step of one training phase. The single-process default is
`TorchStepper` (AdamW); the distributed package supplies one built on a DeepSpeed engine, so the
stage loops run unchanged on one CPU or on a ZeRO-3 cluster.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Protocol

import torch
from torch import nn

from trsp_ray.data.calibration import interleave
from trsp_ray.data.perplexity import windows
from trsp_ray.models import families

# The stream of calibration batches each stage reads (an offset to the run's seed): one process and
# the Ray Train workers read the same streams, so both select, fit and train on the same windows.
STAGE1_STREAM, STAGE2_STREAM, HEAL_STREAM, SELECTION_STREAM, PROBE_STREAM, FIT_STREAM = 0, 1, 2, 100, 200, 300
Report = Callable[[dict, int], None]
LOW_PRECISION = (torch.bfloat16, torch.float16)  # dtypes whose trained parameters get an fp32 master


def null_report(metrics: dict, step: int) -> None:
    """The report callable for runs that log nothing."""


class Batches:
    """A deterministic, resumable stream of calibration windows, each batch shape [B, seqlen].

    Windows are non-overlapping, shuffled once by `seed`, and cycled; `position` counts batches.
    With `bos` (perplexity.bos_token of the tokenizer), each window is [bos] + seqlen - 1 text tokens,
    the convention every evaluation window follows, so a model is never selected or trained on
    inputs it is not scored on (SPEC section 5).
    """

    def __init__(self, ids: torch.Tensor, *, seqlen: int, batch_size: int, seed: int = 0,
                 max_windows: int | None = None, bos: int | None = None, strata: torch.Tensor | None = None):
        self.windows = windows(ids, seqlen, max_windows, bos=bos)
        gen = torch.Generator().manual_seed(seed)
        n = self.windows.shape[0]
        body = seqlen - (bos is not None)
        if strata is not None and ids.numel() // body == strata.numel():
            self.order = stratified_order(strata[:n], gen)
        else:  # one source, or windows that do not line up with the mixture's chunks (another seqlen)
            self.order = torch.randperm(n, generator=gen)
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


def stratified_order(strata: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """A seeded shuffle of window indices that keeps each stratum's share within one window in every
    prefix: each stratum's windows shuffled, then spread evenly (calibration.interleave)."""
    labels = sorted(set(strata.tolist()))
    pools = [torch.nonzero(strata == lab).flatten() for lab in labels]
    pools = [p[torch.randperm(p.numel(), generator=gen)] for p in pools]
    taken = [0] * len(pools)
    order = []
    for i in interleave([p.numel() for p in pools]):
        order.append(int(pools[i][taken[i]]))
        taken[i] += 1
    return torch.tensor(order, dtype=torch.long)


def split_over_ranks(windows: list[torch.Tensor], *, rank: int, world: int) -> tuple[list[torch.Tensor], int]:
    """(this rank's rows k % world == rank of the concatenated `windows`, in batches of the first
    window's batch size; the padding forwards this rank runs so that every rank runs as many
    forwards as the largest share): the one data-parallel split of every forward that ranks share
    (the removal probes', the fit's, Block Influence's). Under ZeRO-3 each forward is a collective,
    so a rank short of a batch must still run one; a rank with no row gets none and only padding."""
    rows = torch.cat(list(windows))
    size = windows[0].shape[0]
    part = rows[rank::world]
    mine = list(part.split(size)) if part.shape[0] else []  # torch splits an empty tensor into one empty batch
    passes = math.ceil(math.ceil(rows.shape[0] / world) / size)
    return mine, passes - len(mine)


def join_over_ranks(parts: list, *, rows: int) -> torch.Tensor:
    """split_over_ranks undone: `parts[r]` (rank r's rows k % world == r, concatenated; None for a
    rank with no row) back in their order, [rows, ...] (the teacher pass's records, gathered)."""
    world = len(parts)
    first = next(p for p in parts if p is not None)
    out = first.new_empty((rows, *first.shape[1:]))
    for r, part in enumerate(parts):
        if part is not None:
            out[r::world] = part
    return out


class Stepper(Protocol):
    def forward(self, batch: torch.Tensor) -> torch.Tensor: ...  # mean next-token CE, scalar
    def backward(self, loss: torch.Tensor) -> None: ...
    def step(self) -> None: ...  # optimizer step + zero grad


def causal_lm_loss(model, batch: torch.Tensor) -> torch.Tensor:
    device = next(model.parameters()).device
    batch = batch.to(device)
    return model(input_ids=batch, labels=batch, use_cache=False).loss


class DistillLoss:
    """A training objective: KL(teacher || model) between next-token distributions at `temperature`,
    mean over tokens, times T^2 (so its gradient scale does not depend on T). The teacher (the dense
    model) runs without gradients on the student's device: a teacher left in host memory beside a
    GPU student made each heal step ~20x slower (a 3B on one H200: 8.6 s vs 0.44 s), so a teacher
    elsewhere is a caller's bug, refused rather than silently slow."""

    def __init__(self, teacher, *, temperature: float = 1.0):
        self.teacher, self.temperature = teacher, temperature

    def __call__(self, model, batch: torch.Tensor) -> torch.Tensor:
        device = next(model.parameters()).device
        t_device = next(self.teacher.parameters()).device
        if t_device != device:
            raise ValueError(f"the distillation teacher is on {t_device} and the student on {device}; "
                             f"put the teacher on the student's device")
        batch = batch.to(device)
        with torch.no_grad():
            t_logits = self.teacher(input_ids=batch, use_cache=False).logits.float()
        s_logits = model(input_ids=batch, use_cache=False).logits.float()
        t = self.temperature
        t_logp = torch.log_softmax(t_logits / t, dim=-1)
        s_logp = torch.log_softmax(s_logits / t, dim=-1)
        kl = (t_logp.exp() * (t_logp - s_logp)).sum(-1).mean()
        return kl * t**2


class TorchStepper:
    """AdamW over explicit param groups, with gradient-norm clipping.

    fp32 parameters step in place, exactly as they always have. A bf16/fp16 parameter gets an
    fp32 master copy that AdamW steps (its moments are fp32 too) and that is rounded back into
    the parameter after each step: bf16 keeps 8 significant bits, so an update of lr 1e-4 x a
    weight of 0.05 (2e-3 relative) would round away entirely in a bf16 weight. fp16 also gets a
    dynamic loss scale (its gradients underflow below 6e-8); a step whose gradients overflow is
    skipped and the scale halved. Gates are fp32 parameters and never need a master.
    """

    def __init__(self, model, param_groups: list[dict], *, clip: float = 1.0,
                 objective: Callable[[nn.Module, torch.Tensor], torch.Tensor] | None = None):
        self.model = model
        self.objective = objective or causal_lm_loss  # what `forward` returns: next-token CE by default
        self.masters: list[tuple[nn.Parameter, nn.Parameter]] = []  # (low-precision param, fp32 master)
        groups = []
        for g in param_groups:
            params = []
            for p in g["params"]:
                if p.dtype in LOW_PRECISION:
                    master = nn.Parameter(p.detach().to(torch.float32, copy=True))
                    self.masters.append((p, master))
                    p = master
                params.append(p)
            groups.append({**g, "params": params})
        self.params = [p for g in groups for p in g["params"]]
        # fused: no multi-tensor temporaries the size of all gradients (only on the new master path,
        # so fp32 runs keep their exact update order).
        extra = {"fused": True} if self.masters else {}
        self.optimizer = torch.optim.AdamW(groups, weight_decay=0.0, **extra)
        self.clip = clip
        fp16 = any(p.dtype == torch.float16 for p, _ in self.masters)
        self.loss_scale = 2.0**16 if fp16 else 1.0
        self.skipped_steps = 0

    def forward(self, batch: torch.Tensor) -> torch.Tensor:
        return self.objective(self.model, batch)

    def backward(self, loss: torch.Tensor) -> None:
        (loss * self.loss_scale if self.loss_scale != 1.0 else loss).backward()

    def step(self) -> None:
        for p, master in self.masters:  # fp32 gradients for the masters; the low-precision ones go
            master.grad = None if p.grad is None else p.grad.float()
            p.grad = None
        if self.loss_scale != 1.0 and not self._unscale():
            self.optimizer.zero_grad(set_to_none=True)
            return
        if self.clip:
            torch.nn.utils.clip_grad_norm_(self.params, self.clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        with torch.no_grad():
            for p, master in self.masters:
                p.copy_(master)

    def _unscale(self) -> bool:
        """Divide every gradient by the loss scale; False (and a halved scale) on inf/NaN."""
        grads = [p.grad for p in self.params if p.grad is not None]
        finite = bool(torch.stack([torch.isfinite(g).all() for g in grads]).all()) if grads else True  # one sync
        if not finite:
            self.loss_scale /= 2.0
            self.skipped_steps += 1
            return False
        for g in grads:
            g.div_(self.loss_scale)
        return True

    def state_dict(self) -> dict:
        return self.optimizer.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.optimizer.load_state_dict(state)
        with torch.no_grad():  # resumed masters hold the resumed parameters, not the old rounding
            for p, master in self.masters:
                master.copy_(p.float())



def set_checkpointing(model, enabled: bool) -> None:
    """Recompute each decoder layer's activations in backward instead of keeping them.

    Only the wrapped layer is recomputed: a GatedLayer's gate, probe and stage-2 distance stay
    outside, so what it records is computed once. Unlike `gradient_checkpointing_enable`, this
    does not need training mode (which would switch on dropout, e.g. OPT's 0.1) and leaves the
    module tree and parameter names alone (LoRA targets, export). No-op without gradients.
    """
    from trsp_ray.method.gates import GatedLayer

    for layer in families.decoder_layers(model):
        inner = layer.layer if isinstance(layer, GatedLayer) else layer
        cls = type(inner)
        base = cls.__mro__[1] if getattr(cls, "_trsp_checkpointed", False) else cls
        inner.__class__ = _checkpointed_class(base) if enabled else base


def checkpointing_enabled(model) -> bool:
    from trsp_ray.method.gates import GatedLayer

    layers = families.decoder_layers(model)
    return any(getattr(layer.layer if isinstance(layer, GatedLayer) else layer, "_trsp_checkpointed", False)
               for layer in layers)


_CHECKPOINTED: dict[type, type] = {}


def _checkpointed_class(cls: type) -> type:
    """A subclass of a decoder-layer class whose forward runs under torch.utils.checkpoint."""
    if cls not in _CHECKPOINTED:
        def forward(self, *args, **kwargs):
            if not torch.is_grad_enabled():
                return cls.forward(self, *args, **kwargs)
            from torch.utils.checkpoint import checkpoint

            return checkpoint(cls.forward, self, *args, use_reentrant=False, **kwargs)

        _CHECKPOINTED[cls] = type(cls.__name__, (cls,), {"forward": forward, "__module__": cls.__module__,
                                                         "__qualname__": cls.__qualname__,
                                                         "_trsp_checkpointed": True})
    return _CHECKPOINTED[cls]


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


def lora_targets(model, layers=None) -> list[str]:
    """Full names of the nn.Linear modules inside the decoder layers (the LoRA targets); `layers`:
    those layers only (default: every decoder layer)."""
    layers = families.decoder_layers(model) if layers is None else layers
    layer_ids = {id(m) for layer in layers for m in layer.modules() if isinstance(m, nn.Linear)}
    return [name for name, m in model.named_modules() if id(m) in layer_ids]


def add_lora(model, *, rank: int, layers=None):
    """Wrap the decoder-layer Linears (of `layers` only, when given) with LoRA adapters (peft); only
    adapters train."""
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(r=rank, lora_alpha=2 * rank, lora_dropout=0.0, target_modules=lora_targets(model, layers))
    return get_peft_model(model, config)


def merge_lora(peft_model):
    """Fold the adapters into the base weights and return the plain model."""
    return peft_model.merge_and_unload()
