"""The teacher pass: the stage that fills the teacher store (run/teacher_store.py) before a
distilling heal, planned from config.json alone.

It is a no-grad forward of the dense model over every window the heal will read, once per heal
stream (a second row, seed or trial reads the store and plans no pass). Its compute is the heal's
KD_TEACHER dense-forward token per distilled token, counted once per row as the budget does
(run/budget.py). What it needs:
- storage: 6k + 2 bytes a token (bytes_per_token), on the store's root;
- device memory: the dense model (one process on a GPU: a copy, while the working copy waits in
  host memory, as the fit's dense passes do; workers: their ZeRO-3 shards, before stage 1), one
  batch's logits with their fp32 log-softmax, and one layer's activations;
- host memory: one shard of records as it is written (teacher_store.SHARD_WINDOWS windows).
"""

from __future__ import annotations

from dataclasses import dataclass

from trsp_ray.plan.activations import forward_layer_bytes
from trsp_ray.plan.memory import GB, StagePlan
from trsp_ray.plan.shape import Shape

SHARD_WINDOWS = 64  # windows a teacher-store shard holds: SmolLM2 at 512 tokens, k = 64: 12.6 MB a shard
# per token of a teacher batch beside the model's own logits (e bytes): the fp32 copy, the fp32
# log-softmax and the tail's masked copy (distill.teacher_topk)
PASS_LOGIT_BYTES = 4 * 3


def bytes_per_token(k: int) -> int:
    """Storage of one token's records: k fp16 log-probs, k int32 ids, one fp16 tail."""
    return 6 * k + 2


@dataclass(frozen=True)
class TeacherPass:
    """The teacher pass of a heal that reads `tokens` tokens of the heal stream at top-`k`."""

    tokens: int
    k: int
    seqlen: int
    batch: int  # windows one device forwards at a time
    device_gb: float  # beside the weights: one batch's logits, their log-softmax and one layer
    host_gb: float  # one shard of records

    @property
    def compute(self) -> float:
        """Dense-forward tokens (KD_TEACHER per token: the whole depth, no backward)."""
        from trsp_ray.plan.compute import KD_TEACHER

        return KD_TEACHER * self.tokens

    @property
    def storage_gb(self) -> float:
        return self.tokens * bytes_per_token(self.k) / GB

    def describe(self) -> str:
        return (f"teacher pass: {self.tokens:,} tokens ({self.compute:,.0f} dense-forward tokens, once per heal "
                f"stream), top-{self.k} records {bytes_per_token(self.k)} bytes a token = {self.storage_gb:.3f} GB "
                f"stored, {self.device_gb:.2f} GB per device beside the weights ({self.batch} x {self.seqlen}-token "
                f"batches), "
                f"{self.host_gb:.3f} GB of host memory per shard")


def teacher_pass(s: Shape, *, tokens: int, k: int, seqlen: int, batch: int, dtype_bytes: int) -> TeacherPass:
    """The teacher pass over `tokens` heal tokens in batches of `batch` x `seqlen` on shape `s`."""
    per_batch = batch * seqlen
    device = per_batch * (s.vocab * (dtype_bytes + PASS_LOGIT_BYTES) + forward_layer_bytes(s, dtype_bytes)) / GB
    return TeacherPass(tokens=tokens, k=k, seqlen=seqlen, batch=batch, device_gb=device,
                       host_gb=min(tokens, SHARD_WINDOWS * seqlen) * bytes_per_token(k) / GB)


def teacher_pass_for_run(cfg, s: Shape, *, heal_method: bool, workers: int = 1) -> TeacherPass | None:
    """The teacher pass of `cfg`'s heal (a heal method's: stage2.steps + heal.steps, methods.method_heal;
    else heal.steps) in compute.heal_shape's windows, each of `workers` ranks forwarding its share of a
    batch (recovery.ranks_compute); None when the heal does not distil from a stored teacher
    (compute.heal_teacher)."""
    from trsp_ray.plan.compute import heal_shape, heal_teacher

    steps = cfg.stage2.steps + cfg.heal.steps if heal_method else cfg.heal.steps
    if steps <= 0 or heal_teacher(cfg) != "stored":
        return None
    seqlen, batch = heal_shape(cfg)
    e = {"bf16": 2, "fp16": 2, "fp32": 4}.get(cfg.dtype, 2)
    return teacher_pass(s, tokens=steps * batch * seqlen, k=cfg.recovery.kd_topk, seqlen=seqlen,
                        batch=max(1, batch // workers), dtype_bytes=e)


def single_teacher_stage(tp: TeacherPass, weights: dict[str, float]) -> StagePlan:
    """The teacher pass as a stage of the single-process plan: `weights` (the plan's weight parts:
    the dense model where the working copy was) and the pass's batch working memory."""
    plan = StagePlan("teacher pass")
    plan.parts.update(weights)
    plan.parts["teacher logits + top-k (one batch)"] = tp.device_gb
    return plan
