"""The reproduction driver: plan -> (skip finished cells) -> stage 1 + single-device cells per model ->
Ray Train cells -> score -> tables.

    result = run_reproduce("local", out="runs/reproduce-local")
    print(dry_run("paper"))          # every cell's route and plan, nothing run

Every cell is routed by the memory planner before anything runs (one process on one device, or N
Ray Train workers), and every TRSP cell of a model prunes from the model's one shared stage-1 run
(work.py). With `use_ray` (default) each model's stage 1 and single-device cells are one Ray task
on `gpus_per_model` GPUs, its Ray Train cells follow from the driver, and the exported cells are
scored by the evaluation actor pool. Without Ray the same functions run in this process (tests,
debugging). Each finished cell is stored atomically, under the content key of what produced it, as
soon as it is scored; the run log records what each run skipped, found stale and computed.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from trsp_ray.common.errors import TrspError
from trsp_ray.common.logs import log
from trsp_ray.distributed import ray_session
from trsp_ray.reproduce.grid import Cell, CellStore, build_grid
from trsp_ray.reproduce.presets import Preset, get_preset, paper_numbers
from trsp_ray.reproduce.work import (
    cell_config,
    cell_key,
    cell_record,
    cell_route,
    hands_over,
    model_shape,
    prune_cells,
    prune_distributed,
    prune_key,
    stage1_route,
    uses_stage1,
)


def eval_settings(preset: Preset, dense_dir: str | None, overrides: dict | None = None):
    from trsp_ray.evaluation.evaluator import EvalSettings
    from trsp_ray.evaluation.speed import SpeedSettings

    e = {**preset.evaluation, **(overrides or {})}
    speed = None if e.get("speed") is None else SpeedSettings(**e["speed"])
    eval_text = preset.run.get("data", {}).get("eval_text")
    return EvalSettings(tasks=tuple(e.get("tasks", ())), limit=e.get("limit"), ppl_seqlen=e.get("ppl_seqlen", 256),
                        ppl_windows=e.get("ppl_windows"), dtype=e.get("dtype", "float32"), speed=speed,
                        eval_text=eval_text, dense=dense_dir if speed is not None else None)


@dataclass
class Stage1Plan:
    """One shared stage-1 run of a model: the config it runs, the layers it orders, its route."""

    model: str
    cfg: object  # RunConfig
    n_drop: int
    route: object  # distributed.route.Route
    cells: list  # the cell ids that prune from it
    key: str | None = None  # content key, set once the data files are fingerprinted


@dataclass
class CellPlan:
    cell: Cell
    cfg: object  # RunConfig
    route: object  # distributed.route.Route
    stage1: Stage1Plan | None
    prune_key: str | None = None
    key: str | None = None


def plan_grid(preset: Preset, cells: list[Cell], overrides: list[str]) -> dict[str, CellPlan]:
    """Every cell's config, route and shared stage 1, from config files alone (no weights, no
    writes); a bad override, a ratio that drops nothing or a cell that fits no route fails here."""
    from trsp_ray.common.digest import content_key
    from trsp_ray.method.stage1 import n_drop_for
    from trsp_ray.run.stage1_store import prefix_serves, stage1_content
    from trsp_ray.run.workbench import check_inputs

    plans: dict[str, CellPlan] = {}
    stage1: dict[tuple, Stage1Plan] = {}
    for model in dict.fromkeys(c.model for c in cells):
        spec = preset.model(model)
        shape = model_shape(spec)
        mine = [c for c in cells if c.model == model]
        widest = max((c.ratio for c in mine), default=0.0) or max(preset.ratios)
        for cell in mine:
            cfg = cell_config(preset, spec, overrides=overrides, method=cell.method, ratio=cell.ratio or widest)
            if spec.shape is None:
                check_inputs(cfg)  # local models: texts readable, the ratio drops and keeps layers
            group = None
            if uses_stage1(cfg, cell.method):
                n_drop = n_drop_for(cfg.ratio, shape.layers)
                content = stage1_content(cfg.to_dict())
                # swap refinement can reorder any position: then a smaller cell needs its own stage 1,
                # not a prefix of a larger cell's order (stage1_store.prefix_serves)
                token = (model, content_key(content)) + (() if prefix_serves(content) else (n_drop,))
                group = stage1.get(token)
                if group is None:
                    group = stage1[token] = Stage1Plan(model, cfg, 0, stage1_route(preset, spec, cfg, shape=shape), [])
                group.cells.append(cell.id)
                if n_drop > group.n_drop:
                    group.n_drop, group.cfg = n_drop, cfg
            plans[cell.id] = CellPlan(cell, cfg, cell_route(preset, spec, cfg, cell.method, shape=shape), group)
    return plans


def _attach_keys(plans: dict[str, CellPlan], eval_dict: dict) -> None:
    """Content keys of every cell and stage 1 (reads the model's and texts' files: after the checks)."""
    from trsp_ray.run.content import data_fingerprint, text_fingerprint
    from trsp_ray.run.stage1_store import stage1_key

    fps: dict[tuple, str] = {}
    for p in plans.values():
        d = p.cfg.data
        fp = fps.setdefault((p.cfg.model, d.calib_text, d.calib_mix),
                            data_fingerprint(model=p.cfg.model, calib_text=d.calib_text, calib_mix=d.calib_mix))
        calib = fps.setdefault(("calib", d.calib_text, d.calib_mix), text_fingerprint(d.calib_text, d.calib_mix))
        p.prune_key = prune_key(p.cfg, p.cell.method, calib_fp=calib)
        p.key = cell_key(p.prune_key, eval_dict)
        if p.stage1 is not None and p.stage1.key is None:
            p.stage1.key = stage1_key(p.stage1.cfg.to_dict(), fp)


def _plan_parts(plan) -> str:
    return ", ".join(f"{st.name} {st.total:.1f} GB" for st in plan.stages)


def format_dry_run(preset: Preset, plans: dict[str, CellPlan]) -> str:
    """Every cell with its route and plan, each model's shared stage 1, and what the cluster needs."""
    gpu = any(p.route.device == "gpu" for p in plans.values())
    workers = (f"at most {preset.max_workers} Ray Train workers per cell" if preset.max_workers
               else "no Ray Train workers")
    lines = [f"preset {preset.name}: {len(plans)} cells; {workers}"
             + (f", {preset.gpu_memory_gb:g} GB per GPU" if gpu else ", on CPU")]
    groups = list({id(p.stage1): p.stage1 for p in plans.values() if p.stage1 is not None}.values())
    for g in groups:
        lines.append(f"{g.model}: shared stage 1 for {len(g.cells)} cell(s), {g.n_drop} layers ordered: "
                     f"{g.route.describe()} [{_plan_parts(g.route.plan)}]")
    width = max(len(cid) for cid in plans)
    for cid, p in plans.items():
        shared = "; stage 1: the shared one" if p.stage1 is not None else ""
        if hands_over(p.cfg, p.route.workers):
            shared = "; drop set chosen on 1 device, healed on the workers"
        lines.append(f"  {cid.ljust(width)}  {p.route.describe()}{shared} [{_plan_parts(p.route.plan)}]")
    scoring = (f"scoring: {preset.eval_actors} actor(s) x {preset.eval_gpus_per_actor:g} GPU, "
               f"{preset.evaluation.get('dtype')}")
    if not gpu:
        lines.append(f"every cell runs in one process on this machine's CPU; {scoring}")
        return "\n".join(lines)
    widest = max(1, max(p.route.workers for p in plans.values()), int(-(-preset.eval_gpus_per_actor // 1)))
    lines.append(f"largest cell: {widest} GPU(s) at once; {scoring}")
    lines.append(f"every cell fits one node of 8 x {preset.gpu_memory_gb:g} GB: {'yes' if widest <= 8 else 'NO'}")
    return "\n".join(lines)


def dry_run(preset: str | Preset, *, models=None, methods=None, ratios=None, overrides: list[str] | None = None) -> str:
    """The text `--dry-run` prints: nothing is loaded, written or started."""
    p = get_preset(preset) if isinstance(preset, str) else preset
    return format_dry_run(p, plan_grid(p, build_grid(p, models=models, methods=methods, ratios=ratios),
                                       overrides or []))


def run_reproduce(preset: str | Preset, *, out: str, models=None, methods=None, ratios=None,
                  overrides: list[str] | None = None, eval_overrides: dict | None = None, use_ray: bool = True,
                  address: str | None = None, on_cell: Callable | None = None) -> dict:
    """Run (or resume) a reproduction grid; returns {"results", "computed", "skipped", "missing", "paths"}.

    Unknown preset/model/method, a bad ratio or override, a cell no route fits fail with a one-line
    TrspError before any model is loaded or Ray is started. `on_cell(cell, record)` is called after
    each stored cell."""
    from trsp_ray.reproduce.report import write_reports
    from trsp_ray.run.export import check_work_dir

    check_work_dir(out, flag="--out")  # a file or a read-only folder: refused before any cell is planned
    p = get_preset(preset) if isinstance(preset, str) else preset
    cells = build_grid(p, models=models, methods=methods, ratios=ratios)
    plans = plan_grid(p, cells, overrides or [])
    settings = eval_settings(p, None, eval_overrides)  # bad task names / limits fail now, not after pruning
    _attach_keys(plans, settings.to_dict())
    store = CellStore(out)
    done = [c for c in cells if store.is_done(c, plans[c.id].key)]
    todo = [c for c in cells if c not in done]
    started_ray = bool(use_ray and todo) and ray_session.connect(address)
    computed: list[str] = []
    try:
        _check_devices(p, [plans[c.id] for c in todo], use_ray)  # before the run log's first line
        store.log("start", preset=p.name, cells=[c.id for c in cells], skipped=[c.id for c in done],
                  todo=[c.id for c in todo])
        for c in done:
            store.log("skipped", cell=c.id)
        for c in todo:
            if store.is_done(c):
                store.log("stale", cell=c.id, reason="its settings changed since it was computed")
        log(f"reproduce {p.name}: {len(cells)} cells, {len(done)} already finished (skipped), {len(todo)} to compute")
        try:
            _run_all(store, p, todo, plans, eval_overrides, use_ray, on_cell, computed)
        finally:
            store.log("end", computed=computed, complete=len(computed) == len(todo))
    finally:
        if started_ray:
            import ray

            ray.shutdown()
    results = [store.load(c) for c in cells if store.is_done(c, plans[c.id].key)]
    paths = write_reports(results, store.root, preset=p)
    missing = [c.id for c in cells if not store.is_done(c, plans[c.id].key)]  # failed cells: a rerun retries them
    return {"results": results, "computed": computed, "skipped": [c.id for c in done], "missing": missing,
            "paths": paths}


def _check_devices(p: Preset, plans: list[CellPlan], use_ray: bool) -> None:
    """GPU routes need GPUs where they run: the Ray cluster's (at least the largest cell's), or this
    process's CUDA device without Ray. One line, before any model is loaded."""
    gpu = [pl for pl in plans if pl.route.device == "gpu"]
    if not gpu:
        return
    need = max(1, max(pl.route.workers for pl in gpu), p.gpus_per_model)
    if use_ray:
        import ray

        have = int(ray.cluster_resources().get("GPU", 0))
        if have < need:
            raise TrspError(f"preset {p.name!r} needs {need} GPU(s) for its largest cell, the Ray cluster has "
                            f"{have}; run it on a GPU cluster (see --dry-run) or use --preset local")
        return
    import torch

    if not torch.cuda.is_available() or need > torch.cuda.device_count():
        raise TrspError(f"preset {p.name!r} needs {need} CUDA device(s) in this process (--no-ray), this machine "
                        f"has {torch.cuda.device_count()}; use Ray on a GPU cluster or --preset local")


def _start_model(store, p: Preset, plans, todo: list[Cell], use_ray: bool):
    """Start (Ray) or run (in process) the shared stage 1 and the single-device cells of one model:
    the unfinished cells not yet exported, and the stage-1 runs any of them prunes from."""
    need = [c for c in todo if not store.is_pruned(c, plans[c.id].prune_key)]
    local = [c for c in need if plans[c.id].route.workers == 0]
    handed = [c for c in need if hands_over(plans[c.id].cfg, plans[c.id].route.workers)]
    groups = list({id(plans[c.id].stage1): plans[c.id].stage1 for c in need if plans[c.id].stage1}.values())
    if not local and not groups and not handed:
        return None
    specs = [{"root": str(store.stage1_root), "key": g.key, "n_drop": g.n_drop,
              "content": {"config": g.cfg.to_dict(), "cells": g.cells}} for g in groups]
    run = (groups[0].cfg if groups else plans[(local or handed)[0].id].cfg).to_dict()  # fits one device (planned)
    args = (run, [{"id": c.id, "method": c.method, "run": plans[c.id].cfg.to_dict(),
                   "stage1_key": plans[c.id].stage1.key if plans[c.id].stage1 else None} for c in local])
    kwargs = {"model_dirs": {c.id: str(store.model_dir(c)) for c in local}, "stage1": specs,
              "selections": [{"id": c.id, "run": plans[c.id].cfg.to_dict()} for c in handed]}
    if not use_ray:
        return prune_cells(*args, **kwargs)
    import ray

    task = ray.remote(prune_cells).options(num_cpus=1, num_gpus=p.gpus_per_model, max_retries=1)
    return task.remote(*args, **kwargs)


def _record_pruned(store: CellStore, plans, cell: Cell, record: dict) -> None:
    route = plans[cell.id].route
    short = f"{route.workers} x {route.device.upper()} (Ray Train)" if route.workers else f"1 {route.device.upper()}"
    record = {**record, "route": short, "route_plan": route.describe()}
    store.save_pruned(cell, record, plans[cell.id].prune_key)
    store.log("pruned", cell=cell.id, drop=record["drop"], route=record["route"],
              stage1_shared=record.get("stage1_shared"))


def _finish_model(store, p: Preset, key: str, todo: list[Cell], plans, pending, eval_overrides, use_ray,
                  on_cell, computed) -> None:
    """Collect the model's task, run its Ray Train cells from the shared stage 1, score its cells."""
    from trsp_ray.method.stage1 import n_drop_for

    shared: dict = {}
    chosen: dict = {}
    if pending is not None:
        if not isinstance(pending, dict):
            import ray

            pending = ray.get(pending)
        shared, chosen = pending["stage1"], pending.get("selections", {})
        for record in pending["records"]:
            _record_pruned(store, plans, next(c for c in todo if c.id == record["cell_id"]), record)
    for c in todo:
        plan = plans[c.id]
        if plan.route.workers and not store.is_pruned(c, plan.prune_key):
            log(f"cell {c.id}: {plan.route.describe()}")
            stage1 = shared.get(plan.stage1.key) if plan.stage1 else None
            record = prune_distributed(plan.cfg, cell_id=c.id, target=str(store.model_dir(c)),
                                       workers=plan.route.workers, stage1=stage1, selection=chosen.get(c.id),
                                       n_drop=n_drop_for(plan.cfg.ratio, plan.route.plan.shape.layers))
            _record_pruned(store, plans, c, record)
    pruned = {c.id: store.pruned(c) or {} for c in todo}
    dense = next((store.pruned(c)["model_dir"] for c in plans_cells(plans, key)
                  if c.method == "dense" and store.pruned(c)), None)
    settings = eval_settings(p, dense, eval_overrides)
    log(f"{key}: scoring {len(todo)} cell(s)")
    _score(store, p, {str(Path(pruned[c.id]["model_dir"]).resolve()): c for c in todo}, pruned, plans, settings,
           use_ray, on_cell, computed)


def plans_cells(plans: dict[str, CellPlan], model: str) -> list[Cell]:
    return [pl.cell for pl in plans.values() if pl.cell.model == model]


def _score(store, preset, cells_by_dir: dict, pruned: dict, plans, settings, use_ray, on_cell, computed) -> None:
    """Score exported cells (pool or in-process evaluator); store each cell the moment it is scored."""
    def finish(scored: dict) -> None:
        cell = cells_by_dir[str(Path(scored["model"]).resolve())]
        if scored.get("status") != "ok":
            store.log("failed", cell=cell.id, error=scored.get("error"))
            return
        record = cell_record(cell, pruned.get(cell.id, {}), scored,
                             paper_numbers(cell.model, cell.method, cell.ratio), key=plans[cell.id].key)
        store.save(cell, record)
        computed.append(cell.id)
        store.log("computed", cell=cell.id, ppl=record["ppl"], mean5_acc=record["mean5_acc"])
        if not preset.keep_models and cell.method != "dense" and store.model_dir(cell).is_dir():
            import shutil

            shutil.rmtree(store.model_dir(cell), ignore_errors=True)
        if on_cell is not None:
            on_cell(cell, record)

    dirs = list(cells_by_dir)
    if use_ray:
        from trsp_ray.evaluation.pool import ActorResources, evaluate_pool

        res = ActorResources(num_cpus=1.0, num_gpus=preset.eval_gpus_per_actor)
        evaluate_pool(dirs, settings=settings, actors=min(preset.eval_actors, len(dirs)), resources=res,
                      on_result=finish, log=log)
        return
    from trsp_ray.evaluation.evaluator import Evaluator

    evaluator = Evaluator(settings.to_dict(), threads=1)
    for d in dirs:
        finish(evaluator.evaluate(d))


def _run_all(store, p, todo, plans, eval_overrides, use_ray, on_cell, computed) -> None:
    """Every model's stage 1 and single-device cells start at once (Ray spreads them); each model's
    Ray Train cells and scoring follow as its task finishes."""
    by_model: dict[str, list[Cell]] = {}
    for c in todo:
        by_model.setdefault(c.model, []).append(c)
    pending = {key: _start_model(store, p, plans, cells, use_ray) for key, cells in by_model.items()}
    for key, cells in by_model.items():
        _finish_model(store, p, key, cells, plans, pending[key], eval_overrides, use_ray, on_cell, computed)
