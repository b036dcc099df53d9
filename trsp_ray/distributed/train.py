"""The driver of a distributed run: check everything, then hand the workers to Ray Train.

    result = run_distributed(cfg)          # cfg.distributed.workers >= 1

Every check that can fail does so here, as a one-line TrspError, before any worker starts: the
DeepSpeed config (parsed by DeepSpeed), the worker count against the cluster's resources, the
storage path, the export target and the memory plan.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

from trsp_ray.errors import TrspError


@dataclass
class DistributedResult:
    drop_order: list[int]
    output: str | None
    storage: str  # the run's folder under storage_path (checkpoints + trsp_events.jsonl)
    events: list[dict] = field(default_factory=list)
    mlflow_run: str | None = None  # the driver's MLflow run id (None when tracking is off)

    def rounds_computed(self) -> int:
        """Stage-1 rounds finished over all attempts (== rounds when nothing was recomputed)."""
        return sum(e["event"] == "round" for e in self.events)

    def attempts(self) -> int:
        return sum(e["event"] == "start" for e in self.events)


def check_storage(storage_path: str) -> str:
    """A local path must be creatable and writable; a URI's filesystem must answer."""
    if "://" in storage_path and not storage_path.startswith("file://"):
        try:
            import pyarrow.fs

            fs, path = pyarrow.fs.FileSystem.from_uri(storage_path)
            fs.get_file_info(path)
        except Exception as exc:
            raise TrspError(f"distributed.storage_path={storage_path!r} is not reachable "
                            f"({' '.join(str(exc).split())[:160]}); pass a reachable URI or a shared local path") from None
        return storage_path
    path = Path(storage_path.removeprefix("file://")).expanduser().resolve()
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / f".trsp-write-test-{os.getpid()}"
        probe.write_text("ok")
        probe.unlink()
    except OSError as exc:
        raise TrspError(f"distributed.storage_path={storage_path!r} is not writable ({exc.strerror}); "
                        f"pass a directory you can write to") from None
    return str(path)


