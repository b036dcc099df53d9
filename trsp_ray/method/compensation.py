"""Training-free compensation of removed blocks (SPEC section 7), in closed form and folded into an
existing weight so the pruned model stays a stock checkpoint with no new parameters (ReplaceMe's
least-squares form).

A removed block is a maximal run [a..b] of dropped layers (original indices). Layer a-1 is kept
and, after removal, feeds layer b+1 directly. On calibration tokens (rows, d = hidden size):
  M     = the MLP output of layer a-1: its output projection's output, bias included   [n, d]
  h_mid = layer a-1's output minus M: the residual stream M is added to              [n, d]
  Y     = (dense output of layer b: what the dense model feeds layer b+1, or the final hidden
           state before the final norm when b is the last layer) - h_mid            [n, d]
  T     = argmin ||M T - Y||^2 + r ||T - I||^2 = (M^T M + r I)^-1 (M^T Y + r I),
          r = ridge * mean(diag(M^T M)): the ridge shrinks the map towards the identity, i.e. towards
          the uncompensated model (a ridge towards 0 would shrink layer a-1's MLP output instead, and a
          large ridge would silence it: measured on SmolLM2, ridge 1e-1 towards 0 cost LAMBADA accuracy)
Folding T into the projection (W <- T^T W, bias <- T^T bias) makes the pruned layer a-1 write
h_mid + M T, the least-squares estimate of the dense input of layer b+1. Sums are float64.

Weighting (`weighting`): "norm" (the default) divides every token's rows of M and Y by the norm of
its dense target stream, so the fit minimises the summed squared *relative* error, which is what
the next layer's RMSNorm sees. Unweighted ("none", ReplaceMe's form), a few huge attention-sink
tokens (the first of every window: a stream ~170x the others' on SmolLM2 after layer 11) hold
99.98% of M^T M, so the map is fitted to them and the ridge, relative to their energy, pins it to
the identity everywhere else. Measured on SmolLM2 (8 of 30, ShortGPT's set, 256 x 128 tokens,
ridge 1e-2, untrained): held-out PPL 50.5 -> 40.2 unweighted, -> 35.4 weighted; news 107.0 -> 89.9
and -> 82.6. Dropping the sink tokens instead leaves the map free on their direction and
destroys the sink (held-out PPL 870,778).

Where M and h_mid come from (`activations`):
  "dense": all from the dense model, one pass for every block (the SPEC's form). Map k repairs the
      boundary a_k-1 -> b_k+1 as if the stream entering layer a_k-1 were dense; the error that
      earlier removed blocks leave upstream is not seen by later maps.
  "sequential": M and h_mid from the pruned model with the earlier blocks already compensated
      (block by block from the first), Y's target still from the dense model: map k repairs the
      boundary a_k-1 -> b_k+1 for the stream that actually reaches it. Costs a pass per block.

The scalar fold (Prune&Comp's form, `method="scalar"`) lives in trsp_ray/method/compensation_scalar.py;
the map's restricted forms (diagonal, low-rank) in trsp_ray/method/compensation_forms.py; the cosine
objective (`objective="cosine"`: the same map refined to minimise 1 - cos(M T + h_mid, target),
ReplaceMe's) in trsp_ray/method/compensation_cosine.py, from the rows `accumulate` hands its `sink`.

Gemma 2/3 normalise the MLP output (post_feedforward_layernorm, scale 1 + w) before the residual add,
so M there is the norm's output and a full map cannot fold: the norm divides by the rms of its own
input, so any map placed before it is undone up to a scale, and one placed after it is no weight of
the stock model. A diagonal D can: rmsnorm(z) (1 + w) D = rmsnorm(z) (1 + w'), w' = (1 + w) D - 1,
exact up to the rounding of w' (map_form fits the diagonal there; fold writes w').

Data parallel: each rank accumulates its own window shard; `reduce` (identity in one process, an
all-reduce sum under torch.distributed) is applied to the sums before the solve, so every rank
solves the same system and applies the same fold to its copy or shard.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from trsp_ray.common.errors import TrspError
from trsp_ray.method.boundaries import Stop, blocks, fold_layers, hidden, hooked_pass, stream_blocks
from trsp_ray.method.compensation_forms import (  # noqa: F401 (re-exported)
    WEIGHTINGS,
    check_form,
    check_objective,
    check_tokens,
    solve,
)
from trsp_ray.models import families

METHODS = ("none", "lstsq", "scalar")
ACTIVATIONS = ("dense", "sequential")


@dataclass
class Stats:
    """The least-squares sums of one block over n calibration tokens (float64)."""

    block: tuple[int, int]
    mtm: torch.Tensor  # sum M^T M, [d, d]
    mty: torch.Tensor  # sum M^T Y, [d, d]
    yty: torch.Tensor  # sum ||Y||^2, scalar
    tokens: int

    @classmethod
    def zeros(cls, block, k: int, d: int, like: torch.Tensor) -> Stats:
        """Empty sums for inputs of width `k` and targets of width `d`, float64 on `like`'s device."""
        return cls(block, like.new_zeros(k, k, dtype=torch.float64), like.new_zeros(k, d, dtype=torch.float64),
                   like.new_zeros((), dtype=torch.float64), 0)

    def add(self, m: torch.Tensor, y: torch.Tensor) -> Stats:
        """Add one batch's float64 rows, inputs m [n, k] and targets y [n, d] (already weighted), in place:
        the one accumulation of every least-squares fit (the fold's maps, a merge's refits)."""
        self.mtm.addmm_(m.T, m)
        self.mty.addmm_(m.T, y)
        self.yty += torch.dot(y.view(-1), y.view(-1))
        self.tokens += m.shape[0]
        return self

    def reduced(self, reduce: Callable[[torch.Tensor], torch.Tensor]) -> Stats:
        """These sums combined across ranks by `reduce` (a sum); the token count travels with them."""
        tail = reduce(torch.stack([self.yty, self.yty.new_tensor(float(self.tokens))]))
        return Stats(self.block, reduce(self.mtm), reduce(self.mty), tail[0], int(round(tail[1].item())))

    def residual(self, t: torch.Tensor) -> float:
        """||M T - Y||^2 summed over the tokens, from the sums alone."""
        t = t.to(self.mtm)
        return float(self.yty - 2 * (t * self.mty).sum() + (t * (self.mtm @ t)).sum())


