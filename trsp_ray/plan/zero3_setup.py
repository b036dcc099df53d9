"""What a ZeRO-3 run's memory depends on (`Setup`), and the Setup of a run config."""

from __future__ import annotations

from dataclasses import dataclass

from trsp_ray.method.recipes import TAIL_RECIPE
from trsp_ray.plan.memory import GB, MAX_LIVE_PARAMETERS


@dataclass(frozen=True)
class Setup:
    workers: int
    gpu_memory_gb: float = 80.0
    dtype_bytes: int = 2  # 2 = bf16 (GPU), 4 = fp32 (CPU)
    micro_batch: int = 1  # windows per worker per step
    seqlen: int = 2048
    trainable: str = "all"  # stage 2 (or a heal run as stage 2): all | lora | tail | map (heal.py's recipes)
    lora_rank: int = 8
    tail_layers: int = 3  # the tail recipe's k: lm_head + the last k kept layers train
    maps: int = 0  # the map recipe's folded down_proj count (at most one per block of the drop set)
    offload_params: bool = False
    offload_optimizer: bool = False
    activation_checkpointing: bool = False
    train_base: bool = False  # stage 1 also trains the weights
    device: str = "gpu"  # gpu | cpu (only the fixed overhead differs)
    max_live_parameters: float = MAX_LIVE_PARAMETERS  # DeepSpeed's stage3_max_live_parameters
    # Host side (see `host_and_disk`): the node shape, checkpoints kept, their disk budget, the
    # export's shard size, and whether storage is remote (checkpoints staged on local disk first).
    gpus_per_node: int = 8
    cpus_per_node: int = 96
    keep_checkpoints: int = 2
    disk_budget_gb: float | None = None
    export_shard_gb: float = 5.0
    remote_storage: bool = True
    async_upload: bool = True  # a remote save uploads while the next is staged: two on local disk
    frozen_layers: int = 0  # decoder layers stage 2 leaves out of the optimizer (a heal's drop set)

    def trained_params(self, s) -> int:
        """Parameters stage 2 (or the heal) updates on Shape `s`: the recipe's count (Shape.recipe_params)
        with the frozen drop set out of it."""
        return s.recipe_params(self.trainable, kept_layers=s.layers - self.frozen_layers, lora_rank=self.lora_rank,
                               tail_layers=self.tail_layers, maps=self.maps)

    def grad_layers(self, s) -> int:
        """Decoder layers stage 2's backward runs through: a tail heal's backward stops at its first
        trained layer (heal.output_side_only detaches a tied head's embedding); otherwise every layer
        (the map recipe's first target is unknown before selection: at most all of them)."""
        return self.tail_layers if self.trainable == TAIL_RECIPE else s.layers



def setup_for_run(cfg, ds_config: dict | None = None) -> Setup:
    """The planner's setup of a run config; `ds_config` (the built DeepSpeed config) may change the
    live-parameter cap."""
    d = cfg.distributed
    zero = (ds_config or {}).get("zero_optimization", {})
    return Setup(workers=max(1, d.workers), gpu_memory_gb=d.gpu_memory_gb, dtype_bytes=2 if d.use_gpu else 4,
                 micro_batch=max(1, cfg.data.batch_size // max(1, d.workers)), seqlen=cfg.data.seqlen,
                 trainable=cfg.stage2.trainable, lora_rank=cfg.stage2.lora_rank, offload_params=d.offload_params,
                 offload_optimizer=d.offload_optimizer, activation_checkpointing=d.activation_checkpointing,
                 train_base=cfg.stage1.train_base, device="gpu" if d.use_gpu else "cpu",
                 max_live_parameters=float(zero.get("stage3_max_live_parameters", MAX_LIVE_PARAMETERS)),
                 keep_checkpoints=d.keep_checkpoints, disk_budget_gb=d.disk_budget_gb,
                 export_shard_gb=getattr(d, "export_shard_mb", 5000) * 1e6 / GB,
                 remote_storage="://" in (d.storage_path or "") and not (d.storage_path or "").startswith("file://"),
                 async_upload=getattr(d, "checkpoint_upload", "async") == "async")
