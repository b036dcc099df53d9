"""The driver of one pruning run, top to bottom: route -> load -> select -> stage 2 -> remove ->
heal -> evaluate -> export -> log. `run(cfg)` is what `trsp-ray prune` and the jobs call; a model
one device cannot hold goes to Ray Train workers (`run_on_workers`)."""

from __future__ import annotations

import time

from trsp_ray.common.logs import log
from trsp_ray.config.run_config import RunConfig
from trsp_ray.data import domains
from trsp_ray.data.heldout import text_windows
from trsp_ray.data.perplexity import nlls_of, ppl_of
from trsp_ray.run import pipeline, workbench


def run_stage1(cfg: RunConfig, bench, *, report):
    """Stage 1 of this run through the stage-1 store under `checkpoint_dir` (the store the search and
    the reproduction use, keyed by what stage 1 depends on): a stored result covering the run's
    layers is reused; otherwise it is computed with each finished round saved, so an interrupted run
    (Ctrl-C, a lost machine) restarts after its last finished round."""
    from trsp_ray.run.content import checkpoint_root, data_fingerprint
    from trsp_ray.run.methods import run_stage1_for
    from trsp_ray.run.stage1_store import Stage1Store, stage1_content, stage1_key

    cfg_dict = cfg.to_dict()
    fingerprint = data_fingerprint(model=cfg.model, calib_text=cfg.data.calib_text, calib_mix=cfg.data.calib_mix)
    key = stage1_key(cfg_dict, fingerprint)
    store = Stage1Store(checkpoint_root(cfg.checkpoint_dir))

    def compute(n_drop: int):
        resume, on_round = store.checkpoints(key, n_drop)
        if resume is not None:
            log(f"stage 1: resuming after round {len(resume['round_ends'])} from {store.rounds_path(key, n_drop)}")
        return run_stage1_for(bench, n_drop=n_drop, report=report, resume=resume, on_round=on_round)

    result, computed = store.obtain(key, need=bench.n_drop(), compute=compute, content=stage1_content(cfg_dict))
    if not computed:
        log(f"stage 1: reusing the stored result {store.path(key)}")
        result.rounds_computed = 0
    return result


def run(cfg: RunConfig, *, overwrite: bool = False) -> dict:
    """Prune one model with one method as configured; export, evaluate and log. Returns the results."""
    from trsp_ray.common import plots
    from trsp_ray.common.table import render
    from trsp_ray.run.export import check_export_target, export_model, pruned_manifest
    from trsp_ray.run.methods import apply_method
    from trsp_ray.run.tracking import make_tracker

    # the pipeline on this model, decided once: the fit it runs on this family, the heal a budget buys
    pipe = pipeline.resolve(cfg)
    cfg = pipe.cfg
    chosen = route_for(cfg, pipe=pipe)  # config.json only: no weights are read before the output is checked
    if not chosen.workers:  # one process runs here: device=cuda without a GPU is one line, before any log
        workbench.resolve_device(cfg.device)
    log(pipe.describe())
    check_export_target(cfg.output, overwrite=overwrite, plan=chosen.plan, ratio=cfg.ratio)
    log(f"route: {chosen.describe()}")
    if chosen.workers:
        return run_on_workers(cfg, chosen, overwrite=overwrite)
    bench = workbench.prepare(cfg)
    t = cfg.tracking
    tracker = make_tracker(enabled=t.enabled, tracking_uri=t.tracking_uri, experiment=t.experiment)
    dense_params = workbench.kept_parameters(bench.model)
    with tracker.run(f"{cfg.method}-r{cfg.ratio}", tags={"method": cfg.method, "model": cfg.model}):
        tracker.log_params(cfg.to_dict())
        tracker.log_params({f"pipeline.{k}": v for k, v in pipe.to_dict().items()})
        tracker.log_params({"data.calibration_source": bench.calibration.source,
                            "data.heldout_source": bench.texts.heldout_source})
        log(f"model {cfg.model}: {bench.num_layers} layers, dropping {bench.n_drop()} with {cfg.method}")
        dense_ppl = bench.heldout_ppl()
        log(f"dense held-out PPL {dense_ppl:.2f}")
        report = lambda metrics, step: tracker.log_metrics(metrics, step)
        stage1, stage1_seconds = None, 0.0
        if pipe.spec.uses_stage1:
            started = time.perf_counter()
            stage1 = run_stage1(cfg, bench, report=report)
            stage1_seconds = time.perf_counter() - started
            tracker.log_figure(plots.gate_trajectories(stage1.gate_history, stage1.round_ends, stage1.drop_order),
                               "stage1_gates.png")
        from trsp_ray.distributed.audition import audition

        outcome = apply_method(bench, pipe.spec, stage1=stage1, report=report, audition=audition)
        if "audition" in outcome.info:  # a selection by recovery: its trials, best first
            tracker.log_dict(outcome.info["audition"], "audition.json")
        if "relative_update" in outcome.info:
            tracker.log_dict(outcome.info["relative_update"], "stage2_relative_update.json")
        ppl = bench.heldout_ppl(outcome.model)
        results = {"method": cfg.method, "ratio": cfg.ratio, "dropped_layers": outcome.drop,
                   "kept_layers": outcome.kept, "num_layers_original": bench.num_layers,
                   "num_layers_kept": len(outcome.kept), "dense_ppl": dense_ppl, "heldout_ppl": ppl,
                   "kept_parameters": workbench.kept_parameters(outcome.model), "dense_parameters": dense_params,
                   "heldout_source": bench.texts.heldout_source, "calibration_source": bench.calibration.source,
                   "heldout_windows": bench.heldout.coverage() if bench.heldout else None,
                   "calibration_shares": bench.calibration.shares, "pipeline": pipe.to_dict(),
                   **{k: v for k, v in outcome.info.items()}}
        if stage1 is not None:
            results["stage1_drop_order"] = stage1.drop_order
            results["stage1_rounds_computed"] = stage1.rounds_computed  # 0: reused from the store
            # stage 1 is this run's selection, run before apply_method's clock starts: count it there
            results["stage1_seconds"] = stage1_seconds
            results["select_seconds"] = results.get("select_seconds", 0.0) + stage1_seconds
            results["seconds"] = results.get("seconds", 0.0) + stage1_seconds
        manifest = pruned_manifest(method=cfg.method, drop=outcome.drop, num_layers_original=bench.num_layers,
                                   config=cfg.to_dict(), metrics=results)
        if cfg.output:
            path = export_model(outcome.model, bench.tokenizer, cfg.output, manifest=manifest, overwrite=overwrite)
            log(f"exported to {path}")
            results["output"] = str(path)
        tracker.log_metrics({"heldout_ppl": ppl, "dense_ppl": dense_ppl, "num_layers_kept": len(outcome.kept)})
        tracker.log_dict(manifest, "trsp_ray.json")
        tracker.log_dict({"drop_order": outcome.drop}, "drop_order.json")
    comp = cfg.compensation.method
    named = pipe.spec.compensate and comp == "lstsq"  # the method's name says it
    label = cfg.method if comp == "none" or named else f"{cfg.method} ({comp} compensation)"
    print(render([{"method": "dense", "layers": bench.num_layers, "held-out PPL": dense_ppl},
                  {"method": label, "layers": len(outcome.kept), "dropped": " ".join(map(str, outcome.drop)),
                   "held-out PPL": ppl}], ["method", "layers", "dropped", "held-out PPL"]))
    held = f", {bench.heldout.describe()}" if bench.heldout else ""
    print(f"(held-out text: {bench.texts.heldout_source}{held}; calibration: {bench.calibration.source})")
    return results


