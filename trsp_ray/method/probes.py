"""Stage 1's removal probes: what removing a set of layers costs, measured on fixed calibration
windows (next-token CE, or KL to the dense model), with the memory rule the planner shares and the
passage-recall positions the probes may weight. run_stage1 (stage1.py) ranks and refines with them.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from trsp_ray.common.errors import TrspError
from trsp_ray.method.training import split_over_ranks

# Dense log-probs of this rank's probe windows kept on the device (model dtype) up to this many
# bytes per rank; above it the dense model is re-run each call (same dtype, so the scores agree).
TEACHER_CACHE_BYTES = 2 * 2**30


def probe_memory_bytes(*, chunk_tokens: int, cached_tokens: int, vocab: int, dtype_bytes: int) -> dict[str, int]:
    """Device bytes of a removal probe beyond the model, per rank (see RemovalScorer), at the larger
    of its two peaks over one chunk's scored tokens (bytes = tokens x V x the sum): while the
    student's log-probs are made, the teacher's chunk in the model's dtype (e), the model's logits
    (e), their fp32 upcast (4, none for an fp32 model) and the fp32 log-probs (4); while the KL is
    summed, the teacher's chunk (e), the student's log-probs (4, overwritten in place) and the
    teacher's fp32 probabilities (4). Plus the teacher cache (`cached_tokens` = this rank's scored
    tokens when they fit TEACHER_CACHE_BYTES, else 0) in the model's dtype."""
    e = dtype_bytes
    per_token = max(2 * e + (4 if e < 4 else 0) + 4, e + 8)
    return {"probe chunk (student log-probs + teacher)": chunk_tokens * vocab * per_token,
            "probe teacher cache": cached_tokens * vocab * dtype_bytes}


def teacher_cached(*, windows: int, scored_positions: int, world: int, vocab: int, dtype_bytes: int,
                   budget: int = TEACHER_CACHE_BYTES) -> bool:
    """Whether the dense log-probs of the largest rank's share of the probe windows fit the budget
    (the one rule RemovalScorer and the planner apply)."""
    return math.ceil(windows / world) * scored_positions * vocab * dtype_bytes <= budget


def recall_positions(windows, *, common: set[int], min_gap: int = 16):
    """Bool mask [n, T-1] of the positions t whose next token x[t+1] is a word piece that already
    occurred at least `min_gap` tokens earlier in the same window and is not one of the text's
    `common` tokens (its most frequent ones): predictions that need the passage, e.g. a name or a
    noun coming back, the skill passage-level tasks such as LAMBADA's final words test. Built from
    calibration text only."""
    import torch

    mask = torch.zeros(windows.shape[0], windows.shape[1] - 1, dtype=torch.bool)
    for row, window in enumerate(windows.tolist()):
        first: dict[int, int] = {window[0]: 0}
        for t, tok in enumerate(window[1:]):
            if tok not in common and tok in first and t + 1 - first[tok] >= min_gap:
                mask[row, t] = True
            first.setdefault(tok, t + 1)
    return mask


def common_tokens(ids, count: int = 200) -> set[int]:
    """The `count` most frequent token ids of a calibration text (shape [N])."""
    import torch

    return set(torch.argsort(torch.bincount(ids), descending=True)[:count].tolist())


