"""The driver of a distributed run: check everything, then hand the workers to Ray Train.

    result = run_distributed(cfg)          # cfg.distributed.workers >= 1

Every check that can fail does so here, as a one-line TrspError, before any worker starts: the
DeepSpeed config (parsed by DeepSpeed), the worker count against the cluster's resources, the
storage (reachable and writable, any filesystem Ray Train supports), the model (local, cached or on
the hub), the export target, the memory plan and the checkpoints' disk budget. Progress comes back
through the run's records on that storage (storage.RunRecords), so nothing assumes a shared disk.
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

from trsp_ray.common.errors import TrspError
from trsp_ray.common.filesystems import filesystem, is_remote
from trsp_ray.common.logs import warn
from trsp_ray.distributed import ray_session
from trsp_ray.distributed.storage import RunRecords, check_storage, location

__all__ = ["DistributedResult", "check_plan", "check_resources", "check_storage", "prepare_run", "run_distributed"]


@dataclass
class DistributedResult:
    drop_order: list[int]
    output: str | None
    storage: str  # the run's folder under storage_path (checkpoints + records/)
    events: list[dict] = field(default_factory=list)
    mlflow_run: str | None = None  # the driver's MLflow run id (None when tracking is off)

    def rounds_computed(self) -> int:
        """Stage-1 rounds finished over all attempts (== rounds when nothing was recomputed)."""
        return sum(e["event"] == "round" for e in self.events)

    def attempts(self) -> int:
        return sum(e["event"] == "start" for e in self.events)


def worker_cpus(dist, nodes: list[dict]) -> int:
    """CPUs (and torch threads) per worker: `cpus_per_worker`, else 1, else under offload the CPUs of
    the tightest node divided among the workers it hosts (its GPUs, or on CPU an even share):
    DeepSpeed's CPU Adam steps each rank's whole partition every step, 1 thread would stall it."""
    if dist.cpus_per_worker:
        return dist.cpus_per_worker
    if not (dist.offload_optimizer or dist.offload_params):
        return 1
    alive = [n.get("Resources", {}) for n in nodes if n.get("Alive", True)]
    if dist.use_gpu:
        shares = [int(r.get("CPU", 0)) // int(r["GPU"]) for r in alive if r.get("GPU")]
    else:
        hosts = [r for r in alive if r.get("CPU")]
        per_node = math.ceil(dist.workers / max(1, len(hosts)))
        shares = [int(r["CPU"]) // per_node for r in hosts]
    return max(1, min(shares, default=1))


def check_resources(dist, resources: dict, cpus: int | None = None) -> None:
    """The cluster must hold workers x (cpus CPUs [+ 1 GPU]) at once (cpus: worker_cpus)."""
    cpus = cpus or dist.cpus_per_worker or 1
    need_cpu = dist.workers * cpus
    have_cpu = int(resources.get("CPU", 0))
    if need_cpu > have_cpu:
        fit = max(0, have_cpu // cpus)
        raise TrspError(f"distributed.workers={dist.workers} x cpus_per_worker={cpus} needs "
                        f"{need_cpu} CPUs but the Ray cluster has {have_cpu}; use workers <= {fit} or add nodes")
    if dist.use_gpu and dist.workers > int(resources.get("GPU", 0)):
        raise TrspError(f"distributed.workers={dist.workers} with use_gpu=true needs {dist.workers} GPUs but the "
                        f"Ray cluster has {int(resources.get('GPU', 0))}; use fewer workers or add GPU nodes")


def check_plan(cfg, model_path: str, ds_config: dict | None = None, *, pipe=None) -> None:
    """Refuse a plan whose GPU memory (GPU runs: the stages, then stage 1's removal probes) or
    checkpoints (`disk_budget_gb`, any run) do not fit, naming what would (see zero3_plan.py).
    `pipe`: the run's resolved pipeline (prepare_run's); by default the one `cfg` names (pipeline.named)."""
    from trsp_ray.plan.route import worker_extras_problem
    from trsp_ray.plan.zero3_plan import plan_for_run
    from trsp_ray.run.pipeline import named

    spec = (pipe or named(cfg)).spec
    plan = plan_for_run(cfg, model_path, ds_config, spec=spec)
    disk = plan.disk_problem()
    if disk:
        raise TrspError(disk)
    if cfg.distributed.use_gpu and not plan.fits:
        raise TrspError(f"the plan does not fit: {plan.reason()}; {plan.suggestion()}")
    problem = cfg.distributed.use_gpu and worker_extras_problem(cfg, plan, spec=spec)
    if problem:
        raise TrspError(f"the plan does not fit: {problem}")


def check_worker_settings(cfg, *, drop_given: bool = False, pipe=None) -> None:
    """Settings one process honours that the workers would not: refused in one line. `pipe`: the
    run's resolved pipeline (run_distributed's); by default the one `cfg` names (pipeline.named)."""
    from trsp_ray.config import registry
    from trsp_ray.distributed.compensate import check_for_workers
    from trsp_ray.distributed.deepspeed_config import check_worker_dtype
    from trsp_ray.plan.compute import heal_teacher
    from trsp_ray.plan.zero3_plan import method_on_workers
    from trsp_ray.run.pipeline import named

    if not method_on_workers(cfg.method, drop_given=drop_given):
        handed = (f" ({', '.join(registry.HANDED_OVER_METHODS)} with a drop set chosen in one process)"
                  if registry.HANDED_OVER_METHODS else "")
        raise TrspError(f"method={cfg.method!r} is not run on Ray Train workers; use one of "
                        f"{', '.join(registry.WORKER_METHODS)}{handed}, a composed +heal pipeline after trsp, "
                        "shortgpt or tail, or distributed.workers=0")
    if drop_given and not (pipe or named(cfg)).spec.heal:
        raise TrspError(f"a drop set handed to the workers is healed there; method={cfg.method!r} does not heal, "
                        f"use a heal method ({', '.join(m.name for m in registry.METHODS.values() if m.heal)})")
    check_worker_dtype(cfg)
    check_for_workers(cfg)
    if cfg.recovery.objective == "kd" and not ((pipe or named(cfg)).spec.heal and heal_teacher(cfg) == "stored"):
        raise TrspError(f"recovery.objective=kd with method={cfg.method!r} and heal.compute_budget="
                        f"{cfg.heal.compute_budget:g} would run the dense teacher beside the student, which the "
                        "workers do not hold; distil in a heal method's heal on the heal stream (e.g. "
                        "shortgpt+heal with heal.compute_budget >= 200k or heal.seqlen), or use recovery.objective=ce")
    if cfg.heal.steps > 0:
        # a heal method already heals with stage 2's budget there; an extra heal is not built
        raise TrspError(f"heal.steps={cfg.heal.steps} is not run on Ray Train workers (heal.lr, heal.trainable "
                        f"with it); use heal.steps=0 (a heal method such as shortgpt+heal heals with stage2.steps "
                        f"at stage2.lr) or distributed.workers=0")


def check_handed_drop(drop, *, ratio: float, layers: int) -> None:
    """A drop set handed to the workers: distinct layer indices of the model, as many as `ratio` drops."""
    from trsp_ray.method.stage1 import n_drop_for

    want = n_drop_for(ratio, layers)
    if (len(drop) != want or len(set(drop)) != len(drop)
            or any(isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < layers for i in drop)):
        raise TrspError(f"drop={list(drop)!r} is not a drop set of this model; pass {want} distinct layer "
                        f"indices in 0..{layers - 1} (ratio={ratio:g} of {layers} layers)")


def prepare_run(cfg, *, ds_options: dict | None = None, overwrite: bool = False, resources: dict | None = None,
                cpus: int | None = None, drop_given: bool = False, pipe=None):
    """All checks, in the driver; returns (ds_config, storage, model_path). `pipe`: the run's resolved
    pipeline (run_distributed's); by default the one `cfg` names (pipeline.named)."""
    from trsp_ray.data import assets
    from trsp_ray.distributed.deepspeed_config import build_ds_config, validate_ds_config
    from trsp_ray.run.export import check_output_dir
    from trsp_ray.run.pipeline import named

    dist = cfg.distributed
    if dist.workers < 1:
        raise TrspError("distributed.workers=0 means a single-process run; use workers >= 1 for Ray Train")
    pipe = pipe or named(cfg)
    check_worker_settings(cfg, drop_given=drop_given, pipe=pipe)
    ds_config = build_ds_config(dist, batch_size=cfg.data.batch_size, lr=cfg.stage1.lr, extra=ds_options)
    validate_ds_config(ds_config)
    for name, steps in (("stage1.first_round_steps", cfg.stage1.first_round_steps),
                        ("stage1.steps_per_round", cfg.stage1.steps_per_round),
                        ("distributed.checkpoint_every", dist.checkpoint_every)):
        if steps % dist.grad_accum:  # a round or checkpoint must end on an optimizer step
            raise TrspError(f"{name}={steps} is not a multiple of distributed.grad_accum={dist.grad_accum}")
    from trsp_ray.config.run_config import heal_recipe
    from trsp_ray.plan.zero3_plan import trains_on_workers

    heals = pipe.spec.heal  # a heal method's heal trains its recipe, stage 2 stage2.trainable
    trainable = heal_recipe(cfg, heal_method=True)[0] if heals else cfg.stage2.trainable
    if trainable == "lora" and dist.strategy == "zero3" and trains_on_workers(pipe.spec):
        raise TrspError("stage2.trainable=lora is not supported under distributed.strategy=zero3 yet "
                        "(peft merges into partitioned weights); use trainable=all|tail|map, or all with "
                        "offload_optimizer=true")
    storage = check_storage(dist.storage_path or str(Path.cwd() / "runs" / "ray"))
    if cfg.output:
        check_output_dir(cfg.output, overwrite=overwrite)
    model_path = assets.resolve_model(cfg.model)
    if resources is not None:
        check_resources(dist, resources, cpus)
    check_plan(cfg, model_path, ds_config, pipe=pipe)
    return ds_config, storage, model_path


def run_distributed(cfg, *, ds_options: dict | None = None, fault: dict | list | None = None,
                    overwrite: bool = False, name: str | None = None, stage1: dict | None = None,
                    drop: list[int] | None = None) -> DistributedResult:
    """Stage 1 + stage 2 + export of `cfg` on `cfg.distributed.workers` Ray Train workers.

    `stage1` (a plain stage-1 result, stage1_store.result_dict): the workers take its drop set for
    `cfg.method` instead of learning stage 1 themselves (a shared, content-keyed stage 1).
    `drop` (a heal method): the drop set, chosen in one process (e.g. SLEB's); the workers heal it.

    `fault` (tests): one spec or a list, see events.FaultInjector; e.g. {"round": 2} kills worker
    1 once, one step into stage-1 round 2 (needs max_failures >= 1 to recover). Connects to the
    running Ray cluster (RAY_ADDRESS) or starts one.
    """
    import ray

    from trsp_ray.run.pipeline import resolve

    # the pipeline on this model (idempotent for a config driver.run resolved): a compensating method
    # (the default) fits its compensation on the workers
    pipe = resolve(cfg, budget_layers=False)
    cfg = pipe.cfg
    # Everything but the cluster's resources is checked before Ray is even started or joined.
    if drop is not None and stage1 is not None:
        raise TrspError("run_distributed takes a stage-1 result or a drop set, not both")
    ds_config, storage, model_path = prepare_run(cfg, ds_options=ds_options, overwrite=overwrite,
                                                 drop_given=drop is not None, pipe=pipe)
    if drop is not None:
        from trsp_ray.plan.shape import read_shape

        check_handed_drop(drop, ratio=cfg.ratio, layers=read_shape(model_path).layers)
    ray_session.connect(include_dashboard=None)  # Ray's default: a long training run is worth watching
    cpus = worker_cpus(cfg.distributed, ray.nodes())
    check_resources(cfg.distributed, ray.cluster_resources(), cpus)
    name = name or f"trsp-{time.strftime('%Y%m%d-%H%M%S')}"
    records = RunRecords(storage, name)
    specs = [fault] if isinstance(fault, dict) else list(fault or [])
    specs = [{**spec, "marker": spec.get("marker", f"fault-{i}")} for i, spec in enumerate(specs)]
    loop_config = {"run": cfg.to_dict(), "ds_config": ds_config, "model_path": model_path,
                   "records": {"storage": storage, "run": name}, "fault": specs, "cpus_per_worker": cpus,
                   "stage1": stage1, "drop": None if drop is None else [int(i) for i in drop],
                   "teacher": teacher_settings(cfg, pipe),
                   "manifest": {"method": cfg.method, "config": cfg.to_dict(), "workers": cfg.distributed.workers,
                                "metrics": {"pipeline": pipe.to_dict()}}}
    _fit(cfg, loop_config, storage=storage, name=name, cpus=cpus)
    events = records.read()
    done = [e for e in events if e["event"] == "done"]
    if not done:
        raise RuntimeError(f"the run ended without a 'done' record; see {location(storage, name)}/records")
    result = DistributedResult(drop_order=done[-1]["drop_order"], output=cfg.output, storage=location(storage, name),
                               events=events)
    if cfg.tracking.enabled:
        result.mlflow_run = log_run(cfg, result, name=name, local_storage=None if is_remote(storage) else storage)
    return result


def teacher_settings(cfg, pipe) -> dict | None:
    """The teacher store a distilling heal's workers fill and read (recovery.teacher_on_workers): its
    root (teacher_store.store_root, absolute: a worker's working directory is not the driver's) and
    the model's fingerprint, computed here where the model resolves; None without a stored teacher."""
    from trsp_ray.plan.compute import heal_teacher
    from trsp_ray.run.content import model_fingerprint
    from trsp_ray.run.teacher_store import store_root

    if not (pipe.spec.heal and heal_teacher(cfg) == "stored"):
        return None
    return {"root": store_root(cfg.checkpoint_dir), "model": model_fingerprint(cfg.model)}


def tracking_uri_for(cfg, local_storage: str | None) -> str | None:
    """`tracking.tracking_uri`, else the shared store named by TRSP_RAY_MLFLOW_DIR (set by
    cluster/runtime_env.yaml), else `<storage_path>/mlflow.db` for a local storage path, else None."""
    from trsp_ray.run.tracking import default_tracking_uri

    if cfg.tracking.tracking_uri:
        return cfg.tracking.tracking_uri
    if os.environ.get("TRSP_RAY_MLFLOW_DIR"):
        return default_tracking_uri()
    return f"sqlite:///{Path(local_storage) / 'mlflow.db'}" if local_storage else None


def log_run(cfg, result: DistributedResult, *, name: str, local_storage: str | None) -> str | None:
    """One MLflow run for a distributed run, written by the driver from the run's own event log
    (workers never write MLflow: one writer per store), in the store of `tracking_uri_for`."""
    from trsp_ray.common import plots
    from trsp_ray.run.tracking import MlflowTracker

    uri = tracking_uri_for(cfg, local_storage)
    if uri is None:
        warn("MLflow skipped: storage_path is remote and tracking.tracking_uri is not set")
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
        tracker.log_dict({"records": ev}, "records.json")
        if result.output and Path(result.output, "trsp_ray.json").exists():
            tracker.log_artifact(str(Path(result.output, "trsp_ray.json")))
        return tracker.run_id


def _fit(cfg, loop_config: dict, *, storage: str, name: str, cpus: int) -> None:
    from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    from trsp_ray.distributed.worker import train_loop

    dist = cfg.distributed
    fs, path = filesystem(storage)  # the same filesystem the records use (endpoint options included)
    trainer = TorchTrainer(
        train_loop,
        train_loop_config=loop_config,
        scaling_config=ScalingConfig(num_workers=dist.workers, use_gpu=dist.use_gpu,
                                     resources_per_worker={"CPU": cpus}),
        torch_config=TorchConfig(backend="nccl" if dist.use_gpu else "gloo"),
        run_config=RunConfig(name=name, storage_path=path, storage_filesystem=fs,
                             failure_config=FailureConfig(max_failures=dist.max_failures),
                             checkpoint_config=CheckpointConfig(num_to_keep=dist.keep_checkpoints)),
    )
    trainer.fit()
