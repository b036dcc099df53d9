"""PNG figures logged to MLflow: gate trajectories (stage 1) and relative updates (stage 2)."""

from __future__ import annotations


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def close(figure) -> None:
    """Release a figure once it is logged: pyplot keeps every open figure alive for the life of the
    process, and a search or reproduction logs hundreds."""
    _pyplot().close(figure)


def _suptitle(fig, text: str, *, fontsize: float = 11.0) -> None:
    """`text` as the figure's title, wrapped to the figure's width: matplotlib centres a title wider
    than a one-panel figure and cuts it at both edges (the README job's retention_vs_compute.png)."""
    import textwrap

    # ~0.62 em per character of DejaVu Sans (matplotlib's default font), 72 points per inch
    chars = max(20, int(fig.get_figwidth() * 72 / (0.62 * fontsize)))
    fig.suptitle(textwrap.fill(text, chars), fontsize=fontsize)


def _log_x(ax) -> None:
    """A log x axis labelled with plain numbers at 1-2-5 steps, no minor labels: matplotlib's default
    labels every minor tick as "3x10^1", and within one decade they print on top of each other."""
    from matplotlib import ticker

    ax.set_xscale("log")
    ax.xaxis.set_major_locator(ticker.LogLocator(base=10, subs=(1.0, 2.0, 5.0), numticks=8))
    # four significant digits below 10,000: a range inside one 1-2-5 step gets linear ticks (50, 50.25, ...)
    ax.xaxis.set_major_formatter(ticker.FuncFormatter(lambda v, _: f"{v:,.0f}" if v >= 1e4 else f"{v:.4g}"))
    ax.xaxis.set_minor_formatter(ticker.NullFormatter())


def _error_bars(pts: list[tuple[float, dict]]) -> list | None:
    """yerr of a line's points as the results table prints them: the seeds' range where every point
    has several seeds, else ± 1 standard error where the column has one, else none."""
    means = [stat["mean"] for _, stat in pts]
    if all(stat["n"] > 1 for _, stat in pts):
        # max(0, .): a mean of equal values can land an ulp outside [min, max], and matplotlib refuses
        return [[max(0.0, y - stat["min"]) for y, (_, stat) in zip(means, pts)],
                [max(0.0, stat["max"] - y) for y, (_, stat) in zip(means, pts)]]
    if all("se" in stat for _, stat in pts):
        return [stat["se"] for _, stat in pts]
    return None


def gate_trajectories(gate_history: list[list[float]], round_ends: list[int], drop_order: list[int]):
    """Each layer's gate value per stage-1 step; dashed lines end rounds, dropped layers in colour."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(9, 5))
    steps = range(1, len(gate_history) + 1)
    n_layers = len(gate_history[0]) if gate_history else 0
    for i in range(n_layers):
        series = [g[i] for g in gate_history]
        if i in drop_order:
            ax.plot(steps, series, lw=1.8, label=f"layer {i} (drop #{drop_order.index(i) + 1})")
        else:
            ax.plot(steps, series, lw=0.7, color="0.6")
    for end in round_ends:
        ax.axvline(end + 0.5, ls="--", lw=0.6, color="0.3")
    ax.set_xlabel("stage-1 step (dashed: end of a selection round)")
    ax.set_ylabel("gate value s_i")
    ax.set_title("TRSP stage 1: gate trajectories (grey: kept layers)")
    if drop_order:
        ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    return fig


def relative_updates(history: dict[int, list[float]]):
    """Per layer of the drop set, ||x_{i+1} - x_i|| / ||x_i|| per stage-2 step."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for layer, series in history.items():
        ax.plot(range(1, len(series) + 1), series, label=f"layer {layer}")
    ax.set_xlabel("stage-2 step")
    ax.set_ylabel("relative update ||x_{i+1}-x_i|| / ||x_i||")
    ax.set_title("TRSP stage 2: layers in the drop set approach identity")
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    return fig