def check_request(*, model, method: str, tokens: int, drop=None, form: str = "full", rank: int | None = None,
                  minimum: float = 1.0, objective: str = "mse") -> None:
    """Refuse, before any forward pass, a compensation that cannot run: an unknown method, a family
    whose MLP output a map cannot be folded into, fewer than `minimum` calibration tokens per column
    of a d x d map (below 1 it is underdetermined; a run's floor is compensation.min_tokens_per_column),
    or a block at layer 0 (no layer before it to fold into).
    The scalar fold needs the layers' output projections and at least one token, and serves layer 0;
    the cosine `objective` needs a fitted map (method lstsq)."""
    if method not in METHODS:
        raise TrspError(f"compensation.method={method!r} is not valid; choose one of {', '.join(METHODS)}")
    check_objective(objective, method=method)
    if method == "none":
        return
    layers = families.decoder_layers(model)
    if method == "scalar":
        families.residual_writers(layers[0], model)
        if tokens < 1:
            raise TrspError(f"compensation has {tokens} calibration tokens; the scalar fold needs at least 1")
        return
    families.map_output(layers[0], model)
    hidden = families.text_config(model).hidden_size
    check_form(form, rank, hidden)
    check_tokens(tokens=tokens, hidden=hidden, form=map_form(model, form), minimum=minimum)
    if drop is not None and 0 in set(drop):
        raise TrspError(f"drop set {sorted(drop)} removes layer 0: no earlier layer's MLP output can take the "
                        f"compensation; {families.NO_COMPENSATION}, or protect layer 0 (gates.protect_head)")


def map_form(model, form: str) -> str:
    """The form a map of `form` is fitted in on `model`: as asked where the MLP's output projection
    reaches the residual add; on a family with a norm between (Gemma 2/3, families.map_output) the
    diagonal for full (the default: the only map that folds exactly through a norm, which divides by
    the mapped output's own rms), and a one-line refusal for lowrank."""
    family = families.family_of(model)
    if not family.mlp_norm_path or form == "diagonal":
        return form
    if form == "lowrank":
        raise TrspError(f"compensation.form='lowrank' cannot fold into family {family.name!r}: "
                        f"{family.mlp_fold_refusal} unless the map is diagonal (folded into "
                        f"{family.mlp_norm_path}'s weight); use compensation.form=diagonal, or full (which fits the "
                        "diagonal there)")
    return "diagonal"


