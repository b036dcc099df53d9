"""What a ZeRO-3 run needs besides GPU memory: checkpoint size per save, storage for the kept saves,
local disk and host memory per node, CPU threads per worker and the export's host memory."""

from __future__ import annotations

from dataclasses import dataclass

from trsp_ray.plan.memory import ADAM_FP32, GB, HOST_BASE_GB, StagePlan
from trsp_ray.plan.shape import Shape
from trsp_ray.plan.zero3_setup import Setup


@dataclass(frozen=True)
class HostPlan:
    """What a run needs besides GPU memory, in GB (see `host_and_disk`)."""

    checkpoint_gb: float  # one save, all ranks together
    storage_gb: float  # the kept saves + the one being written
    disk_per_node_gb: float  # local disk a node needs while its ranks' share of a save is staged
    threads_per_worker: int
    host_per_worker_gb: float
    host_per_node_gb: float  # the larger of the fit's peak and the node of rank 0 during the export
    export_host_gb: float  # rank 0's host memory above its baseline during the export
    fit_host_per_worker_gb: float = 0.0  # while a fit holds its maps (0: the pipeline has no fit)


def checkpoint_bytes(s: Shape, st: Setup, *, trained: int) -> float:
    """One save, all ranks: DeepSpeed's ZeRO-3 checkpoint holds the optimizer's fp32 master copy
    and both Adam moments of the trained parameters (12 bytes each) and no 16-bit weights (they
    are rebuilt from the fp32 copy; frozen weights come from the model); plus the gate state."""
    return trained * ADAM_FP32 + 64 * 1024 * st.workers


def host_and_disk(s: Shape, st: Setup, stages: tuple[StagePlan, ...], *, fit_host_gb: float = 0.0) -> HostPlan:
    """Checkpoint size per save, storage for the kept ones, local disk and host memory per node,
    threads per worker and the export's host memory, of a plan's `stages` (stage 2 when 2).

    Host memory per worker = offloaded state (+ pinned copies) + HOST_BASE_GB; per node = its
    workers + the export on rank 0's node, which streams one layer at a time into safetensors
    shards and holds about 2 x the largest shard (the shard being filled + the one being written).
    `fit_host_gb`: what a worker holds on the host while the pipeline's fit runs (its maps T, from
    the fit to the fold, on top of stage 1's offloaded state: compensation_plan's host figure); the
    maps are dropped once folded, before the heal and the export, so a node's figure is the larger
    of its workers during the fit and its workers + the export after it.
    """
    trained = s.params if st.train_base else 0
    if len(stages) > 1:  # stage 2's (or the heal's) recipe: its optimizer state is what a save holds
        trained = st.trained_params(s) if st.trainable == "lora" else max(trained, st.trained_params(s))
    ckpt = checkpoint_bytes(s, st, trained=trained) / GB
    per_node = min(st.gpus_per_node, st.workers)
    offload = st.offload_optimizer or st.offload_params
    threads = max(1, st.cpus_per_node // max(1, per_node)) if offload else 1
    host_worker = max(stage.host for stage in stages) + HOST_BASE_GB[st.device]
    largest_tensor = s.counts.largest_tensor * st.dtype_bytes / GB
    export = 2 * max(min(st.export_shard_gb, s.params * st.dtype_bytes / GB), largest_tensor)
    fit_worker = fit_host_gb + HOST_BASE_GB[st.device] if fit_host_gb else 0.0
    return HostPlan(checkpoint_gb=ckpt, storage_gb=ckpt * (st.keep_checkpoints + 1),
                    disk_per_node_gb=(ckpt * per_node / st.workers * (2 if st.async_upload else 1)
                                      if st.remote_storage else 0.0),
                    threads_per_worker=threads, host_per_worker_gb=host_worker,
                    host_per_node_gb=max(host_worker * per_node + export, fit_worker * per_node),
                    export_host_gb=export, fit_host_per_worker_gb=fit_worker)


def disk_problem(h: HostPlan, st: Setup) -> str | None:
    """A one-line refusal when the kept checkpoints exceed `disk_budget_gb`, else None."""
    if st.disk_budget_gb is None or h.storage_gb <= st.disk_budget_gb:
        return None
    one = h.checkpoint_gb * 2  # keep_checkpoints=1: the kept one + the one being written

    def gb(x: float) -> str:  # small models: enough digits that the comparison shows
        return f"{x:.1f}" if x >= 10 else f"{x:.3g}"

    fix = f"keep_checkpoints=1 ({gb(one)} GB) or " if st.keep_checkpoints > 1 and one <= st.disk_budget_gb else ""
    return (f"checkpoints need {gb(h.storage_gb)} GB of storage (keep_checkpoints={st.keep_checkpoints} + 1 being "
            f"written, {gb(h.checkpoint_gb)} GB per save) but distributed.disk_budget_gb={st.disk_budget_gb:g}; "
            f"use {fix}a disk budget >= {gb(h.storage_gb)} GB")
