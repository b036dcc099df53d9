"""Per-layer scalar gates, bypass and residual probes, applied by wrapping decoder layers.

A `GatedLayer` wraps one decoder layer without editing the model file. With x the hidden state
entering the layer and y = f(x) what the layer returns (residual adds included):

    gate "delta":  y' = x + s * (y - x), written y + (s - 1) * (y - x) so s == 1 is bit-exact y
    gate "output": y' = s * y
    bypass:        y' = x (the layer is not computed: identical to the layer being removed)

Stage 2 uses `residual_scale` (a plain float, not trained) to anneal a layer to exact identity,
and `penalty_norm` to keep d(x_{i+1}, x_i) in the graph for the regularizer.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch
from torch import nn

from trsp_ray.models import families


class GatedLayer(nn.Module):
    def __init__(self, layer: nn.Module, *, index: int, gate_mode: str = "delta"):
        super().__init__()
        self.layer = layer
        self.index = index  # original position in the model
        self.gate_mode = gate_mode
        self.gate = nn.Parameter(torch.ones((), dtype=torch.float32))
        self.gated = False  # apply the gate (stage 1)
        self.bypass = False
        self.residual_scale = 1.0
        self.penalty_norm: str | None = None  # "l2" | "l1": record the stage-2 distance
        self.inject: torch.Tensor | None = None  # replaces the incoming hidden state (SLEB replay)
        self.probe: Callable[[int, torch.Tensor, torch.Tensor], None] | None = None
        self.l1_term: torch.Tensor | None = None
        self.distance: torch.Tensor | None = None
        self.relative_update: float | None = None
        self.grad_ema = 0.0
        self._tuple_tail: int | None = None  # the wrapped layer returns (h, *k extra) when set

    def _record_grad(self, grad: torch.Tensor) -> None:
        # dLoss/ds, smoothed: breaks ties between gates the projection has pinned at exactly 0
        # (at s = 0 the |s| term adds nothing, so this is the CE pull alone).
        self.grad_ema = 0.8 * self.grad_ema + 0.2 * float(grad.detach().float().sum())

    def __getattr__(self, name: str):
        # Model code reads attributes of its layers (e.g. `attention_type`); forward them.
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self._modules["layer"], name)

    def forward(self, *args, **kwargs):
        if self.inject is not None:
            args, kwargs = _replace_hidden(args, kwargs, self.inject)
        x = args[0] if args else kwargs["hidden_states"]
        if self.bypass or self.residual_scale == 0.0:
            self.l1_term = self.distance = None
            return x if self._tuple_tail is None else (x,) + (None,) * self._tuple_tail
        out = self.layer(*args, **kwargs)
        is_tuple = isinstance(out, tuple)
        self._tuple_tail = len(out) - 1 if is_tuple else None
        y = out[0] if is_tuple else out
        if self.penalty_norm is not None:
            delta = (y - x).float()
            per_token = delta.norm(dim=-1) if self.penalty_norm == "l2" else delta.abs().sum(dim=-1)
            self.distance = per_token.mean()
            self.relative_update = (delta.norm(dim=-1) / x.float().norm(dim=-1).clamp_min(1e-6)).mean().item()
        if self.probe is not None:
            self.probe(self.index, x.detach(), y.detach())
        if self.gated:
            s = self.gate.to(device=y.device, dtype=y.dtype)  # a gate left on the host: no device mix
            if s.requires_grad:
                # The hook goes on a non-leaf alias that lives and dies with this step's graph: on the
                # Parameter itself (what `.to` returns when the dtype already matches) hooks would
                # pile up, one per forward, and every backward would update the EMA many times.
                s = s.view_as(s)
                s.register_hook(self._record_grad)
            y = y + (s - 1) * (y - x) if self.gate_mode == "delta" else s * y
            self.l1_term = self.gate.abs()
        else:
            self.l1_term = None
        if self.residual_scale != 1.0:
            y = x + self.residual_scale * (y - x)
        return (y,) + tuple(out[1:]) if is_tuple else y


def _replace_hidden(args: tuple, kwargs: dict, hidden: torch.Tensor):
    if args:
        return (hidden,) + tuple(args[1:]), kwargs
    return args, {**kwargs, "hidden_states": hidden}


class GateStack:
    """The GatedLayer wrappers of one model, in layer order, with helpers used by the stages."""

    def __init__(self, wrappers: list[GatedLayer]):
        self.wrappers = wrappers
        # Reading parameters under ZeRO-3 needs a gather; the distributed package swaps this in.
        self.gather: Callable[[list[nn.Parameter]], contextlib.AbstractContextManager] = (
            lambda params: contextlib.nullcontext()
        )

    def __len__(self) -> int:
        return len(self.wrappers)

    def __getitem__(self, i: int) -> GatedLayer:
        return self.wrappers[i]

    def gate_params(self) -> list[nn.Parameter]:
        return [w.gate for w in self.wrappers]

    def gate_values(self) -> list[float]:
        params = self.gate_params()
        with self.gather(params):
            return [float(p.detach().float().reshape(-1)[0]) for p in params]

    def set_gated(self, on: bool, *, mode: str | None = None) -> None:
        for w in self.wrappers:
            w.gated = on
            if mode is not None:
                w.gate_mode = mode
            w.gate.requires_grad_(on)

    def reset_gates(self) -> None:
        params = self.gate_params()
        with self.gather(params), torch.no_grad():
            for p in params:
                p.fill_(1.0)

    def clamp_nonnegative(self) -> None:
        """Project the gates onto s >= 0 after a step: Adam moves a scalar by about lr per step
        whatever the gradient size, so under the L1 pull an unimportant gate would overshoot zero
        and |s| would grow again; the projection keeps it at 0, which is where L1 wants it."""
        params = self.gate_params()
        with self.gather(params), torch.no_grad():
            for p in params:
                p.clamp_(min=0.0)

    def clear_records(self) -> None:
        """Drop the tensors recorded in the last forward (they hold the autograd graph alive and
        make the model impossible to deepcopy)."""
        for w in self.wrappers:
            w.l1_term = w.distance = None

    @contextlib.contextmanager
    def state(self, *, gated: bool, bypass):
        """Temporarily set every wrapper's gating and the bypassed layers (e.g. to score a removal
        from inside stage 1); restores both afterwards. Trainability of the gates is untouched."""
        saved = [(w.gated, w.bypass) for w in self.wrappers]
        wanted = set(bypass)
        for w in self.wrappers:
            w.gated, w.bypass = gated, w.index in wanted
        try:
            yield self
        finally:
            for w, (g, b) in zip(self.wrappers, saved):
                w.gated, w.bypass = g, b

    def set_bypass(self, indices) -> None:
        wanted = set(indices)
        for w in self.wrappers:
            w.bypass = w.index in wanted

    def bypassed(self) -> list[int]:
        return [w.index for w in self.wrappers if w.bypass]

    def l1(self, indices, *, like: torch.Tensor | None = None) -> torch.Tensor:
        """Sum of |s_i| over `indices`, from the terms recorded in the last forward, on the device of
        `like` (the loss it is added to; the terms' own device without it)."""
        terms = [self.wrappers[i].l1_term for i in indices if self.wrappers[i].l1_term is not None]
        device = like.device if like is not None else (terms[0].device if terms else None)
        if not terms:
            return torch.zeros((), device=device)
        return torch.stack([t.reshape(()).to(device) for t in terms]).sum()


def attach_gates(model, *, gate_mode: str = "delta") -> GateStack:
    """Wrap every decoder layer of `model` in a GatedLayer; logits are unchanged. Re-attaching keeps
    the wrappers (and gate values) but clears bypass, gating and stage-2 state."""
    layers = families.decoder_layers(model)
    wrappers = []
    for i, layer in enumerate(layers):
        if not isinstance(layer, GatedLayer):
            ref = next(layer.parameters(), None)
            layer = GatedLayer(layer, index=i, gate_mode=gate_mode)
            if ref is not None and ref.device.type != "meta":
                layer.gate.data = layer.gate.data.to(ref.device)
            layers[i] = layer
        else:  # already wrapped: start from a clean state, keep the module
            layer.gated, layer.bypass, layer.residual_scale, layer.gate_mode = False, False, 1.0, gate_mode
            layer.penalty_norm = layer.inject = layer.probe = None
        wrappers.append(layer)
    stack = GateStack(wrappers)
    stack.clear_records()
    return stack


def detach_gates(model) -> None:
    """Put the original decoder layers back (gate values are discarded)."""
    layers = families.decoder_layers(model)
    for i, layer in enumerate(layers):
        if isinstance(layer, GatedLayer):
            layers[i] = layer.layer
