"""What one unit of the reproduction does, as plain functions (no Ray here; run.py ships them to Ray).

Every TRSP cell of a model (trsp, trsp-oneshot, trsp-no-stage2, any ratio) prunes from one
stage-1 run: learned once, on one device, at the largest TRSP ratio of the grid (a smaller ratio's
drop set is a prefix of the order; the one-shot ablation uses the round-1 ranking), and kept in the
content-keyed stage-1 store (trsp_ray/run/stage1_store.py, shared with the search), so a changed
stage-1 setting recomputes it and an interrupted run does not. A cell whose stage 2 needs several
GPUs gets that same result handed to its Ray Train run (distributed/handoff.py).

Keys: a cell's export is keyed by the content of its config (`prune_key`), its score by that and
the evaluation settings (`cell_key`): a changed setting recomputes the cell instead of reusing it.
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

from trsp_ray.common.digest import content_key
from trsp_ray.common.errors import TrspError
from trsp_ray.config import registry
from trsp_ray.config.run_config import RunConfig, load_config, replace
from trsp_ray.reproduce.presets import grid_method
from trsp_ray.run.content import model_fingerprint, text_fingerprint

# Config sections that do not change what a cell exports or scores.
NOT_RESULTS = ("tracking", "output", "threads", "checkpoint_dir", "distributed")


def cell_config(preset, spec, *, method: str, overrides: list[str] | None = None,
                ratio: float = 0.25) -> RunConfig:
    """The RunConfig of one cell (`method` is a grid row): preset values, the model, user
    `key=value` overrides, then the row's own overrides (they define the row)."""
    row = grid_method(method)
    # The dense cell prunes nothing; its method is a placeholder the config accepts.
    base = {**preset.run, "model": spec.model, "method": row.method or registry.STAGE1_ONLY, "ratio": ratio}
    return load_config(None, list(overrides or []) + list(row.overrides), base=base)


def uses_stage1(cfg: RunConfig, method: str) -> bool:
    from trsp_ray.run.pipeline import named

    return grid_method(method).method is not None and named(cfg).spec.uses_stage1


def prune_key(cfg: RunConfig, method: str, *, calib_fp: str) -> str:
    """Content key of a cell's export: the model's files and every result-bearing config value
    (the dense cell: the model alone)."""
    if grid_method(method).method is None:
        return content_key({"dense": cfg.model, "model": model_fingerprint(cfg.model)})
    content = {k: v for k, v in cfg.to_dict().items() if k not in NOT_RESULTS}
    return content_key({"row": method, "config": content, "model": model_fingerprint(cfg.model), "calib": calib_fp})


def cell_key(prune: str, eval_settings: dict) -> str:
    """Content key of a scored cell: its export and how it was scored (settings and the text's bytes)."""
    return content_key({"prune": prune, "eval": eval_settings,
                        "eval_text": text_fingerprint(eval_settings.get("eval_text"))})


def planner_shape(spec):
    """A planner Shape from a preset's config.json fields (what read_shape would read from disk)."""
    from trsp_ray.plan.shape import shape_from_config

    return shape_from_config(spec.shape, source=spec.key)


def model_shape(spec):
    from trsp_ray.data import assets
    from trsp_ray.plan.shape import read_shape

    return planner_shape(spec) if spec.shape else read_shape(assets.resolve_model(spec.model))


def _device(cfg: RunConfig) -> str:
    return "gpu" if cfg.device == "cuda" or (cfg.device == "auto" and cfg.distributed.use_gpu) else "cpu"


