"""Memory planner: per-worker memory of stage 1 and stage 2 under ZeRO-3, from config.json alone.

Model state (bytes per parameter, b = 2 for bf16, 4 for fp32), partitioned over W workers:
    frozen weights          b / W                 (stage 1 base, LoRA base)
    trained weights         b + b (grad) + 12 (fp32 master + Adam m, v), all / W
Offload moves the optimizer's 12 (+ the gradient partition) or the weights to host memory.
Plus the working set ZeRO-3 gathers: gathered parameters stay resident until their reuse is more
than `stage3_max_reuse_distance` away or `stage3_max_live_parameters` (1e9 by default) are live, so
a model under 1e9 parameters is held whole, gathered, during a step; a larger one holds the larger of
that cap and two decoder layers (the current and the prefetched one). Measured on SmolLM2 with 2
CPU workers (benchmarks/planner_check.py): the default cache is +0.6 GiB per worker against
max_live_parameters=1e6, the whole fp32 model.
Then the activations kept for backward (every layer: a gate's gradient flows through all later
layers), the logits in fp32, DeepSpeed's reduce bucket when weights train, and a fixed runtime
overhead (CUDA context + allocator slack on GPU; Python, torch and DeepSpeed themselves on CPU).
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field

from trsp_ray.errors import TrspError

GB = 1024**3
ADAM_FP32 = 12  # fp32 master copy + two Adam moments, bytes per trained parameter
REDUCE_BUCKET = 5e8  # DeepSpeed's default reduce_bucket_size (elements)
MAX_LIVE_PARAMETERS = 1e9  # DeepSpeed's default stage3_max_live_parameters (elements)
OVERHEAD_GB = {"gpu": 2.0, "cpu": 1.0}
# Host memory of one worker process besides offloaded state: Python, torch, DeepSpeed, the CUDA
# context's host side and the pinned staging buffers on GPU; measured ~1 GiB per CPU worker here.
HOST_BASE_GB = {"gpu": 6.0, "cpu": 1.0}


@dataclass(frozen=True)
class Shape:
    """What the planner needs from config.json."""

    vocab: int
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    tied: bool

    @property
    def layer_params(self) -> int:
        q_o = 2 * self.hidden * self.heads * self.head_dim
        k_v = 2 * self.hidden * self.kv_heads * self.head_dim
        return q_o + k_v + 3 * self.hidden * self.intermediate + 2 * self.hidden

    @property
    def params(self) -> int:
        embed = self.vocab * self.hidden * (1 if self.tied else 2)
        return self.layers * self.layer_params + embed + self.hidden

    def lora_params(self, rank: int) -> int:
        """Adapters on every Linear of every decoder layer: rank x (in + out) each."""
        h, q, kv, i = self.hidden, self.heads * self.head_dim, self.kv_heads * self.head_dim, self.intermediate
        per_layer = (h + q) * 2 + (h + kv) * 2 + (h + i) * 3
        return self.layers * rank * per_layer


def read_shape(path: str) -> Shape:
    """Shape from a config.json file, a model directory holding one, or a hub id (its cached or
    downloaded config.json, see trsp_ray.hub); no weights are read."""
    from trsp_ray import hub

    return shape_from_config(hub.read_config(path), source=path)


def shape_from_config(c: dict, *, source: str = "config") -> Shape:
    """Shape from the fields of a config.json (a multimodal config's text_config is used)."""
    c = c.get("text_config", c)
    try:
        heads = c["num_attention_heads"]
        return Shape(vocab=c["vocab_size"], hidden=c["hidden_size"], intermediate=c["intermediate_size"],
                     layers=c["num_hidden_layers"], heads=heads, kv_heads=c.get("num_key_value_heads") or heads,
                     head_dim=c.get("head_dim") or c["hidden_size"] // heads,
                     tied=bool(c.get("tie_word_embeddings", False)))
    except KeyError as exc:
        raise TrspError(f"model config {source!r} lacks {exc.args[0]!r}; the planner needs a decoder LLM config") from None


@dataclass(frozen=True)
class Setup:
    workers: int
    gpu_memory_gb: float = 80.0
    dtype_bytes: int = 2  # 2 = bf16 (GPU), 4 = fp32 (CPU)
    micro_batch: int = 1  # windows per worker per step
    seqlen: int = 2048
    trainable: str = "all"  # stage 2: all | lora
    lora_rank: int = 8
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


@dataclass
class StagePlan:
    name: str
    parts: dict[str, float] = field(default_factory=dict)  # GB per worker on the device
    host: float = 0.0  # GB per worker moved to host memory by offload

    @property
    def total(self) -> float:
        return sum(self.parts.values())


def _activations_gb(s: Shape, st: Setup) -> float:
    tokens = st.micro_batch * st.seqlen
    kv = s.kv_heads * s.head_dim
    # Saved per token per layer: norms/residuals (~8h, RMSNorm upcasts), q/k/v with RoPE copies
    # (~3 kv-widths beyond h), SwiGLU gate/up/act/product (4 I); SDPA keeps no score matrix.
    per_layer = st.dtype_bytes * (8 * s.hidden + 3 * kv + 4 * s.intermediate) + 8 * s.hidden
    if st.activation_checkpointing:  # only each layer's input is kept; one layer is recomputed
        layers = s.layers * st.dtype_bytes * s.hidden + per_layer
    else:
        layers = s.layers * per_layer
    logits = s.vocab * 4 * 3  # fp32 logits, log-softmax and their gradient
    return tokens * (layers + logits) / GB


def _stage(name: str, s: Shape, st: Setup, *, trained: int, frozen: int) -> StagePlan:
    b, w = st.dtype_bytes, st.workers
    plan = StagePlan(name)
    weights = (trained + frozen) * b / w
    if st.offload_params:
        plan.host += weights / GB
    else:
        plan.parts["weights (partition)"] = weights / GB
    live = max(2 * s.layer_params, min(s.params, st.max_live_parameters))
    plan.parts["gathered parameters"] = live * b / GB
    if trained:
        grads, optim = trained * b / w, trained * ADAM_FP32 / w
        if st.offload_optimizer:
            plan.host += (optim + trained * 4 / w) / GB
        else:
            plan.parts["gradients (partition)"] = grads / GB
            plan.parts["optimizer fp32 + Adam (partition)"] = optim / GB
        plan.parts["reduce bucket"] = min(REDUCE_BUCKET, trained) * b / GB
    plan.parts["activations"] = _activations_gb(s, st)
    plan.parts["runtime overhead"] = OVERHEAD_GB[st.device]
    return plan


def estimate(s: Shape, st: Setup) -> tuple[StagePlan, StagePlan]:
    """(stage 1, stage 2) per-worker plans."""
    p = s.params
    stage1 = _stage("stage 1", s, st, trained=p if st.train_base else 0, frozen=0 if st.train_base else p)
    if st.trainable == "lora":
        stage2 = _stage("stage 2 (lora)", s, st, trained=s.lora_params(st.lora_rank), frozen=p)
    else:
        stage2 = _stage("stage 2 (all weights)", s, st, trained=p, frozen=0)
    return stage1, stage2


@dataclass
class Plan:
    shape: Shape
    setup: Setup
    stages: tuple[StagePlan, ...]

    @property
    def peak(self) -> float:
        return max(st.total for st in self.stages)

    @property
    def fits(self) -> bool:
        return self.peak <= self.setup.gpu_memory_gb

    def reason(self) -> str:
        worst = max(self.stages, key=lambda st: st.total)
        return (f"{worst.name} needs {worst.total:.1f} GB per worker, more than the "
                f"{self.setup.gpu_memory_gb:g} GB available")

    def suggestion(self) -> str:
        return "what would fit: " + "; ".join(alternatives(self.shape, self.setup))

    def host(self) -> "HostPlan":
        return host_and_disk(self)

    def disk_problem(self) -> str | None:
        """A one-line refusal when the kept checkpoints exceed `disk_budget_gb`, else None."""
        h, st = self.host(), self.setup
        if st.disk_budget_gb is None or h.storage_gb <= st.disk_budget_gb:
            return None
        one = h.checkpoint_gb * 2  # keep_checkpoints=1: the kept one + the one being written
        return (f"checkpoints need {h.storage_gb:.1f} GB of storage (keep_checkpoints={st.keep_checkpoints} + 1 being "
                f"written, {h.checkpoint_gb:.1f} GB per save) but distributed.disk_budget_gb={st.disk_budget_gb:g}; "
                f"use keep_checkpoints=1 ({one:.1f} GB) or a disk budget >= {h.storage_gb:.1f} GB")


def plan(s: Shape, st: Setup) -> Plan:
    return Plan(s, st, estimate(s, st))


@dataclass(frozen=True)
class HostPlan:
    """What a run needs besides GPU memory, in GB (see `host_and_disk`)."""

    checkpoint_gb: float  # one save, all ranks together
    storage_gb: float  # the kept saves + the one being written
    disk_per_node_gb: float  # local disk a node needs while its ranks' share of a save is staged
    threads_per_worker: int
    host_per_worker_gb: float
    host_per_node_gb: float  # the node of rank 0 during the export
    export_host_gb: float  # rank 0's host memory above its baseline during the export


def checkpoint_bytes(s: Shape, st: Setup, *, trained: int) -> float:
    """One save, all ranks: DeepSpeed's ZeRO-3 checkpoint holds the optimizer's fp32 master copy
    and both Adam moments of the trained parameters (12 bytes each) and no 16-bit weights (they
    are rebuilt from the fp32 copy; frozen weights come from the model); plus the gate state."""
    return trained * ADAM_FP32 + 64 * 1024 * st.workers


def host_and_disk(p: Plan) -> HostPlan:
    """Checkpoint size per save, storage for the kept ones, local disk and host memory per node,
    threads per worker and the export's host memory.

    Host memory per worker = offloaded state (+ pinned copies) + HOST_BASE_GB; per node = its
    workers + the export on rank 0's node, which streams one layer at a time into safetensors
    shards and holds about 2 x the largest shard (the shard being filled + the one being written).
    """
    s, st = p.shape, p.setup
    trained = s.params if (len(p.stages) > 1 and st.trainable != "lora") or st.train_base else 0
    if len(p.stages) > 1 and st.trainable == "lora":
        trained = s.lora_params(st.lora_rank)
    ckpt = checkpoint_bytes(s, st, trained=trained) / GB
    per_node = min(st.gpus_per_node, st.workers)
    offload = st.offload_optimizer or st.offload_params
    threads = max(1, st.cpus_per_node // max(1, per_node)) if offload else 1
    host_worker = max(stage.host for stage in p.stages) + HOST_BASE_GB[st.device]
    largest_tensor = max(s.vocab * s.hidden, s.hidden * s.intermediate) * st.dtype_bytes / GB
    export = 2 * max(st.export_shard_gb, largest_tensor)
    return HostPlan(checkpoint_gb=ckpt, storage_gb=ckpt * (st.keep_checkpoints + 1),
                    disk_per_node_gb=ckpt * per_node / st.workers if st.remote_storage else 0.0,
                    threads_per_worker=threads, host_per_worker_gb=host_worker,
                    host_per_node_gb=host_worker * per_node + export, export_host_gb=export)


def min_workers(s: Shape, st: Setup, *, limit: int = 4096) -> int | None:
    """The smallest world size (a multiple of 8 above 8, whole nodes) at which `st` fits."""
    from dataclasses import replace

    for w in [1, 2, 4] + list(range(8, limit + 1, 8)):
        if plan(s, replace(st, workers=w)).fits:
            return w
    return None


def alternatives(s: Shape, st: Setup) -> list[str]:
    """Changes that make `st` fit: more workers, offload, LoRA, activation checkpointing."""
    from dataclasses import replace

    out = []
    w = min_workers(s, st)
    if w is not None and w != st.workers:
        out.append(f"--workers {w} ({math.ceil(w / 8)} node(s) of 8 GPUs)")
    # Cheapest first: recomputation costs ~30% compute, offload costs PCIe traffic every step.
    options = [("activation_checkpointing", "--activation-checkpointing"),
               ("offload_optimizer", "--offload-optimizer"), ("offload_params", "--offload-params")]
    free = [(a, f) for a, f in options if not getattr(st, a)]
    subsets = [c for n in range(1, len(free) + 1) for c in itertools.combinations(free, n)]
    for subset in subsets:
        if plan(s, replace(st, **{a: True for a, _ in subset})).fits:
            out.append(" + ".join(f for _, f in subset) + f" at {st.workers} workers")
            break
    if st.trainable != "lora" and plan(s, replace(st, trainable="lora")).fits:
        out.append(f"--trainable lora at {st.workers} workers")
    return out or ["nothing at this GPU size; use larger GPUs or a smaller micro batch / seqlen"]


def format_plan(p: Plan) -> str:
    st = p.setup
    lines = [f"model: {p.shape.params / 1e9:.2f}B parameters, {p.shape.layers} layers; {st.workers} workers x "
             f"{st.gpu_memory_gb:g} GB, {'bf16' if st.dtype_bytes == 2 else 'fp32'}, micro batch {st.micro_batch} x "
             f"{st.seqlen} tokens"]
    for stage in p.stages:
        verdict = "fits" if stage.total <= st.gpu_memory_gb else "DOES NOT FIT"
        host = f", host {stage.host:.1f} GB" if stage.host else ""
        lines.append(f"  {stage.name}: {stage.total:.1f} GB per worker ({verdict}{host})")
        lines += [f"      {k}: {v:.2f} GB" for k, v in stage.parts.items()]
    h = p.host()
    budget = f" (budget {st.disk_budget_gb:g} GB)" if st.disk_budget_gb is not None else ""
    lines += [f"  checkpoint: {h.checkpoint_gb:.1f} GB per save; storage {h.storage_gb:.1f} GB for "
              f"keep_checkpoints={st.keep_checkpoints} + 1 being written{budget}",
              f"  disk per node: {h.disk_per_node_gb:.1f} GB ("
              + ("its ranks' share of a save, staged before upload" if st.remote_storage else
                 "none: saves are written in place on the shared path") + ")",
              f"  host memory per node: {h.host_per_node_gb:.1f} GB ({min(st.gpus_per_node, st.workers)} workers x "
              f"{h.host_per_worker_gb:.1f} GB + the export on rank 0's node); "
              f"{h.threads_per_worker} CPU threads per worker",
              f"  export host memory: {h.export_host_gb:.1f} GB above baseline on rank 0 "
              f"(2 x {st.export_shard_gb:.1f} GB shards, one layer gathered at a time)"]
    lines.append(f"plan {'fits' if p.fits else 'does not fit: ' + p.reason()}")
    if not p.fits:
        lines.append(p.suggestion())
    if p.disk_problem():
        lines.append(f"refused: {p.disk_problem()}")
    return "\n".join(lines)


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
                 remote_storage="://" in (d.storage_path or "") and not (d.storage_path or "").startswith("file://"))


def plan_for_run(cfg, model_path: str, ds_config: dict | None = None) -> Plan:
    """The plan of a run config; stage 2 counts only when the method trains weights."""
    return zero3_plan(cfg, read_shape(model_path), ds_config)


def zero3_plan(cfg, s: Shape, ds_config: dict | None = None) -> Plan:
    """`plan_for_run` for a known Shape (a preset's config.json fields, no model directory)."""
    p = plan(s, setup_for_run(cfg, ds_config))
    if not (cfg.method in ("trsp", "trsp-oneshot") and cfg.stage2.enabled and cfg.stage2.steps > 0):
        p.stages = p.stages[:1]
    return p