@torch.no_grad()
def fold(*, model, layer, t: torch.Tensor) -> None:
    """Right-multiply the MLP output of decoder `layer` of `model` by `t` [d, d], in its weights:
    output z W^T + b becomes (z W^T + b) T, i.e. W <- T^T W and b <- T^T b (cast back to their dtype).
    Through a norm (families.map_output "norm"; `t` must be diagonal) its scale c + w becomes
    (c + w) diag(t): w <- (c + w) diag(t) - c."""
    proj, kind = families.map_output(layer, model)
    if kind == "norm":
        scale = t.to(device=proj.weight.device, dtype=torch.float64).diagonal()
        if not torch.equal(t.to(scale.device, torch.float64), torch.diag(scale)):
            raise TrspError(f"family {families.family_of(model).name!r} takes only a diagonal map into its MLP "
                            "output's norm; fit compensation.form=diagonal")
        c = families.norm_offset(model)
        proj.weight.copy_(((c + proj.weight.double()) * scale - c).to(proj.weight.dtype))
        return
    w = proj.weight
    tt = t.to(device=w.device, dtype=torch.float64).T
    w.copy_((tt @ w.double()).to(w.dtype))
    if getattr(proj, "bias", None) is not None:
        proj.bias.copy_((tt @ proj.bias.double()).to(proj.bias.dtype))


def _record(model, wanted: dict[int, str], store: dict, *, stop_after: int | None, mlp_output=None) -> list:
    """Forward hooks on `model` writing store[(index, 'out')] (a decoder layer's output) and
    store[(index, 'mlp')] (its MLP output projection's output), flattened to [n, d]; the pass
    stops after decoder layer `stop_after` (None: it runs to the end)."""
    mlp_output = mlp_output or (lambda layer, m: families.map_output(layer, m)[0])
    layers = families.decoder_layers(model)
    handles = []

    def saver(key, stop):
        def hook(_module, _inputs, output):
            h = hidden(output)
            store[key] = h.reshape(-1, h.shape[-1])
            if stop:
                raise Stop
        return hook

    for index, what in wanted.items():
        if "mlp" in what:
            proj = mlp_output(layers[index], model)
            handles.append(proj.register_forward_hook(saver((index, "mlp"), False)))
    for index, what in wanted.items():
        if "out" in what:
            handles.append(layers[index].register_forward_hook(saver((index, "out"), index == stop_after)))
    if stop_after is not None and stop_after not in {i for i, w in wanted.items() if "out" in w}:
        handles.append(layers[stop_after].register_forward_hook(saver((stop_after, "out"), True)))
    return handles


def _run(model, batch, wanted: dict[int, str], *, stop_after: int | None, mlp_output=None) -> dict:
    store: dict = {}
    hooked_pass(model, batch, _record(model, wanted, store, stop_after=stop_after, mlp_output=mlp_output))
    return store


def _add(stats: Stats | None, block, out: torch.Tensor, m: torch.Tensor, target: torch.Tensor, *,
         weighting: str) -> Stats:
    """Add one batch's rows of `block` [n, d] to its float64 sums: Y = target - (out - m), and under
    "norm" weighting every token's rows of M and Y divided by its target's norm (its relative error
    counts). Two float64 [n, d] are live at a time (Y, built in place, and M), on M's device: the
    differences are taken in float64, Y being small beside the streams it is taken from."""
    y = target.to(device=m.device, dtype=torch.float64, copy=True)
    scale = y.norm(dim=-1).clamp_min_(1e-12)[:, None] if weighting == "norm" else None
    y.sub_(out)  # before M's float64 copy exists: a mixed-dtype in-place op may cast `out` to a temporary
    m = m.to(torch.float64, copy=True)  # a copy: `m` may be the forward's own float64 tensor
    y.add_(m)
    if scale is not None:
        m.div_(scale)
        y.div_(scale)
    return (stats or Stats.zeros(block, m.shape[1], y.shape[1], m)).add(m, y)


