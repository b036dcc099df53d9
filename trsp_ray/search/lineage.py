"""MLflow lineage of a search: one parent run, a child run per trial, the trial's evaluation as a run
nested under it, the Pareto plot (calibration held-out PPL vs total compute, colour = kept parameters)
and gate heat map on the parent, the best model in the registry.

Written with `MlflowClient` by the driver alone (trials never touch MLflow): a sqlite store has one
writer, and explicit run ids keep the tree right when trials finish out of order. Run ids are kept
in `<search_dir>/mlflow.json`, so a resumed search adds children to the same parent run.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from trsp_ray.common import atomic, plots
from trsp_ray.run.tracking import _flatten, default_tracking_uri, experiment_id
from trsp_ray.search.layout import RANKING

STATE = "mlflow.json"
PARENT_TAG = "mlflow.parentRunId"


def _client(tracking_uri: str | None, experiment: str):
    from mlflow.tracking import MlflowClient

    uri = tracking_uri or default_tracking_uri()
    client = MlflowClient(tracking_uri=uri)
    return client, experiment_id(client, experiment, uri)


def _log(client, run_id: str, *, params: dict | None = None, metrics: dict | None = None, step: int = 0) -> None:
    from mlflow.entities import Metric, Param

    now = int(time.time() * 1000)
    ps = [Param(k, str(v)[:6000]) for k, v in _flatten(params or {}).items()]
    ms = [Metric(k, float(v), now, step) for k, v in (metrics or {}).items() if isinstance(v, (int, float))]
    for i in range(0, max(len(ps), len(ms), 1), 100):  # MLflow caps a batch at 100 params
        client.log_batch(run_id, params=ps[i:i + 100], metrics=ms[i:i + 100])


def _trial_run(client, exp_id: str, parent: str, record: dict) -> str:
    key = record["trial_key"]
    run = client.create_run(exp_id, run_name=f"trial-{key[:8]}",
                            tags={PARENT_TAG: parent, "trsp.trial_key": key, "trsp.status": record["status"]})
    rid = run.info.run_id
    _log(client, rid, params={"point": record["point"], "config": record.get("config", {})},
         metrics={**{k: record.get(k) for k in ("val_ppl", "val_loss", "kept_parameters", "kept_fraction",
                                                 "heldout_ppl")},
                  **{f"compute_{k}": v for k, v in (record.get("compute") or {}).items()
                     if isinstance(v, (int, float)) and not isinstance(v, bool)}})
    for point in record.get("curve", []):  # stage 2's or the heal's steps (the names predate heals)
        _log(client, rid, metrics={"stage2_val_loss": point["val_loss"], "stage2_ce": point["stage2_ce"]},
             step=point["step"])
    client.log_dict(rid, record, "trial.json")
    if record.get("evaluation"):
        _evaluation_run(client, exp_id, rid, record)
    client.set_terminated(rid, "FINISHED" if record["status"] == "finished" else "KILLED")
    return rid


def _evaluation_run(client, exp_id: str, trial_run: str, record: dict) -> None:
    from trsp_ray.evaluation.report import flat_metrics

    result = record["evaluation"]
    run = client.create_run(exp_id, run_name=f"eval-{record['trial_key'][:8]}",
                            tags={PARENT_TAG: trial_run, "trsp.trial_key": record["trial_key"],
                                  "trsp.kind": "evaluation", "candidate": str(result.get("model"))})
    _log(client, run.info.run_id, metrics=flat_metrics(result))
    client.log_dict(run.info.run_id, result, "result.json")
    client.set_terminated(run.info.run_id, "FINISHED" if result.get("status") == "ok" else "FAILED")


def total_compute(record: dict) -> float | None:
    """A trial's total dense-forward tokens (selection + fit + heal), None when it was not recorded."""
    return (record.get("compute") or {}).get("total", record.get("total_compute"))