def cell_route(preset, spec, cfg: RunConfig, method: str, *, shape=None):
    """The planner's route of a cell: one process on one device, or N Ray Train workers (at most
    the preset's `max_workers`); a one-line TrspError when neither fits. The dense cell is only
    scored, and a TRSP cell's stage 1 is the shared one, so neither plans a stage 1 of its own."""
    from trsp_ray.plan import route
    from trsp_ray.plan.single_plan import single_plan, single_setup_for_run
    from trsp_ray.run.pipeline import named

    shape = shape or model_shape(spec)
    device = _device(cfg)
    memory = preset.gpu_memory_gb if device == "gpu" else None
    if grid_method(method).method is None:
        setup = single_setup_for_run(cfg, device=device, memory_gb=memory or _host_gb(), shape=shape)
        plan = single_plan(shape, setup, ("evaluation",))
        if not plan.fits:
            raise TrspError(f"scoring {spec.key}: {plan.reason()}")
        return route.Route(0, device, plan)
    pipe = named(cfg).spec  # the cell's pipeline, read once for its route (`spec` is the model's)
    chosen = route.route(cfg, spec=pipe, device=device, memory_gb=memory, shape=shape,
                         max_workers=preset.max_workers, drop_given=_selects_elsewhere(pipe))
    if chosen.workers > 0 and _selects_elsewhere(pipe):  # its selection runs in the model's one-device task
        selection = selection_method(pipe)
        try:
            route.route(replace(cfg, method=selection), spec=registry.METHODS[selection], device=device,
                        memory_gb=memory, shape=shape, max_workers=0)
        except TrspError as exc:
            raise TrspError(f"the {cfg.method} cell of {spec.key} heals on {chosen.workers} workers, and its "
                            f"selection must run on one device: {exc}") from None
    return chosen


def selection_method(spec: registry.Method) -> str:
    """The method that only selects with the selector of pipeline `spec` (sleb+heal -> sleb)."""
    return next(m.name for m in registry.METHODS.values()
                if m.selector == spec.selector and not m.heal and not m.stage2 and m.ranking == "order")


def _selects_elsewhere(spec: registry.Method) -> bool:
    """A heal method whose selection the workers do not run (registry.HANDED_OVER_METHODS)."""
    return spec.name in registry.HANDED_OVER_METHODS


def hands_over(cfg: RunConfig, workers: int) -> bool:
    """Whether a cell routed to `workers` gets its drop set from the model's one-device task."""
    from trsp_ray.run.pipeline import named

    return workers > 0 and _selects_elsewhere(named(cfg).spec)


def stage1_route(preset, spec, cfg: RunConfig, *, shape=None):
    """The route of a model's shared stage 1: one device, always (the store is filled by one process)."""
    from trsp_ray.plan import route

    shape = shape or model_shape(spec)
    device = _device(cfg)
    memory = preset.gpu_memory_gb if device == "gpu" else None
    try:
        return route.route(replace(cfg, method=registry.STAGE1_ONLY, **{"heal.steps": 0}),
                           spec=registry.METHODS[registry.STAGE1_ONLY], device=device, memory_gb=memory,
                           shape=shape, max_workers=0)
    except TrspError as exc:
        raise TrspError(f"the shared stage 1 of {spec.key} must run on one device: {exc}") from None


def _host_gb() -> float:
    import os

    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30


def shared_stage1(load, *, root: str, key: str, n_drop: int, content: dict) -> dict:
    """The shared stage-1 result of `key` covering `n_drop` layers, as plain data: from the store,
    else learned on the workbench `load()` returns and stored."""
    from trsp_ray.run.methods import run_stage1_for
    from trsp_ray.run.stage1_store import Stage1Store, result_dict

    def compute(n: int):
        from trsp_ray.common.logs import log

        log(f"stage 1: learning {n} layers (shared by every TRSP cell of this model)")
        return run_stage1_for(load(), n_drop=n)

    result, _ = Stage1Store(root).obtain(key, need=n_drop, compute=compute, content=content)
    return result_dict(result)


def _dense_dir(bench, out_dir: Path) -> str:
    """Scoring needs a model directory: the local model itself, else a one-time export (hub ids)."""
    from trsp_ray.data import assets
    from trsp_ray.run.export import export_model, pruned_manifest

    path = Path(assets.resolve_model(bench.cfg.model))
    if path.is_dir():
        return str(path)
    if not (out_dir / "config.json").is_file():
        export_model(bench.model, bench.tokenizer, str(out_dir), overwrite=True, verify=False,
                     manifest=pruned_manifest(method="dense", drop=[], num_layers_original=bench.num_layers,
                                              config=bench.cfg.to_dict()))
    return str(out_dir)


