"""Activation memory of a forward: what a training forward keeps for backward (per token and
decoder layer, plus the logits), and a no-grad forward's one layer at a time. One model for one
process and for ZeRO-3 workers.

Bytes per token unless said otherwise; e = dtype bytes, h hidden, q = heads x head_dim,
kv = kv_heads x head_dim, I intermediate, V vocab:
  any layer a gradient flows through: the RMSNorms' fp32 inputs and inverse RMS (2 x 4h + 8),
            attention's q, k, v, output and log-sum-exp (e(2q + 2kv) + 4 heads), SwiGLU's gate,
            act and up (3eI). Frozen torch Linears keep no inputs.
  weights train (stage 2, a heal): + the Linears' inputs (the two normed streams and down_proj's,
            e(2h + I); o_proj's is attention's output, kept already) and the normed streams again
            for the norms' weights (2eh).
  ZeRO-3    DeepSpeed's Linear keeps its input even when its weight is frozen, so stage 1 on workers
            keeps e(2h + I) more than in one process.
  stage 1   + the gate's (y - x) (eh).
  checkpointing  only each layer's input (+ a gate's (y - x) in stage 1) is kept; the layer
            being recomputed holds its activations once more, after the logits' gradients are gone.
  logits    training: the fp32 log-softmax kept for backward (4V), and at the start of backward
            its gradient and the NLL gradient (8V).
The per-layer figures are what autograd's saved-tensor hooks count on SmolLM2 (fp32 and bf16, one
process and with ZeRO-3's Linear, stage 1 and stage 2: all eight exact, benchmarks/activation_check.py);
the peaks they lead to are measured against the plans in benchmarks/planner_single.py (one process,
glibc returning freed memory at once, the analog of torch.cuda.max_memory_allocated) and
benchmarks/planner_check.py (two ZeRO-3 workers).
"""

from __future__ import annotations

from trsp_ray.plan.memory import GB
from trsp_ray.plan.shape import Shape


def layer_activation_bytes(s: Shape, e: int, *, trained: bool, gated: bool, zero3: bool = False) -> float:
    """Bytes per token kept for backward by one decoder layer (see the table above)."""
    q, kv = s.heads * s.head_dim, s.kv_heads * s.head_dim
    kept = 2 * 4 * s.hidden + 8 + e * (2 * q + 2 * kv + 3 * s.intermediate) + 4 * s.heads
    if trained:
        kept += e * (4 * s.hidden + s.intermediate)
    elif zero3:
        kept += e * (2 * s.hidden + s.intermediate)
    if gated:
        kept += e * s.hidden
    return kept


def training_activations_gb(s: Shape, *, dtype_bytes: int, tokens: int, layers: int, checkpointing: bool,
                            trained: bool, gated: bool, zero3: bool = False) -> float:
    """GB one training step keeps for backward over `tokens` tokens of `layers` decoder layers,
    logits included (see the table above); `zero3`: on a ZeRO-3 worker."""
    per_layer = layer_activation_bytes(s, dtype_bytes, trained=trained, gated=gated, zero3=zero3)
    if checkpointing:
        kept = layers * dtype_bytes * s.hidden * (2 if gated else 1)
        return tokens * (kept + 4 * s.vocab + max(8 * s.vocab, 2 * per_layer)) / GB
    return tokens * (layers * per_layer + 12 * s.vocab) / GB


def forward_layer_bytes(s: Shape, e: int) -> int:
    """Bytes per token of a no-grad forward at its largest inside one decoder layer, the larger of
    the MLP, where SwiGLU's gate activation, up projection and their product (3eI) sit beside the
    layer's input, the attention residual and the normed stream (3eh), and the rotary embedding of
    the queries (q, q cos, its rotated half, that times sin: 4eq) beside k, v (2e kv) and the layer's
    input and normed stream; both beside the embedding output, which a Hugging Face forward holds to
    its end (eh). Counted on a CPU Llama by tests/test_forward_memory.py; on one H200 the Block
    Influence pass of a 1B (d 2048, I 8192: the MLP) measured 63-66 KiB per token above the weights,
    this 64."""
    q, kv = s.heads * s.head_dim, s.kv_heads * s.head_dim
    return e * max(4 * s.hidden + 3 * s.intermediate, 3 * s.hidden + 4 * q + 2 * kv)


def probe_bytes(s: Shape, e: int) -> int:
    """Bytes per token while Block Influence's probe scores one layer (selectors.influence_sums):
    the layer's input and output and the embedding output (3eh) beside cos(x, y) taken in float32:
    the two upcasts (none in fp32) and cosine_similarity's two normalised rows and their product
    (12h). On one H200 a 3B (d 3072) measured 74-79 KiB per token above the weights, this 78."""
    return 3 * e * s.hidden + (8 * s.hidden if e != 4 else 0) + 12 * s.hidden
