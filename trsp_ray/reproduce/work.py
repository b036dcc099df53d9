"""What one unit of the reproduction does, as plain functions (no Ray here; run.py ships them to Ray).

`prune_cells` loads one model once and exports every pending cell of it: one stage-1 run at the
largest TRSP ratio serves every TRSP cell (a smaller ratio's drop set is a prefix of the order;
the one-shot ablation uses the round-1 ranking), and that stage-1 result is stored so a rerun after
an interruption does not learn it again. `score_cell` turns an evaluator result into a cell record.
"""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path

from trsp_ray.config import RunConfig, from_dict, load_config, replace
from trsp_ray.errors import TrspError

TRSP_METHODS = ("trsp", "trsp-no-stage2", "trsp-oneshot")
STAGE2_METHODS = ("trsp", "trsp-oneshot")  # the cells whose pruning trains all weights


def cell_config(preset, spec, *, overrides: list[str] | None = None, method: str = "trsp",
                ratio: float = 0.25) -> RunConfig:
    """The RunConfig of one cell: preset values, the model, then user `key=value` overrides."""
    base = {**preset.run, "model": spec.model, "method": method, "ratio": ratio}
    return load_config(None, overrides, base=base)


def _stage1(bench, store_path: Path, ratio: float):
    """The shared stage-1 result at `ratio`: read back when stored for at least that ratio, else learned."""
    from trsp_ray.methods import run_stage1_for
    from trsp_ray.pipeline import log
    from trsp_ray.stage1 import Stage1Result
    from trsp_ray.tracking import write_json_atomic

    n_drop = bench.n_drop(ratio)
    if store_path.is_file():
        saved = json.loads(store_path.read_text(encoding="utf-8"))
        if len(saved["drop_order"]) >= n_drop:
            log(f"stage 1: reusing {store_path.name} ({len(saved['drop_order'])} layers ordered)")
            return Stage1Result(drop_order=saved["drop_order"], round1_ranking=saved["round1_ranking"],
                                steps=saved["steps"], tokens=saved["tokens"])
    bench_r = dataclasses.replace(bench, cfg=replace(bench.cfg, ratio=ratio))
    t0 = time.time()
    result = run_stage1_for(bench_r)
    write_json_atomic({"drop_order": result.drop_order, "round1_ranking": result.round1_ranking,
                       "steps": result.steps, "tokens": result.tokens, "ratio": ratio,
                       "seconds": time.time() - t0}, store_path)
    return result


def _dense_dir(bench, out_dir: Path) -> str:
    """Scoring needs a model directory: the local model itself, else a one-time export (hub ids)."""
    from trsp_ray import assets
    from trsp_ray.export import export_model

    path = Path(assets.resolve_model(bench.cfg.model))
    if path.is_dir():
        return str(path)
    if not (out_dir / "config.json").is_file():
        export_model(bench.model, bench.tokenizer, str(out_dir), overwrite=True, verify=False,
                     manifest={"method": "dense", "num_layers_original": bench.num_layers,
                               "num_layers_kept": bench.num_layers, "dropped_layers": []})
    return str(out_dir)


def prune_cells(run: dict, cells: list[dict], *, model_dirs: dict[str, str], stage1_path: str) -> list[dict]:
    """Export every cell of one model; returns one record per cell: {cell_id, model_dir, drop, info}.

    `run` is the model's RunConfig as a plain dict, `cells` are Cell dicts with their ids under
    "id", `model_dirs` maps a cell id to its export target. Exports are atomic, so a cell whose
    directory exists is complete.
    """
    from trsp_ray.export import export_model
    from trsp_ray.methods import apply_method
    from trsp_ray.pipeline import log, prepare

    cfg = from_dict(run)
    bench = prepare(cfg)
    trsp_ratios = [c["ratio"] for c in cells if c["method"] in TRSP_METHODS]
    stage1 = _stage1(bench, Path(stage1_path), max(trsp_ratios)) if trsp_ratios else None
    records = []
    for c in cells:
        t0 = time.time()
        target = model_dirs[c["id"]]
        if c["method"] == "dense":
            records.append({"cell_id": c["id"], "model_dir": _dense_dir(bench, Path(target)), "drop": [],
                            "info": {}, "prune_seconds": 0.0})
            continue
        bench_r = dataclasses.replace(bench, cfg=replace(cfg, ratio=c["ratio"], method=c["method"]))
        log(f"cell {c['id']}: pruning {bench_r.n_drop()} of {bench.num_layers} layers")
        out = apply_method(bench_r, c["method"], stage1=stage1)
        manifest = {"method": c["method"], "dropped_layers": out.drop, "drop_order": out.drop,
                    "kept_layers": out.kept, "num_layers_original": bench.num_layers,
                    "num_layers_kept": len(out.kept), "config": bench_r.cfg.to_dict(),
                    "info": {k: v for k, v in out.info.items() if k != "relative_update"}}
        export_model(out.model, bench.tokenizer, target, manifest=manifest, overwrite=True)
        records.append({"cell_id": c["id"], "model_dir": target, "drop": out.drop, "info": manifest["info"],
                        "prune_seconds": time.time() - t0})
    return records


