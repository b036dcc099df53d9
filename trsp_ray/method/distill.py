"""Distillation from a stored teacher: the dense model's top-k next-token log-probabilities, kept
with the log-mass of everything else, and the KL of a student against them.

The teacher's distribution at temperature T is summarised per token by k+1 bins: its k most likely
tokens (log-probabilities `logp` [.., k], fp16, and their vocabulary ids `index` [.., k], int32) and
one bin for the rest (`tail` [..], fp16: log of the probability outside the top k). That is 6k + 2
bytes a token (k = 64: 386 bytes, against 2V bytes for fp16 logits of a 49k vocabulary: 98 kB).
The student's distribution is folded into the same bins: its log-probabilities at the teacher's
indices, and the complement of their mass. With k = V the tail is empty and the loss is the full
KL(teacher || student) of training.DistillLoss.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

# smallest tail probability the student's bin is clamped to: the tail's log stays finite (and its
# gradient too) when the top k hold all of the student's mass; a teacher tail of 0 weighs it by 0
_TINY = 1e-30


def teacher_topk(logits: torch.Tensor, *, k: int, temperature: float) -> tuple[torch.Tensor, torch.Tensor,
                                                                                 torch.Tensor]:
    """(logp [.., k] fp16, index [.., k] int32, tail [..] fp16) of logits [.., V] at `temperature`:
    the k largest log-probabilities, their token ids, and the log of the probability outside them
    (-inf when k = V)."""
    logp = torch.log_softmax(logits.float() / temperature, dim=-1)
    top, index = logp.topk(k, dim=-1)
    rest = logp.scatter(-1, index, float("-inf"))
    tail = torch.logsumexp(rest, dim=-1)
    return top.half(), index.int(), tail.half()


def topk_kl(s_logits: torch.Tensor, logp: torch.Tensor, index: torch.Tensor, tail: torch.Tensor, *,
            temperature: float) -> torch.Tensor:
    """KL(teacher || student) over the k+1 bins, mean over tokens, times T^2 (a scalar). `s_logits`
    [.., V] the student's logits; `logp`, `index`, `tail` the teacher's records of the same tokens
    (teacher_topk), moved to the student's device here."""
    device = s_logits.device
    t_top, t_tail = logp.to(device).float(), tail.to(device).float()
    s_logp = torch.log_softmax(s_logits.float() / temperature, dim=-1)
    s_top = s_logp.gather(-1, index.to(device).long())
    s_tail = torch.log((-torch.expm1(torch.logsumexp(s_top, dim=-1))).clamp(min=_TINY))
    top = (t_top.exp() * (t_top - s_top)).sum(-1)
    p_tail = t_tail.exp()
    rest = torch.where(p_tail > 0, p_tail * (t_tail - s_tail), torch.zeros_like(p_tail))
    return (top + rest).mean() * temperature**2


# lookup(rows) -> (logp, index, tail) of the current batch's rows `rows` (None: every row)
Lookup = Callable[[slice | None], tuple[torch.Tensor, torch.Tensor, torch.Tensor]]


class StoredDistillLoss:
    """A training objective: topk_kl of the model against the stored teacher records of the batch it
    is given, plus `ce_weight` x next-token cross-entropy. `lookup(rows)` returns the records of the
    stream's last batch (rows `rows` of it: a data-parallel rank's slice); the teacher itself is
    never run here, so no second model sits beside the student."""

    def __init__(self, lookup: Lookup, *, temperature: float = 1.0, ce_weight: float = 0.0):
        self.lookup, self.temperature, self.ce_weight = lookup, temperature, ce_weight

    def __call__(self, model, batch: torch.Tensor, rows: slice | None = None) -> torch.Tensor:
        batch = batch.to(getattr(model, "device", None) or next(model.parameters()).device)  # a DeepSpeed engine's too
        logits = model(input_ids=batch, use_cache=False).logits
        logp, index, tail = self.lookup(rows)
        if logp.shape[:2] != batch.shape:
            raise ValueError(f"teacher records of shape {tuple(logp.shape[:2])} do not match the batch "
                             f"{tuple(batch.shape)}; the objective must read the stream that gave the batch")
        loss = topk_kl(logits, logp, index, tail, temperature=self.temperature)
        if self.ce_weight:
            ce = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), batch[:, 1:].flatten())
            loss = loss + self.ce_weight * ce
        return loss
