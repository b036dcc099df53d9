"""Closed-form compensation (trsp_ray/method/compensation.py) on Ray Train ZeRO-3 workers (issue 21 item 3).

The workers never cut the model before the streaming export: the drop set stays in the network,
bypassed through its gates, so the map of block [a..b] is folded into the kept layer a-1 (original
index) while P stays bypassed, and export.py writes the folded weights from the live parameters.

`fit` runs on the dense model (every gate off, nothing bypassed) before any weight trains, i.e.
right after stage 1 (which trains only the gates): rank r of W accumulates M^T M and M^T Y over
windows k with k % W == r (the removal probes' split, probes.RemovalScorer), the float64 sums are
all-reduced, and every rank solves the same T per block (each rank runs its share of the
windows in batches of the run's batch size, so a forward has min(batch, ceil(windows / W)) rows:
compensation_plan sizes the fit in those, and measured: benchmarks/fit_memory.py). Under ZeRO-3 every forward is a
collective, so a rank with fewer windows runs a padding forward it discards, and the passes run
the whole model (compensation.accumulate's early stop would leave a pass half-way through
DeepSpeed's gather hooks). `fold` applies the maps where one process does: after stage 2, before
a heal. Only the "dense" activations are served here (check_for_workers refuses the rest).

The cosine objective (`compensation.objective=cosine`, trsp_ray/method/compensation_cosine.py) is no
function of the sums: each rank keeps its own shard's rows (x, r, y) of every block on the host,
from the same dense pass, and the Gauss-Newton steps from the least-squares map all-reduce their
curvature, gradient and step-length losses, so every rank takes the same steps on all the tokens
without another forward (compensation_plan counts the cached rows and the steps' matrices).

The scalar fold (`compensation.method=scalar`) shards the same way: each rank sums its windows'
token norms and inner products (compensation_scalar.scalar_sums), the six float64 sums are all-reduced,
every rank computes the same scales, and `apply` scales the output projections of the kept layers
after each block (original indices; the bypassed drop set is left as it is).
"""

from __future__ import annotations

import functools
import time

import torch

from trsp_ray.common.errors import TrspError
from trsp_ray.distributed.collectives import all_reduce_sum
from trsp_ray.method import compensation, compensation_scalar
from trsp_ray.method.boundaries import forward_pass
from trsp_ray.method.training import split_over_ranks
from trsp_ray.models import families


def check_for_workers(cfg, *, workers: int | None = None) -> None:
    """Refuse, before any worker starts, a compensation the workers do not run (one line); `workers`
    defaults to distributed.workers (a route or a plan passes the count it chose)."""
    from trsp_ray.config.run_config import for_method

    c = for_method(cfg).compensation  # the compensation the method runs (auto resolved)
    workers = cfg.distributed.workers if workers is None else workers
    if c.method != "none" and not c.windows:  # 0: sized from the model's hidden size, as the run sizes it
        from trsp_ray.config.run_config import sized
        from trsp_ray.run.workbench import model_hidden

        hidden = model_hidden(cfg.model)
        c = c if hidden is None else sized(for_method(cfg), hidden=hidden).compensation
    if c.method != "none" and c.windows and c.windows < workers:  # unknown size: the workers refuse alike
        # a rank without a window never enters the fit's batch loop, where every other rank's first
        # lookup of a ZeRO-3 projection gathers it: a collective the empty rank never joins (a hang)
        raise TrspError(f"compensation.windows={c.windows} is fewer than the {workers} workers: every worker "
                        f"fits on its share of the windows; use compensation.windows >= {workers} or fewer workers")
    if c.method != "none" and cfg.stage1.train_base:
        raise TrspError("compensation on Ray Train workers needs the dense weights after stage 1, and "
                        "stage1.train_base=true trains them; use stage1.train_base=false or distributed.workers=0")
    if c.method != "none" and c.activations != "dense":
        raise TrspError(f"compensation.activations={c.activations!r} is not run on Ray Train workers (it needs "
                        "the pruned model's activations block by block); use compensation.activations=dense or "
                        "distributed.workers=0")


