"""The block boundaries a drop set leaves, and a forward pass cut short after the last layer it needs.

Shared by both compensation forms (trsp_ray/compensation.py, trsp_ray/compensation_scalar.py): each
repairs the boundary a_k-1 -> b_k+1 of every maximal run [a_k..b_k] of removed layers, and reads the
dense stream with forward hooks that stop the pass once the deepest layer they need has run.
"""

from __future__ import annotations

from trsp_ray.errors import TrspError


def blocks(drop, num_layers: int) -> list[tuple[int, int]]:
    """Maximal contiguous runs of dropped layers as (first, last) original indices, ascending."""
    out: list[tuple[int, int]] = []
    for i in sorted(int(j) for j in drop):
        if not 0 <= i < num_layers:
            raise TrspError(f"drop set {sorted(drop)} is not valid for a {num_layers}-layer model")
        if out and out[-1][1] == i - 1:
            out[-1] = (out[-1][0], i)
        else:
            out.append((i, i))
    return out


def fold_layers(spans) -> list[int]:
    """The original index of the kept layer each block's map is folded into: the layer before it
    (a - 1 for block (a, b); what compensation.compensate folds into and reports as "blocks")."""
    return [a - 1 for a, _ in spans]


class Stop(Exception):
    """Raised by a hook once the last layer a pass needs has run: the rest is not computed."""


def hidden(output):
    """The hidden-state tensor of a module's output (decoder layers may return a tuple)."""
    return output[0] if isinstance(output, tuple) else output
