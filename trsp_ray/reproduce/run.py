"""The reproduction driver: grid -> (skip finished cells) -> prune per model -> score -> tables.

    result = run_reproduce("local", out="runs/reproduce-local")

With `use_ray` (default) every model's pending cells are one Ray task (`gpus_per_model` GPUs, or
Ray Train + ZeRO-3 through `run_distributed` for cells the memory planner says need more), and the
exported cells are scored by the evaluation actor pool. Without Ray the same functions run in this
process (tests, debugging). Each finished cell is stored atomically as soon as it is scored, so an
interrupted run loses at most the cells in flight; the run log records what each run skipped and
computed.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

from trsp_ray.errors import TrspError
from trsp_ray.reproduce.grid import Cell, CellStore, build_grid
from trsp_ray.reproduce.presets import Preset, get_preset, paper_numbers
from trsp_ray.reproduce.work import cell_config, cell_record, distributed_workers, prune_cells


def eval_settings(preset: Preset, dense_dir: str | None, overrides: dict | None = None):
    from trsp_ray.evaluation.evaluator import EvalSettings
    from trsp_ray.evaluation.speed import SpeedSettings

    e = {**preset.evaluation, **(overrides or {})}
    speed = None if e.get("speed") is None else SpeedSettings(**e["speed"])
    eval_text = preset.run.get("data", {}).get("eval_text")
    return EvalSettings(tasks=tuple(e.get("tasks", ())), limit=e.get("limit"), ppl_seqlen=e.get("ppl_seqlen", 256),
                        ppl_windows=e.get("ppl_windows"), dtype=e.get("dtype", "float32"), speed=speed,
                        eval_text=eval_text, dense=dense_dir if speed is not None else None)


def check_inputs(preset: Preset, cells: list[Cell], overrides: list[str]) -> dict:
    """Every cell's config, validated from config files alone (no weights); returns id -> RunConfig."""
    from trsp_ray.pipeline import check_plan

    configs, checked = {}, set()
    widest = max((c.ratio for c in cells), default=0.0) or max(preset.ratios)
    for cell in cells:
        spec = preset.model(cell.model)
        cfg = cell_config(preset, spec, overrides=overrides, method="trsp" if cell.method == "dense" else cell.method,
                          ratio=cell.ratio or widest)
        if spec.shape is None and (cell.model, cell.ratio) not in checked:
            check_plan(cfg)  # local models: the ratio must leave layers to drop and keep
            checked.add((cell.model, cell.ratio))
        configs[cell.id] = cfg
    return configs


def _prune_model(store: CellStore, preset: Preset, cells: list[Cell], configs: dict, use_ray: bool):
    """Start (Ray) or run (in process) the pruning of one model's cells; returns a ref or records."""
    cfg = configs[cells[0].id]
    args = (cfg.to_dict(), [{**c.to_dict(), "id": c.id} for c in cells])
    kwargs = {"model_dirs": {c.id: str(store.model_dir(c)) for c in cells},
              "stage1_path": str(store.stage1_path(cells[0].model))}
    if not use_ray:
        return prune_cells(*args, **kwargs)
    import ray

    task = ray.remote(prune_cells).options(num_cpus=1, num_gpus=preset.gpus_per_model, max_retries=1)
    return task.remote(*args, **kwargs)


def _prune_distributed(store: CellStore, cell: Cell, cfg, workers: int) -> dict:
    """A cell too large for one GPU: Ray Train + DeepSpeed ZeRO-3 on `workers` GPUs, exported to disk."""
    from trsp_ray.config import replace
    from trsp_ray.distributed.train import run_distributed

    t0 = time.time()
    target = str(store.model_dir(cell))
    result = run_distributed(replace(cfg, output=target, **{"distributed.workers": workers}), overwrite=True,
                             name=f"reproduce-{cell.id}")
    return {"cell_id": cell.id, "model_dir": target, "drop": result.drop_order,  # already the cell's drop set
            "info": {"workers": workers, "storage": result.storage}, "prune_seconds": time.time() - t0}


def _score(store, preset, cells_by_dir: dict, pruned: dict, settings, use_ray, on_cell, computed) -> None:
    """Score exported cells (pool or in-process evaluator); store each cell the moment it is scored."""
    def finish(scored: dict) -> None:
        cell = cells_by_dir[str(Path(scored["model"]).resolve())]
        if scored.get("status") != "ok":
            store.log("failed", cell=cell.id, error=scored.get("error"))
            return
        record = cell_record(cell, pruned.get(cell.id, {}), scored, paper_numbers(cell.model, cell.method, cell.ratio))
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
                      on_result=finish, log=lambda m: print(m, flush=True))
        return
    from trsp_ray.evaluation.evaluator import Evaluator

    evaluator = Evaluator(settings.to_dict(), threads=1)
    for d in dirs:
        finish(evaluator.evaluate(d))