def distributed_workers(preset, spec, cfg: RunConfig) -> int:
    """GPUs a cell needs per the memory planner: 0 = fits the preset's single-process prune task.

    Only cells that train all weights (stage 2) can outgrow one GPU; shapes come from the preset
    (no hub access) or the model's config.json."""
    from trsp_ray import assets
    from trsp_ray.distributed import planner

    if not cfg.distributed.use_gpu or cfg.method not in STAGE2_METHODS:
        return 0
    shape = planner_shape(spec) if spec.shape else planner.read_shape(assets.resolve_model(spec.model))
    setup = planner.setup_for_run(replace(cfg, **{"distributed.workers": max(1, preset.gpus_per_model)}))
    if planner.plan(shape, setup).fits:
        return 0
    need = planner.min_workers(shape, setup)
    if need is None:
        raise TrspError(f"model {spec.key!r} does not fit any number of {setup.gpu_memory_gb:g} GB GPUs with "
                        "this config; see `trsp-ray plan`")
    return need


def planner_shape(spec):
    """A planner Shape from a preset's config.json fields (what read_shape would read from disk)."""
    from trsp_ray.distributed import planner

    return planner.shape_from_config(spec.shape, source=spec.key)


def cell_record(cell, pruned: dict, scored: dict, paper: tuple[float, float] | None) -> dict:
    """The stored result of a finished cell: what was dropped, what it scored, the paper's numbers."""
    from trsp_ray.evaluation.report import paper_mean

    tasks = scored.get("tasks") or {}
    mean = paper_mean(tasks, "acc")
    manifest = scored.get("manifest") or {}
    return {"model": cell.model, "method": cell.method, "ratio": cell.ratio, "status": scored.get("status", "ok"),
            "layers": scored.get("layers"), "layers_original": manifest.get("num_layers_original", scored.get("layers")),
            "dropped": sorted(pruned.get("drop") or manifest.get("dropped_layers") or []),
            "ppl": scored.get("ppl"), "mean5_acc": None if mean is None else 100.0 * mean, "tasks": tasks,
            "speed": scored.get("speed"),
            # a cell exported by an earlier (interrupted) run: its manifest kept the pruning time
            "prune_seconds": pruned.get("prune_seconds", (manifest.get("info") or {}).get("seconds")),
            "eval_seconds": scored.get("seconds"), "info": pruned.get("info") or manifest.get("info") or {},
            "paper_ppl": paper[0] if paper else None, "paper_acc": paper[1] if paper else None,
            "lm_eval_version": scored.get("lm_eval_version")}


def gpus_needed(preset, *, overrides: list[str] | None = None) -> int:
    """The largest GPU set one cell of the preset holds at once (what a cluster must offer):
    a Ray Train cell's world size, else one prune task's GPUs, else one evaluation actor's."""
    need = max(preset.gpus_per_model, int(-(-preset.eval_gpus_per_actor // 1)))
    for spec in preset.models:
        for method in STAGE2_METHODS:
            if method in preset.methods:
                for ratio in preset.ratios:
                    cfg = cell_config(preset, spec, overrides=overrides, method=method, ratio=ratio)
                    need = max(need, distributed_workers(preset, spec, cfg))
    return need
