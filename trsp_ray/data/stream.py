"""The heal stream: the calibration sources' documents, streamed for as long as a heal needs.

The calibration mixture (calibration.Calibration.ids) holds as many chunks of each source as the
scarcest source allows at its weight: with the default mixture that is some 170k SmolLM2 tokens, so
a heal of a million tokens looped it until it was memorised (its perplexity on the news domain's
own documents fell below the dense model's while fiction's rose). The heal reads each source's
*whole* training text instead (Calibration.parts: every document before the validation cut, never a
held-out one), in windows of the heal's own sequence length:

- each source is drawn at its stated weight; a source is read in passes, each pass a new seeded
  shuffle of its windows;
- a source that reaches `max_passes` passes stops, and the others share its weight from then on
  (water-filling in time, so the first n windows are the same whatever n a heal asks for: rows of
  one budget, and the teacher store's shards, share a prefix);
- when every source has reached its limit the stream is exhausted: `check` refuses the heal in one
  line before any work, naming how many windows the text gives.

`passes(n)` says how many passes over each source the first n windows make (the log and the
manifest report them); `documents(k)` names the documents window k was cut from.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass

import torch

from trsp_ray.common.digest import content_key
from trsp_ray.common.errors import TrspError

MAX_PASSES = 4.0  # heal.max_passes' default: past four passes a small source starts to be memorised


@dataclass(frozen=True)
class Take:
    """Window `window` of source `source` (indices into HealStream.names / its windows)."""
    source: int
    window: int


class HealStream:
    """A deterministic, resumable stream of heal batches [batch_size, seqlen] over calibration
    sources (calibration.SourceText by name) at `weights`; `position` counts batches, `last` holds
    the global indices of the last batch's windows (what a stored teacher's record is read by)."""

    def __init__(self, sources: dict, weights: dict[str, float], *, seqlen: int, batch_size: int,
                 bos: int | None, seed: int, max_passes: float = MAX_PASSES):
        if max_passes <= 0:
            raise TrspError(f"heal.max_passes={max_passes:g} is not valid; it must be > 0 (passes over each "
                            "calibration source a heal may read)")
        self.names = list(sources)
        self.sources = [sources[s] for s in self.names]
        total = sum(weights[s] for s in self.names)
        self.weights = [weights[s] / total for s in self.names]
        self.seqlen, self.batch_size, self.bos, self.seed = seqlen, batch_size, bos, seed
        self.chunk = seqlen - (bos is not None)
        if self.chunk < 1:
            raise TrspError(f"heal sequence length {seqlen} leaves no text after the BOS token; use >= 2")
        self.counts = [src.ids.numel() // self.chunk for src in self.sources]  # windows per pass
        self.max_passes = max_passes
        self.caps = [math.floor(max_passes * n) for n in self.counts]
        self._order: list[Take] = []
        self._taken = [0] * len(self.sources)
        self._deficit = [0.0] * len(self.sources)
        self._perms: dict[tuple[int, int], torch.Tensor] = {}
        self.position = 0
        self.last: list[int] = []

    # -- the schedule ---------------------------------------------------------------------------
    @property
    def capacity(self) -> int:
        """Windows the stream gives before every source reaches max_passes."""
        return sum(self.caps)

    def check(self, windows: int, *, what: str = "the heal") -> None:
        """Refuse, before any work, a heal that needs more windows than the stream gives."""
        if windows > self.capacity:
            have = ", ".join(f"{n} {c} windows" for n, c in zip(self.names, self.counts))
            raise TrspError(f"{what} needs {windows} windows of {self.seqlen} tokens and the calibration text gives "
                            f"{self.capacity} at heal.max_passes={self.max_passes:g} ({have} per pass); pass more "
                            "text (data.calib_mix / data.calib_text), a smaller budget or a higher heal.max_passes")

    def take(self, k: int) -> Take:
        """The k-th window of the stream (0-based)."""
        if k >= len(self._order):
            self.check(k + 1)
            self._extend(min(max(k + 1, 2 * len(self._order), 1024), self.capacity) - len(self._order))
        return self._order[k]

    def _extend(self, n: int) -> None:
        for _ in range(n):
            active = [i for i, (t, c) in enumerate(zip(self._taken, self.caps)) if t < c]
            weight = sum(self.weights[i] for i in active)
            for i in active:
                self._deficit[i] += self.weights[i] / weight
            i = max(active, key=lambda j: (self._deficit[j], -j))
            self._deficit[i] -= 1.0
            k = self._taken[i]
            self._taken[i] += 1
            self._order.append(Take(i, int(self._perm(i, k // self.counts[i])[k % self.counts[i]])))

    def _perm(self, source: int, pass_: int) -> torch.Tensor:
        key = (source, pass_)
        if key not in self._perms:
            gen = torch.Generator().manual_seed(self.seed * 1_000_003 + source * 7919 + pass_)
            self._perms[key] = torch.randperm(self.counts[source], generator=gen)
        return self._perms[key]

    def passes(self, windows: int) -> dict[str, float]:
        """Passes over each source the first `windows` windows make."""
        taken = [0] * len(self.sources)
        for k in range(windows):
            taken[self.take(k).source] += 1
        return {n: t / c for n, t, c in zip(self.names, taken, self.counts)}

    # -- the windows ----------------------------------------------------------------------------
    def window(self, k: int) -> torch.Tensor:
        """Window k's tokens [seqlen] (BOS first when the tokenizer adds one)."""
        t = self.take(k)
        a = t.window * self.chunk
        body = self.sources[t.source].ids[a: a + self.chunk]
        return body if self.bos is None else torch.cat([body.new_tensor([self.bos]), body])

    def documents(self, k: int) -> tuple[str, range]:
        """(source name, indices of its calibration documents) window k was cut from."""
        t = self.take(k)
        a = t.window * self.chunk
        return self.names[t.source], self.sources[t.source].documents_of(a, a + self.chunk)

    def next(self) -> torch.Tensor:
        first = self.position * self.batch_size
        self.last = list(range(first, first + self.batch_size))
        self.position += 1
        return torch.stack([self.window(k) for k in self.last])

    @property
    def tokens_per_batch(self) -> int:
        return self.batch_size * self.seqlen

    def key(self) -> str:
        """What the window sequence depends on: each source's tokens, the weights, the windows' length
        and BOS, the seed and the pass limit (not the batch size: the sequence is the same)."""
        return content_key({"sources": {n: hashlib.sha256(s.ids.numpy().tobytes()).hexdigest()[:24]
                                        for n, s in zip(self.names, self.sources)},
                            "weights": self.weights, "seqlen": self.seqlen, "bos": self.bos, "seed": self.seed,
                            "max_passes": self.max_passes}, 24)

    def describe(self, windows: int) -> str:
        """One line for the log: what `windows` windows read of each source."""
        parts = ", ".join(f"{n} {p:.2f}" for n, p in self.passes(windows).items())
        return f"heal stream: {windows} windows of {self.seqlen} tokens; passes over each source: {parts}"
