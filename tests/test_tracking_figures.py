"""Logged figures land in MLflow as PNGs and are closed afterwards: pyplot keeps every open figure
alive for the life of the process, and a search or reproduction logs hundreds."""

from __future__ import annotations

from pathlib import Path

from trsp_ray.common import plots
from trsp_ray.run.tracking import make_tracker


def _gates():
    return plots.gate_trajectories([[1.0, 0.9, 0.8], [1.0, 0.5, 0.7], [1.0, 0.1, 0.6]], [2], [1])


def test_mlflow_tracker_logs_the_png_and_closes_the_figure(tmp_path):
    from mlflow.tracking import MlflowClient

    plt = plots._pyplot()
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    tracker = make_tracker(tracking_uri=uri, experiment="figures")
    open_before = set(plt.get_fignums())
    with tracker.run("figure"):
        fig = _gates()
        assert fig.number in plt.get_fignums()
        tracker.log_figure(fig, "gates.png")
        run_id = tracker.run_id
    assert set(plt.get_fignums()) == open_before
    local = Path(MlflowClient(tracking_uri=uri).download_artifacts(run_id, "gates.png", str(tmp_path)))
    assert local.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and local.stat().st_size > 5000


def test_null_tracker_closes_the_figure_too():
    plt = plots._pyplot()
    tracker = make_tracker(enabled=False)
    fig = _gates()
    tracker.log_figure(fig, "gates.png")
    assert fig.number not in plt.get_fignums()


def test_search_lineage_logs_both_plots_and_closes_them(tmp_path):
    from mlflow.tracking import MlflowClient

    from trsp_ray.search import lineage

    plt = plots._pyplot()
    records = [{"trial_key": f"trial{i}", "status": "finished", "point": {"stage1.lambda1": 0.01 * (i + 1)},
                "heldout_ppl": 20.0 + i, "kept_fraction": 1 - 0.1 * i, "gates": [1.0, 0.5 - 0.1 * i, 0.2]}
               for i in range(3)]
    uri = f"sqlite:///{tmp_path / 'm.db'}"
    open_before = set(plt.get_fignums())
    state = lineage.log_search(search_dir=tmp_path, name="s", tracking_uri=uri, experiment="e", space={},
                               records=records, new_keys={r["trial_key"] for r in records}, best=None,
                               register_name=None, summary={"trials": 3})
    assert set(plt.get_fignums()) == open_before
    names = {a.path for a in MlflowClient(tracking_uri=uri).list_artifacts(state["parent"])}
    assert {"pareto.png", "gates_heatmap.png"} <= names


def test_every_benchmark_row_name_is_a_valid_metric_name(tmp_path):
    """The benchmark logs '<row>/x<budget>/...' metrics; MLflow refuses '+' and '@' in a name (the
    README run died on 'shortgpt+heal@compute' after every row had run)."""
    from mlflow.tracking import MlflowClient

    from trsp_ray.config.registry import ROW_NAMES

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    tracker = make_tracker(tracking_uri=uri, experiment="names")
    with tracker.run("names"):
        tracker.log_metrics({f"{row}/x1/heldout_ppl": float(i) for i, row in enumerate(ROW_NAMES)})
        run_id = tracker.run_id
    logged = MlflowClient(tracking_uri=uri).get_run(run_id).data.metrics
    assert len(logged) == len(ROW_NAMES) and logged["shortgpt_plus_heal_at_compute/x1/heldout_ppl"] >= 0
