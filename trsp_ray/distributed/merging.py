"""A merge on Ray Train workers (--method merge, merge+heal; issue 51): the pairs chosen and merged on the
ZeRO-3 ranks, where no rank ever holds the whole model.

The pairs. merge_select's angular distance of every candidate pair, each rank on its share of the
selection windows (training.split_over_ranks, padding passes where a rank is short), the sums added over
the ranks, so every rank takes the one process's pairs.

The merge. merge.merge_pairs, the one process's code, with a host (`OnRanks`) for a model that keeps every
layer. For pair (a, a + 1) both layers are gathered and copied into plain blocks of their own class on
every rank (two layers' weights, ~1.6 GiB in bf16 at 70B), and block a is flattened there
(merge_blocks.widen). While the wide block is scored, cut and refitted, the gated model bypasses a and
a + 1 and a hook on layer a runs the wide block in their place, so every pass through the ZeRO-3 model goes
through it; the sums are all-reduced, so every rank computes the same cut. The merged block's weights are
then written into layer a's partitions (rank 0's values, re-partitioned) and a + 1 stays bypassed, as a
dropped layer does on the workers: the heal trains the layers kept, the export leaves a + 1 out.

The windows. The merge's calibration windows are dealt row by row (rank r takes rows r, r + world, ...), so
every rank runs as many passes and the loss choice's first windows are the one process's; rows beyond a
multiple of the world size are left out (their count is logged). Each pass runs the whole model (no early
stop on ZeRO-3), which merge_cost counts.

Resume. Rank 0 stores each pair as it is done (run/merge_store.py, keyed by the world size and precision
too); a restarted run reads them on rank 0, every rank learns how many, and rank 0's stored blocks are
written into the partitions as merge_pairs puts them back. The store is a folder of rank 0's
checkpoint_dir: a restart resumes where that folder is the same (a shared file system, the same node).
"""

from __future__ import annotations

import torch

from trsp_ray.common.errors import TrspError
from trsp_ray.common.logs import log
from trsp_ray.distributed.collectives import all_reduce_sum, sum_over_ranks
from trsp_ray.distributed.engine import gather_context
from trsp_ray.method.boundaries import forward_pass
from trsp_ray.method.merge_blocks import Flat, check_pairs, widen
from trsp_ray.method.merge_select import candidate_starts, check_pairs_count, choose_pairs, pair_distances
from trsp_ray.method.training import split_over_ranks
from trsp_ray.models import families


def dealt_rows(windows: list[torch.Tensor], *, rank: int, world: int) -> list[torch.Tensor]:
    """This rank's rows r, r + world, ... of the concatenated `windows` (batches of token ids [B, S]), cut to a
    multiple of `world` rows so that every rank runs as many passes and none pads (training.split_over_ranks,
    in batches of the first window's size)."""
    rows = torch.cat(list(windows))
    usable = rows.shape[0] // world * world
    if usable == 0:
        raise TrspError(f"a merge on {world} workers needs at least {world} calibration windows, got {rows.shape[0]}; "
                        f"raise merging.windows or use fewer workers")
    mine, padding = split_over_ranks(list(rows[:usable].split(windows[0].shape[0])), rank=rank, world=world)
    assert padding == 0, "equal shares need no padding pass"
    return mine


@torch.no_grad()
def pairs_on_ranks(model, gates, windows: list[torch.Tensor], *, n_pairs: int, candidates: list[int], rank: int,
                   world: int) -> tuple[list[int], float]:
    """(the first layers of the `n_pairs` pairs to merge, in the order chosen; tokens scored): merge_select's
    choice with each rank scoring its share of `windows` and the distances' sums added over the ranks."""
    check_pairs_count(model, n_pairs)
    starts = candidate_starts(candidates)  # every rank refuses alike, before any pass
    mine, padding = split_over_ranks(windows, rank=rank, world=world)
    means = pair_distances(model, gates, mine, candidates=candidates, head=True) if mine else {}
    for _ in range(padding):  # the collective passes of the other ranks' extra windows
        forward_pass(model, windows[0][:1])
    tokens = float(sum(int(b.numel()) for b in mine))
    total = sum_over_ranks([means.get(a, 0.0) * tokens for a in starts] + [tokens])
    distances = {a: total[k] / total[-1] for k, a in enumerate(starts)}
    return choose_pairs(distances, model=model, n_pairs=n_pairs), float(total[-1])


