"""`run_search`: a Ray Tune search over pipelines (`method`), the ratio and any stage setting, at an
optional total compute budget, top to bottom: validate the space (keys that act in only some
pipelines, budgets a selection alone exceeds: search/pipeline.py) -> plan stage-1 reuse -> skip
finished trials -> Tune (grid / random / Optuna, ASHA on the calibration held-out loss reported
during stage 2 or the heal) -> score the new exports on the evaluation pool (reported only) -> MLflow
lineage, the Pareto figure and the best model in the registry.

Resumable: each finished trial leaves `<search_dir>/trials/<trial key>.json`, where the key is a
hash of the trial's whole config; running the same search again only runs the missing trials.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

from trsp_ray.common.errors import TrspError
from trsp_ray.common.logs import log as progress_log
from trsp_ray.config.run_config import RunConfig, from_dict
from trsp_ray.distributed import ray_session
from trsp_ray.search.cache import RunLog
from trsp_ray.search.layout import RANKING, TRIALS, trial_record_path
from trsp_ray.search.space import SearchSpace, apply_point, check_points, grid_points, sample_points, trial_key

# the data keys that change a trial's calibration stream (search/objective.py keeps the validation text out of it)
CALIBRATION_KEYS = ("data.calib_text", "data.calib_mix", "data.seqlen")


@dataclass(frozen=True)
class SearchOptions:
    """How the search runs (what it searches is the SearchSpace; what it prunes is the RunConfig)."""

    search_dir: str
    name: str = "search"
    reuse: bool = True  # share stage 1 between trials with the same stage-1 settings
    asha: bool = True
    val_every: int | None = None  # stage-2 steps between validation reports (None: about 4 per trial)
    val_windows: int = 8  # validation windows per report
    cpus_per_trial: float = 1.0
    gpus_per_trial: float | None = None  # None: from the memory planner on a GPU run (see route.py), else 0
    trial_workers: int | None = None  # force stage 2 onto this many Ray Train workers per trial
    max_concurrent: int | None = None  # None: what the cluster's CPUs and GPUs hold at once
    eval_actors: int = 1
    eval_gpus_per_actor: float | None = None  # None: what a pruned model's inference needs on a GPU run
    eval_tasks: tuple[str, ...] = ()  # zero-shot tasks for every trial's model (PPL is always scored)
    eval_limit: int | None = None
    register_name: str | None = "trsp-search-best"
    address: str | None = None
    extra: dict = field(default_factory=dict)


def _probe(base: dict, space: SearchSpace, points: list[dict] | None) -> dict:
    return points[0] if points else {d.key: d.bounds()[0] for d in space.dims}


class Plan(NamedTuple):
    """What a search will run, checked before any trial (search/pipeline.py has the rule for keys
    that act only in some pipelines)."""

    points: list[dict] | None  # None: Optuna proposes them
    num_layers: int
    n_drop: dict  # {stage-1 key: largest n_drop among the TRSP trials that share it}
    ignored: list  # per point: {key: value} dropped from it (the key does not act in its pipeline)
    merged: list  # [(point, the point it runs as)]: points that ran the same pipeline as an earlier one
    refused: list  # [(point, why)]: grid points their pipeline refuses (config.for_method), left out
    max_steps: int  # the most steps any trial trains (a budgeted heal: what its budget buys at most)


def plan_trials(base: RunConfig, space: SearchSpace) -> Plan:
    """The checked plan of a search. Raises a one-line TrspError before any trial: a bad point, a key
    that acts in none of the searched pipelines, a budget a point's selection and fit alone exceed."""
    from trsp_ray.method.stage1 import n_drop_for
    from trsp_ray.run.pipeline import named
    from trsp_ray.run.workbench import check_inputs
    from trsp_ray.search import pipeline

    if space.algorithm == "optuna":
        _optuna_search_class()  # a missing optuna fails here, before Ray starts
    points = grid_points(space) if space.algorithm == "grid" else (
        sample_points(space) if space.algorithm == "random" else None)
    base_dict = _absolute_paths(base.to_dict())
    num_layers = check_inputs(from_dict(apply_point(base_dict, _probe(base_dict, space, points))))
    check_points(base, space, points, num_layers=num_layers)
    ignored, merged, refused = [], [], []
    if points is None:
        pipeline.check_conditional(base_dict, space, num_layers=num_layers)
        probes = [{d.key: d.bounds()[i] for d in space.dims} for i in (0, 1)]
    else:
        points, dropped, merged, refused = pipeline.reduce_points(base_dict, space, points, num_layers=num_layers)
        ignored = [dropped.get(i, {}) for i in range(len(points))]
        probes = points
    pipeline.check_trial_selectors(base_dict, probes)
    pipeline.check_budgets(base_dict, probes, num_layers=num_layers)
    pipeline.check_keys(base_dict, space, probes, num_layers=num_layers)
    if points is not None and space.seeds > 1:  # every point once per seed (search/objective.py averages them)
        seeds = [base.seed + i for i in range(space.seeds)]
        points = [{**p, "seed": s} for p in points for s in seeds]
        ignored = [i for i in ignored for _ in seeds]
    fp = pipeline.search_fingerprint(base_dict)
    n_drop: dict[str, int] = {}
    for point in points or [{d.key: d.bounds()[1] for d in space.dims}]:
        cfg = apply_point(base_dict, point)
        if named(from_dict(cfg)).spec.uses_stage1:  # the point's pipeline (check_points validated it)
            n = n_drop_for(cfg["ratio"], num_layers)
            key = pipeline.trial_stage1_key(cfg, fp, n_drop=n)
            n_drop[key] = max(n_drop.get(key, 0), n)
    steps = pipeline.max_heal_steps(base_dict, probes, num_layers=num_layers)
    return Plan(points, num_layers, n_drop, ignored, merged, refused, steps)


