"""Two adjacent blocks as one (FlattenGPT, ICML 2026): the shape transform of a merge
(trsp_ray/method/merge.py scores, cuts and repairs with it).

The parallel form. Blocks a and b = a + 1 of a pre-norm decoder compute, on the stream x entering a,
    h_a = x + A_a(n_a(x)),  x_b = h_a + M_a(m_a(h_a)),  h_b = x_b + A_b(n_b(x_b)),  y = h_b + M_b(m_b(h_b))
(A attention, M MLP, n and m their norms). The flattened block computes
    h = x + A_a(n(x)) + A_b(n(x)),   y = h + M_a(m(h)) + M_b(m(h))
with one attention holding both blocks' heads (each head its own q/k/v rows and o columns) and one MLP
holding both blocks' channels (each its own gate/up rows and down column). That is the one
approximation before the cut: block b's attention reads x instead of x_b (it no longer sees what block
a wrote), block a's MLP reads h instead of h_a (it now sees A_b), and block b's MLP reads h instead of
h_b (it no longer sees M_a). On a pair whose blocks change the stream little (the pairs
trsp_ray/method/merge_select.py picks) these differences are small; with GPT-NeoX's parallel residual
every attention and MLP of both blocks reads x.

The norms fold exactly. n_a(x) = x / rms(x) * (c + w_a) (c = Family.norm_offset, 1 on Gemma): both blocks
normalise the same x, so the normalisation is shared, and the diagonal c + w_a goes into the input
columns of the linears that read it, W ((c + w_a) * z) = (W diag(c + w_a)) z. So the flattened norm has
scale 1 and each head's q/k/v rows (each channel's gate/up rows) carry their own block's scale. A
LayerNorm's shift beta goes into the same linears' biases (b + W beta); its mean removal is shared too.
The output projections' biases add (both blocks' contributions do).

Units. Under grouped-query attention an attention unit is a KV group with its query heads (its q rows,
its k and v rows, its o columns), so a cut back to the original count of units keeps
num_key_value_heads and num_attention_heads; without it a unit is one head. An MLP unit is a channel.
Fused projections keep their layout: Phi-3's [q; k; v] and [gate; up] are cut segment by segment,
GPT-NeoX's per-head q, k, v rows unit by unit (families.Family.qkv_layout).

Refused by name (families.merge_refusal): Qwen3 and Gemma 3's q_norm / k_norm (one weight for all of a
layer's heads), Gemma 2/3's norms after the attention and the MLP, OPT with its norms after the
residual adds; a pair of layers with different per-layer settings (sliding against full attention).
Gemma's scaled embeddings and tied embeddings are outside the blocks and untouched.
"""

from __future__ import annotations

import copy
import operator
from dataclasses import dataclass, field

import torch

from trsp_ray.common.errors import TrspError
from trsp_ray.method.surgery import remove_layers
from trsp_ray.models import families

# attention attributes and config fields that count heads (OPT views q by self.num_heads, Phi-3 splits
# its fused qkv by config.num_attention_heads): a wide attention holds twice as many until it is cut
_HEAD_COUNTS = ("num_heads", "num_attention_heads", "num_key_value_heads")


def module_at(module, path: str):
    """The submodule of `module` at dotted `path` (a family table path, e.g. "self_attn.q_proj")."""
    return operator.attrgetter(path)(module)


@dataclass(frozen=True)
class Part:
    """One linear of a block: its rows (an input linear) or columns (the output linear) as stacked
    segments, segment s holding `units` x sizes[s] rows, unit by unit (a fused [q; k; v] has three)."""

    path: str
    sizes: tuple[int, ...]


@dataclass(frozen=True)
class Layout:
    """How a block's attention (units: KV groups) or MLP (units: channels) splits into units."""

    units: int
    inputs: tuple[Part, ...]
    output: Part
    norm: str


