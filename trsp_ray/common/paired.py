"""The paired standard error every verdict rests on (the benchmark's columns, the search's ranking):
two rows scored on the same items are compared item by item, and items that share a document are
one cluster (windows of one document are correlated, SPEC section 2)."""

from __future__ import annotations

import math


def paired_se(a: list[float], b: list[float], clusters: list | None = None) -> tuple[float, float]:
    """(mean of d_i = a_i - b_i, its standard error) for items scored by both.

    Without `clusters` the items are independent: sd(d) / sqrt(n), sd with n - 1. With `clusters`
    (the document of each item: windows of one document are correlated), the cluster-robust SE of
    the mean: sqrt(G / (G - 1) * sum over clusters g of (sum_{i in g} (d_i - mean))^2) / n, G the
    number of clusters; with one item per cluster it is the plain SE. With one item, or one
    cluster, the error is infinite (nothing can be decided)."""
    if len(a) != len(b) or not a or (clusters is not None and len(clusters) != len(a)):
        raise ValueError(f"paired items differ in number ({len(a)} vs {len(b)}"
                         f"{'' if clusters is None else f' vs {len(clusters)} clusters'}) or are empty")
    d = [x - y for x, y in zip(a, b)]
    n = len(d)
    mean = sum(d) / n
    sums: dict = {}
    for i, x in enumerate(d):
        g = i if clusters is None else clusters[i]
        sums[g] = sums.get(g, 0.0) + (x - mean)
    g = len(sums)
    if g < 2:
        return mean, math.inf
    return mean, math.sqrt(g / (g - 1) * sum(v * v for v in sums.values())) / n