def _mlp_output_resolver(model):
    """families.map_output's module for a ZeRO-3 model: a partitioned weight is an empty 1-D placeholder,
    so the layer is gathered (one layer, once per layer) while its projection is looked up."""
    from trsp_ray.distributed.engine import gather_context

    @functools.cache
    def resolve(layer):
        with gather_context(list(layer.parameters())):
            return families.map_output(layer, model)[0]

    return lambda layer, _model: resolve(layer)


@torch.no_grad()
def fit_scalar(*, model, gates, drop: list[int], windows: list[torch.Tensor], rank: int, world: int,
               reduce=all_reduce_sum) -> dict:
    """The scalar fold's scales of every block of `drop` from this rank's shard of `windows`,
    all-reduced. Returns {"scales", "blocks", "tokens", "cost", "residual", "residual_identity", "seconds"}."""
    t0 = time.time()
    num = families.num_layers(model)
    layers = families.decoder_layers(model)
    with gather_layer(layers[0]):
        families.residual_writers(layers[0], model)  # a family the fold cannot serve fails before any forward
    mine, padding = split_over_ranks(windows, rank=rank, world=world)
    with gates.state(gated=False, bypass=[]):
        sums = compensation_scalar.scalar_sums(dense=model, windows=mine, drop=drop, stop=False)
        device = next(model.parameters()).device
        for _ in range(padding):  # the collective forwards of the other ranks' extra windows
            model(input_ids=windows[0][:1].to(device), use_cache=False)
    for acc in sums:
        acc.sums = reduce(acc.sums).cpu()
    scales = [acc.scale(num) for acc in sums]
    tokens = sums[0].tokens if sums else 0
    return {"scales": scales, "blocks": [acc.block for acc in sums], "tokens": tokens,
            "residual": [acc.residual(x) for acc, x in zip(sums, scales)],
            "residual_identity": [acc.residual(1.0) for acc in sums],
            "cost": compensation.cost(drop=drop, num_layers=num, tokens=tokens, stops=False),
            "seconds": time.time() - t0}


def gather_layer(layer):
    """Every parameter of one decoder layer gathered (ZeRO-3) while the block runs."""
    from trsp_ray.distributed.engine import gather_context

    return gather_context(list(layer.parameters()))


@torch.no_grad()
def apply(*, model, drop: list[int], info: dict) -> None:
    """Fold `info` (from `fit` or `fit_scalar`) into `model`, which still holds every layer. The maps
    (one d x d float64 per block, 512 MiB each at d = 8192) leave `info` once folded, so that the
    host does not carry them through a heal and the export (compensation_plan counts them to the fold)."""
    if "scales" not in info:
        fold(model=model, maps=info.pop("maps"))
        return
    layers = families.decoder_layers(model)
    num, dropped = len(layers), set(drop)
    for index, layer in enumerate(layers):
        if index in dropped:  # bypassed: not gathered at all (20 of 80 layers at 70B)
            continue
        with gather_layer(layer):
            compensation_scalar.fold_scales(model=model, drop=drop, scales=info["scales"], num_layers=num,
                                            layers={index: layer})