@dataclass
class Flat:
    """A flattened pair: the wide block's index in the model now, its layouts (per original block,
    the wide block holds 2 x units, a's first), and the attention's head counts to put back. `block`: the
    wide block where it stands outside the model (a ZeRO-3 rank's plain copy, run in the pair's place by a
    hook: distributed/merging.py); None: it is the model's layer at `index`."""

    index: int
    attention: Layout
    mlp: Layout
    restore: dict = field(default_factory=dict)
    block: torch.nn.Module | None = None


def wide_of(model, flat: Flat) -> torch.nn.Module:
    """The flattened pair's wide block: its own module, or the model's layer at its index."""
    return flat.block if flat.block is not None else families.decoder_layers(model)[flat.index]


def attention_layout(model, layer) -> Layout:
    """The attention units of decoder `layer` (of the original width) of `model`."""
    family, text = families.family_of(model), families.text_config(model)
    heads = text.num_attention_heads
    groups = getattr(text, "num_key_value_heads", None) or heads
    head_dim = module_at(layer, family.attn_out_path).in_features // heads
    per_q = heads // groups * head_dim  # a KV group's query rows
    paths = family.attn_in_paths
    if len(paths) == 3:
        inputs = tuple(Part(p, (s,)) for p, s in zip(paths, (per_q, head_dim, head_dim)))
    elif family.qkv_layout == "per_head":  # GPT-NeoX: no grouped-query attention, a unit is one head
        inputs = (Part(paths[0], (per_q + 2 * head_dim,)),)
    else:
        inputs = (Part(paths[0], (per_q, head_dim, head_dim)),)
    return Layout(groups, inputs, Part(family.attn_out_path, (per_q,)), family.norm_paths[0])


