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
        fig.canvas.draw()
        renderer = fig.canvas.get_renderer()
        for ax in fig.axes:
            lo, hi = ax.get_xlim()
            ticks = ax.xaxis.get_major_ticks() + ax.xaxis.get_minor_ticks()
            labels = [t.label1 for t in ticks if t.label1.get_visible() and t.label1.get_text()
                      and lo <= t.get_loc() <= hi]
            boxes = sorted((lab.get_window_extent(renderer) for lab in labels), key=lambda b: b.x0)
            assert len(boxes) >= 2, [lab.get_text() for lab in labels]  # the axis can still be read
            gaps = [b.x0 - a.x1 for a, b in zip(boxes, boxes[1:])]
            assert min(gaps) > 2, [lab.get_text() for lab in labels]  # pixels between neighbours
    finally:
        close(fig)