@torch.no_grad()
def accumulate(*, dense, windows, drop, pruned=None, block: tuple[int, int] | None = None, stop: bool = True,
               mlp_output=None, weighting: str = "norm", sink=None) -> list[Stats | None]:
    """The sums of every block of `drop` over `windows` (batches of token ids [B, S]; None for a
    block when `windows` is empty).

    With `pruned` None, everything comes from `dense` in one pass per batch ("dense" form), each
    block summed as soon as its last layer has run (boundaries.stream_blocks). With `pruned` (the layer-removed
    model, earlier blocks already folded) and one `block`, M and h_mid come from pruned's copy of
    layer a-1 and the target from dense ("sequential" form).
    `stop=False` runs every pass to the end (a ZeRO-3 forward is a collective that must not stop
    inside DeepSpeed's gather hooks); `mlp_output(layer, model)` finds the module whose output is M
    (families.map_output's by default; a partitioned model needs its layer gathered to look).
    `weighting="norm"`: every token's rows of M and Y are divided by the norm of its dense target
    stream, so the fit minimises the summed squared *relative* boundary error (module doc).
    `sink(block, out, m, target)`, when given, also gets every batch's unweighted rows [n, d] in the
    forward's dtype (layer a-1's output, its MLP output, the dense target): the cosine fit keeps them."""
    if weighting not in WEIGHTINGS:
        raise TrspError(f"compensation.weighting={weighting!r} is not valid; choose one of {', '.join(WEIGHTINGS)}")
    num = families.num_layers(dense)
    spans = blocks(drop, num) if block is None else [block]
    if spans and spans[0][0] == 0:
        raise TrspError(f"drop set {sorted(drop)} removes layer 0: no earlier layer's MLP output can take the "
                        f"compensation; {families.NO_COMPENSATION}, or protect layer 0 (gates.protect_head)")
    stats: dict[tuple[int, int], Stats | None] = {s: None for s in spans}

    def on_block(s, out, m, target):
        if sink is not None:
            sink(s, out, m, target)
        stats[s] = _add(stats[s], s, out, m, target, weighting=weighting)

    kept = [i for i in range(num) if i not in set(drop)]
    for batch in windows:
        if not spans:
            break
        if pruned is None:
            stream_blocks(dense, batch, spans, on_block=on_block, stop=stop, mlp_output=mlp_output)
            continue
        (a, b), = spans
        target = _run(dense, batch, {b: "out"}, stop_after=b)[(b, "out")]
        new = kept.index(a - 1)
        got = _run(pruned, batch, {new: "out mlp"}, stop_after=new)
        on_block((a, b), got.pop((new, "out")), got.pop((new, "mlp")), target)
        del target, got  # not held through the next batch's passes
    return [stats[s] for s in spans]


def cosine_sink(objective: str):
    """The row cache the cosine fit needs from `accumulate` (None for least squares)."""
    if objective != "cosine":
        return None
    from trsp_ray.method.compensation_cosine import Collector

    return Collector()


