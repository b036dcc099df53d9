"""Issue 20: the benchmark PNG's log-axis tick labels do not print on top of each other."""

import pytest


def _cell(mean: float) -> dict:
    return {"mean": mean, "min": mean * 0.97, "max": mean * 1.03}


RANGES = {  # (geo-mean, left-out) PPL of dense and three rows: one decade, three decades, a tiny model's
    "one decade": [(22, 30), (31, 44), (45, 58), (38, 52)],
    "a third of a decade": [(18, 21.6), (27, 28.8), (25, 27.5), (20, 22.5)],  # minor labels collided here
    "three decades": [(22, 30), (31, 44), (4500, 5800), (380, 520)],
    "tiny random model": [(49310, 52000), (48167, 51000), (60000, 70000), (55000, 66000)],
}


@pytest.mark.parametrize("ppls", RANGES.values(), ids=RANGES.keys())
def test_benchmark_bars_tick_labels_do_not_overlap(ppls):
    from trsp_ray.common.plots import benchmark_bars, close

    names = [("dense", "dense"), ("trsp", "trained"), ("shortgpt", "selection"), ("sleb", "selection")]
    summary = [{"row": r, "group": g, "geo-mean x dense": _cell(a), "left-out PPL": _cell(b)}
               for (r, g), (a, b) in zip(names, ppls)]
    fig = benchmark_bars(summary)
    try:
        _assert_x_labels_apart(fig)
    finally:
        close(fig)


def _assert_x_labels_apart(fig) -> None:
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    for ax in fig.axes:
        lo, hi = ax.get_xlim()
        ticks = ax.xaxis.get_major_ticks() + ax.xaxis.get_minor_ticks()
        labels = [t.label1 for t in ticks if t.label1.get_visible() and t.label1.get_text()
                  and lo <= t.get_loc() <= hi]
        texts = [lab.get_text() for lab in labels]
        boxes = sorted((lab.get_window_extent(renderer) for lab in labels), key=lambda b: b.x0)
        assert len(boxes) >= 2, texts  # the axis can still be read
        gaps = [b.x0 - a.x1 for a, b in zip(boxes, boxes[1:])]
        assert min(gaps) > 2, texts  # pixels between neighbours
        assert len(set(texts)) == len(texts), texts  # no two ticks read the same


def _stat(mean: float, n: int = 1, se: float | None = None) -> dict:
    out = {"mean": mean, "min": mean - 0.01 * n, "max": mean + 0.02 * n, "n": n}
    return out if se is None else {**out, "se": se}


def _summary(seeds: int) -> list[dict]:
    """The README job's rows (one heal budget, LAMBADA measured, no zero-shot: one panel each)."""
    rows = [{"row": "dense", "group": "dense", "total cost": 0.0, "geo-mean x dense": _stat(1.0),
             "LAMBADA acc": _stat(0.30, seeds, 0.02)}]
    for k, name in enumerate(("shortgpt+heal", "shortgpt+comp+heal", "shortgpt+heal@comp")):
        rows.append({"row": name, "group": "trained", "total cost": 50_000.0 + 1000 * k,
                     "geo-mean x dense": _stat(1.4 + 0.1 * k, seeds),
                     "LAMBADA acc": _stat(0.15 + 0.01 * k, seeds, 0.015),
                     "LAMBADA % dense": _stat(50.0 + 3 * k, seeds, 5.0)})
    return rows


@pytest.mark.parametrize("plot", ["retention_vs_compute", "quality_vs_compute", "benchmark_bars"])
def test_a_figure_title_fits_its_figure(plot):
    """Issue 49: the README job's retention_vs_compute.png (one panel) cut its title at both edges."""
    from trsp_ray.common import plots

    summary = _summary(seeds=1)
    if plot == "benchmark_bars":
        summary = [{**s, "geo-mean x dense": {**s["geo-mean x dense"], "min": 1.0, "max": 2.0}} for s in summary]
    fig = getattr(plots, plot)(summary)
    try:
        fig.canvas.draw()
        renderer = fig.canvas.get_renderer()
        title = fig._suptitle.get_window_extent(renderer)
        width, height = fig.canvas.get_width_height()
        assert title.x0 >= 0 and title.x1 <= width and title.y1 <= height, (title, width, height)
        for ax in fig.axes:  # and it does not run into a panel
            assert title.y0 >= ax.get_tightbbox(renderer).y1 - 1, plot
    finally:
        plots.close(fig)


def test_retention_vs_compute_tick_labels_do_not_overlap():
    """Its log compute axis (one budget: every row within one 1-2-5 step) labelled each minor tick."""
    from trsp_ray.common import plots

    fig = plots.retention_vs_compute(_summary(seeds=1))
    try:
        _assert_x_labels_apart(fig)
    finally:
        plots.close(fig)


@pytest.mark.parametrize("seeds", [1, 3])
def test_quality_vs_compute_draws_the_tables_error_bars(seeds):
    """Issue 49: quality_vs_compute.png drew no error bars although the table prints them: ± 1 SE
    (LAMBADA) with one seed, the seeds' range with several; a column with neither (geo-mean at one
    seed) has none, as in the table."""
    from matplotlib.container import ErrorbarContainer

    from trsp_ray.common import plots

    summary = _summary(seeds)
    fig = plots.quality_vs_compute(summary)
    try:
        geo, lambada = fig.axes
        for ax, col in ((geo, "geo-mean x dense"), (lambada, "LAMBADA acc")):
            bars = [c for c in ax.containers if isinstance(c, ErrorbarContainer)]
            assert len(bars) == 3, col
            for c, row in zip(bars, summary[1:]):
                stat = row[col]
                segments = [seg for coll in c[2] for seg in coll.get_segments()]
                if seeds == 1 and "se" not in stat:
                    assert segments == [], col
                    continue
                (low, high), = [(seg[0][1], seg[1][1]) for seg in segments]
                expected = (stat["min"], stat["max"]) if seeds > 1 else (stat["mean"] - stat["se"],
                                                                           stat["mean"] + stat["se"])
                assert (low, high) == pytest.approx(expected), col
    finally:
        plots.close(fig)
