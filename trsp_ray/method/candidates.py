"""The candidate drop sets a selection by recovery auditions (run/audition.py): each a cheap
selector's answer, computed on the same model and calibration windows, deduplicated.

The layers that score best right after the cut are not the layers that recover best (a public
Gemma-3-270m series: the set that kept 26% of dense LAMBADA before a distillation heal kept 92%
after it), so the candidates span the shapes the published recoveries favour rather than one
score's ranking:

- ``bi``: Block Influence's lowest layers over the candidates (ShortGPT, the head protected);
- ``bi-tailN``: the same with the last N candidate layers protected too;
- ``block-N``: the contiguous block of n_drop layers that ends just before the model's last N layers;
- ``angular-block``: the contiguous block whose input and output are closest in angle (Gromov et al.);
- ``tail-cut``: the last candidates (reverse-order pruning).

A candidate that cannot exist on this model (a block that would reach a protected layer, a BI set
with too few candidates left) is left out, and said so. No Ray here.
"""

from __future__ import annotations

import re

from trsp_ray.common.errors import TrspError

PATTERNS = (r"bi", r"bi-tail(\d+)", r"block-(\d+)", r"angular-block", r"tail-cut")
FORWARD_CANDIDATES = ("bi", "angular-block")  # need a dense forward over the windows (bi-tailN reuses bi's)


def parse(text: str) -> list[str]:
    """The candidate names of `text` (comma-separated), each checked; a one-line TrspError names a bad one."""
    names = [n.strip() for n in text.split(",") if n.strip()]
    if not names:
        raise TrspError(f"selection.candidates={text!r} names no candidate; use a comma list of "
                        "bi, bi-tailN, block-N, angular-block, tail-cut (N >= 1)")
    for name in names:
        match = next((re.fullmatch(p, name) for p in PATTERNS if re.fullmatch(p, name)), None)
        if match is None or (match.groups() and int(match.group(1)) < 1):
            raise TrspError(f"selection.candidates has {name!r}, which is not a candidate; valid: bi, bi-tailN, "
                            "block-N, angular-block, tail-cut (N >= 1)")
    if len(set(names)) != len(names):
        raise TrspError(f"selection.candidates={text!r} names a candidate twice")
    return names


def needs_forward(names: list[str]) -> set[str]:
    """Which dense forwards the candidates need: "bi" (every bi and bi-tailN) and "angular-block"."""
    return {"bi" if n.startswith("bi") else n for n in names} & set(FORWARD_CANDIDATES)


def block_before(*, n_drop: int, keep_last: int, num_layers: int, candidates: list[int]) -> list[int] | None:
    """Layers L-keep_last-n_drop .. L-keep_last-1 when they all are candidates, else None."""
    end = num_layers - keep_last
    block = list(range(end - n_drop, end))
    return block if block and block[0] >= 0 and set(block) <= set(candidates) else None


def drop_sets(names: list[str], *, n_drop: int, num_layers: int, candidates: list[int],
              influence: dict[int, float] | None = None, angular: list[int] | None = None) -> dict[str, list[int]]:
    """{name: sorted drop set} in `names`' order; a set equal to an earlier name's is left out (the
    first name stands for it). `influence`: Block Influence per layer (for bi and bi-tailN);
    `angular`: the angular block (for angular-block)."""
    out: dict[str, list[int]] = {}
    for name in names:
        drop = _one(name, n_drop=n_drop, num_layers=num_layers, candidates=candidates, influence=influence,
                    angular=angular)
        if drop is not None and sorted(drop) not in out.values():
            out[name] = sorted(drop)
    return out


def _one(name: str, *, n_drop, num_layers, candidates, influence, angular) -> list[int] | None:
    if name == "tail-cut":
        return sorted(candidates)[-n_drop:]
    if name == "angular-block":
        return angular
    if name.startswith("block-"):
        return block_before(n_drop=n_drop, keep_last=int(name.split("-")[1]), num_layers=num_layers,
                            candidates=candidates)
    allowed = sorted(candidates)
    if name.startswith("bi-tail"):
        allowed = allowed[: len(allowed) - int(name[len("bi-tail"):])]
    if influence is None or len(allowed) < n_drop:
        return None
    return sorted(allowed, key=lambda i: influence[i])[:n_drop]