def pareto_front(records: list[dict]) -> list[dict]:
    """Finished trials not dominated in (calibration held-out PPL, total compute), both lower is better."""
    done = [r for r in records if r.get("val_ppl") is not None and total_compute(r) is not None]
    score = {id(r): (r["val_ppl"], total_compute(r)) for r in done}
    return [r for r in done if not any(
        score[id(o)][0] <= score[id(r)][0] and score[id(o)][1] <= score[id(r)][1] and score[id(o)] != score[id(r)]
        for o in done)]


def _label(record: dict) -> str:
    def short(k, v):
        return f"{k.split('.')[-1]}={v:.3g}" if isinstance(v, float) else f"{k.split('.')[-1]}={v}"

    return ", ".join(short(k, v) for k, v in record["point"].items() if k != "method")


def pareto_figure(records: list[dict]):
    """Calibration held-out PPL (the objective) against each trial's total compute; colour: kept
    fraction of parameters, marker: the pipeline; the line joins the Pareto front."""
    from trsp_ray.common.plots import _pyplot

    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    done = [r for r in records if r.get("status") == "finished" and r.get("val_ppl") is not None
            and total_compute(r) is not None]
    markers = "osD^vP*Xh<>"
    methods = sorted({r.get("method") or r.get("config", {}).get("method", "?") for r in done})
    image = None
    for i, method in enumerate(methods):
        mine = [r for r in done if (r.get("method") or r.get("config", {}).get("method", "?")) == method]
        image = ax.scatter([total_compute(r) / 1e3 for r in mine], [r["val_ppl"] for r in mine],
                           c=[r["kept_fraction"] for r in mine], cmap="viridis", vmin=0, vmax=1, s=45,
                           marker=markers[i % len(markers)], edgecolors="k", linewidths=0.4, label=method)
    front = sorted(pareto_front(done), key=total_compute)
    ax.plot([total_compute(r) / 1e3 for r in front], [r["val_ppl"] for r in front], "-", color="C3", lw=1,
            label="Pareto front")
    for r in done:
        ax.annotate(_label(r), (total_compute(r) / 1e3, r["val_ppl"]), fontsize=6)
    if image is not None:
        fig.colorbar(image, ax=ax, label="kept fraction of parameters")
    ax.set_xlabel("total compute (k dense-forward tokens: selection + fit + heal)")
    ax.set_ylabel("calibration held-out PPL (mixture tail)")
    ax.set_title("Search: quality vs total compute")
    ax.legend(fontsize=7)
    fig.tight_layout()
    return fig


def gate_heatmap(records: list[dict]):
    """Rows: trials; columns: layers; colour: stage-1 gate value when the trial's drop set was complete."""
    import numpy as np

    from trsp_ray.common.plots import _pyplot

    plt = _pyplot()
    rows = [r for r in records if r.get("gates")]
    width = max((len(r["gates"]) for r in rows), default=1)
    grid = np.full((max(len(rows), 1), width), np.nan)
    for i, r in enumerate(rows):
        grid[i, :len(r["gates"])] = r["gates"]
    fig, ax = plt.subplots(figsize=(max(5, width * 0.4), max(3, len(rows) * 0.35 + 1.5)))
    image = ax.imshow(grid, aspect="auto", cmap="viridis")
    ax.set_yticks(range(len(rows)), [r["trial_key"][:8] for r in rows], fontsize=6)
    ax.set_xlabel("layer")
    ax.set_ylabel("trial")
    ax.set_title("Stage-1 gate values per layer and trial")
    fig.colorbar(image, ax=ax, label="s_i")
    fig.tight_layout()
    return fig


