"""Held-out perplexity windows spread over documents (SPEC section 2).

The first N windows of a held-out text are one document when its first document is long: the gensim
Wikipedia split's first held-out article ("Alabama") is 19,678 tokens, so 16 windows of 256 tokens
were one article, not a held-out set. Here every window starts where a document starts:

- documents are taken in order and grouped into *units*: a document at least one window long is a
  unit of its own; shorter ones are joined (blank lines between them, as the text joins them) with
  the next until the group fills a window. Units share no document.
- round 0 takes the first window of each unit, round 1 the second window of every unit that has
  one, and so on, until `max_windows` windows are taken (or every window of every unit).

Each window carries its unit (the index of the unit's first document): windows of one unit are
correlated, so paired standard errors cluster on it (trsp_ray.benchmark.stats). Tokens are those of
the joined text (the WikiText-2 protocol's stream), so a window's tokens are what it was before.

This is the one reader of held-out windows: `prune`'s held-out PPL and its manifest, `trsp-ray eval`,
and the benchmark's domains all read them here, with the BOS rule decided here from the tokenizer
(perplexity.bos_token), so two commands that claim the same windows score the same windows (`eval`
once read 48 windows without BOS where `prune` read 16 with it, and printed 45.41 beside 38.84).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from trsp_ray.common.errors import TrspError
from trsp_ray.data.perplexity import bos_token
from trsp_ray.data.perplexity import windows as cut_windows


@dataclass(frozen=True)
class HeldoutWindows:
    windows: torch.Tensor  # [n, seqlen] token ids, BOS first where the tokenizer adds one
    docs: tuple[int, ...]  # [n] the unit of each window: the index of its first held-out document
    documents: int  # held-out documents whose tokens the windows hold
    held_out: int  # held-out documents of the text
    units: int  # units the text has (how many windows can come from distinct documents)
    bos: int | None = None  # the id each window starts with, None when the tokenizer adds none
    source: str = ""  # what the held-out text is, for reports and manifests

    @property
    def tokens(self) -> int:
        return int(self.windows.numel())

    @property
    def clusters(self) -> int:
        return len(set(self.docs))

    def too_few(self) -> bool:
        """True when some windows share a document: the text has fewer units than windows scored."""
        return self.clusters < len(self.docs)

    def describe(self) -> str:
        few = (f"; TOO FEW held-out documents for one window each: {len(self.docs)} windows share {self.clusters}"
               + (" (a text file's documents are separated by blank lines)" if self.held_out == 1 else "")
               if self.too_few() else "")
        return (f"{len(self.docs)} windows x {self.windows.shape[1]} tokens from {self.documents} of {self.held_out} "
                f"held-out documents{few}")

    def coverage(self) -> dict:
        """Plain numbers for reports and results."""
        return {"windows": len(self.docs), "documents": self.documents, "clusters": self.clusters,
                "held_out": self.held_out, "tokens": self.tokens, "too_few": self.too_few(),
                "seqlen": int(self.windows.shape[1]), "bos": self.bos, "source": self.source}


def spread(ids: torch.Tensor, starts: list[int], *, seqlen: int, max_windows: int | None,
           bos: int | None) -> HeldoutWindows:
    """The windows of `ids` (a held-out text's tokens, documents starting at `starts`), spread over
    documents as the module says. A one-line TrspError if no unit holds one window."""
    body = seqlen if bos is None else seqlen - 1
    bounds = list(starts) + [ids.numel()]
    units = []  # (first document, last document + 1, token start, token end)
    first = 0
    for d in range(len(starts)):
        if bounds[d + 1] - bounds[first] >= body or d == len(starts) - 1:
            units.append((first, d + 1, bounds[first], bounds[d + 1]))
            first = d + 1
    per_unit = [(end - begin) // body for _, _, begin, end in units]
    picked: list[tuple[int, int]] = []  # (unit, window index within it)
    for k in range(max(per_unit, default=0)):
        picked += [(u, k) for u, n in enumerate(per_unit) if k < n]
    if max_windows is not None:
        picked = picked[:max_windows]
    if not picked:
        raise TrspError(f"the held-out text has {ids.numel()} tokens in {len(starts)} document(s), fewer than one "
                        f"window of data.eval_seqlen={seqlen}; pass a longer text or a smaller data.eval_seqlen")
    rows = []
    for u, k in picked:
        begin = units[u][2] + k * body
        rows.append(cut_windows(ids[begin: begin + body], seqlen, bos=bos))
    scored = sorted({u for u, _ in picked})
    return HeldoutWindows(windows=torch.cat(rows), docs=tuple(units[u][0] for u, _ in picked),
                          documents=sum(units[u][1] - units[u][0] for u in scored), held_out=len(starts),
                          units=len(units), bos=bos)


def document_windows(tokenizer, documents: list[str], *, seqlen: int, max_windows: int | None,
                     source: str = "") -> HeldoutWindows:
    """`spread` of held-out `documents` (tokenized joined with blank lines, cached on disk), each window
    starting with BOS when the tokenizer adds one. With a window cap only as many leading documents
    are tokenized as the windows need (math's held-out part is 720k characters), doubling until the
    windows come from distinct units or every document is read; the windows are those of the whole
    text."""
    from trsp_ray.data.calibration import document_text, encode_documents_cached

    bos = bos_token(tokenizer)
    body = seqlen if bos is None else seqlen - 1
    n = len(documents) if max_windows is None else min(len(documents), 4 * max_windows)
    while True:
        text, char_starts = document_text(documents[:n])
        ids, starts = encode_documents_cached(tokenizer, text, char_starts)
        if ids.numel() < body and n < len(documents):  # short leading documents: not one window yet
            n = min(len(documents), 2 * n)
            continue
        out = spread(ids, starts, seqlen=seqlen, max_windows=max_windows, bos=bos)
        # the last unit read may continue into documents not read yet: only complete units count
        if n == len(documents) or (out.units - 1 >= len(out.docs) and not out.too_few()):
            break
        n = min(len(documents), 2 * n)
    return HeldoutWindows(windows=out.windows, docs=out.docs, documents=out.documents, held_out=len(documents),
                          units=out.units, bos=bos, source=source)


def domain_windows(tokenizer, name: str, *, seqlen: int, max_windows: int | None) -> HeldoutWindows:
    """A text domain's held-out windows (trsp_ray.data.domains): what the benchmark scores."""
    from trsp_ray.data import domains

    return document_windows(tokenizer, domains.split_texts(name)[1], seqlen=seqlen, max_windows=max_windows,
                            source=domains.domain(name).source)


def text_windows(tokenizer, texts, *, seqlen: int, max_windows: int | None) -> HeldoutWindows:
    """The held-out windows of a run's text (domains.load_texts: a user's file split at blank lines,
    by default the held-out Wikipedia articles): what `prune`'s held-out PPL, its manifest and
    `trsp-ray eval` score."""
    return document_windows(tokenizer, list(texts.documents) or [texts.heldout], seqlen=seqlen,
                            max_windows=max_windows, source=texts.heldout_source)