def _absolute_paths(cfg: dict) -> dict:
    """Tune runs trials in their own working directory: every path must be absolute."""
    from trsp_ray.data import assets, domains

    cfg["model"] = str(Path(assets.resolve_model(cfg["model"])).resolve()) if Path(cfg["model"]).exists() \
        else cfg["model"]
    for k in ("calib_text", "eval_text"):
        if cfg["data"][k]:
            cfg["data"][k] = str(Path(cfg["data"][k]).expanduser().resolve())
    if not cfg["data"]["calib_text"]:
        cfg["data"]["calib_mix"] = domains.absolute_mix(cfg["data"]["calib_mix"])
    return cfg


def finished_records(search_dir: str | Path) -> dict[str, dict]:
    out = {}
    for f in sorted((Path(search_dir) / TRIALS).glob("*.json")):
        record = json.loads(f.read_text())
        out[record["trial_key"]] = record
    return out


def _optuna_search_class():
    try:
        import optuna  # noqa: F401
    except ImportError:
        raise TrspError("algorithm=optuna needs optuna; install it with `pip install optuna==5.0.0` "
                        "(or `pip install trsp_ray[search]`)") from None
    from ray.tune.search.optuna import OptunaSearch

    return OptunaSearch


def _tune_space(space: SearchSpace) -> dict:
    from ray import tune

    out = {}
    for d in space.dims:
        if d.kind == "choice":
            out[d.key] = tune.choice(list(d.values))
        elif d.kind == "int":
            out[d.key] = tune.randint(int(d.low), int(d.high) + 1)
        else:
            out[d.key] = (tune.loguniform if d.kind == "loguniform" else tune.uniform)(d.low, d.high)
    return out


def _searcher(space: SearchSpace, done: dict[str, dict], remaining: list[dict] | None):
    """(param_space["point"], search_alg, num_samples) for the trials still to run."""
    from ray import tune

    if remaining is not None:  # grid and seeded random: the points are known, Tune runs the list
        return tune.grid_search(remaining), None, 1
    metrics = list(space.objectives)
    modes = ["min"] * len(metrics)
    finished = [r for r in done.values() if r["status"] == "finished"]
    known = {"points_to_evaluate": [r["point"] for r in finished],
             "evaluated_rewards": [[r[m] for m in metrics] if len(metrics) > 1 else r[metrics[0]] for r in finished]}
    search = _optuna_search_class()(metric=metrics if len(metrics) > 1 else metrics[0],
                                    mode=modes if len(modes) > 1 else modes[0], seed=space.seed,
                                    **(known if finished else {}))
    # the warm-start points are told to Optuna, not rerun
    return _tune_space(space), search, max(0, space.num_samples - len(done))


