"""MLflow behind a small tracker, with a do-nothing version for tests and non-zero ranks.

Default store: a local sqlite file (`sqlite:///<dir>/mlflow.db`, <dir> = $TRSP_RAY_MLFLOW_DIR or
./runs) with the artifacts beside it in `<dir>/artifacts`; any tracking URI works.
"""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path
from typing import Any, Iterator

from trsp_ray.common import plots


def default_tracking_uri() -> str:
    root = Path(os.environ.get("TRSP_RAY_MLFLOW_DIR", Path.cwd() / "runs"))
    root.mkdir(parents=True, exist_ok=True)
    return f"sqlite:///{root.resolve() / 'mlflow.db'}"


def artifact_location(tracking_uri: str) -> str | None:
    """Where a new experiment keeps its artifacts: beside a sqlite database (`<its folder>/artifacts`),
    not in the caller's working directory (`./mlruns`, MLflow's default); None (the server's own
    default) for any other store."""
    if tracking_uri.startswith("sqlite:///"):
        return (Path(tracking_uri.removeprefix("sqlite:///")).parent / "artifacts").resolve().as_uri()
    return None


def experiment_id(client, name: str, tracking_uri: str) -> str:
    """The id of experiment `name`, created with `artifact_location` when it does not exist yet
    (an existing one keeps the location it was created with)."""
    from mlflow.exceptions import MlflowException

    found = client.get_experiment_by_name(name)
    if found is not None:
        return found.experiment_id
    try:
        return client.create_experiment(name, artifact_location=artifact_location(tracking_uri))
    except MlflowException:  # created meanwhile by another process on the same store
        return client.get_experiment_by_name(name).experiment_id


def _flatten(d: dict, prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in d.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(_flatten(value, name + "."))
        else:
            out[name] = value
    return out


class NullTracker:
    """Same interface as MlflowTracker; records nothing."""

    run_id: str | None = None

    @contextlib.contextmanager
    def run(self, name: str, *, nested: bool = False, tags: dict | None = None,
            parent_run_id: str | None = None) -> Iterator["NullTracker"]:
        yield self

    def log_params(self, params: dict) -> None: ...
    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None: ...
    def log_dict(self, obj: Any, name: str) -> None: ...
    def log_text(self, text: str, name: str) -> None: ...
    def log_figure(self, figure, name: str) -> None:
        plots.close(figure)

    def log_artifact(self, path: str, artifact_path: str | None = None) -> None: ...
    def set_tags(self, tags: dict) -> None: ...


class MlflowTracker:
    """Thin wrapper over the mlflow fluent API. Params are flattened (`a.b.c`); values are str-cast."""

    def __init__(self, *, tracking_uri: str | None, experiment: str):
        import mlflow

        self._mlflow = mlflow
        self.tracking_uri = tracking_uri or default_tracking_uri()
        mlflow.set_tracking_uri(self.tracking_uri)
        client = mlflow.tracking.MlflowClient(tracking_uri=self.tracking_uri)
        mlflow.set_experiment(experiment_id=experiment_id(client, experiment, self.tracking_uri))
        self.run_id: str | None = None

    @contextlib.contextmanager
    def run(self, name: str, *, nested: bool = False, tags: dict | None = None,
            parent_run_id: str | None = None) -> Iterator["MlflowTracker"]:
        if parent_run_id:  # a child of a run started elsewhere (e.g. by the driver of a Ray job)
            tags = {**(tags or {}), "mlflow.parentRunId": parent_run_id}
        with self._mlflow.start_run(run_name=name, nested=nested, tags=tags) as active:
            previous, self.run_id = self.run_id, active.info.run_id
            try:
                yield self
            finally:
                self.run_id = previous

    def log_params(self, params: dict) -> None:
        flat = {k: str(v)[:6000] for k, v in _flatten(params).items()}
        items = list(flat.items())
        for i in range(0, len(items), 100):  # MLflow caps a batch at 100 params
            self._mlflow.log_params(dict(items[i : i + 100]))

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        clean = {k.replace("+", "_plus_").replace("@", "_at_"): float(v) for k, v in metrics.items() if v is not None}
        self._mlflow.log_metrics(clean, step=step)

    def log_dict(self, obj: Any, name: str) -> None:
        self._mlflow.log_text(json.dumps(obj, indent=2, default=str), name)

    def log_text(self, text: str, name: str) -> None:
        self._mlflow.log_text(text, name)

    def log_figure(self, figure, name: str) -> None:
        """Log `figure` as a PNG, then close it (`plots.close`)."""
        try:
            self._mlflow.log_figure(figure, name)
        finally:
            plots.close(figure)

    def log_artifact(self, path: str, artifact_path: str | None = None) -> None:
        self._mlflow.log_artifact(path, artifact_path)

    def set_tags(self, tags: dict) -> None:
        self._mlflow.set_tags(tags)


def make_tracker(*, enabled: bool = True, tracking_uri: str | None = None, experiment: str = "trsp_ray"):
    """An MlflowTracker, or a NullTracker when disabled (tests, non-zero ranks)."""
    if not enabled:
        return NullTracker()
    return MlflowTracker(tracking_uri=tracking_uri, experiment=experiment)

