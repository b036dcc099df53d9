"""The calibration token stream every path reads (stage 1 and its probes, Block Influence, SLEB, the
fold's fit, stage 2, the heal, the search's validation): a user's text file, or windows drawn from
the text domains in stated proportions (trsp_ray.data.domains).

A mixture is built in window-sized chunks (the training window's text part: data.seqlen, less one
token when the tokenizer adds a BOS), interleaved so that every prefix of the stream holds each
source's share within one window; `strata` labels each chunk with its source, and
training.Batches draws its shuffled windows stratified by that label, so any number of windows a
consumer takes (the fit's 128, a probe's 8) holds the proportions within one window too. The last
chunks (VALIDATION_TOKENS, a mixture as well) are the calibration tail: never trained on, what
settings are tuned on.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from trsp_ray.common import atomic
from trsp_ray.common.errors import TrspError
from trsp_ray.data import assets, domains
from trsp_ray.data.perplexity import encode

VALIDATION_TOKENS = 4096


@dataclass(frozen=True)
class Calibration:
    ids: torch.Tensor  # [N] training tokens (the stream less its tail)
    val_ids: torch.Tensor  # [M] the calibration tail, never trained on
    strata: torch.Tensor | None  # [N // chunk] source index of each training chunk (None: one source)
    chunk: int  # tokens per chunk of the stream (= a training window's text)
    source: str  # what it was drawn from, for the manifest and MLflow
    shares: dict  # {source: share of the training chunks}


def encode_cached(tokenizer, text: str) -> torch.Tensor:
    """`encode`, cached on disk by tokenizer and text hash (a 700k-token text takes seconds to
    tokenize, and every Ray worker of a benchmark would redo it)."""
    import hashlib

    vocab = tokenizer.get_vocab()
    key = hashlib.sha256(text.encode("utf-8", "replace"))
    key.update(str(sorted(vocab.items())[:: max(1, len(vocab) // 997)]).encode())
    key.update(type(tokenizer).__name__.encode())
    path = assets.cache_dir() / "tokens" / f"{key.hexdigest()[:32]}.pt"
    if path.exists():
        return torch.load(path)
    ids = encode(tokenizer, text)
    atomic.save_torch(path, ids)
    return ids



def interleave(counts: list[int]) -> list[int]:
    """Source index of each position of a stream with counts[i] chunks of source i, spread so that
    every prefix holds each source's share within one chunk (chunk k of source i sits at the
    (k + 1/2) / counts[i] quantile)."""
    keyed = [((k + 0.5) / n, i) for i, n in enumerate(counts) for k in range(n)]
    return [i for _, i in sorted(keyed)]


def _source_ids(tokenizer, source: str) -> torch.Tensor:
    from trsp_ray.data.assets import read_text_file

    text = domains.texts(source)[0] if source in domains.DOMAINS else read_text_file(source, "calibration text")
    return encode_cached(tokenizer, text)


def mixture(tokenizer, mix: dict[str, float], *, chunk: int) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """(ids [n * chunk], strata [n], shares) of a mixture {source: weight summing to 1}: as many
    chunks as the scarcest source allows at its weight, each source's chunks in its text's order."""
    pieces = {s: _source_ids(tokenizer, s) for s in mix}
    avail = {s: ids.numel() // chunk for s, ids in pieces.items()}
    for s, n in avail.items():
        if n == 0:
            instead = " or leave it out of data.calib_mix" if len(mix) > 1 else ""
            raise TrspError(f"calibration source {s!r} has {pieces[s].numel()} tokens, fewer than one window of "
                            f"{chunk}; pass a longer text{instead}")
    total = min(avail[s] / w for s, w in mix.items())
    counts = [max(1, math.floor(w * total + 1e-9)) for s, w in mix.items()]
    names = list(mix)
    chunks = [pieces[s][: n * chunk].view(n, chunk) for s, n in zip(names, counts)]
    order = interleave(counts)
    taken = [0] * len(names)
    rows = []
    for i in order:
        rows.append(chunks[i][taken[i]])
        taken[i] += 1
    strata = torch.tensor(order, dtype=torch.long)
    return torch.cat(rows), strata, {s: n / len(order) for s, n in zip(names, counts)}


def load(tokenizer, *, calib_text: str | None, calib_mix: str, seqlen: int, bos: int | None) -> Calibration:
    """The run's calibration: `calib_text` (a file) when given, else the mixture `calib_mix`."""
    chunk = seqlen - (1 if bos is not None else 0)
    if chunk < 1:
        raise TrspError(f"data.seqlen={seqlen} leaves no text after the BOS token; use data.seqlen >= 2")
    mix = {calib_text: 1.0} if calib_text else domains.parse_mix(calib_mix)
    ids, strata, shares = mixture(tokenizer, mix, chunk=chunk)
    n_chunks = strata.numel()
    n_val = min(max(1, VALIDATION_TOKENS // chunk), n_chunks // 5)
    if n_chunks - n_val < 1 or n_val < 1:
        raise TrspError(f"calibration data has {ids.numel()} tokens, {n_chunks} window(s) of {chunk}; at least 5 "
                        "are needed (4 to train on, 1 to validate); pass a longer text")
    cut = (n_chunks - n_val) * chunk
    source = calib_text or domains.describe(shares)
    return Calibration(ids=ids[:cut], val_ids=ids[cut:], strata=strata[: n_chunks - n_val] if len(mix) > 1 else None,
                       chunk=chunk, source=source, shares=shares)


def check_windows(cal: Calibration, *, windows: int, what: str) -> None:
    """Refuse, before any work, a method that needs more distinct calibration windows than there are."""
    have = cal.ids.numel() // cal.chunk
    if windows > have:
        raise TrspError(f"{what} needs {windows} distinct calibration windows; the calibration data "
                        f"({cal.source}) has {have}; pass more text (data.calib_text / data.calib_mix) or ask for "
                        "fewer windows")
