"""What a merge (--method merge, merge+heal; trsp_ray/method/merge.py) reads before it runs: its calibration
window count and one block's refit widths, which the run, the budget (run/merging.py) and the plans share, and
the memory it holds beside the model (the single-process plan's merge stage)."""

from __future__ import annotations

import math

from trsp_ray.plan.compute import model_shape
from trsp_ray.plan.shape import Shape


def merge_windows(cfg, shape: Shape | None = None) -> int:
    """merging.windows, 0 (auto) resolved to ceil(merging.tokens_per_column x the widest refit / data.seqlen)
    on cfg.model (or planner `shape`): the one count the run, the plan and the budget read."""
    m = cfg.merging
    widest = max(shape_widths(shape or model_shape(cfg.model)))
    return m.windows or math.ceil(m.tokens_per_column * widest / cfg.data.seqlen)


def shape_widths(shape: Shape) -> tuple[int, int]:
    """(MLP channels, attention q rows) of one block of a model of planner `shape`."""
    return shape.intermediate, shape.heads * shape.head_dim


def merge_memory(cfg, *, dtype_bytes: int, shape: Shape | None = None, ranks: int = 0) -> tuple[float, float]:
    """(device GB, host GB) a merge holds beside the model and one layer's pass (the single plan's merge stage):
    the wide pair's extra layer; two layers' copies (target "pair": the pair as it was; units=loss: the wide
    block a trial cuts); the refit's float64 sums (units=loss: the attention's over the wide block's columns);
    units=loss: one batch's logits and their fp32 loss, and the stream entering the block on the choice
    windows (stored once for the trials); the larger float64 working set of the fold (one input linear at a
    time, a fused [gate; up] the largest) and of a refit's solve (merge.solve_refit: the shifted Z^T Z and
    its LU factor beside the sums, W0 and the solution); target "dense"'s stored streams, on the host. `ranks` > 0: per
    ZeRO-3 worker (distributed/merging.py), beside its partition: the wide pair whole (two layers) and, while
    it is built, block b's copy; no stored block inputs (whole passes); its share of the stored streams."""
    from trsp_ray.method.merge_costs import refit_bytes

    m, e = cfg.merging, dtype_bytes
    shape = shape or model_shape(cfg.model)
    loss = m.refit and m.units == "loss"
    copies = 2 if m.refit and (m.target == "pair" or loss) else 0
    mlp, attn = shape_widths(shape)
    sums = refit_bytes(intermediate=mlp, hidden=shape.hidden, attention_width=attn * (2 if loss else 1))
    logits = cfg.data.batch_size * cfg.data.seqlen * shape.vocab * (e + 8) if loss else 0
    inputs = m.choice_windows * cfg.data.seqlen * shape.hidden * e if loss and not ranks else 0
    layers = 1 + copies + (2 if ranks else 0)
    k = max(mlp, attn)  # the widest refit
    work = max(8 * 2 * mlp * shape.hidden, 8 * 2 * (k * k + k * shape.hidden) if m.refit else 0)
    device = layers * shape.layer_params * e + (sums if m.refit else 0) + logits + inputs + work
    return device / 1024**3, targets_gb(cfg, dtype_bytes=e, shape=shape) / max(ranks, 1)


def targets_gb(cfg, *, dtype_bytes: int, shape: Shape | None = None) -> float:
    """Host GB of target "dense"'s stored streams (merge_costs.target_bytes) at cfg's pair count; else 0."""
    if not (cfg.merging.refit and cfg.merging.target == "dense"):
        return 0.0
    from trsp_ray.method.merge_costs import target_bytes
    from trsp_ray.method.stage1 import n_drop_for

    shape = shape or model_shape(cfg.model)
    return target_bytes(pairs=n_drop_for(cfg.ratio, shape.layers), tokens=merge_windows(cfg, shape) * cfg.data.seqlen,
                        hidden=shape.hidden, dtype_bytes=dtype_bytes) / 1024**3


def store_gb(cfg, *, dtype_bytes: int, shape: Shape | None = None) -> float:
    """Disk GB the merge's resume store (run/merge_store.py) reaches under checkpoint_dir on the process that
    stores (rank 0 on workers): one merged block per pair, in the run's precision, the last pair's written
    beside the others; kept beside the heal's checkpoints until the heal is done (a resumed heal reads them)."""
    from trsp_ray.method.stage1 import n_drop_for

    shape = shape or model_shape(cfg.model)
    return n_drop_for(cfg.ratio, shape.layers) * shape.counts.layer * dtype_bytes / 1024**3