def check_resources(dist, resources: dict) -> None:
    """The cluster must hold workers x (cpus_per_worker CPUs [+ 1 GPU]) at once."""
    need_cpu = dist.workers * dist.cpus_per_worker
    have_cpu = int(resources.get("CPU", 0))
    if need_cpu > have_cpu:
        fit = max(0, have_cpu // dist.cpus_per_worker)
        raise TrspError(f"distributed.workers={dist.workers} x cpus_per_worker={dist.cpus_per_worker} needs "
                        f"{need_cpu} CPUs but the Ray cluster has {have_cpu}; use workers <= {fit} or add nodes")
    if dist.use_gpu and dist.workers > int(resources.get("GPU", 0)):
        raise TrspError(f"distributed.workers={dist.workers} with use_gpu=true needs {dist.workers} GPUs but the "
                        f"Ray cluster has {int(resources.get('GPU', 0))}; use fewer workers or add GPU nodes")


def check_plan(cfg, model_path: str, ds_config: dict | None = None) -> None:
    """Refuse a GPU plan that does not fit, naming what would (see planner.py)."""
    from trsp_ray.distributed import planner

    if not cfg.distributed.use_gpu:
        return
    plan = planner.plan_for_run(cfg, model_path, ds_config)
    if not plan.fits:
        raise TrspError(f"the plan does not fit: {plan.reason()}; {plan.suggestion()}")


def prepare_run(cfg, *, ds_options: dict | None = None, overwrite: bool = False, resources: dict | None = None):
    """All checks, in the driver; returns (ds_config, storage, model_path)."""
    from trsp_ray import assets
    from trsp_ray.distributed.deepspeed_config import build_ds_config, validate_ds_config
    from trsp_ray.export import check_output_dir

    dist = cfg.distributed
    if dist.workers < 1:
        raise TrspError("distributed.workers=0 means a single-process run; use workers >= 1 for Ray Train")
    ds_config = build_ds_config(dist, batch_size=cfg.data.batch_size, lr=cfg.stage1.lr, extra=ds_options)
    validate_ds_config(ds_config)
    for name, steps in (("stage1.first_round_steps", cfg.stage1.first_round_steps),
                        ("stage1.steps_per_round", cfg.stage1.steps_per_round),
                        ("distributed.checkpoint_every", dist.checkpoint_every)):
        if steps % dist.grad_accum:  # a round or checkpoint must end on an optimizer step
            raise TrspError(f"{name}={steps} is not a multiple of distributed.grad_accum={dist.grad_accum}")
    if cfg.stage2.trainable == "lora" and dist.strategy == "zero3" and cfg.method in ("trsp", "trsp-oneshot"):
        raise TrspError("stage2.trainable=lora is not supported under distributed.strategy=zero3 yet "
                        "(peft merges into partitioned weights); use trainable=all with offload_optimizer=true")
    storage = check_storage(dist.storage_path or str(Path.cwd() / "runs" / "ray"))
    if cfg.output:
        check_output_dir(cfg.output, overwrite=overwrite)
    model_path = assets.resolve_model(cfg.model)
    if resources is not None:
        check_resources(dist, resources)
    check_plan(cfg, model_path, ds_config)
    return ds_config, storage, model_path


def run_distributed(cfg, *, ds_options: dict | None = None, fault: dict | None = None, overwrite: bool = False,
                    name: str | None = None) -> DistributedResult:
    """Stage 1 + stage 2 + export of `cfg` on `cfg.distributed.workers` Ray Train workers.

    `fault` = {"round": r, "rank": k, "after_steps": n} kills worker k once, n steps into stage-1
    round r (needs max_failures >= 1 to recover). Connects to the running Ray cluster or starts one.
    """
    import ray

    if not ray.is_initialized():
        ray.init(address=os.environ.get("RAY_ADDRESS"), log_to_driver=True)
    ds_config, storage, model_path = prepare_run(cfg, ds_options=ds_options, overwrite=overwrite,
                                                 resources=ray.cluster_resources())
    name = name or f"trsp-{time.strftime('%Y%m%d-%H%M%S')}"
    local = "://" not in storage
    run_dir = Path(storage) / name
    events = str(run_dir / "trsp_events.jsonl") if local else None
    if fault is not None:
        if not local:
            raise TrspError("fault injection needs a local storage_path (its once-only marker lives there)")
        run_dir.mkdir(parents=True, exist_ok=True)
        fault = {"rank": 1, "after_steps": 1, **fault, "marker": str(run_dir / "fault-injected")}
    loop_config = {"run": cfg.to_dict(), "ds_config": ds_config, "model_path": model_path, "events": events,
                   "fault": fault, "manifest": {"method": cfg.method, "config": cfg.to_dict(),
                                                "workers": cfg.distributed.workers}}
    _fit(cfg, loop_config, storage=storage, name=name)
    records = _read_events(events)
    done = [e for e in records if e["event"] == "done"]
    if not done:
        raise RuntimeError(f"the run ended without a 'done' event; see {events or storage}")
    result = DistributedResult(drop_order=done[-1]["drop_order"], output=cfg.output, storage=str(run_dir),
                               events=records)
    if cfg.tracking.enabled:
        result.mlflow_run = log_run(cfg, result, name=name, local_storage=storage if local else None)
    return result


def tracking_uri_for(cfg, local_storage: str | None) -> str | None:
    """`tracking.tracking_uri`, else the shared store named by TRSP_RAY_MLFLOW_DIR (set by
    cluster/runtime_env.yaml), else `<storage_path>/mlflow.db` for a local storage path, else None."""
    from trsp_ray.tracking import default_tracking_uri

    if cfg.tracking.tracking_uri:
        return cfg.tracking.tracking_uri
    if os.environ.get("TRSP_RAY_MLFLOW_DIR"):
        return default_tracking_uri()
    return f"sqlite:///{Path(local_storage) / 'mlflow.db'}" if local_storage else None


def log_run(cfg, result: DistributedResult, *, name: str, local_storage: str | None) -> str | None:
    """One MLflow run for a distributed run, written by the driver from the run's own event log
    (workers never write MLflow: one writer per store), in the store of `tracking_uri_for`."""
    from trsp_ray import plots
    from trsp_ray.tracking import MlflowTracker

    uri = tracking_uri_for(cfg, local_storage)
    if uri is None:
        print("[trsp_ray] MLflow skipped: storage_path is remote and tracking.tracking_uri is not set", flush=True)
        return None
    tracker = MlflowTracker(tracking_uri=uri, experiment=cfg.tracking.experiment)
    ev = result.events
    stage1 = next((e for e in reversed(ev) if e["event"] == "stage1_done"), None)
    stage2 = next((e for e in reversed(ev) if e["event"] == "stage2_done"), None)
    rounds = sorted({e["round"]: (e["step"], e["dropped"]) for e in ev if e["event"] == "round"}.items())
    with tracker.run(name, tags={"trsp.kind": "distributed", "trsp.method": cfg.method,
                                 "trsp.workers": str(cfg.distributed.workers),
                                 "trsp.strategy": cfg.distributed.strategy}):
        tracker.log_params(cfg.to_dict())
        tracker.log_metrics({"attempts": result.attempts(), "rounds_computed": result.rounds_computed(),
                             "layers_dropped": len(result.drop_order),
                             "stage1/peak_gb": stage1 and stage1.get("peak_gb"),
                             "stage2/peak_gb": stage2 and stage2.get("peak_gb")})
        for _, (step, dropped) in rounds:
            tracker.log_metrics({"stage1/dropped": dropped}, step=step)
        if stage1 and stage1.get("gate_history"):
            history = stage1["gate_history"]
            for step, values in enumerate(history, start=1):
                tracker.log_metrics({f"gate/{i:02d}": v for i, v in enumerate(values)}, step=step)
            tracker.log_figure(plots.gate_trajectories(history, [s for _, (s, _) in rounds], result.drop_order),
                               "gate_trajectories.png")
        tracker.log_dict({"drop_order": result.drop_order, "output": result.output, "storage": result.storage},
                         "result.json")
        if local_storage and Path(result.storage, "trsp_events.jsonl").exists():
            tracker.log_artifact(str(Path(result.storage, "trsp_events.jsonl")))
        if result.output and Path(result.output, "trsp_ray.json").exists():
            tracker.log_artifact(str(Path(result.output, "trsp_ray.json")))
        return tracker.run_id


def _fit(cfg, loop_config: dict, *, storage: str, name: str) -> None:
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    from trsp_ray.distributed.worker import train_loop

    dist = cfg.distributed
    trainer = TorchTrainer(
        train_loop,
        train_loop_config=loop_config,
        scaling_config=ScalingConfig(num_workers=dist.workers, use_gpu=dist.use_gpu,
                                     resources_per_worker={"CPU": dist.cpus_per_worker}),
        torch_config=TorchConfig(backend="nccl" if dist.use_gpu else "gloo"),
        run_config=RunConfig(name=name, storage_path=storage, failure_config=FailureConfig(max_failures=dist.max_failures)),
    )
    trainer.fit()


def _read_events(path: str | None) -> list[dict]:
    if not path or not Path(path).exists():
        return []
    return [json.loads(line) for line in Path(path).read_text(encoding="utf-8").splitlines() if line.strip()]
