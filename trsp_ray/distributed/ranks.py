"""Data-parallel scoring on the Ray Train ranks: ShortGPT's Block Influence over every rank's share
of the selection windows (the default method's selection on the workers, and stage 1's
Block-Influence shortlist); the sums go through `collectives`."""

from __future__ import annotations

import socket

import torch

from trsp_ray.distributed.collectives import sum_over_ranks


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now (a gloo rendezvous for local ranks)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def forward_engine(bench, *, fresh: bool = False) -> None:
    """Make sure a DeepSpeed engine wraps the ZeRO-3 model: a forward without an engine's hooks cannot
    gather a layer's partitions. Builds one over the gates (never stepped; the next stage's build
    closes it) when none is open, or always with `fresh`. A worker handed its drop set (a stage 1
    computed elsewhere, SLEB's set) has built none before the compensation's fit."""
    if fresh or not bench.factory.built:
        bench.factory(bench.model, [{"params": bench.gates.gate_params(), "lr": 0.0}])


def block_influence_on_ranks(cfg, bench, windows: list, *, rank: int) -> tuple[dict[int, float], float]:
    """(Block Influence per layer, tokens scored) over `windows` (every rank passes the same list):
    each rank scores its share (rows k % world == rank; a rank short of one runs a padding row that
    counts nowhere, so every rank runs as many ZeRO-3 forwards) and the sums are summed over the
    ranks, so every rank gets the same figures, equal to one process's on all the windows."""
    from trsp_ray.method.selectors import influence_sums
    from trsp_ray.method.training import split_over_ranks

    # a stage-1 step's rows per rank (its micro batch): the activations and logits the plan's
    # stage-1 figure holds, at any world size
    size = max(1, cfg.data.batch_size // bench.world)
    rows = torch.cat(list(windows))
    mine, padding = split_over_ranks(list(rows.split(size)), rank=rank, world=bench.world)
    batches = mine + [rows[:1]] * padding  # padding forwards keep the ranks' collectives in step
    masks = [torch.ones(len(b)) for b in mine] + [torch.zeros(1)] * padding
    forward_engine(bench, fresh=True)
    training = bench.model.training
    bench.model.eval()  # no dropout (OPT) in a selection forward, whatever activation checkpointing set
    with torch.no_grad():
        sums, tokens = influence_sums(bench.model, bench.gates, batches, masks=masks, head=True)
    bench.model.train(training)
    layers = sorted(sums)
    total = sum_over_ranks([sums[i] for i in layers] + [tokens])
    return {i: 1.0 - total[k] / total[-1] for k, i in enumerate(layers)}, float(total[-1])