@torch.no_grad()
def fit(*, model, gates, drop: list[int], windows: list[torch.Tensor], rank: int, world: int, ridge: float,
        form: str = "full", map_rank: int | None = None, weighting: str = "norm", objective: str = "mse",
        reduce=all_reduce_sum, minimum: float = 1.0) -> dict:
    """The maps of every block of `drop`, from the dense model's activations over all `windows`
    (every rank passes the same list; each runs its own shard). Returns {"maps": [(block, T [d, d]
    float64 on the host)], "blocks", "tokens", "cost", "residual", "residual_identity", "seconds"},
    and for the cosine `objective` "cosine_lstsq", "cosine", "cosine_steps", "cosine_passes" per block."""
    t0 = time.time()
    num = families.num_layers(model)
    layers = families.decoder_layers(model)
    resolve = _mlp_output_resolver(model)
    resolve(layers[0], model)  # a family the fold cannot serve fails here, before any forward
    total = sum(int(w.numel()) for w in windows)
    hidden = families.text_config(model).hidden_size
    compensation.check_form(form, map_rank, hidden)
    form = compensation.map_form(model, form)  # the diagonal through Gemma's MLP norm
    compensation.check_tokens(tokens=total, hidden=hidden, form=form, minimum=minimum)
    compensation.check_objective(objective, method="lstsq")
    mine, padding = split_over_ranks(windows, rank=rank, world=world)
    sink = compensation.cosine_sink(objective)
    with gates.state(gated=False, bypass=[]):
        stats = compensation.accumulate(dense=model, windows=mine, drop=drop, stop=False, mlp_output=resolve,
                                        weighting=weighting, sink=sink)
        device = next(model.parameters()).device
        for _ in range(padding):  # the collective forwards of the other ranks' extra windows
            forward_pass(model, windows[0][:1])
    spans = compensation.blocks(drop, num)
    info: dict = {"maps": [], "blocks": spans, "tokens": 0, "residual": [], "residual_identity": [], "form": form}
    for k, span in enumerate(spans):
        if stats[k] is None:  # this rank had no window: zeros of the right shape join the sum
            stats[k] = compensation.Stats.zeros(span, hidden, hidden, torch.empty(0, device=device))
        summed = stats[k].reduced(reduce)
        stats[k] = None  # the all-reduced copy replaces this rank's sums (compensation_plan's solve)
        t = compensation.solve(summed.mtm, summed.mty, ridge=ridge, form=form, rank=map_rank)
        if sink is not None:  # every rank steps together (its shard's rows, all-reduced sums)
            t = compensation.refine(sink, info, span=span, t=t, form=form, rank=map_rank, ridge=ridge, reduce=reduce)
        info["maps"].append((span, t.cpu()))
        info["tokens"] = summed.tokens
        info["residual"].append(summed.residual(t))
        info["residual_identity"].append(summed.residual(torch.eye(hidden, dtype=t.dtype, device=t.device)))
        del summed, t
    # whole-model passes (no early stop), counted as such
    info["cost"] = compensation.cost(drop=drop, num_layers=num, tokens=info["tokens"], stops=False)
    info["seconds"] = time.time() - t0
    return info


def manifest_metrics(comp, info: dict | None) -> dict:
    """The compensation's fields in the export manifest's metrics, as one process records them
    (methods.apply_method); empty without a compensation."""
    if info is None:
        return {}
    return {**compensation.describe(comp, form=info.get("form")), "compensation_tokens": info["tokens"],
            "compensation_cost": info["cost"], "compensation_seconds": info["seconds"]}


@torch.no_grad()
def fold(*, model, maps) -> None:
    """Fold each (block, T) of `fit` into the MLP output projection of layer block[0] - 1 (original
    index: the model is not cut), consistently on every rank's shard: the projection is gathered and
    rank 0's folded values are re-partitioned (every rank solved the same T). The worker folds
    when no optimizer will step this weight from an old fp32 master: under stage 1's engine (which
    trains only the gates) before a heal's engine is built from the live weights, or after stage
    2's last step."""
    from trsp_ray.distributed.engine import gather_context

    layers = families.decoder_layers(model)
    resolve = _mlp_output_resolver(model)
    for (a, _b), t in maps:
        layer = layers[a - 1]
        proj = resolve(layer, model)
        params = [p for p in (proj.weight, getattr(proj, "bias", None)) if p is not None]
        with gather_context(params):
            compensation.fold(model=model, layer=layer, t=t)