def refine(sink, info: dict, *, span, t: torch.Tensor, form: str, rank: int | None, ridge: float,
           reduce: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """The cosine map of block `span` from its cached rows (dropped after), started at the least-squares
    `t`; its mean 1 - cos before and after and the steps taken are appended to `info`."""
    from trsp_ray.method.compensation_cosine import fit

    t, got = fit(sink.pop(span), t, form=form, rank=rank, ridge=ridge, reduce=reduce)
    for key, value in got.items():
        info.setdefault(key, []).append(value)
    return t


def describe(comp, *, form: str | None = None) -> dict:
    """The manifest's and results' record of a CompensationConfig: the method, and for least
    squares its form (`form`: the one fitted, compensate's "form", where known: the diagonal on Gemma
    2/3), ridge, token weighting and objective (mse | cosine)."""
    out = {"compensation": comp.method}
    if comp.method == "lstsq":
        form = form or comp.form
        out.update(compensation_form=f"lowrank {comp.rank}" if form == "lowrank" else form,
                   compensation_ridge=comp.ridge, compensation_weighting=comp.weighting,
                   compensation_objective=comp.objective)
    return out


def cost(*, drop, num_layers: int, tokens: int, activations: str = "dense", stops: bool = True) -> float:
    """Dense-forward tokens of `compensate` over `tokens` calibration tokens: passes stop after the
    last layer they need and count the fraction of the dense depth they run (`stops=False`: whole
    dense passes, as on ZeRO-3 workers). The float64 sums, solves and cosine steps are counted apart
    (plan/compute.py's fit_solve_cost)."""
    spans = blocks(drop, num_layers)
    if not spans:
        return 0.0
    if activations == "dense":
        return tokens * ((spans[-1][1] + 1) / num_layers if stops else 1.0)
    kept = [i for i in range(num_layers) if i not in set(drop)]
    return sum(tokens * (b + 1 + kept.index(a - 1) + 1) / num_layers for a, b in spans)


def compensate(*, model, dense, drop, windows, method: str = "lstsq", ridge: float = 1e-2,
               activations: str = "dense", form: str = "full", rank: int | None = None, weighting: str = "norm",
               objective: str = "mse", reduce: Callable[[torch.Tensor], torch.Tensor] = lambda t: t) -> dict:
    """Fold one least-squares map (`method="lstsq"`) or one scale (`"scalar"`) per removed block of
    `drop` into `model` (the layer-removed copy of `dense`, original indices in `drop`), from
    calibration `windows` (this rank's shard).

    `form` / `rank`: which maps least squares may fit (trsp_ray/method/compensation_forms.py);
    `weighting`: "norm" fits the tokens' relative boundary errors, "none" their absolute ones (module doc);
    `objective`: "mse" folds the least-squares map, "cosine" that map refined to the lowest mean
    1 - cos of the repaired stream (trsp_ray/method/compensation_cosine.py; it adds "cosine_lstsq",
    "cosine", "cosine_steps" and "cosine_passes" per block to the result).
    `reduce(t)` returns the sum of tensor `t` over ranks (float64, on the activations' device; an
    NCCL caller moves it); every rank gets the same sums, solves the same T and folds it.
    Returns {"blocks", "tokens" (after `reduce`), "residual", "residual_identity"} (the summed
    squared boundary error, relative to the target's norm under "norm" weighting, with the map and
    without it, per block; the scalar fold adds "scales", a map its "form": map_form's, the diagonal
    on Gemma 2/3)."""
    if activations not in ACTIVATIONS:
        raise TrspError(f"compensation.activations={activations!r} is not valid; "
                        f"choose one of {', '.join(ACTIVATIONS)}")

    tokens = sum(int(w.numel()) for w in windows)
    total = int(round(reduce(torch.tensor(float(tokens), dtype=torch.float64)).item()))  # float32 is exact to 2^24
    check_request(model=dense, method=method, tokens=total, drop=drop, form=form, rank=rank, objective=objective)
    if method == "none":
        return {"blocks": [], "tokens": 0, "residual": [], "residual_identity": []}
    if method == "lstsq":
        form = map_form(dense, form)  # the diagonal through Gemma's MLP norm
    if method == "scalar":
        if activations != "dense":
            raise TrspError(f"compensation.activations={activations!r} is not used by the scalar fold (its scales "
                            "come from the dense model); use compensation.activations=dense")
        from trsp_ray.method.compensation_scalar import compensate_scalar

        return compensate_scalar(model=model, dense=dense, drop=drop, windows=windows, reduce=reduce)
    num = families.num_layers(dense)
    spans = blocks(drop, num)
    kept = [i for i in range(num) if i not in set(drop)]
    layers = families.decoder_layers(model)
    sink = cosine_sink(objective)
    dense_stats = accumulate(dense=dense, windows=windows, drop=drop, weighting=weighting, sink=sink) \
        if activations == "dense" else None
    info: dict = {"blocks": spans, "tokens": 0, "residual": [], "residual_identity": [], "form": form}
    for k, span in enumerate(spans):
        if dense_stats is not None:
            stats = dense_stats[k]
        else:
            stats, = accumulate(dense=dense, windows=windows, drop=drop, pruned=model, block=span,
                                weighting=weighting, sink=sink)
        stats = stats.reduced(reduce)
        t = solve(stats.mtm, stats.mty, ridge=ridge, form=form, rank=rank)
        if sink is not None:
            t = refine(sink, info, span=span, t=t, form=form, rank=rank, ridge=ridge, reduce=reduce)
        fold(model=model, layer=layers[kept.index(span[0] - 1)], t=t)
        info["tokens"] = stats.tokens
        info["residual"].append(stats.residual(t))
        info["residual_identity"].append(stats.residual(torch.eye(t.shape[0], dtype=t.dtype)))
    return info


def folded_weights(model, kept: list[int], done: dict) -> dict:
    """{parameter name: a CPU copy} of what a least-squares fold wrote: the parameters of the module each
    map folded into (families.map_module: the down_proj, or Gemma's MLP norm) of the pruned `model`,
    whose decoder layers are the original layers `kept`. With these a stored fit is replayed exactly."""
    names = {id(p): n for n, p in model.named_parameters()}
    layers = families.decoder_layers(model)
    modules = [families.map_module(layers[kept.index(i)], model) for i in fold_layers(done["blocks"])]
    return {names[id(p)]: p.detach().to("cpu", copy=True) for m in modules for p in m.parameters()}


def load_folded(model, weights: dict) -> None:
    """Write a stored fit's folded weights (folded_weights) into the pruned `model`, in place."""
    import torch

    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, value in weights.items():
            params[name].copy_(value.to(params[name].device, params[name].dtype))