def _concurrency(opts: SearchOptions, trials: int, route, cluster: dict, *, cpus_per_worker: int) -> int:
    """Trials at once: what the cluster's CPUs hold, and its GPUs (a Ray Train trial occupies its
    workers' GPUs and CPUs besides its own CPU)."""
    cpus = cluster.get("CPU", 1.0)
    per_trial_cpus = opts.cpus_per_trial + route.workers * cpus_per_worker
    if per_trial_cpus > cpus:
        raise TrspError(f"a trial needs {per_trial_cpus:g} CPUs ({opts.cpus_per_trial:g} + {cpus_per_worker} per Ray "
                        f"Train worker), the cluster has {cpus:g}; lower --cpus-per-trial or add nodes")
    limit = max(1, int(cpus // per_trial_cpus))
    if route.gpus_per_trial():
        limit = min(limit, max(1, int(cluster.get("GPU", 0.0) / route.gpus_per_trial() + 1e-9)))
    return max(1, min(opts.max_concurrent or limit, limit, trials))


def _route(base: RunConfig, opts: SearchOptions, cluster: dict):
    from trsp_ray.data import assets
    from trsp_ray.search.route import trial_route

    return trial_route(base, model_path=assets.resolve_model(base.model), cluster=cluster,
                       gpus_per_trial=opts.gpus_per_trial, workers=opts.trial_workers,
                       eval_gpus=opts.eval_gpus_per_actor)


def _run_tune(base_dict, space, opts, *, point_space, search_alg, num_samples, trials, trial_config, num_layers,
              max_steps, route, cluster):
    from ray import tune

    from trsp_ray.search.scheduler import GroupedASHA
    from trsp_ray.search.trial import REPORTS, run_trial

    every = trial_config["val_every"]  # None: each trial reports REPORTS times over its own steps
    reports = (max(1, -(-max_steps // every)) if every else REPORTS) + 1
    # Early stopping compares only trials that drop the same number of layers (see scheduler.py).
    scheduler = GroupedASHA(num_layers=num_layers, base_ratio=base_dict["ratio"], metric="val_loss", mode="min",
                            max_t=reports, grace_period=max(1, reports // 3), reduction_factor=2) if opts.asha else None
    tuner = tune.Tuner(
        tune.with_resources(run_trial, route.resources(opts.cpus_per_trial)),
        param_space={**trial_config, "point": point_space},
        # reuse_actors: a trial's process keeps torch/transformers/DeepSpeed imported for the next
        # trial (a fresh process costs ~14 s of imports per trial on a 2-core machine).
        tune_config=tune.TuneConfig(num_samples=num_samples, search_alg=search_alg, scheduler=scheduler,
                                    max_concurrent_trials=_concurrency(
                                        opts, trials, route, cluster,
                                        cpus_per_worker=base_dict["distributed"]["cpus_per_worker"]),
                                    reuse_actors=True),
        run_config=tune.RunConfig(name=f"{opts.name}-{trial_config['invocation']}", verbose=0,
                                  storage_path=str(Path(opts.search_dir, "tune").resolve())),
    )
    return tuner.fit()


def _collect(results, search_dir: Path, base_dict: dict) -> list[dict]:
    """Records of the trials this invocation ran; early-stopped ones get a 'stopped' record."""
    from trsp_ray.common import atomic

    out = []
    for result in results:
        point = result.config["point"]
        key = trial_key(apply_point(base_dict, point))
        path = trial_record_path(search_dir, key)
        if path.is_file():
            out.append(json.loads(path.read_text()))
            continue
        metrics = result.metrics or {}
        status = "failed" if result.error else "stopped"
        config = apply_point(base_dict, point)
        # a stopped trial's PPL is at the step ASHA stopped it: the record says which, of how many
        record = {"trial_key": key, "point": point, "config": config, "method": config["method"], "status": status,
                  "val_loss": metrics.get("val_loss"), "val_ppl": metrics.get("val_ppl"),
                  "stopped_at_step": metrics.get("stage2_step"),
                  "error": str(result.error).splitlines()[0][:300] if result.error else None}
        if status == "stopped":  # ASHA's decision is final: a rerun does not revisit the trial
            atomic.write_json(path, record)
        out.append(record)
    return out


def _score(records: list[dict], base: RunConfig, opts: SearchOptions, log, route) -> None:
    """Held-out PPL (and optional zero-shot tasks) of every new export, on the evaluation pool
    (actors on GPUs, in bf16, when the search runs on GPUs)."""
    from trsp_ray.common import atomic
    from trsp_ray.evaluation.evaluator import EvalSettings
    from trsp_ray.evaluation.pool import ActorResources, evaluate_pool

    todo = [r for r in records if r["status"] == "finished" and r.get("evaluation") is None]
    if not todo:
        return
    d = base.data
    settings = EvalSettings(tasks=opts.eval_tasks, limit=opts.eval_limit, eval_text=d.eval_text,
                            ppl_seqlen=d.eval_seqlen, ppl_windows=d.eval_max_windows, speed=None,
                            dtype="bfloat16" if route.use_gpu else "float32")
    resources = ActorResources(num_cpus=1.0, num_gpus=route.eval_gpus, placement_group=route.eval_gpus > 1)
    results = evaluate_pool([r["model_dir"] for r in todo], settings=settings, actors=opts.eval_actors,
                            resources=resources, log=log)
    for record, result in zip(todo, results):
        record["evaluation"] = result
        record["heldout_ppl"] = result.get("ppl")
        atomic.write_json(trial_record_path(opts.search_dir, record["trial_key"]), record)


def best_trial(records: list[dict], rows: list[dict] | None = None) -> dict | None:
    """The first trial (lowest seed) of the ranking's best row (objective.ranking: the most layers
    dropped, a smaller ratio would otherwise always win; then the lowest validation NLL, averaged over
    seeds); held-out text plays no part in the choice."""
    from trsp_ray.search.objective import ranking

    rows = ranking(records) if rows is None else rows
    if not rows:
        return None
    return next(r for r in records if r["trial_key"] == rows[0]["trials"][0])


def _check_route_data(route, space: SearchSpace) -> None:
    """Ray Train workers read the trial's calibration stream whole: a trial whose stream could hold the
    search's validation text (search/objective.py) must run in one process."""
    calibration = [d.key for d in space.dims if d.key in CALIBRATION_KEYS]
    if route.workers and calibration:
        raise TrspError(f"search key(s) {', '.join(calibration)} change the calibration stream, and trials on Ray "
                        "Train workers cannot leave the search's validation text out of it; search them on one device "
                        "per trial (a smaller model or --gpus-per-trial) or drop them")


def run_search(base: RunConfig, space: SearchSpace, opts: SearchOptions, *, log=progress_log) -> dict:
    """Run (or resume) a search; returns a summary with the stage-1/stage-2 counts of this invocation."""
    import ray

    from trsp_ray.run.export import check_work_dir

    check_work_dir(opts.search_dir, flag="--search-dir")  # a file or a read-only folder: refused now
    plan = plan_trials(base, space)
    points, num_layers = plan.points, plan.num_layers
    base_dict = _absolute_paths(base.to_dict())
    search_dir = Path(opts.search_dir).resolve()
    done = finished_records(search_dir)
    remaining = None if points is None else [p for p in points if trial_key(apply_point(base_dict, p)) not in done]
    invocation = uuid.uuid4().hex[:12]
    runlog = RunLog(search_dir, invocation=invocation)
    runlog.write("search_started", name=opts.name, algorithm=space.algorithm, pending=None if remaining is None
                 else len(remaining), skipped=len(done))
    for point, same in plan.merged:
        runlog.write("point_merged", point=point, runs_as=same)
        log(f"search {opts.name}: point {point} runs the same pipeline as {same}; run once")
    for point, why in plan.refused:
        runlog.write("point_refused", point=point, reason=why)
        log(f"search {opts.name}: point {point} left out: {why}")
    from trsp_ray.search import pipeline

    fp = pipeline.search_fingerprint(base_dict)
    ignored = {trial_key(apply_point(base_dict, p)): drop for p, drop in zip(points or [], plan.ignored) if drop}
    trial_config = {"run": base_dict, "search_dir": str(search_dir), "search_fp": fp, "reuse": opts.reuse,
                    "plan_n_drop": plan.n_drop, "default_plan_n_drop": max(plan.n_drop.values(), default=0),
                    "val_every": opts.val_every, "val_windows": opts.val_windows, "num_layers": num_layers,
                    "ignored": ignored, "threads": max(1, int(opts.cpus_per_trial)), "invocation": invocation}
    point_space, search_alg, num_samples = _searcher(space, done, remaining)
    trials = len(remaining) if remaining is not None else num_samples
    started = bool(trials) and ray_session.connect(opts.address)
    try:
        new = []
        if trials:
            cluster = ray.cluster_resources()
            route = _route(base, opts, cluster)  # a bad device or a trial too large fails here
            _check_route_data(route, space)
            trial_config["route"] = route.to_dict()
            runlog.write("route", **route.to_dict())
            log(f"search {opts.name}: {trials} trial(s) to run, {len(done)} finished earlier are skipped; "
                f"per trial {route.resources(opts.cpus_per_trial)}"
                + (f" + {route.workers} Ray Train workers" if route.workers else ""))
            results = _run_tune(base_dict, space, opts, point_space=point_space, search_alg=search_alg,
                                num_samples=num_samples, trials=trials, trial_config=trial_config,
                                num_layers=num_layers, max_steps=plan.max_steps, route=route, cluster=cluster)
            new = _collect(results, search_dir, base_dict)
            _score(new, base, opts, log, route)
        else:
            log(f"search {opts.name}: all {len(done)} trial(s) finished earlier; nothing to run")
    finally:
        if started and ray.is_initialized():
            ray.shutdown()
    return _finish(base, space, opts, search_dir, runlog, new, invocation, log)


def _finish(base, space, opts, search_dir, runlog, new, invocation, log) -> dict:
    from trsp_ray.search import lineage

    records = list(finished_records(search_dir).values())
    new_keys = {r["trial_key"] for r in new}
    summary = {"invocation": invocation, "trials_run": len(new), "trials_total": len(records),
               "stage1_computed": runlog.count("stage1_computed", invocation=invocation),
               "stage1_reused": runlog.count("stage1_reused", invocation=invocation),
               "selection_computed": runlog.count("selection_computed", invocation=invocation),
               "selection_reused": runlog.count("selection_reused", invocation=invocation),
               "fit_computed": runlog.count("fit_computed", invocation=invocation),
               "fit_reused": runlog.count("fit_reused", invocation=invocation),
               "stage2_runs": runlog.count("stage2_run", invocation=invocation),
               "failed": sum(r["status"] == "failed" for r in new)}
    from trsp_ray.common import atomic
    from trsp_ray.search.objective import ranking, ranking_table

    rows = ranking(records)
    best = best_trial(records, rows)
    summary["best_trial"] = best["trial_key"] if best else None
    # rows of the best's drop count within 2 paired SE of it (seeds: every trial of the row)
    summary["tied_with_best"] = [k for r in rows if r["tie"] and not r["best"] and r["n_drop"] == rows[0]["n_drop"]
                                 for k in r["trials"]]
    atomic.write_json(Path(search_dir) / RANKING, rows)
    if rows:
        log(f"search {opts.name}: ranking (validation NLL vs the best, paired over the same windows; a tie is within "
            f"2 SE; {RANKING}):\n{ranking_table(rows)}")
    runlog.write("search_finished", **summary)
    if base.tracking.enabled:
        state = lineage.log_search(search_dir=search_dir, name=opts.name, tracking_uri=base.tracking.tracking_uri,
                                   experiment=base.tracking.experiment, space=_space_dict(space), records=records,
                                   new_keys=new_keys, best=best, register_name=opts.register_name, summary=summary)
        summary.update(parent_run=state["parent"], model_version=state.get("model_version"))
    log(f"search {opts.name}: {summary}")
    return summary


def _space_dict(space: SearchSpace) -> dict:
    return {"algorithm": space.algorithm, "num_samples": space.num_samples, "seed": space.seed,
            "objectives": list(space.objectives),
            "params": {d.key: list(d.values) if d.kind == "choice" else {d.kind: [d.low, d.high]} for d in space.dims}}
