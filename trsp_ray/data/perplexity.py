"""Perplexity with the WikiText-2 protocol on any text, following the model's tokenizer conventions.

Protocol: tokenize the whole text once (documents joined with "\\n\\n" by the caller), cut it into
non-overlapping windows of `seqlen` tokens (the tail shorter than a window is dropped), and report
exp of the mean next-token NLL over every predicted token.

BOS: a model whose tokenizer puts a BOS token in front of every text (Llama, Gemma) has only ever
seen text after it, and scores far worse without it (dense Gemma-3-270m on 256-token Wikipedia
windows: 25.7 with a BOS per window, 108 without). Such a window is [BOS] + seqlen - 1 text tokens,
and every text token is predicted, the first one from BOS alone (what lm-eval's rolling
loglikelihood does with its prefix token). A tokenizer that adds no BOS (SmolLM2) gets plain
windows, so its figures do not change.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch


def encode(tokenizer, text: str) -> torch.Tensor:
    """Token ids of the whole text, shape [N] (int64), without special tokens."""
    ids = tokenizer(text, return_tensors="pt", add_special_tokens=False).input_ids[0]
    return ids.to(torch.long)


def bos_token(tokenizer) -> int | None:
    """The id the tokenizer puts in front of every text, or None when it adds none.

    Read from what the tokenizer does (a probe text with and without special tokens), not from
    `bos_token_id` alone: SmolLM2 declares a BOS token but never adds it."""
    bos = getattr(tokenizer, "bos_token_id", None)
    if bos is None:
        return None
    with_special = list(tokenizer("a", add_special_tokens=True).input_ids)
    plain = list(tokenizer("a", add_special_tokens=False).input_ids)
    return int(bos) if with_special[:1] == [bos] and len(with_special) > len(plain) else None


def windows(ids: torch.Tensor, seqlen: int, max_windows: int | None = None, *, bos: int | None = None) -> torch.Tensor:
    """Non-overlapping windows, shape [n, seqlen]; with `bos`, each is [bos] + seqlen - 1 tokens of
    text. Raises if the text is shorter than one window."""
    body = seqlen if bos is None else seqlen - 1
    if body < 1:
        raise ValueError(f"seqlen={seqlen} leaves no text after the BOS token; use seqlen >= 2")
    n = ids.numel() // body
    if max_windows is not None:
        n = min(n, max_windows)
    if n == 0:
        raise ValueError(f"text has {ids.numel()} tokens, fewer than one window of seqlen={seqlen}")
    chunks = ids[: n * body].view(n, body)
    if bos is None:
        return chunks
    return torch.cat([torch.full((n, 1), bos, dtype=chunks.dtype), chunks], dim=1)


@torch.no_grad()
def window_nlls(
    model,
    ids: torch.Tensor,
    *,
    seqlen: int,
    batch_size: int = 1,
    max_windows: int | None = None,
    bos: int | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> list[float]:
    """Mean next-token NLL (nats) of each window of `ids`, in window order: what paired comparisons
    of two models on the same windows read (every window predicts seqlen - 1 tokens)."""
    return nlls_of(model, windows(ids, seqlen, max_windows, bos=bos), batch_size=batch_size, progress=progress)


def nlls_of(model, chunks: torch.Tensor, *, batch_size: int = 1,
            progress: Callable[[int, int], None] | None = None) -> list[float]:
    """Mean next-token NLL (nats) of each window of `chunks` [n, seqlen] (as `windows` or
    trsp_ray.data.heldout cut them), in order."""
    return scores_of(model, chunks, batch_size=batch_size, progress=progress)[0]


@torch.no_grad()
def scores_of(model, chunks: torch.Tensor, *, batch_size: int = 1,
              progress: Callable[[int, int], None] | None = None) -> tuple[list[float], list[float]]:
    """(mean next-token NLL, cloze accuracy) of each window of `chunks` [n, seqlen], in order; the
    cloze accuracy of a window is the share of its next tokens the model's greedy choice gets right
    (every position a cloze item, the held-out text's own answer key)."""
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    nlls: list[float] = []
    accs: list[float] = []
    for start in range(0, chunks.shape[0], batch_size):
        batch = chunks[start : start + batch_size].to(device)
        logits = model(input_ids=batch, use_cache=False).logits.float()[:, :-1]
        target = batch[:, 1:]
        nll = torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), target.reshape(-1), reduction="none"
        ).view(batch.shape[0], -1)
        nlls += nll.mean(dim=1).tolist()
        accs += (logits.argmax(dim=-1) == target).float().mean(dim=1).tolist()
        if progress is not None:
            progress(min(start + batch_size, chunks.shape[0]), chunks.shape[0])
    model.train(was_training)
    return nlls, accs


def perplexity(model, ids: torch.Tensor, *, seqlen: int, batch_size: int = 1, max_windows: int | None = None,
               bos: int | None = None, progress: Callable[[int, int], None] | None = None) -> float:
    """exp(mean NLL) of `model` over the windows of `ids` (shape [N]); `bos` as `bos_token` gives it."""
    return ppl_of(window_nlls(model, ids, seqlen=seqlen, batch_size=batch_size, max_windows=max_windows, bos=bos,
                              progress=progress))


def ppl_of(nlls: list[float]) -> float:
    """Perplexity of equal-length windows from their mean NLLs: exp of the mean over every token."""
    return math.exp(sum(nlls) / len(nlls))
