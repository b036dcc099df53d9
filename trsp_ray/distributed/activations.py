"""Activation memory of a forward: what a training forward keeps for backward (per token and
decoder layer, plus the logits), and a no-grad forward's one layer at a time.

Bytes per token unless said otherwise; e = dtype bytes, h hidden, q = heads x head_dim,
kv = kv_heads x head_dim, I intermediate, V vocab:
  stage 1   gates train, weights frozen: per layer the RMSNorms' fp32 inputs (2 x 4h), attention's
            q, k, v, output and log-sum-exp (e(2q + 2kv) + 4 heads), SwiGLU's gate, act and up
            (3eI) and the gate's (y - x) (eh). Frozen Linears keep no inputs.
  stage 2   all weights train: + the Linears' inputs (e(2h + q + I)).
  checkpointing  only each layer's input (+ a gate's (y - x) in stage 1) is kept; the layer
            being recomputed holds its activations once more, after the logits' gradients are gone.
  logits    training: the fp32 log-softmax kept for backward (4V), and at the start of backward
            its gradient and the NLL gradient (8V).
Measured against this on CPU with glibc returning freed memory at once (MALLOC_MMAP_THRESHOLD_,
the analog of torch.cuda.max_memory_allocated): benchmarks/planner_single.py.

The ZeRO-3 plan still uses its own, coarser per-layer figure (`zero3_activations_gb`): moving it to
the model above (with trained=True in stage 1 too: DeepSpeed's ZeRO-3 Linear saves every input)
would lower figures the tests pin by more than 1% (Llama-2-70B on 16 x 80 GB without checkpointing:
stage 1 79.9 -> 74.6 GB, stage 2 137.0 -> 129.3 GB, tests/test_distributed_hub.py), and
benchmarks/planner_check.py has not measured that change.
"""

from __future__ import annotations

from trsp_ray.distributed.memory import GB
from trsp_ray.distributed.shape import Shape


def layer_activation_bytes(s: Shape, e: int, *, trained: bool, gated: bool) -> float:
    """Bytes per token kept for backward by one decoder layer (see the table above)."""
    q, kv = s.heads * s.head_dim, s.kv_heads * s.head_dim
    kept = 2 * 4 * s.hidden + e * (2 * q + 2 * kv + 3 * s.intermediate) + 4 * s.heads
    if trained:
        kept += e * (2 * s.hidden + q + s.intermediate)
    if gated:
        kept += e * s.hidden
    return kept


def training_activations_gb(s: Shape, *, dtype_bytes: int, tokens: int, layers: int, checkpointing: bool,
                            trained: bool, gated: bool) -> float:
    """GB one training step keeps for backward over `tokens` tokens of `layers` decoder layers,
    logits included (see the table above)."""
    per_layer = layer_activation_bytes(s, dtype_bytes, trained=trained, gated=gated)
    if checkpointing:
        kept = layers * dtype_bytes * s.hidden * (2 if gated else 1)
        return tokens * (kept + 4 * s.vocab + max(8 * s.vocab, 2 * per_layer)) / GB
    return tokens * (layers * per_layer + 12 * s.vocab) / GB


def zero3_activations_gb(s: Shape, *, dtype_bytes: int, tokens: int, checkpointing: bool) -> float:
    """GB one ZeRO-3 worker's step keeps for backward over `tokens` tokens (every layer: a gate's
    gradient flows through all later layers), logits included."""
    kv = s.kv_heads * s.head_dim
    # Saved per token per layer: norms/residuals (~8h, RMSNorm upcasts), q/k/v with RoPE copies
    # (~3 kv-widths beyond h), SwiGLU gate/up/act/product (4 I); SDPA keeps no score matrix.
    per_layer = dtype_bytes * (8 * s.hidden + 3 * kv + 4 * s.intermediate) + 8 * s.hidden
    if checkpointing:  # only each layer's input is kept; one layer is recomputed
        layers = s.layers * dtype_bytes * s.hidden + per_layer
    else:
        layers = s.layers * per_layer
    logits = s.vocab * 4 * 3  # fp32 logits, log-softmax and their gradient
    return tokens * (layers + logits) / GB


def forward_layer_bytes(s: Shape, e: int) -> int:
    """Bytes per token of one decoder layer's intermediates in a no-grad forward (one at a time)."""
    return e * (3 * s.hidden + 3 * s.intermediate)