def mlp_layout(model, layer) -> Layout:
    """The MLP channels of decoder `layer` of `model` (a fused [gate; up] linear has two segments)."""
    family = families.family_of(model)
    channels = module_at(layer, family.mlp_out_path).in_features
    inputs = tuple(Part(p, (1,) * (module_at(layer, p).out_features // channels)) for p in family.mlp_in_paths)
    return Layout(channels, inputs, Part(family.mlp_out_path, (1,)), family.norm_paths[1])


def _segments(t: torch.Tensor, part: Part, units: int) -> list[torch.Tensor]:
    """The rows of `t` [R, ...] as one [units, size, ...] tensor per segment of `part`."""
    pieces = t.split([units * s for s in part.sizes])
    return [p.unflatten(0, (units, s)) for p, s in zip(pieces, part.sizes)]


def _join(ta: torch.Tensor, tb: torch.Tensor, part: Part, units: int) -> torch.Tensor:
    """Two blocks' rows side by side in every segment of `part`: a's units, then b's."""
    pairs = zip(_segments(ta, part, units), _segments(tb, part, units))
    return torch.cat([torch.cat([x, y]).flatten(0, 1) for x, y in pairs])


def _take(t: torch.Tensor, part: Part, units: int, keep: torch.Tensor) -> torch.Tensor:
    """The rows of units `keep` (indices, ascending) in every segment of `part`."""
    return torch.cat([s[keep.to(s.device)].flatten(0, 1) for s in _segments(t, part, units)])


def _set(linear, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
    """Give `linear` a new weight [out, in] (and bias, where given) in its own dtype and device, contiguous
    (a cut of columns is a transposed view; safetensors writes contiguous tensors only)."""
    old = linear.weight
    linear.weight = torch.nn.Parameter(weight.to(old.dtype).contiguous(), requires_grad=old.requires_grad)
    linear.out_features, linear.in_features = weight.shape
    if bias is not None:
        linear.bias = torch.nn.Parameter(bias.to(old.dtype), requires_grad=old.requires_grad)


def _folded(model, block, layout: Layout, part: Part) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(weight, bias) of `block`'s input linear `part` of `layout` with the norm in front of it folded in,
    W diag(c + w) and b + W beta for a LayerNorm's shift: computed in float64, returned in the linear's dtype
    (one linear's float64 copy at a time: 1.9 GB for a 70B gate_proj)."""
    norm, c = module_at(block, layout.norm), families.norm_offset(model)
    scale, shift = getattr(norm, "weight", None), getattr(norm, "bias", None)
    linear = module_at(block, part.path)
    w = linear.weight.to(torch.float64, copy=True)  # scaled in place below: never the weight itself
    b = None if linear.bias is None else linear.bias.double()
    if shift is not None and bool(shift.any()):
        if b is None:
            raise TrspError(f"family {families.family_of(model).name!r}: {layout.norm} has a shift and "
                            f"{part.path} no bias to take it, so blocks cannot merge")
        b = b + w @ shift.double()
    if scale is not None:
        w.mul_(c + scale.double())  # in place: one float64 copy of the linear
    return w.to(linear.weight.dtype), None if b is None else b.to(linear.weight.dtype)


def _plain(norm, c: float) -> None:
    """`norm` with scale 1 and no shift: its folded scales now sit in the linears after it."""
    if getattr(norm, "weight", None) is not None:
        norm.weight.fill_(1.0 - c)
    if getattr(norm, "bias", None) is not None:
        norm.bias.zero_()


def _attention(flat: Flat) -> str:
    return flat.attention.output.path.rpartition(".")[0]


def _double_heads(attn, restore: dict) -> None:
    """Double `attn`'s head counts for the wide block (its config: a copy that says so); what they were
    goes into `restore` (_restore_heads puts it back)."""
    for name in _HEAD_COUNTS:
        if isinstance(attn.__dict__.get(name), int):
            restore[name] = attn.__dict__[name]
            setattr(attn, name, 2 * attn.__dict__[name])
    if getattr(attn, "config", None) is not None:
        restore["config"] = attn.config
        wide = copy.copy(attn.config)
        for name in _HEAD_COUNTS:
            if isinstance(getattr(wide, name, None), int):
                setattr(wide, name, 2 * getattr(wide, name))
        attn.config = wide


def _restore_heads(attn, restore: dict) -> None:
    """Put back `attn`'s head counts and config (the model's own object, which save_pretrained writes)."""
    for name, value in restore.items():
        setattr(attn, name, value)
    restore.clear()


def family_refusal(model) -> str:
    """Why no two blocks of `model` can be merged, in one line naming its family ("" = they can)."""
    reason = families.merge_refusal(model.config)
    return f"family {families.family_of(model).name!r} cannot merge blocks: {reason}" if reason else ""


def pair_refusal(model, first: int) -> str:
    """Why blocks `first` and `first + 1` of `model` cannot be merged, in one line ("" = they can):
    the family's (families.merge_refusal), or the two layers differ in a per-layer config list (sliding
    against full attention: one block cannot be both)."""
    family, text = families.family_of(model), families.text_config(model)
    reason = family_refusal(model)
    if reason:
        return reason
    total = families.num_layers(model)
    if not 0 <= first < total - 1:
        return f"pair ({first}, {first + 1}) is not valid for a {total}-layer model; a pair starts in [0, {total - 1})"
    for name in families.per_layer_lists(text, total, family.per_layer_config):
        got = getattr(text, name)
        if got[first] != got[first + 1]:
            return (f"layers {first} and {first + 1} of family {family.name!r} differ in config.{name} "
                    f"({got[first]!r} vs {got[first + 1]!r}): one merged block cannot be both")
    return ""


def check_pairs(*, model, firsts) -> None:
    """Refuse, in one line, pairs (first, first + 1) of `model` that overlap or cannot be merged."""
    firsts = sorted(int(a) for a in firsts)
    for k, a in enumerate(firsts):
        reason = pair_refusal(model, a)
        if reason:
            raise TrspError(reason)
        if k and a <= firsts[k - 1] + 1:
            raise TrspError(f"pairs starting at {firsts} overlap at layer {a}; a layer joins one pair at most")


@torch.no_grad()
def widen(model, a, b, *, index: int) -> Flat:
    """Block `a` (a decoder layer of `model`'s family) made the flattened pair of `a` and `b`, in place: both
    blocks' attention units and MLP channels side by side, their norms folded into the linears after them
    (module doc); `index`: where the wide block stands in the model. `b` is left as it was."""
    flat = Flat(index, attention_layout(model, a), mlp_layout(model, a))
    for layout in (flat.attention, flat.mlp):
        for part in layout.inputs:  # folded before either block's norm is made plain below
            (wa, ba), (wb, bb) = _folded(model, a, layout, part), _folded(model, b, layout, part)
            _set(module_at(a, part.path), _join(wa, wb, part, layout.units),
                 None if ba is None else _join(ba, bb, part, layout.units))
        out_a, out_b = module_at(a, layout.output.path), module_at(b, layout.output.path)
        # both blocks' contributions add: o columns side by side, one bias (their sum)
        _set(out_a, _join(out_a.weight.T, out_b.weight.T, layout.output, layout.units).T,
             None if out_a.bias is None else out_a.bias + out_b.bias)
        _plain(module_at(a, layout.norm), families.norm_offset(model))
    _double_heads(module_at(a, _attention(flat)), flat.restore)
    return flat


@torch.no_grad()
def flatten(model, first: int) -> Flat:
    """Blocks `first` and `first + 1` of `model` as one block of twice the width at `first` (widen), in place:
    the model has one layer fewer, renumbered by surgery."""
    check_pairs(model=model, firsts=[first])
    layers = families.decoder_layers(model)
    flat = widen(model, layers[first], layers[first + 1], index=first)
    remove_layers(model, [first + 1])
    return flat


@torch.no_grad()
def cut_part(model, flat: Flat, part: str, *, keep: torch.Tensor, out: torch.Tensor | None = None) -> None:
    """Keep units `keep` (ascending indices into the wide block's, a's first) of the flattened pair `flat`'s
    `part` ("attention" or "mlp"): that part is back to its original width. `out` [d, width]: refitted
    output weights (None: the kept units' own columns). The attention's head counts go back with its cut."""
    layer, layout = wide_of(model, flat), getattr(flat, part)
    wide = 2 * layout.units
    for piece in layout.inputs:
        linear = module_at(layer, piece.path)
        _set(linear, _take(linear.weight, piece, wide, keep),
             None if linear.bias is None else _take(linear.bias, piece, wide, keep))
    output = module_at(layer, layout.output.path)
    _set(output, _take(output.weight.T, layout.output, wide, keep).T if out is None else out)
    if part == "attention":
        _restore_heads(module_at(layer, _attention(flat)), flat.restore)


@torch.no_grad()
def put_merged(model, first: int, state: dict[str, torch.Tensor]) -> None:
    """Blocks `first` and `first + 1` of `model` replaced by a merged block stored before (`state`: its
    state_dict, as merge_pairs left it), in place and without a pass: the pair is flattened and cut back to
    one block's shape (heads, channels, config, numbering as a merge leaves them), then given `state`."""
    flat = flatten(model, first)
    for part in ("attention", "mlp"):
        cut_part(model, flat, part, keep=torch.arange(getattr(flat, part).units))
    families.decoder_layers(model)[first].load_state_dict(state)


class InPlace:
    """Where merge.merge_pairs merges in one process: in the model itself, each pair flattened into its first
    layer and the second removed (the k earlier pairs are one layer each by now, so pair (a, a + 1) stands at
    a - k). distributed/merging.py's host does the same on ZeRO-3 ranks, whose model keeps every layer."""

    def prepare(self, model) -> None:
        from trsp_ray.method.gates import detach_gates

        detach_gates(model)

    def originals(self, model, a: int, k: int) -> torch.nn.ModuleList:
        return copy.deepcopy(families.decoder_layers(model)[a - k:a - k + 2])

    def flatten(self, model, a: int, k: int) -> Flat:
        return flatten(model, a - k)

    def finish(self, model, flat: Flat, a: int, k: int) -> None:
        pass

    def put(self, model, a: int, k: int, state: dict) -> None:
        put_merged(model, a - k, state)
