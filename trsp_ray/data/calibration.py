"""The calibration token stream every path reads (stage 1 and its probes, Block Influence, SLEB, the
fold's fit, stage 2, the heal, the search's validation): a user's text file, or windows drawn from
the text domains in stated proportions (trsp_ray.data.domains).

A mixture is built in window-sized chunks (the training window's text part: data.seqlen, less one
token when the tokenizer adds a BOS), interleaved so that every prefix of the stream holds each
source's share within one window; `strata` labels each chunk with its source, and
training.Batches draws its shuffled windows stratified by that label, so any number of windows a
consumer takes (the fit's 128, a probe's 8) holds the proportions within one window too. The
calibration tail (VALIDATION_TOKENS, a mixture as well) is cut from each source's last documents,
never from a document that is trained on: never trained on, what settings are tuned on.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

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
    # {source: its whole training text}: every document before the validation cut, not only the
    # chunks the scarcest source's share leaves in `ids` (the heal streams these: data/stream.py)
    parts: dict = field(default_factory=dict)
    weights: dict = field(default_factory=dict)  # {source: the mixture's stated weight}
    # the document of each validation chunk ("source#index" among its calibration documents): the
    # search's paired SE clusters on them
    val_docs: tuple = ()
    left_out: int = 0  # training chunks without_text removed (another calibration's validation text)


@dataclass(frozen=True)
class SourceText:
    """One calibration source's training text: its tokens and where each document starts (the
    documents are the source's calibration documents in order, up to the validation cut:
    document_ids names them)."""
    name: str
    ids: torch.Tensor
    starts: list[int]
    index: tuple = ()  # each start's document among the source's calibration documents (() = in order)

    def documents_of(self, begin: int, end: int) -> list[int]:
        """Indices (among the source's calibration documents) of the documents tokens [begin, end) lie in."""
        import bisect

        first = max(0, bisect.bisect_right(self.starts, begin) - 1)
        found = range(first, max(first, bisect.bisect_left(self.starts, end) - 1) + 1)
        return [self.index[d] for d in found] if self.index else list(found)


def _token_key(tokenizer, text: str, *extra) -> str:
    import hashlib

    vocab = tokenizer.get_vocab()
    key = hashlib.sha256(text.encode("utf-8", "replace"))
    key.update(str(sorted(vocab.items())[:: max(1, len(vocab) // 997)]).encode())
    key.update(type(tokenizer).__name__.encode())
    for part in extra:
        key.update(str(part).encode())
    return key.hexdigest()[:32]


def encode_cached(tokenizer, text: str) -> torch.Tensor:
    """`encode`, cached on disk by tokenizer and text hash (a 700k-token text takes seconds to
    tokenize, and every Ray worker of a benchmark would redo it)."""
    path = assets.cache_dir() / "tokens" / f"{_token_key(tokenizer, text)}.pt"
    if path.exists():
        return torch.load(path)
    ids = encode(tokenizer, text)
    atomic.save_torch(path, ids)
    return ids


def encode_documents_cached(tokenizer, text: str, char_starts: list[int]) -> tuple[torch.Tensor, list[int]]:
    """(ids [N], starts): `encode` of `text` and the index of each document's first token, for
    documents starting at `char_starts` (ascending, the first 0). A start is the first token that
    begins at or after the document's first character (the fast tokenizer's offsets); a tokenizer
    without offsets gives [0]: one document. Cached on disk like `encode_cached`."""
    path = assets.cache_dir() / "tokens" / f"{_token_key(tokenizer, text, 'starts', char_starts)}.pt"
    if path.exists():
        saved = torch.load(path)
        return saved["ids"], saved["starts"]
    if not getattr(tokenizer, "is_fast", False):
        ids, starts = encode(tokenizer, text), [0]
    else:
        enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        ids = torch.tensor(enc["input_ids"], dtype=torch.long)
        token_begins = torch.tensor([b for b, _ in enc["offset_mapping"]] or [0], dtype=torch.long)
        found = torch.searchsorted(token_begins, torch.tensor(char_starts, dtype=torch.long)).tolist()
        starts = sorted({k for k in found if k < ids.numel()} | {0})
    atomic.save_torch(path, {"ids": ids, "starts": starts})
    return ids, starts


def document_text(docs: list[str]) -> tuple[str, list[int]]:
    """(documents joined with blank lines, the character where each starts)."""
    starts, at = [], 0
    for d in docs:
        starts.append(at)
        at += len(d) + 2
    return "\n\n".join(docs), starts



def interleave(counts: list[int]) -> list[int]:
    """Source index of each position of a stream with counts[i] chunks of source i, spread so that
    every prefix holds each source's share within one chunk (chunk k of source i sits at the
    (k + 1/2) / counts[i] quantile)."""
    keyed = [((k + 0.5) / n, i) for i, n in enumerate(counts) for k in range(n)]
    return [i for _, i in sorted(keyed)]


def _source_stream(tokenizer, source: str) -> tuple[torch.Tensor, list[int]]:
    """(ids, document starts) of a calibration source: a domain's calibration documents, or a text
    file whose documents are its blank-line-separated parts (a plain file marks no other)."""
    from trsp_ray.data.assets import read_text_file

    if source in domains.DOMAINS:
        text, starts = document_text(domains.split_texts(source)[0])
    else:
        text = read_text_file(source, "calibration text")
        starts = domains.file_document_starts(text)
    return encode_documents_cached(tokenizer, text, starts)


def document_ids(source: str) -> list[str]:
    """The content id (digest.content_key of its text) of each calibration document of `source`, in
    the order _source_stream joins them: what a test checks no held-out document is trained on by."""
    from trsp_ray.common.digest import content_key
    from trsp_ray.data.assets import read_text_file

    if source in domains.DOMAINS:
        docs = domains.split_texts(source)[0]
    else:
        docs = domains.file_documents(read_text_file(source, "calibration text"))
    return [content_key(d.strip()) for d in docs]


def _counts(avail: dict[str, int], mix: dict[str, float]) -> list[int]:
    """Chunks of each source: as many as the scarcest source allows at its weight."""
    total = min(avail[s] / w for s, w in mix.items())
    return [max(1, math.floor(w * total + 1e-9)) for s, w in mix.items()]


def _interleaved(pieces: dict[str, torch.Tensor], counts: list[int], chunk: int) -> tuple[torch.Tensor, list[int]]:
    """(ids, source index of each chunk): counts[i] chunks of source i from the start of its
    piece, spread by `interleave`."""
    chunks = [ids[: n * chunk].view(n, chunk) for ids, n in zip(pieces.values(), counts)]
    order = interleave(counts)
    taken = [0] * len(chunks)
    rows = []
    for i in order:
        rows.append(chunks[i][taken[i]])
        taken[i] += 1
    return (torch.cat(rows) if rows else torch.zeros(0, dtype=torch.long)), order


def mixture(pieces: dict[str, torch.Tensor], mix: dict[str, float], *, chunk: int) -> tuple[torch.Tensor,
                                                                                            torch.Tensor, dict]:
    """(ids [n * chunk], strata [n], shares) of a mixture {source: weight summing to 1} of token
    streams `pieces`: as many chunks as the scarcest source allows at its weight, each source's
    chunks in its text's order."""
    avail = {s: ids.numel() // chunk for s, ids in pieces.items()}
    for s, n in avail.items():
        if n == 0:
            instead = " or leave it out of data.calib_mix" if len(mix) > 1 else ""
            raise TrspError(f"calibration source {s!r} has {pieces[s].numel()} tokens, fewer than one window of "
                            f"{chunk}; pass a longer text{instead}")
    counts = _counts(avail, mix)
    ids, order = _interleaved(pieces, counts, chunk)
    return ids, torch.tensor(order, dtype=torch.long), {s: n / len(order) for s, n in zip(mix, counts)}


def split_by_document(ids: torch.Tensor, starts: list[int], *, chunks: int, chunk: int) -> tuple[torch.Tensor,
                                                                                                  torch.Tensor]:
    """(training ids, validation ids [chunks * chunk]) of one source: the validation chunks are cut from
    its last documents and training reads only the documents before them, so no document is on both
    sides. The validation chunks start at the first chunk boundary of the stream at or after a
    document's start (the tokens before it are on neither side), so they are chunks of the source's
    own stream. A source of one document (no start to cut at) is cut by tokens."""
    need = chunks * chunk
    if need == 0:
        return ids, ids[:0]
    cuts = [k for k in starts if chunk <= k and -(-k // chunk) * chunk + need <= ids.numel()]
    cut = max(cuts) if cuts else (ids.numel() // chunk - chunks) * chunk
    begin = -(-cut // chunk) * chunk
    return ids[:cut], ids[begin: begin + need]


def load(tokenizer, *, calib_text: str | None, calib_mix: str, seqlen: int, bos: int | None) -> Calibration:
    """The run's calibration: `calib_text` (a file) when given, else the mixture `calib_mix`; its
    tail (VALIDATION_TOKENS, in the mixture's shares) is cut from each source's last documents."""
    chunk = seqlen - (1 if bos is not None else 0)
    if chunk < 1:
        raise TrspError(f"data.seqlen={seqlen} leaves no text after the BOS token; use data.seqlen >= 2")
    mix = {calib_text: 1.0} if calib_text else domains.parse_mix(calib_mix)
    streams = {s: _source_stream(tokenizer, s) for s in mix}
    full = mixture({s: ids for s, (ids, _) in streams.items()}, mix, chunk=chunk)[1]
    n_chunks = full.numel()
    n_val = min(max(1, VALIDATION_TOKENS // chunk), n_chunks // 5)
    if n_chunks - n_val < 1 or n_val < 1:
        raise TrspError(f"calibration data has {n_chunks * chunk} tokens, {n_chunks} window(s) of {chunk}; at least "
                        "5 are needed (4 to train on, 1 to validate); pass a longer text")
    # each source validates on as many chunks as it has in the full stream's last n_val
    val_counts = [int((full[-n_val:] == i).sum()) for i in range(len(mix))]
    parts = {s: split_by_document(ids, starts, chunks=v, chunk=chunk)
             for (s, (ids, starts)), v in zip(streams.items(), val_counts)}
    ids, strata, shares = mixture({s: train for s, (train, _) in parts.items()}, mix, chunk=chunk)
    val_ids, _ = _interleaved({s: val for s, (_, val) in parts.items()}, val_counts, chunk)
    source = calib_text or domains.describe(shares)
    texts = {s: SourceText(name=s, ids=train, starts=[k for k in streams[s][1] if k < train.numel()] or [0])
             for s, (train, _) in parts.items()}
    return Calibration(ids=ids, val_ids=val_ids, strata=strata if len(mix) > 1 else None,
                       chunk=chunk, source=source, shares=shares, parts=texts, weights=dict(mix),
                       val_docs=_validation_documents(streams, parts, val_counts, chunk))


def _validation_documents(streams: dict, parts: dict, counts: list[int], chunk: int) -> tuple[str, ...]:
    """The document ("source#index") of each validation chunk, in the tail's interleaved order: the
    one holding the chunk's middle token (a chunk is one source's; it may run past a document's end)."""
    import bisect

    per_source = []
    for (s, (train, _)), n in zip(parts.items(), counts):
        starts, begin = streams[s][1], -(-train.numel() // chunk) * chunk
        per_source.append([f"{s}#{bisect.bisect_right(starts, begin + j * chunk + chunk // 2) - 1}" for j in range(n)])
    taken = [0] * len(per_source)
    out = []
    for i in interleave(counts):
        out.append(per_source[i][taken[i]])
        taken[i] += 1
    return tuple(out)


def check_windows(cal: Calibration, *, windows: int, what: str) -> None:
    """Refuse, before any work, a method that needs more distinct calibration windows than there are."""
    have = cal.ids.numel() // cal.chunk
    if windows > have:
        raise TrspError(f"{what} needs {windows} distinct calibration windows; the calibration data "
                        f"({cal.source}) has {have}; pass more text (data.calib_text / data.calib_mix) or ask for "
                        "fewer windows")


# tokens two texts must share in a row to count as the same text (a chunk holding such a run is dropped)
NGRAM = 16


def _hashes(x: torch.Tensor, k: int) -> torch.Tensor:
    """A 64-bit rolling hash of every run of `k` tokens along the last dimension ([..., L-k+1])."""
    p, mask, weights = 1_000_003, (1 << 64) - 1, []
    w = 1
    for _ in range(k):
        weights.append(w - (1 << 64) if w >= 1 << 63 else w)
        w = (w * p) & mask
    return (x.to(torch.int64).unfold(-1, k, 1) * torch.tensor(weights, dtype=torch.int64)).sum(-1)  # wraps mod 2^64


def without_text(cal: Calibration, text: torch.Tensor) -> Calibration:
    """`cal` without the training text that shares a run of NGRAM tokens (fewer for short chunks)
    with `text` (another calibration's validation tail: a search's base, workbench.calibration_of):
    the mixture's chunks holding such a run, and in the heal's sources (`parts`) every document
    holding one; its tail and shares are kept as they were. `left_out` counts the chunks removed."""
    import dataclasses

    rows = cal.ids.view(-1, cal.chunk)
    k = min(NGRAM, cal.chunk, text.numel())
    seen = _hashes(text, k)
    hit = torch.isin(_hashes(rows, k), seen).any(-1)
    parts = {s: _part_without(part, seen, k) for s, part in cal.parts.items()}
    if not hit.any() and all(parts[s] is cal.parts[s] for s in parts):
        return cal
    keep = ~hit
    if not keep.any():
        raise TrspError(f"every calibration window of {cal.source} is part of the search's validation text; "
                        "search another mixture or calibrate the base config on another text")
    strata = cal.strata[keep] if cal.strata is not None else None
    return dataclasses.replace(cal, ids=rows[keep].reshape(-1), strata=strata, parts=parts,
                               left_out=cal.left_out + int(hit.sum()))


def _part_without(part: SourceText, seen: torch.Tensor, k: int) -> SourceText:
    """`part` without the documents that hold a run of `k` tokens hashed in `seen`."""
    if part.ids.numel() < k:
        return part
    at = torch.nonzero(torch.isin(_hashes(part.ids, k), seen)).flatten().tolist()
    if not at:
        return part
    ends = part.starts[1:] + [part.ids.numel()]
    bad = {d for d in range(len(part.starts)) for a in at if part.starts[d] <= a < ends[d]}
    index = part.index or tuple(range(len(part.starts)))
    kept = [d for d in range(len(part.starts)) if d not in bad]
    if not kept:
        raise TrspError(f"every document of calibration source {part.name!r} is part of the search's validation "
                        "text; search another mixture or calibrate the base config on another text")
    ids = torch.cat([part.ids[part.starts[d]:ends[d]] for d in kept])
    lengths = [ends[d] - part.starts[d] for d in kept]
    starts = [sum(lengths[:j]) for j in range(len(kept))]
    return SourceText(name=part.name, ids=ids, starts=starts, index=tuple(index[d] for d in kept))
