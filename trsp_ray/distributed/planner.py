"""Memory planner: per-worker memory of stage 1 and stage 2 under ZeRO-3, from config.json alone
(parameter counts are read off the model built on the meta device: no weights, no download).

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

import functools
import itertools
import json
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
class Counts:
    """Parameter counts read off a model built on the meta device (see `meta_model`)."""

    total: int  # unique parameters: a tied LM head counts once
    layer: int  # the largest decoder layer
    lora_width: int  # in + out features summed over the decoder layers' nn.Linear (LoRA parameters per rank)
    largest_tensor: int  # elements of the largest parameter (the export holds it whole)
    tied: bool  # the LM head shares the input embedding


@dataclass(frozen=True)
class Shape:
    """What the planner needs of a model: the sizes that set activation memory (config fields) and
    its parameter counts, read off the model's own structure on the meta device (`counts`).

    `read_shape` / `shape_from_config` keep the model's config (`config`). A Shape built by hand from
    the fields alone is a Llama of those sizes, counted by formula (transformers refuses some sizes
    a hand figure uses, e.g. an odd head_dim; the tests check the formula against a meta Llama).
    """

    vocab: int
    hidden: int
    intermediate: int  # the MLP's inner width (OPT's ffn_dim)
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    tied: bool
    config: str = field(default="", repr=False)  # the text config's fields as sorted JSON, with model_type

    @property
    def counts(self) -> Counts:
        return _counts(self.config) if self.config else _llama_counts(self)

    @property
    def layer_params(self) -> int:
        return self.counts.layer

    @property
    def params(self) -> int:
        return self.counts.total

    def lora_params(self, rank: int) -> int:
        """Adapters on every Linear of every decoder layer (training.lora_targets): rank x (in + out) each."""
        return rank * self.counts.lora_width


def _llama_counts(s: Shape) -> Counts:
    """A Llama decoder layer: q, k, v, o projections, SwiGLU's gate, up and down, two RMSNorms."""
    q, kv, h, i = s.heads * s.head_dim, s.kv_heads * s.head_dim, s.hidden, s.intermediate
    layer = 2 * h * q + 2 * h * kv + 3 * h * i + 2 * h
    return Counts(total=s.layers * layer + s.vocab * h * (1 if s.tied else 2) + h, layer=layer,
                  lora_width=s.layers * ((h + q) * 2 + (h + kv) * 2 + (h + i) * 3),
                  largest_tensor=max(s.vocab * h, h * i, h * q), tied=s.tied)


def _hf_config(config: dict):
    """The transformers config of a text config's fields (`model_type` included): the family's
    defaults fill what the fields leave out, as `from_pretrained` would."""
    from transformers import AutoConfig

    return AutoConfig.for_model(config["model_type"], **{k: v for k, v in config.items() if k != "model_type"})