def _run_model(store, preset, key, todo, configs, overrides_eval, use_ray, on_cell, computed, pending_ref=None):
    """Prune (unless already exported) and score the unfinished cells of one model."""
    from trsp_ray.pipeline import log

    pruned: dict[str, dict] = {}
    if pending_ref is not None:
        import ray

        pruned.update({r["cell_id"]: r for r in ray.get(pending_ref)})
    elif any(not store.is_pruned(c) for c in todo if c.method != "dense") or any(c.method == "dense" for c in todo):
        need = [c for c in todo if c.method == "dense" or not store.is_pruned(c)]
        pruned.update({r["cell_id"]: r for r in _prune_model(store, preset, need, configs, use_ray=False)})
    for c in todo:
        if c.id in pruned:
            store.log("pruned", cell=c.id, drop=pruned[c.id]["drop"])
    dirs = {c.id: pruned[c.id]["model_dir"] if c.id in pruned else str(store.model_dir(c)) for c in todo}
    dense = next((dirs[c.id] for c in todo if c.method == "dense"), None)
    settings = eval_settings(preset, dense, overrides_eval)
    log(f"{key}: scoring {len(todo)} cell(s)")
    _score(store, preset, {str(Path(dirs[c.id]).resolve()): c for c in todo}, pruned, settings, use_ray, on_cell,
           computed)


def run_reproduce(preset: str | Preset, *, out: str, models=None, methods=None, ratios=None,
                  overrides: list[str] | None = None, eval_overrides: dict | None = None, use_ray: bool = True,
                  address: str | None = None, on_cell: Callable | None = None) -> dict:
    """Run (or resume) a reproduction grid; returns {"results", "computed", "skipped", "missing", "paths"}.

    Unknown preset/model/method, a bad ratio or override fail with a one-line TrspError before any
    model is loaded or Ray is started. `on_cell(cell, record)` is called after each stored cell."""
    from trsp_ray.pipeline import log
    from trsp_ray.reproduce.report import write_reports

    p = get_preset(preset) if isinstance(preset, str) else preset
    cells = build_grid(p, models=models, methods=methods, ratios=ratios)
    configs = check_inputs(p, cells, overrides or [])
    eval_settings(p, None, eval_overrides)  # bad task names / limits fail now, not after pruning
    store = CellStore(out)
    done = [c for c in cells if store.is_done(c)]
    todo = [c for c in cells if not store.is_done(c)]
    store.log("start", preset=p.name, cells=[c.id for c in cells], skipped=[c.id for c in done],
              todo=[c.id for c in todo])
    for c in done:
        store.log("skipped", cell=c.id)
    log(f"reproduce {p.name}: {len(cells)} cells, {len(done)} already finished (skipped), {len(todo)} to compute")
    computed: list[str] = []
    started_ray = False
    try:
        if use_ray and todo:
            started_ray = _init_ray(address)
        _run_all(store, p, todo, configs, eval_overrides, use_ray, on_cell, computed)
    finally:
        store.log("end", computed=computed, complete=len(computed) == len(todo))
        if started_ray:
            import ray

            ray.shutdown()
    results = [store.load(c) for c in cells if store.is_done(c)]
    paths = write_reports(results, store.root, preset=p)
    missing = [c.id for c in cells if not store.is_done(c)]  # failed cells: a rerun retries them
    return {"results": results, "computed": computed, "skipped": [c.id for c in done], "missing": missing,
            "paths": paths}


def _init_ray(address: str | None) -> bool:
    import os

    import ray

    if ray.is_initialized():
        return False
    ray.init(address=address or os.environ.get("RAY_ADDRESS"), include_dashboard=False, log_to_driver=True)
    return True


def _run_all(store, p, todo, configs, eval_overrides, use_ray, on_cell, computed) -> None:
    """All models' prune tasks start at once (Ray spreads them); each model is scored as it finishes."""
    by_model: dict[str, list[Cell]] = {}
    for c in todo:
        by_model.setdefault(c.model, []).append(c)
    refs: dict[str, object] = {}
    for key, cells in by_model.items():
        spec = p.model(key)
        local = []
        for c in cells:
            if c.method != "dense" and not store.is_pruned(c):
                workers = distributed_workers(p, spec, configs[c.id])
                if workers:  # the planner says one GPU is not enough: Ray Train + ZeRO-3
                    store.log("pruned", cell=c.id, drop=_prune_distributed(store, c, configs[c.id], workers)["drop"])
                    continue
            local.append(c)
        need = [c for c in local if c.method == "dense" or not store.is_pruned(c)]
        if use_ray and need:
            refs[key] = _prune_model(store, p, need, configs, use_ray=True)
    for key, cells in by_model.items():
        _run_model(store, p, key, cells, configs, eval_overrides, use_ray, on_cell, computed,
                   pending_ref=refs.get(key))
