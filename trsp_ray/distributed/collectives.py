"""The one place that talks to torch.distributed's collectives.

Every all-reduce, broadcast, all-gather and barrier of the workers goes through here, because the
backends disagree on where a tensor may live: NCCL only moves tensors on this rank's GPU ("No
backend type associated with device type cpu" for a host tensor), gloo only host tensors. A
caller hands over a tensor wherever it is (host counters, GPU activation sums); it is moved to the
backend's device for the collective and comes back on the caller's device (or `to=`), so no stage
needs to know which backend the workers run. `tests/test_collectives.py` keeps every other module
from calling a collective itself, through torch.distributed or deepspeed.comm under any alias.

Outside a process group (one process, or a group of one) every function is the identity, so the
same code runs on a laptop.
"""

from __future__ import annotations

import datetime

import torch


def _dist():
    import torch.distributed as dist

    return dist


def active() -> bool:
    """A process group of two or more ranks is up."""
    dist = _dist()
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def rank_and_world() -> tuple[int, int]:
    """(rank, world size) of the process group; (0, 1) without one."""
    dist = _dist()
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def backend_device(backend: str | None = None, group=None) -> torch.device:
    """Where `backend`'s collectives take tensors: NCCL this rank's current GPU, anything else
    (gloo, mpi) the host. Without a name, the backend of `group` (the default group if None)."""
    if backend is None:
        backend = str(_dist().get_backend(group))
    if backend.lower() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _reduce_op(op: str):
    ops = _dist().ReduceOp
    table = {"sum": ops.SUM, "max": ops.MAX, "min": ops.MIN}
    if op not in table:
        raise ValueError(f"reduce op {op!r} is not one of {sorted(table)}")
    return table[op]


def all_reduce(t: torch.Tensor, *, op: str = "sum", dtype: torch.dtype | None = None,
               to: torch.device | str | None = None) -> torch.Tensor:
    """`op` ("sum", "max", "min") of `t` over the ranks, as a new tensor (never in place) in `dtype`
    (default: `t`'s) on `to` (default: `t`'s device). The reduction itself runs on the backend's
    device. Identity (a copy) without a group of two or more."""
    dtype = dtype or t.dtype
    where = torch.device(to) if to is not None else t.device
    if not active():
        return t.to(device=where, dtype=dtype, copy=True)
    work = t.detach().to(device=backend_device(), dtype=dtype, copy=True)
    _dist().all_reduce(work, op=_reduce_op(op))
    return work.to(where)


def all_reduce_sum(t: torch.Tensor) -> torch.Tensor:
    """Sum of `t` over the data-parallel ranks in float64, on `t`'s device: the workers' sums (the
    probes', Block Influence's, the fit's M^T M and M^T Y)."""
    return all_reduce(t, op="sum", dtype=torch.float64)


def sum_over_ranks(values: list[float]) -> list[float]:
    """Element-wise float64 sum over the ranks of a few host numbers (the probes' [score, tokens])."""
    return all_reduce_sum(torch.tensor(values, dtype=torch.float64)).tolist()


def max_over_ranks(values: list[float]) -> list[float]:
    """Element-wise max over the ranks of a few host numbers (flags every rank must agree on)."""
    return all_reduce(torch.tensor(values, dtype=torch.float64), op="max").tolist()


def broadcast_object(value, *, src: int = 0, group=None):
    """Rank `src`'s `value` (any picklable object) on every rank of `group`. The pickled bytes travel
    as a tensor on `group`'s backend device."""
    dist = _dist()
    if not (dist.is_available() and dist.is_initialized()):
        return value
    box = [value]
    dist.broadcast_object_list(box, src=src, group=group, device=backend_device(group=group))
    return box[0]


def gather_objects(value) -> list:
    """Every rank's `value`, in rank order, on every rank ([value] without a group)."""
    _, world = rank_and_world()
    if world < 2:
        return [value]
    out: list = [None] * world
    _dist().all_gather_object(out, value)  # packs on the current GPU under NCCL (Ray Train sets it)
    return out


def barrier() -> None:
    """Wait for every rank (no-op without a group). Under NCCL on this rank's GPU."""
    dist = _dist()
    if not active():
        return
    if str(dist.get_backend()).lower() == "nccl":
        dist.barrier(device_ids=[backend_device().index])
    else:
        dist.barrier()


def host_group(timeout_s: float):
    """A gloo group over the same ranks with its own timeout (None without a group): for
    exchanges of host objects that may wait longer than the default group's timeout (rank 0
    writing a 70B export while the others wait)."""
    if not active():
        return None
    return _dist().new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout_s))


def close_group(group) -> None:
    """Destroy a group `host_group` made (None: nothing to close)."""
    if group is not None:
        _dist().destroy_process_group(group)