def prune_cells(run: dict, cells: list[dict], *, model_dirs: dict[str, str], stage1: list[dict],
                selections: list[dict] = ()) -> dict:
    """Export the single-device cells of one model, and make sure its shared stage-1 results are stored.

    `run` is a RunConfig dict of the model, `cells` are {"id", "method", "run" (the cell's RunConfig
    dict), "stage1_key" (None for a non-TRSP cell)}, `model_dirs` maps a cell id to its export
    target, `stage1` lists {"root", "key", "n_drop", "content"}, `selections` the Ray Train cells
    whose drop set is chosen here ({"id", "run"}: a heal method the workers only heal). The model is
    loaded only when there is a cell to prune, a stage 1 to learn or a selection to make. Returns
    {"records": one {cell_id, model_dir, drop, info, prune_seconds, stage1_shared} per cell,
    "stage1": {key: result dict}, "selections": {cell_id: {"drop", "info"}}}.
    """
    from trsp_ray.config.run_config import from_dict

    loaded: list = []

    def load():
        from trsp_ray.run.workbench import prepare

        if not loaded:
            loaded.append(prepare(from_dict(run)))
        return loaded[0]

    shared = {spec["key"]: shared_stage1(load, **spec) for spec in stage1}
    records = [_prune_one(load(), c, model_dirs[c["id"]], shared.get(c.get("stage1_key"))) for c in cells]
    chosen = {c["id"]: _select_one(load(), c) for c in selections}
    return {"records": records, "stage1": shared, "selections": chosen}


def _select_one(bench, c: dict) -> dict:
    """The drop set of a cell that heals on Ray Train workers, chosen on this one device."""
    from trsp_ray.common.logs import log
    from trsp_ray.config.run_config import from_dict
    from trsp_ray.method.gates import attach_gates
    from trsp_ray.run.methods import select
    from trsp_ray.run.pipeline import named

    cfg = from_dict(c["run"])
    cell_bench = dataclasses.replace(bench, cfg=cfg)
    log(f"cell {c['id']}: choosing {cell_bench.n_drop()} of {bench.num_layers} layers for its Ray Train heal")
    model = cell_bench.fresh_model()
    drop, info = select(cell_bench, named(cfg).spec, model=model, gates=attach_gates(model, gate_mode=cfg.gates.gate))
    return {"drop": [int(i) for i in drop], "info": info}


def _prune_one(bench, c: dict, target: str, stage1: dict | None) -> dict:
    from trsp_ray.common.logs import log
    from trsp_ray.config.run_config import from_dict
    from trsp_ray.run.methods import apply_method
    from trsp_ray.run.pipeline import named
    from trsp_ray.run.stage1_store import result_from

    t0 = time.time()
    if grid_method(c["method"]).method is None:
        return {"cell_id": c["id"], "model_dir": _dense_dir(bench, Path(target)), "drop": [], "info": {},
                "prune_seconds": 0.0}
    cfg = from_dict(c["run"])
    cell_bench = dataclasses.replace(bench, cfg=cfg)
    log(f"cell {c['id']}: pruning {cell_bench.n_drop()} of {bench.num_layers} layers")
    out = apply_method(cell_bench, named(cfg).spec, stage1=None if stage1 is None else result_from(stage1))
    info = {k: v for k, v in out.info.items() if k != "relative_update"}
    export_cell(out, bench, method=c["method"], config=cfg.to_dict(), info=info, target=target)
    return {"cell_id": c["id"], "model_dir": target, "drop": out.drop, "info": info,
            "prune_seconds": time.time() - t0, "stage1_shared": True if stage1 is not None else None}


