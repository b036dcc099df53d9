"""Perplexity with the WikiText-2 protocol on any text.

Protocol: tokenize the whole text once (documents joined with "\\n\\n" by the caller), cut it into
non-overlapping windows of `seqlen` tokens (the tail shorter than a window is dropped), and report
exp of the mean next-token NLL over every predicted token.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch


def encode(tokenizer, text: str) -> torch.Tensor:
    """Token ids of the whole text, shape [N] (int64)."""
    ids = tokenizer(text, return_tensors="pt", add_special_tokens=False).input_ids[0]
    return ids.to(torch.long)


def windows(ids: torch.Tensor, seqlen: int, max_windows: int | None = None) -> torch.Tensor:
    """Non-overlapping windows, shape [n, seqlen]; raises if the text is shorter than one window."""
    n = ids.numel() // seqlen
    if max_windows is not None:
        n = min(n, max_windows)
    if n == 0:
        raise ValueError(f"text has {ids.numel()} tokens, fewer than one window of seqlen={seqlen}")
    return ids[: n * seqlen].view(n, seqlen)


@torch.no_grad()
def perplexity(
    model,
    ids: torch.Tensor,
    *,
    seqlen: int,
    batch_size: int = 1,
    max_windows: int | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> float:
    """exp(mean NLL) of `model` over the windows of `ids` (shape [N])."""
    chunks = windows(ids, seqlen, max_windows)
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    total_nll, total_tokens = 0.0, 0
    for start in range(0, chunks.shape[0], batch_size):
        batch = chunks[start : start + batch_size].to(device)
        logits = model(input_ids=batch, use_cache=False).logits.float()
        nll = torch.nn.functional.cross_entropy(
            logits[:, :-1].reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1), reduction="sum"
        )
        total_nll += nll.item()
        total_tokens += batch[:, 1:].numel()
        if progress is not None:
            progress(min(start + batch_size, chunks.shape[0]), chunks.shape[0])
    model.train(was_training)
    return math.exp(total_nll / total_tokens)