def log_search(*, search_dir: Path, name: str, tracking_uri: str | None, experiment: str, space: dict,
               records: list[dict], new_keys: set[str], best: dict | None, register_name: str | None,
               summary: dict) -> dict:
    """Create/extend the run tree; returns {"parent": id, "children": {trial key: id}, "model_version": ...}."""
    client, exp_id = _client(tracking_uri, experiment)
    state_file = Path(search_dir) / STATE
    state = json.loads(state_file.read_text()) if state_file.is_file() else {}
    if not state.get("parent"):
        state["parent"] = client.create_run(exp_id, run_name=name, tags={"trsp.search": name}).info.run_id
        _log(client, state["parent"], params={"space": space})
    parent, children = state["parent"], state.setdefault("children", {})
    for record in records:
        if record["trial_key"] in new_keys or record["trial_key"] not in children:
            children[record["trial_key"]] = _trial_run(client, exp_id, parent, record)
            atomic.write_json(state_file, state)  # a crash later still leaves the finished children linked
    _log(client, parent, metrics={k: v for k, v in summary.items() if isinstance(v, (int, float))})
    for figure, artifact in ((pareto_figure(records), "pareto.png"), (gate_heatmap(records), "gates_heatmap.png")):
        try:
            client.log_figure(parent, figure, artifact)
        finally:
            plots.close(figure)
    client.log_dict(parent, {"trials": records}, "trials.json")
    if (Path(search_dir) / RANKING).is_file():  # every trial vs the best, paired over the same windows
        client.log_artifact(parent, str(Path(search_dir) / RANKING))
    if best is not None and register_name and state.get("registered_trial") != best["trial_key"]:
        state["model_version"] = register_best(client, children[best["trial_key"]], best, register_name)
        state["registered_trial"] = best["trial_key"]
        client.set_tag(parent, "trsp.best_trial", best["trial_key"])
    atomic.write_json(state_file, state)
    return state


def register_best(client, run_id: str, best: dict, name: str) -> str:
    """Upload the best export to its trial run as an MLflow transformers model and register it, so
    `mlflow.transformers.load_model("models:/<name>/<version>")` gives a text-generation pipeline
    (and mlflow.pyfunc.load_model a pyfunc); returns the model version."""
    import tempfile

    from mlflow.exceptions import MlflowException

    model_dir = Path(best["model_dir"])
    with tempfile.TemporaryDirectory(prefix=".mlflow-", dir=model_dir.parent) as tmp:  # the exports' disk
        staged = Path(tmp) / "model"
        transformers_model(model_dir, staged)
        client.log_artifacts(run_id, str(staged), "model")
    client.log_dict(run_id, best["config"], "config.json")
    manifest = json.loads((Path(best["model_dir"]) / "trsp_ray.json").read_text())
    try:
        client.create_registered_model(name, description="TRSP-pruned model chosen by a trsp_ray search")
    except MlflowException:
        pass  # already registered by an earlier search: add a version
    source = f"{client.get_run(run_id).info.artifact_uri}/model"
    version = client.create_model_version(
        name, source=source, run_id=run_id,
        tags={"trsp.trial_key": best["trial_key"], "config": json.dumps(best["config"])[:4900],
              "manifest": json.dumps({k: manifest.get(k) for k in ("dropped_layers", "kept_layers",
                                      "num_layers_original", "num_layers_kept", "metrics")})[:4900]})
    return version.version


def transformers_model(export_dir: Path, path: Path) -> None:
    """An MLflow transformers model (MLmodel + the export's files) of an export directory at `path`,
    written from the files: the weights are never loaded into this process."""
    import importlib

    import mlflow.transformers
    import transformers
    from transformers import pipelines

    check_task = pipelines.check_task

    def with_class(task: str):
        # mlflow (3.17) reads the pipeline class's __name__ off check_task's "impl", which
        # transformers 5 gives as a dotted name: hand it the class
        name, meta, other = check_task(task)
        if isinstance(meta.get("impl"), str):
            module, _, cls = meta["impl"].rpartition(".")
            meta = {**meta, "impl": getattr(importlib.import_module(module), cls)}
        return name, meta, other

    # explicit requirements: inferring them would load the model in a subprocess
    requirements = [f"transformers=={transformers.__version__}", "torch", "safetensors"]
    pipelines.check_task = with_class
    try:
        mlflow.transformers.save_model(str(export_dir), str(path), task="text-generation",
                                       pip_requirements=requirements)
    finally:
        pipelines.check_task = check_task
