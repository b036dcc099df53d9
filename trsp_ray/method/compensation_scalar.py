"""The scalar fold of removed blocks (`compensation.method=scalar`, Prune&Comp's form; SPEC section 7).

The scalar fold (Prune&Comp's form, `method="scalar"`): removing block [a..b] leaves layer b+1 the
stream h that entered layer a instead of the dense y that left layer b, and later layers add their
contributions to a stream of the wrong magnitude. s = sum ||y|| / sum ||h|| over the calibration
tokens (the ratio of mean token norms, dense activations) says by how much. Scaling the stream at
the cut by s is exact to fold in a pre-norm network, whose norms ignore a scale: the SPEC's form
scales the embeddings and every earlier layer's output projections (untying a tied lm_head);
here the equivalent is folded after the cut instead, with no untie: every kept layer after b has
its attention and MLP output projections scaled by 1/s, so the stream from b+1 on is the s-scaled
stream divided by s, which the final norm (and every layer's input norm) does not see. Blocks
compose: a layer after several blocks gets the product of their 1/s. A block that ends at the last
layer feeds only the final norm, where a scale does nothing: its s is 1.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from trsp_ray.method.boundaries import Stop, blocks, hidden
from trsp_ray.models import families


@dataclass
class ScalarSums:
    """The scalar fold's sums of one block over n calibration tokens (float64): token norms of h
    (the stream entering layer a) and y (the dense stream leaving layer b), and the inner products
    that give the boundary error of a scale."""

    block: tuple[int, int]
    sums: torch.Tensor  # [sum ||h||, sum ||y||, sum <h,h>, sum <h,y>, sum <y,y>, tokens]

    @property
    def tokens(self) -> int:
        return int(round(self.sums[5].item()))


    def scale(self, num_layers: int) -> float:
        """s = sum ||y|| / sum ||h||; 1 for a block ending at the last layer (only the final norm follows)."""
        if self.block[1] == num_layers - 1 or self.sums[0] <= 0:
            return 1.0
        return float(self.sums[1] / self.sums[0])

    def residual(self, s: float) -> float:
        """||s h - y||^2 summed over the tokens."""
        return float(s * s * self.sums[2] - 2 * s * self.sums[3] + self.sums[4])


@torch.no_grad()
def scalar_sums(*, dense, windows, drop, stop: bool = True) -> list[ScalarSums]:
    """The sums of every block of `drop` over `windows`, from `dense` (one pass per batch; a block
    ending at the last layer still gets its sums, its scale is 1). `stop=False`: whole passes."""
    num = families.num_layers(dense)
    spans = blocks(drop, num)
    layers = families.decoder_layers(dense)
    out = [ScalarSums(s, torch.zeros(6, dtype=torch.float64)) for s in spans]
    last = max((b for _, b in spans), default=-1)
    store: dict = {}

    def enter(a):
        def hook(_module, args, kwargs):
            h = args[0] if args else kwargs["hidden_states"]
            store[("in", a)] = h.reshape(-1, h.shape[-1])
        return hook

    def leave(b):
        def hook(_module, _inputs, output):
            h = hidden(output)
            store[("out", b)] = h.reshape(-1, h.shape[-1])
            if stop and b == last:
                raise Stop
        return hook

    handles = [layers[a].register_forward_pre_hook(enter(a), with_kwargs=True) for a, _ in spans]
    handles += [layers[b].register_forward_hook(leave(b)) for _, b in spans]
    try:
        for batch in windows:
            store.clear()
            try:
                dense(input_ids=batch.to(next(dense.parameters()).device), use_cache=False)
            except Stop:
                pass
            for acc in out:
                h, y = store[("in", acc.block[0])].double(), store[("out", acc.block[1])].double()
                acc.sums += torch.stack([h.norm(dim=1).sum(), y.norm(dim=1).sum(), (h * h).sum(), (h * y).sum(),
                                         (y * y).sum(), h.new_tensor(float(h.shape[0]))]).cpu()
    finally:
        for handle in handles:
            handle.remove()
    return out


@torch.no_grad()
def fold_scales(*, model, drop, scales: list[float], num_layers: int, layers: dict | None = None) -> None:
    """Scale the output projections (weights and biases) of every kept layer of `model` after block
    k of `drop` by 1/scales[k]. `model` is the layer-removed copy (kept layers in order); or
    `layers` maps original indices to the decoder layers to fold (a model that still holds every
    layer, as on the workers, which bypass the drop set: dropped ones are skipped)."""
    spans = blocks(drop, num_layers)
    dropped = set(int(i) for i in drop)
    if layers is None:
        kept = [i for i in range(num_layers) if i not in dropped]
        layers = dict(zip(kept, families.decoder_layers(model)))
    for original, layer in layers.items():
        factor = 1.0
        for (_a, b), s in zip(spans, scales):
            if original > b:
                factor /= s
        if original in dropped or factor == 1.0:
            continue
        for proj in families.residual_writers(layer, model):
            for p in (proj.weight, getattr(proj, "bias", None)):
                if p is not None:
                    p.copy_((p.double() * factor).to(p.dtype))


def compensate_scalar(*, model, dense, drop, windows, reduce) -> dict:
    num = families.num_layers(dense)
    sums = scalar_sums(dense=dense, windows=windows, drop=drop)
    for acc in sums:
        acc.sums = reduce(acc.sums).cpu()
    scales = [acc.scale(num) for acc in sums]
    fold_scales(model=model, drop=drop, scales=scales, num_layers=num)
    return {"blocks": [acc.block for acc in sums], "tokens": sums[0].tokens if sums else 0, "scales": scales,
            "residual": [acc.residual(s) for acc, s in zip(sums, scales)],
            "residual_identity": [acc.residual(1.0) for acc in sums]}