def route_for(cfg: RunConfig, *, pipe=None):
    """The planner's route of `cfg` on this machine (plan/route.py), after the cheap checks: the
    device exists, config.json and the ratio are valid. One-line TrspError when nothing fits.
    `pipe`: the run's resolved pipeline; by default the one `cfg` names (pipeline.named)."""
    from trsp_ray.plan import route

    workbench.resolve_device(cfg.device)
    workbench.check_inputs(cfg)
    kind, memory = workbench.device_kind(cfg)
    chosen = route.route(cfg, spec=(pipe or pipeline.named(cfg)).spec, device=kind, memory_gb=memory)
    if chosen.workers:  # what the workers cannot fit, refused before the run (and in `prune --dry-run`)
        from trsp_ray.distributed.compensate import check_for_workers

        check_for_workers(cfg, workers=chosen.workers)
    return chosen


def run_on_workers(cfg: RunConfig, chosen, *, overwrite: bool = False) -> dict:
    """`run` for a model the single-process plan cannot hold: stage 1, stage 2 and export on
    `chosen.workers` Ray Train workers (distributed/train.py), then held-out PPL of the export in
    this process when an evaluation pass fits one device."""
    from trsp_ray.config.run_config import replace
    from trsp_ray.distributed.train import run_distributed
    from trsp_ray.plan.single_plan import single_plan_for_run

    cfg_w = replace(cfg, **{"distributed.workers": chosen.workers, "distributed.use_gpu": chosen.device == "gpu"})
    result = run_distributed(cfg_w, overwrite=overwrite)
    results = {"method": cfg.method, "ratio": cfg.ratio, "route": f"{chosen.workers} workers",
               "dropped_layers": result.drop_order, "output": result.output, "storage": result.storage}
    kind, memory = workbench.device_kind(cfg)
    evaluation = single_plan_for_run(cfg, device=kind, memory_gb=memory, methods=("dense",))
    if not result.output or not evaluation.fits:
        log("held-out PPL skipped: " + ("nothing was exported" if not result.output else evaluation.reason()))
        return results
    texts = domains.load_texts(cfg.data.eval_text)
    for key, name in (("dense_ppl", cfg.model), ("heldout_ppl", result.output)):
        model, tokenizer = workbench.load_model(name, device=cfg.device, dtype=workbench.run_dtype(cfg))
        held = text_windows(tokenizer, texts, seqlen=cfg.data.eval_seqlen, max_windows=cfg.data.eval_max_windows)
        results[key] = ppl_of(nlls_of(model, held.windows, batch_size=4))
        results["heldout_windows"] = held.coverage()
        del model
        log(f"{key.replace('_', ' ')} {results[key]:.2f}")
    return results