class RemovalScorer:
    """What removing a set of layers costs, measured: the mean over every scored token of fixed
    calibration windows of the next-token CE of the model with those layers bypassed and every gate
    at 1 ("ce"), or of KL(dense || pruned) over the whole next-token distribution ("kl"), which
    averages over every possible next token instead of the one observed and so needs far fewer
    windows for a stable ranking. Positions before `start` in each window are not scored.
    "recall" is "kl" plus the mean CE increase over the dense model at the windows' recall
    positions (`recall_positions`, `common` = the calibration text's frequent tokens): KL averages
    over every token, most of them easy and local, so it keeps what short-range prediction needs;
    the recall term weighs what needs the passage.

    Data-parallel: `windows` are all the probe windows (batches of shape [b, T], b = the chunk
    size); rank `rank` of `world` scores windows k with k % world == rank, in chunks of b
    (training.split_over_ranks, the split every data-parallel forward uses), and
    `all_reduce` sums the per-rank [score sum, token count] (identity in one process), so one
    process and W ranks give the same score. Every rank runs the same number of forwards per call
    (under ZeRO-3 each forward is a collective): a rank with fewer chunks runs a padding forward
    whose result it discards. `cost` counts the dense-forward tokens of the scored windows on all
    ranks together (the one-process figure; padding is not counted)."""

    def __init__(self, *, model, gates, windows: list, criterion: str = "kl", start: int = 0, rank: int = 0,
                 world: int = 1, all_reduce: Callable[[list[float]], list[float]] | None = None,
                 teacher_budget_bytes: int = TEACHER_CACHE_BYTES, common: set[int] | None = None):
        import torch

        rows = torch.cat(list(windows))
        if criterion == "recall" and start:
            raise TrspError("probe start is not used by probe_criterion='recall' (it scores every position); "
                            "pass start=0 or probe_criterion='kl'")
        if not 0 <= start < rows.shape[1] - (1 if criterion == "ce" else 0):
            raise TrspError(f"probe start={start} leaves no scored position in {rows.shape[1]}-token windows")
        self.model, self.gates, self.criterion, self.start = model, gates, criterion, start
        self.all_reduce = all_reduce or (lambda values: values)
        self.chunks, padding = split_over_ranks(windows, rank=rank, world=world)
        self.passes = len(self.chunks) + padding  # forwards per call on every rank
        if criterion == "recall":  # a row's positions depend on that row only: one mask per chunk
            common = common_tokens(rows) if common is None else common
            self.masks = [recall_positions(c, common=common) for c in self.chunks]
        self.padding = rows[:1]
        self.tokens = rows.numel()  # calibration tokens of all probe windows (every rank)
        self.cost = 0
        head = model.get_output_embeddings().weight
        vocab = getattr(head, "ds_shape", head.shape)[0]  # ZeRO-3 leaves an empty placeholder
        # the same decision on every rank (it decides how many forwards each call runs)
        self.cache_teacher = criterion in ("kl", "recall") and teacher_cached(
            windows=rows.shape[0], scored_positions=rows.shape[1] - start, world=world, vocab=vocab,
            dtype_bytes=self._dtype().itemsize, budget=teacher_budget_bytes)
        self._teacher: dict[int, object] = {}

    def _dtype(self):
        return self.model.get_input_embeddings().weight.dtype

    def _logprobs(self, batch):
        import torch

        device = self.model.get_input_embeddings().weight.device
        logits = self.model(input_ids=batch.to(device), use_cache=False).logits[:, self.start:]
        return torch.log_softmax(logits.float(), dim=-1)

    def _teacher_logprobs(self, k: int, chunk):
        """The dense model's log-probs of chunk k in the model's dtype, on the device: cached when
        they fit the budget, else recomputed (rounded alike, so every call scores the same)."""
        if k in self._teacher:
            return self._teacher[k]
        with self.gates.state(gated=False, bypass=[]):
            lp = self._logprobs(chunk).to(self._dtype())
        if self.cache_teacher:
            self._teacher[k] = lp
        return lp

    def _chunk_sum(self, k: int, chunk) -> list[float]:
        """[sum of the per-token score over chunk k's scored positions, their count] (recall: then
        the sum of the CE increase at its recall positions and their count)."""
        import torch.nn.functional as F

        if self.criterion == "recall":
            teacher = self._teacher_logprobs(k, chunk)[:, :-1]
            with self.gates.state(gated=False, bypass=self._drop):
                lp = self._logprobs(chunk)[:, :-1]
            count = lp.shape[0] * lp.shape[1]
            mask = self.masks[k].to(lp.device) if k < len(self.masks) else None
            gap = None
            if mask is not None and mask.any():  # read before _kl_sum overwrites lp; CE(pruned) - CE(dense)
                target = chunk[:, 1:].to(lp.device)[:, :, None]
                gap = (teacher.gather(-1, target).float() - lp.gather(-1, target))[..., 0][mask]
            kl = _kl_sum(teacher, lp)
            if gap is None:
                return [kl.item(), count, 0.0, 0.0]
            return [kl.item(), count, gap.sum().item(), float(mask.sum())]
        if self.criterion == "kl":
            teacher = self._teacher_logprobs(k, chunk)
            with self.gates.state(gated=False, bypass=self._drop):
                lp = self._logprobs(chunk)
            count = lp.shape[0] * lp.shape[1]
            return [_kl_sum(teacher, lp).item(), count]
        with self.gates.state(gated=False, bypass=self._drop):
            lp = self._logprobs(chunk)[:, :-1]
        target = chunk[:, self.start + 1:].to(lp.device)
        total = F.cross_entropy(lp.reshape(-1, lp.shape[-1]), target.reshape(-1), reduction="sum")
        return [total.item(), target.numel()]

    def __call__(self, drop: list[int]) -> float:
        import torch

        teacher_passes = 0 if self.cache_teacher and self._teacher else 1
        self._drop = list(drop)
        sums = [0.0] * (4 if self.criterion == "recall" else 2)
        with torch.no_grad():
            for k in range(self.passes):
                if k < len(self.chunks):
                    sums = [a + float(b) for a, b in zip(sums, self._chunk_sum(k, self.chunks[k]))]
                else:  # this rank is out of windows: keep the collectives in step, discard the result
                    self._chunk_sum(k, self.padding)
        self.cost += self.tokens * (1 + (teacher_passes if self.criterion != "ce" else 0))
        sums = self.all_reduce(sums)
        score = sums[0] / sums[1]
        return score + (sums[2] / sums[3] if self.criterion == "recall" and sums[3] else 0.0)


def _kl_sum(teacher, lp):
    """KL(dense || pruned) summed over the positions of `lp` (the pruned model's fp32 log-probs,
    overwritten in place) against `teacher` (the dense log-probs, model dtype): the sum of
    exp(t) (t - lp), which is what F.kl_div(lp, t, log_target=True, reduction="sum") returns, to the
    bit on contiguous tensors, with one temporary (exp(t) in fp32) instead of kl_div's three and an
    fp32 copy of the teacher (0.44 -> 0.28 s per 4 x 128 x 49k chunk on one core)."""
    import torch

    p = teacher.exp() if teacher.dtype == torch.float32 else teacher.float().exp_()
    return -lp.sub_(teacher).mul_(p).sum()