class OnRanks:
    """merge.merge_pairs' host on ZeRO-3 ranks (module doc): the model keeps every layer and its gates; a pair's
    wide block is every rank's plain copy, run in the pair's place by a hook, then written into layer a."""

    def __init__(self, gates, *, rank: int):
        self.gates, self.rank = gates, rank
        self.bypassed: list[int] = []  # the second layers of the pairs merged so far
        self.handle = None
        self.last: torch.nn.Module | None = None

    def prepare(self, model) -> None:
        self.gates.set_gated(False)
        self.gates.set_bypass(self.bypassed)

    def plain(self, model, index: int) -> torch.nn.Module:
        """Decoder layer `index` gathered into a plain module of its class on this rank (eval, no gradients)."""
        inner = self.gates.wrappers[index].layer
        with gather_context(list(inner.parameters())):
            state = {name: t.detach().clone() for name, t in inner.state_dict().items()}
        with torch.device("meta"):  # no random init of a layer's weights (0.9B of them at 70B), then assigned
            block = type(inner)(families.text_config(model), index)
        block.load_state_dict(state, assign=True)
        if any(t.is_meta for t in block.state_dict(keep_vars=True).values()) or any(
                b.is_meta for b in block.buffers()):  # a buffer outside the state_dict: built for real
            block = type(inner)(families.text_config(model), index)
            block.load_state_dict(state)
            first = next(iter(state.values()))
            block.to(device=first.device, dtype=first.dtype)
        return block.eval().requires_grad_(False)

    def originals(self, model, a: int, k: int) -> torch.nn.ModuleList:
        return torch.nn.ModuleList([self.plain(model, a), self.plain(model, a + 1)])

    def flatten(self, model, a: int, k: int) -> Flat:
        check_pairs(model=model, firsts=[a])
        wide = self.plain(model, a)
        flat = widen(model, wide, self.plain(model, a + 1), index=a)
        flat.block = wide
        # a and a + 1 are not computed; the wide block (whichever merge_choice's trials put there) runs instead
        self.gates.set_bypass([*self.bypassed, a, a + 1])
        self.handle = self.gates.wrappers[a].register_forward_hook(
            lambda _m, args, kwargs, _out: flat.block(*args, **kwargs), with_kwargs=True)
        return flat

    def finish(self, model, flat: Flat, a: int, k: int) -> None:
        self.handle.remove()
        self.handle = None
        self._write(a, flat.block.state_dict())
        self.last = flat.block  # what the progress stores (rank 0)

    def put(self, model, a: int, k: int, state: dict | None) -> None:
        self._write(a, state)

    def _write(self, a: int, state: dict | None) -> None:
        """The merged block's `state` into layer a's partitions: rank 0's values are kept (the other ranks hold
        the same, or None where a stored pair was read on rank 0 alone); a + 1 bypassed from now on."""
        inner = self.gates.wrappers[a].layer
        with gather_context(list(inner.parameters())):
            if self.rank == 0:
                for name, p in inner.named_parameters():
                    p.data.copy_(state[name].to(device=p.device, dtype=p.dtype))
        self.bypassed.append(a + 1)
        self.gates.set_bypass(self.bypassed)


def merge_on_ranks(cfg, bench, *, drop: list[int], windows: list[torch.Tensor], rank: int, world: int):
    """Merge the pair (d - 1, d) of the gated ZeRO-3 `bench.model` for every d of `drop` on the merge's
    calibration `windows` (every rank passes the same list; each runs its rows, dealt_rows) with cfg.merging's
    settings; returns what the manifest records of the merge (run/merging.merge_record) and, on rank 0, the
    store of the merged pairs (None elsewhere), which the caller clears after the heal (a heal resumed from
    its checkpoint puts the stored pairs back instead of merging again)."""
    import math

    from trsp_ray.distributed.collectives import broadcast_object
    from trsp_ray.distributed.deepspeed_config import worker_dtype
    from trsp_ray.method.merge import merge_pairs
    from trsp_ray.run.content import checkpoint_root
    from trsp_ray.run.merge_store import MergeCheckpoints, merge_key
    from trsp_ray.run.merging import merge_record, pair_progress

    m = cfg.merging
    mine = dealt_rows(windows, rank=rank, world=world)
    left = sum(len(w) for w in windows) % world
    if left and rank == 0:
        log(f"merge: {left} calibration windows beyond a multiple of the {world} workers are left out")
    store = MergeCheckpoints(checkpoint_root(cfg.checkpoint_dir), merge_key(
        cfg.to_dict(), drop=drop, stage2=False, ranks={"world": world, "dtype": worker_dtype(cfg)}))
    stored = store.finished() if rank == 0 else []
    entries = broadcast_object([entry for entry, _ in stored])  # every rank: how many, and their records
    if entries and rank == 0:
        log(f"merge: resuming after pair {len(entries)} of {len(drop)} from {store.dir}")
    host = OnRanks(bench.gates, rank=rank)
    done = merge_pairs(model=bench.model, firsts=[d - 1 for d in drop], windows=mine, refit=m.refit, ridge=m.ridge,
                       weighting=m.weighting, target=m.target, units=m.units, trials=m.unit_trials,
                       choice_windows=math.ceil(m.choice_windows / world), stop=False, reduce=all_reduce_sum,
                       progress=pair_progress(bench.model, store, lambda a, k: host.last) if rank == 0 else None,
                       resume=[(e, stored[k][1] if rank == 0 else None) for k, e in enumerate(entries)], host=host)
    return merge_record(cfg, done), store if rank == 0 else None