def export_cell(outcome, bench, *, method: str, config: dict, info: dict, target: str) -> str:
    """A single-device cell's export (`method` is the grid row), replacing a half-finished one."""
    from trsp_ray.run.export import export_model, pruned_manifest

    manifest = pruned_manifest(method=method, drop=outcome.drop, num_layers_original=bench.num_layers,
                               config=config, info=info)
    return str(export_model(outcome.model, bench.tokenizer, target, manifest=manifest, overwrite=True))


def prune_distributed(cfg: RunConfig, *, cell_id: str, target: str, workers: int, stage1: dict, n_drop: int,
                      selection: dict | None = None) -> dict:
    """A cell whose stage 2 needs several GPUs: Ray Train + ZeRO-3 on `workers` workers from the
    shared stage 1 (or the drop set of `selection`, chosen on one device: prune_cells), exported to
    `target`; the same record as `prune_cells` gives."""
    from trsp_ray.distributed.handoff import run_stage2_distributed
    from trsp_ray.distributed.train import run_distributed

    t0 = time.time()
    dcfg = replace(cfg, output=target, **{"distributed.workers": workers, "tracking.enabled": False})
    if selection is not None:
        result = run_distributed(dcfg, drop=selection["drop"], name=f"reproduce-{cell_id}", overwrite=True)
        return {"cell_id": cell_id, "model_dir": target, "drop": list(result.drop_order),
                "info": {**selection["info"], "workers": workers, "storage": result.storage},
                "prune_seconds": time.time() - t0, "stage1_shared": None}
    result, shared = run_stage2_distributed(dcfg, stage1=stage1, n_drop=n_drop, name=f"reproduce-{cell_id}")
    return {"cell_id": cell_id, "model_dir": target, "drop": list(result.drop_order),  # the cell's drop set
            "info": {"workers": workers, "storage": result.storage}, "prune_seconds": time.time() - t0,
            "stage1_shared": shared}


def gpus_needed(preset, *, overrides: list[str] | None = None) -> int:
    """The largest GPU set one cell of the preset holds at once (what a cluster must offer):
    a Ray Train cell's world size, else one prune task's GPUs, else one evaluation actor's."""
    need = max(preset.gpus_per_model, int(-(-preset.eval_gpus_per_actor // 1)))
    for spec in preset.models:
        shape = model_shape(spec) if preset.gpus_per_model else None
        for method in preset.methods:
            for ratio in preset.ratios:
                cfg = cell_config(preset, spec, overrides=overrides, method=method, ratio=ratio)
                if _device(cfg) == "gpu":
                    need = max(need, cell_route(preset, spec, cfg, method, shape=shape).workers)
    return need


def cell_record(cell, pruned: dict, scored: dict, paper: tuple[float, float] | None, *, key: str) -> dict:
    """The stored result of a finished cell: what was dropped, what it scored, the paper's numbers.

    Layers come from the scored model itself; the original count from the manifest, else as kept +
    dropped."""
    from trsp_ray.evaluation.report import paper_mean

    tasks = scored.get("tasks") or {}
    mean = paper_mean(tasks, "acc")
    manifest = scored.get("manifest") or {}
    dropped = sorted(pruned.get("drop") or manifest.get("dropped_layers") or [])
    layers = scored.get("layers")
    original = manifest.get("num_layers_original") or (None if layers is None else layers + len(dropped))
    return {"model": cell.model, "method": cell.method, "ratio": cell.ratio, "status": scored.get("status", "ok"),
            "cell_key": key, "layers": layers, "layers_original": original, "dropped": dropped,
            "route": pruned.get("route"), "stage1_shared": pruned.get("stage1_shared"),
            "ppl": scored.get("ppl"), "mean5_acc": None if mean is None else 100.0 * mean, "tasks": tasks,
            "speed": scored.get("speed"), "prune_seconds": pruned.get("prune_seconds"),
            "eval_seconds": scored.get("seconds"), "info": pruned.get("info") or manifest.get("info") or {},
            "paper_ppl": paper[0] if paper else None, "paper_acc": paper[1] if paper else None,
            "lm_eval_version": scored.get("lm_eval_version")}