def benchmark_bars(summary: list[dict]):
    """The geometric-mean perplexity relative to dense and the left-out domain's perplexity (where a
    domain is left out) per benchmark row (mean over seeds, bars = min..max), one panel per metric,
    rows grouped by budget (dense, selection only, trained)."""
    plt = _pyplot()
    rows = [s for s in summary if s["group"] != "dense"]
    dense = next((s for s in summary if s["group"] == "dense"), None)
    panels = [c for c in ("geo-mean x dense", "left-out PPL") if all(s.get(c) for s in rows)]
    fig, axes = plt.subplots(1, len(panels), figsize=(6 * len(panels), 0.45 * len(rows) + 1.8), sharey=True,
                             squeeze=False)
    axes = axes[0]
    colors = {"selection": "tab:orange", "trained": "tab:blue"}
    for ax, col in zip(axes, panels):
        means = [s[col]["mean"] for s in rows]
        # max(0, .): a mean of equal values can land an ulp outside [min, max], and matplotlib refuses
        err = [[max(0.0, s[col]["mean"] - s[col]["min"]) for s in rows],
               [max(0.0, s[col]["max"] - s[col]["mean"]) for s in rows]]
        ax.barh(range(len(rows)), means, xerr=err, color=[colors[s["group"]] for s in rows], capsize=3)
        if dense is not None:
            ax.axvline(dense[col]["mean"], color="0.3", ls="--", lw=1, label="dense")
            ax.legend(fontsize=8)
        ax.set_xlabel(f"{col} (lower is better)")
        _log_x(ax)
    axes[0].set_yticks(range(len(rows)), [f"{s['row']} ({s['group']})" for s in rows], fontsize=8)
    axes[0].invert_yaxis()
    _suptitle(fig, "trsp-ray benchmark: mean over seeds, bars span min..max")
    fig.tight_layout()
    return fig


def _lines(rows: list[dict], col: str) -> dict[str, list[tuple[float, dict]]]:
    """{row name: [(total compute in thousands of tokens, the column's seed statistics)] in compute
    order} of the summary rows that have `col`: one line per row across heal budgets."""
    out: dict[str, list] = {}
    for s in rows:
        if s.get(col):
            out.setdefault(s["row"], []).append((s["total cost"] / 1e3, s[col]))
    return {name: sorted(pts, key=lambda p: p[0]) for name, pts in out.items()}


def quality_vs_compute(summary: list[dict]):
    """What compute buys: the geometric-mean PPL relative to dense and LAMBADA accuracy (where
    measured) of every pruned row against its total compute (selection + recovery, dense-forward
    tokens); one line per row across heal budgets, the dense model as a dashed line."""
    plt = _pyplot()
    rows = [s for s in summary if s["group"] != "dense"]
    dense = next((s for s in summary if s["group"] == "dense"), None)
    panels = [c for c in ("geo-mean x dense", "LAMBADA acc") if any(s.get(c) for s in rows)]
    fig, axes = plt.subplots(1, len(panels), figsize=(6.5 * len(panels), 4.8), squeeze=False)
    for ax, col in zip(axes[0], panels):
        for name, pts in _lines(rows, col).items():
            ax.errorbar([x for x, _ in pts], [stat["mean"] for _, stat in pts], yerr=_error_bars(pts), marker="o",
                        lw=1.2, capsize=3, label=name)
        if dense is not None and dense.get(col):
            ax.axhline(dense[col]["mean"], color="0.3", ls="--", lw=1, label="dense")
        ax.set_xlabel("total compute (thousands of dense-forward tokens)")
        ax.set_ylabel(f"{col} ({'higher' if 'acc' in col else 'lower'} is better)")
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=7)
    _suptitle(fig, "trsp-ray benchmark: quality against total compute (mean over seeds; bars: seed range, or "
                   "± 1 SE where the table has one)")
    fig.tight_layout()
    return fig


def retention_vs_compute(summary: list[dict]):
    """What each recovery keeps as its compute grows: LAMBADA and zero-shot accuracy as % of the dense
    model's (where measured) of every trained row against its total compute, one line per row across
    heal budgets; error bars are the seeds' range where there are several seeds, else ± 1 standard
    error of the accuracy. None when no row has a retention figure."""
    plt = _pyplot()
    rows = [s for s in summary if s["group"] == "trained"]
    panels = [c for c in ("LAMBADA % dense", "zero-shot % dense") if any(s.get(c) for s in rows)]
    if not panels:
        return None
    fig, axes = plt.subplots(1, len(panels), figsize=(6.5 * len(panels), 4.8), squeeze=False)
    for ax, col in zip(axes[0], panels):
        for name, pts in _lines(rows, col).items():
            ax.errorbar([x for x, _ in pts], [stat["mean"] for _, stat in pts], yerr=_error_bars(pts), marker="o",
                        lw=1.2, capsize=3, label=name)
        ax.axhline(100.0, color="0.3", ls="--", lw=1, label="dense")
        _log_x(ax)
        ax.set_xlabel("total compute (thousands of dense-forward tokens, log scale)")
        ax.set_ylabel(f"{col} (higher is better)")
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=7)
    _suptitle(fig, "trsp-ray benchmark: accuracy kept against total compute (bars: seed range, or ± 1 SE)")
    fig.tight_layout()
    return fig