def meta_model(config: dict):
    """The *ForCausalLM of a text config's fields (`model_type` included) on the meta device: every
    parameter has its shape and no storage, so a 70B model costs ~1 s and a few MB."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(_hf_config(config))


@functools.lru_cache(maxsize=64)
def _counts(config_json: str) -> Counts:
    """Counts of one config (sorted JSON); cached, as plans ask for them in loops (`min_workers`)."""
    from torch import nn

    from trsp_ray import families

    model = meta_model(json.loads(config_json))
    layers = families.decoder_layers(model)
    params = list(model.parameters())  # a tied weight is yielded once
    head = model.get_output_embeddings()
    return Counts(total=sum(p.numel() for p in params),
                  layer=max(sum(p.numel() for p in layer.parameters()) for layer in layers),
                  lora_width=sum(m.in_features + m.out_features for layer in layers for m in layer.modules()
                                 if isinstance(m, nn.Linear)),
                  largest_tensor=max(p.numel() for p in params),
                  tied=head is not None and head.weight is model.get_input_embeddings().weight)


def read_shape(path: str) -> Shape:
    """Shape from a config.json file, a model directory holding one, or a hub id (its cached or
    downloaded config.json, see trsp_ray.hub); no weights are read."""
    from trsp_ray import hub

    return shape_from_config(hub.read_config(path), source=path)


_REQUIRED = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads")


def shape_from_config(c: dict, *, source: str = "config") -> Shape:
    """Shape from the fields of a config.json (a multimodal config's text_config is used). Fields
    without `model_type` (a hand-written config, a preset's sizes) are read as a Llama, and then
    must give intermediate_size too (LlamaConfig's default would pass unnoticed)."""
    from trsp_ray.families import FAMILIES

    c = c.get("text_config", c)
    required = _REQUIRED if "model_type" in c else (*_REQUIRED, "intermediate_size")
    c = {"model_type": "llama", **c}
    kind = c["model_type"]
    if kind not in FAMILIES:
        raise TrspError(f"model config {source!r} has model_type {kind!r}, which the planner cannot build; "
                        f"supported: {', '.join(sorted(FAMILIES))}")
    missing = [k for k in required if k not in c]
    if missing:
        raise TrspError(f"model config {source!r} lacks {missing[0]!r}; the planner needs a decoder LLM config")
    # Private keys (_comment, _name_or_path) and quantization say nothing about the parameters' shapes.
    fields = {k: v for k, v in c.items() if not k.startswith("_") and k != "quantization_config"}
    key = json.dumps(fields, sort_keys=True)
    try:
        hf, counts = _hf_config(fields), _counts(key)
    except Exception as exc:  # noqa: BLE001 - transformers' config validators raise several types
        why = " ".join(str(exc).split()) or type(exc).__name__  # one line
        raise TrspError(f"model config {source!r} does not build a {kind} model: {why}") from None
    # Activation sizes as the model has them: OPT calls the MLP width ffn_dim; GPT-NeoX and OPT
    # have no key/value heads or head_dim of their own.
    hidden, heads = hf.hidden_size, hf.num_attention_heads
    return Shape(vocab=hf.vocab_size, hidden=hidden,
                 intermediate=getattr(hf, "intermediate_size", None) or getattr(hf, "ffn_dim", None) or 4 * hidden,
                 layers=hf.num_hidden_layers, heads=heads, kv_heads=getattr(hf, "num_key_value_heads", None) or heads,
                 head_dim=getattr(hf, "head_dim", None) or hidden // heads, tied=counts.tied, config=key)


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
    frozen_layers: int = 0  # decoder layers stage 2 leaves out of the optimizer (a heal's drop set)


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
        frozen = st.frozen_layers * s.layer_params
        stage2 = _stage("stage 2 (all weights)", s, st, trained=p - frozen, frozen=frozen)
    return stage1, stage2


class _Peaks:
    """What a plan of any route reads off its stages: the largest one and its size."""

    stages: tuple[StagePlan, ...]

    @property
    def peak(self) -> float:
        return self.worst().total

    def worst(self) -> StagePlan:
        return max(self.stages, key=lambda st: st.total)


@dataclass
class Plan(_Peaks):
    shape: Shape
    setup: Setup
    stages: tuple[StagePlan, ...]

    @property
    def fits(self) -> bool:
        return self.peak <= self.setup.gpu_memory_gb

    def reason(self) -> str:
        worst = self.worst()
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

        def gb(x: float) -> str:  # small models: enough digits that the comparison shows
            return f"{x:.1f}" if x >= 10 else f"{x:.3g}"

        fix = f"keep_checkpoints=1 ({gb(one)} GB) or " if st.keep_checkpoints > 1 and one <= st.disk_budget_gb else ""
        return (f"checkpoints need {gb(h.storage_gb)} GB of storage (keep_checkpoints={st.keep_checkpoints} + 1 being "
                f"written, {gb(h.checkpoint_gb)} GB per save) but distributed.disk_budget_gb={st.disk_budget_gb:g}; "
                f"use {fix}a disk budget >= {gb(h.storage_gb)} GB")


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
    trained = s.params if st.train_base else 0
    if len(p.stages) > 1 and st.trainable != "lora":
        trained = max(trained, s.params - st.frozen_layers * s.layer_params)
    if len(p.stages) > 1 and st.trainable == "lora":
        trained = s.lora_params(st.lora_rank)
    ckpt = checkpoint_bytes(s, st, trained=trained) / GB
    per_node = min(st.gpus_per_node, st.workers)
    offload = st.offload_optimizer or st.offload_params
    threads = max(1, st.cpus_per_node // max(1, per_node)) if offload else 1
    host_worker = max(stage.host for stage in p.stages) + HOST_BASE_GB[st.device]
    largest_tensor = s.counts.largest_tensor * st.dtype_bytes / GB
    export = 2 * max(min(st.export_shard_gb, s.params * st.dtype_bytes / GB), largest_tensor)
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


def format_plan(p: Plan, *, after_stages: tuple[str, ...] = ()) -> str:
    """The plan as text; `after_stages`: lines printed after the stages (stage 1's probes)."""
    st = p.setup
    lines = [f"model: {p.shape.params / 1e9:.2f}B parameters, {p.shape.layers} layers; {st.workers} workers x "
             f"{st.gpu_memory_gb:g} GB, {'bf16' if st.dtype_bytes == 2 else 'fp32'}, micro batch {st.micro_batch} x "
             f"{st.seqlen} tokens"]
    for stage in p.stages:
        verdict = "fits" if stage.total <= st.gpu_memory_gb else "DOES NOT FIT"
        host = f", host {stage.host:.1f} GB" if stage.host else ""
        lines.append(f"  {stage.name}: {stage.total:.1f} GB per worker ({verdict}{host})")
        lines += [f"      {k}: {v:.2f} GB" for k, v in stage.parts.items()]
    lines += after_stages
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


def _on_workers(method: str) -> bool:
    """Whether the Ray Train path can run `method` (stage 1, stage 2 or a heal, export)."""
    from trsp_ray import registry

    return registry.method(method).uses_stage1


def trains_on_workers(cfg) -> bool:
    """Whether the Ray Train path trains weights after stage 1: TRSP's stage 2, or a heal (run there
    as stage 2 with schedule skip, so it needs stage 2's memory)."""
    from trsp_ray import registry

    spec = registry.method(cfg.method)
    return spec.stage2 or spec.heal


def plan_for_run(cfg, model_path: str, ds_config: dict | None = None) -> Plan:
    """The plan of a run config; stage 2 counts only when the method trains weights."""
    return zero3_plan(cfg, read_shape(model_path), ds_config)


def recovers_on_workers(cfg) -> bool:
    """Whether the workers train weights after stage 1: a heal method heals with stage 2's budget
    whatever stage2.enabled says (as one process does, methods.method_heal); TRSP's stage 2 runs
    when enabled."""
    from trsp_ray import registry

    spec = registry.method(cfg.method)
    return cfg.stage2.steps > 0 and (spec.heal or (spec.stage2 and cfg.stage2.enabled))


def zero3_plan(cfg, s: Shape, ds_config: dict | None = None) -> Plan:
    """`plan_for_run` for a known Shape (a preset's config.json fields, no model directory)."""
    from dataclasses import replace

    from trsp_ray import registry

    st = setup_for_run(cfg, ds_config)
    if registry.method(cfg.method).heal:  # a worker heal freezes the drop set (recovery.heal_stepper)
        st = replace(st, frozen_layers=round(cfg.ratio * s.layers))
    p = plan(s, st)
    if not recovers_on_workers(cfg):
        p.stages = p.stages[:1]
    return p


# --- The single-process path (driver.run, the benchmark, search trials, reproduction cells) and
# the route every job takes: one process on one device when that plan fits, else Ray Train workers.
#
# One device holds the working copy of the model (Workbench.fresh_model; the original stays in host
# memory, so on CPU both count), then per stage (bytes per token unless said otherwise; e = dtype
# bytes, h hidden, q = heads x head_dim, kv = kv_heads x head_dim, I intermediate, V vocab):
#   stage 1   gates train, weights frozen: per layer the RMSNorms' fp32 inputs (2 x 4h), attention's
#             q, k, v, output and log-sum-exp (e(2q + 2kv) + 4 heads), SwiGLU's gate, act and up
#             (3eI) and the gate's (y - x) (eh). Frozen Linears keep no inputs.
#   stage 2   all weights train: + the Linears' inputs (e(2h + q + I)). Per parameter, Adam's two
#             fp32 moments (8) and, for bf16/fp16, an fp32 master copy (4): training.TorchStepper.
#             The step's fp32 gradients (4 per parameter) appear after backward freed the
#             activations, so the stage peaks at the larger of the two.
#   checkpointing  only each layer's input (+ a gate's (y - x) in stage 1) is kept; the layer
#             being recomputed holds its activations once more, after the logits' gradients are gone.
#   logits    training: the fp32 log-softmax kept for backward (4V), and at the start of backward
#             its gradient and the NLL gradient (8V); SLEB / ShortGPT forward: the model-dtype
#             logits, their fp32 upcast and the log-softmax (eV + 4V + 4V; fp32 skips the upcast);
#             evaluation (perplexity.py): fp32 logits, their shifted copy and the log-softmax (12V).
#   SLEB      the inputs of every layer for one batch (L e h): baselines.sleb_drop streams batches.
# Measured against this on CPU with glibc returning freed memory at once (MALLOC_MMAP_THRESHOLD_,
# the analog of torch.cuda.max_memory_allocated): benchmarks/planner_single.py.

@dataclass(frozen=True)
class SingleSetup:
    """What the single-process path's memory depends on (RunConfig fields, see `single_setup_for_run`)."""

    memory_gb: float = 80.0  # what the one device holds: a GPU's memory, or host memory on CPU
    dtype_bytes: int = 2  # 2 = bf16 / fp16, 4 = fp32
    device: str = "gpu"  # gpu | cpu: on CPU the original model shares the memory with the working copy
    batch: int = 4  # windows per training step
    seqlen: int = 2048
    activation_checkpointing: bool = False
    trainable: str = "all"  # stage 2: all | lora
    lora_rank: int = 8
    train_base: bool = False
    baseline_batch: int = 4  # windows per ShortGPT / SLEB forward
    baseline_seqlen: int = 2048
    eval_batch: int = 4  # windows per perplexity forward
    eval_seqlen: int = 2048


SINGLE_OVERHEAD_GB = {"gpu": 1.5, "cpu": 0.8}  # CUDA context + allocator slack; Python + torch + transformers


@dataclass
class SinglePlan(_Peaks):
    """The single-process stages of a run on one device; same reading as `Plan`."""

    shape: Shape
    setup: SingleSetup
    stages: tuple[StagePlan, ...]

    @property
    def fits(self) -> bool:
        return self.peak <= self.setup.memory_gb

    def reason(self) -> str:
        w = self.worst()
        where = "one GPU" if self.setup.device == "gpu" else "host memory"
        return f"{w.name} needs {w.total:.1f} GB in one process, more than the {self.setup.memory_gb:.1f} GB of {where}"


def _layer_activations(s: Shape, e: int, *, trained: bool, gated: bool) -> float:
    """Bytes per token kept for backward by one decoder layer (see the table above)."""
    q, kv = s.heads * s.head_dim, s.kv_heads * s.head_dim
    kept = 2 * 4 * s.hidden + e * (2 * q + 2 * kv + 3 * s.intermediate) + 4 * s.heads
    if trained:
        kept += e * (2 * s.hidden + q + s.intermediate)
    if gated:
        kept += e * s.hidden
    return kept


def _training_activations_gb(s: Shape, st: SingleSetup, *, layers: int, trained: bool, gated: bool) -> float:
    tokens = st.batch * st.seqlen
    per_layer = _layer_activations(s, st.dtype_bytes, trained=trained, gated=gated)
    if st.activation_checkpointing:
        kept = layers * st.dtype_bytes * s.hidden * (2 if gated else 1)
        return tokens * (kept + 4 * s.vocab + max(8 * s.vocab, 2 * per_layer)) / GB
    return tokens * (layers * per_layer + 12 * s.vocab) / GB


def _single_weights(plan: StagePlan, s: Shape, st: SingleSetup, params: int) -> None:
    plan.parts["model (working copy)"] = params * st.dtype_bytes / GB
    if st.device == "cpu":
        plan.parts["model (original, host)"] = s.params * st.dtype_bytes / GB
    plan.parts["runtime overhead"] = SINGLE_OVERHEAD_GB[st.device]


def _optimizer_gb(params: int, e: int) -> float:
    """Adam's fp32 moments, plus the fp32 master copy of low-precision parameters (GB)."""
    return params * (8 if e == 4 else 12) / GB


def single_training(name: str, s: Shape, st: SingleSetup, *, trained_params: int, gated: bool, lora: bool = False,
                    layers: int | None = None) -> StagePlan:
    """One training stage in one process (stage 1, stage 2, heal); `layers` < L after removal;
    `lora`: `trained_params` are fp32 adapters beside the frozen weights."""
    layers = s.layers if layers is None else layers
    params = s.params - (s.layers - layers) * s.layer_params
    plan = StagePlan(name)
    _single_weights(plan, s, st, params)
    # Adapters keep the same Linear inputs for their gradients as trained weights do.
    acts = _training_activations_gb(s, st, layers=layers, trained=trained_params > 0, gated=gated)
    if lora:
        plan.parts["LoRA adapters (fp32)"] = trained_params * 4 / GB
    if trained_params:
        plan.parts["optimizer state"] = _optimizer_gb(trained_params, 4 if lora else st.dtype_bytes)
    # The step's fp32 gradients appear once backward has freed the activations.
    plan.parts["activations + logits | step gradients"] = max(acts, trained_params * 4 / GB)
    return plan


def forward_layer_bytes(s: Shape, e: int) -> int:
    """Bytes per token of one decoder layer's intermediates in a no-grad forward (one at a time)."""
    return e * (3 * s.hidden + 3 * s.intermediate)


def single_forward(name: str, s: Shape, st: SingleSetup, *, batch: int, seqlen: int, evaluation: bool) -> StagePlan:
    """A no-grad pass: ShortGPT, SLEB (with its per-batch layer inputs) or perplexity."""
    from trsp_ray import registry

    e, tokens = st.dtype_bytes, batch * seqlen
    plan = StagePlan(name)
    _single_weights(plan, s, st, s.params)
    logits = 12 * s.vocab if evaluation else s.vocab * (e + 4 + (4 if e != 4 else 0))
    plan.parts["logits + one layer"] = tokens * (logits + forward_layer_bytes(s, e)) / GB
    if name in registry.LAYER_INPUT_SELECTORS:
        plan.parts["layer inputs of one batch"] = tokens * s.layers * e * s.hidden / GB
    return plan


def single_stages(cfg, *, methods: tuple[str, ...] | None = None) -> tuple[str, ...]:
    """The single-process stages `cfg` runs (for every method of `methods` when given, e.g. benchmark rows)."""
    from trsp_ray import registry

    out: list[str] = []
    for m in methods or (cfg.method,):
        selector, recovery = registry.recipe(m)
        wanted = ["stage 1"] if selector == registry.TRSP_SELECTOR else []
        if recovery == "stage2" and cfg.stage2.enabled and cfg.stage2.steps > 0:
            wanted.append("stage 2")
        if selector in registry.FORWARD_SELECTORS:
            wanted.append(selector)
        if (cfg.heal.steps > 0 and selector is not None) or recovery == "heal":
            wanted.append("heal")
        out += [w for w in wanted + ["evaluation"] if w not in out]
    return tuple(out)


def single_setup_for_run(cfg, *, device: str, memory_gb: float) -> SingleSetup:
    e = {"bf16": 2, "fp16": 2, "fp32": 4}.get(cfg.dtype, 2 if device == "gpu" else 4)
    d = cfg.data
    return SingleSetup(memory_gb=memory_gb, dtype_bytes=e, device=device, batch=d.batch_size, seqlen=d.seqlen,
                       activation_checkpointing=cfg.distributed.activation_checkpointing,
                       trainable=cfg.stage2.trainable, lora_rank=cfg.stage2.lora_rank,
                       train_base=cfg.stage1.train_base, baseline_batch=d.batch_size, baseline_seqlen=d.seqlen,
                       eval_batch=4, eval_seqlen=d.eval_seqlen)


def single_plan(s: Shape, st: SingleSetup, stages: tuple[str, ...], *, n_drop: int = 0, heal_trainable: str = "all",
                heal_lora_rank: int = 8) -> SinglePlan:
    """The plan of the single-process `stages` (names as `single_stages` gives them)."""
    from trsp_ray import registry

    built = []
    for name in stages:
        if name == "stage 1":
            built.append(single_training(name, s, st, trained_params=s.params if st.train_base else 0, gated=True))
        elif name == "stage 2":
            lora = st.trainable == "lora"
            trained = s.lora_params(st.lora_rank) if lora else s.params
            built.append(single_training(name, s, st, trained_params=trained, gated=False, lora=lora))
        elif name == "heal":
            kept = s.layers - n_drop
            lora = heal_trainable == "lora"
            trained = (kept * s.lora_params(heal_lora_rank) // s.layers if lora
                       else s.params - n_drop * s.layer_params)
            built.append(single_training(name, s, st, trained_params=trained, gated=False, lora=lora, layers=kept))
        elif name in registry.FORWARD_SELECTORS:
            built.append(single_forward(name, s, st, batch=st.baseline_batch, seqlen=st.baseline_seqlen,
                                        evaluation=False))
        else:
            built.append(single_forward(name, s, st, batch=st.eval_batch, seqlen=st.eval_seqlen, evaluation=True))
    return SinglePlan(s, st, tuple(built))


def single_plan_for_run(cfg, *, device: str, memory_gb: float, methods: tuple[str, ...] | None = None,
                        shape: Shape | None = None) -> SinglePlan:
    """The single-process plan of `cfg` (or of every method in `methods`) on one `device` of `memory_gb`."""
    s = shape or _run_shape(cfg)
    st = single_setup_for_run(cfg, device=device, memory_gb=memory_gb)
    return single_plan(s, st, single_stages(cfg, methods=methods), n_drop=round(cfg.ratio * s.layers),
                       heal_trainable=cfg.heal.trainable, heal_lora_rank=cfg.heal.lora_rank)


def _run_shape(cfg) -> Shape:
    from trsp_ray import assets

    return read_shape(assets.resolve_model(cfg.model))


def single_hint(cfg, p: SinglePlan) -> str:
    """What would make a single-process plan fit (cheapest first), or the Ray Train route."""
    from trsp_ray.config import replace

    st = p.setup
    changes = [("distributed.activation_checkpointing", True), ("dtype", "bf16"), ("stage2.trainable", "lora")]
    for key, value in changes:
        section, _, name = key.rpartition(".")
        now = getattr(getattr(cfg, section) if section else cfg, name)
        if now != value and single_plan_for_run(replace(cfg, **{key: value}), device=st.device,
                                                memory_gb=st.memory_gb, shape=p.shape).fits:
            return f"set {key}={str(value).lower()}"
    if _on_workers(cfg.method) and cfg.heal.steps == 0:
        return "or allow Ray Train workers (distributed.workers=N) so it runs under ZeRO-3"
    return "use a smaller data.batch_size or data.seqlen, or a larger device"




@dataclass
class Route:
    """How a job runs: `workers` 0 = one process on one device, N >= 1 = N Ray Train workers (ZeRO-3)."""

    workers: int
    device: str  # gpu | cpu
    plan: SinglePlan | Plan  # the plan the route was chosen by (per worker when workers >= 1)

    def describe(self) -> str:
        where = "GPU" if self.device == "gpu" else "CPU"
        if self.workers == 0:
            return (f"single process on one {where}: peak {self.plan.peak:.1f} of "
                    f"{self.plan.setup.memory_gb:.1f} GB ({self.plan.worst().name})")
        return (f"{self.workers} Ray Train worker(s), ZeRO-3 on {where}: peak {self.plan.peak:.1f} of "
                f"{self.plan.setup.gpu_memory_gb:g} GB per worker")


def route(cfg, *, device: str | None = None, memory_gb: float | None = None, shape: Shape | None = None,
          max_workers: int | None = None) -> Route:
    """The route of `cfg`: one process on one device when its single-process plan fits, else the
    fewest Ray Train workers (at most `max_workers`, default distributed.workers; 0 = none allowed)
    whose ZeRO-3 plan fits. A one-line TrspError when neither does, before any work.

    device: gpu | cpu (default from cfg.device; auto = gpu when distributed.use_gpu); memory_gb: what
    one device holds (default distributed.gpu_memory_gb on gpu, this host's memory on cpu); shape:
    the model's planner Shape (default: read from cfg.model's config.json, no weights).
    """
    import os

    from trsp_ray.config import replace

    if device is None:
        device = "gpu" if cfg.device == "cuda" or (cfg.device == "auto" and cfg.distributed.use_gpu) else "cpu"
    if memory_gb is None:
        memory_gb = (cfg.distributed.gpu_memory_gb if device == "gpu"
                     else os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / GB)
    s = shape or _run_shape(cfg)
    single = single_plan_for_run(cfg, device=device, memory_gb=memory_gb, shape=s)
    if single.fits:
        return Route(0, device, single)
    limit = cfg.distributed.workers if max_workers is None else max_workers
    if limit >= 1 and _on_workers(cfg.method) and cfg.heal.steps == 0:
        for w in range(1, limit + 1):
            if cfg.data.batch_size % w:  # every worker takes an equal slice of each batch
                continue
            cfg_w = replace(cfg, **{"distributed.workers": w, "distributed.use_gpu": device == "gpu",
                                    "distributed.gpu_memory_gb": memory_gb})
            zero = zero3_plan(cfg_w, s)
            if zero.fits:
                return Route(w, device, zero)
        raise TrspError(f"{single.reason()}, and no ZeRO-3 plan fits on <= {limit} workers; "
                        f"{single_hint(cfg, single)}")
    raise TrspError(f"the plan does not fit: {single.reason()}; {single_hint(cfg, single)}")
