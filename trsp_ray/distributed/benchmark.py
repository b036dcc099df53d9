"""The method comparison (`trsp-ray benchmark`) as a local or cluster Ray workload.

Stage 1 and the rows that do not need it (dense, ShortGPT, SLEB, their heals) start at once on
separate workers; the TRSP rows start as soon as stage 1 is done, reusing its drop order. Workers
send back plain dicts (metrics per step included) and the driver alone writes to MLflow, so the
sqlite store never sees two writers.
"""

from __future__ import annotations

import dataclasses
import time


def _buffered_report():
    history: list[tuple[dict, int]] = []
    return history, (lambda metrics, step: history.append((dict(metrics), step)))


def _stage1_task(cfg_dict: dict, threads: int) -> dict:
    import torch

    from trsp_ray.config import from_dict
    from trsp_ray.methods import run_stage1_for
    from trsp_ray.pipeline import prepare

    torch.set_num_threads(threads)
    bench = prepare(from_dict(cfg_dict))
    history, report = _buffered_report()
    t0 = time.time()
    result = run_stage1_for(bench, report=report)
    return {"stage1": dataclasses.asdict(result), "history": history, "seconds": time.time() - t0}


def _row_task(cfg_dict: dict, row: str, stage1: dict | None, threads: int) -> dict:
    import torch

    from trsp_ray.bench import run_row
    from trsp_ray.config import from_dict
    from trsp_ray.pipeline import prepare
    from trsp_ray.stage1 import Stage1Result

    torch.set_num_threads(threads)
    bench = prepare(from_dict(cfg_dict))
    history, report = _buffered_report()
    result = run_row(bench, row, stage1=Stage1Result(**stage1) if stage1 else None, report=report)
    return {**result, "history": history}


def run_benchmark_ray(cfg, rows: tuple[str, ...], *, workers: int = 2) -> list[dict]:
    """Run the benchmark rows as Ray tasks (one CPU each); returns the printed rows."""
    import ray

    from trsp_ray import plots
    from trsp_ray.bench import _log_tables, print_results, table_rows
    from trsp_ray.pipeline import kept_parameters, log, prepare
    from trsp_ray.stage1 import Stage1Result
    from trsp_ray.tracking import make_tracker

    bench = prepare(cfg)  # validates everything and warms the caches before any worker starts
    started = not ray.is_initialized()
    if started:
        ray.init(num_cpus=workers, include_dashboard=False, log_to_driver=True)
    threads = max(1, int(ray.cluster_resources().get("CPU", workers)) // max(1, workers))
    stage1_remote = ray.remote(num_cpus=1)(_stage1_task)
    row_remote = ray.remote(num_cpus=1)(_row_task)
    cfg_dict = cfg.to_dict()
    t = cfg.tracking
    tracker = make_tracker(enabled=t.enabled, tracking_uri=t.tracking_uri, experiment=t.experiment)
    raw, stage1, stage1_seconds = [], None, 0.0
    try:
        with tracker.run(f"benchmark-r{cfg.ratio}", tags={"kind": "benchmark", "model": cfg.model, "ray": "1"}):
            tracker.log_params(cfg.to_dict())
            tracker.log_params({"data.heldout_source": bench.texts.heldout_source, "rows": ",".join(rows),
                                "ray.workers": workers})
            trsp_rows = [r for r in rows if r.startswith("trsp")]
            pending = {}
            if trsp_rows:  # submitted first: stage 1 is on the critical path of four rows
                pending[stage1_remote.remote(cfg_dict, threads)] = "stage 1"
            pending.update({row_remote.remote(cfg_dict, r, None, threads): r for r in rows if r not in trsp_rows})
            log(f"benchmark on Ray: {len(rows)} rows over {workers} workers ({threads} threads each)")
            while pending:
                [ref], _ = ray.wait(list(pending), num_returns=1)
                name = pending.pop(ref)
                out = ray.get(ref)
                if name == "stage 1":
                    stage1, stage1_seconds = Stage1Result(**out["stage1"]), out["seconds"]
                    _log_stage1(tracker, plots, out, stage1)
                    log(f"stage 1 done in {stage1_seconds:.0f}s: drop order {stage1.drop_order}")
                    pending.update({row_remote.remote(cfg_dict, r, out["stage1"], threads): r for r in trsp_rows})
                    continue
                raw.append(out)
                with tracker.run(name, nested=True, tags={"method": name}):
                    for metrics, step in out.pop("history"):
                        tracker.log_metrics(metrics, step)
                    tracker.log_metrics({"heldout_ppl": out["held-out PPL"]})
                    tracker.log_dict({"drop_order": out["drop order"], **out["info"]}, "result.json")
                log(f"[{len(raw)}/{len(rows)}] {name}: held-out PPL {out['held-out PPL']:.2f} ({out['seconds']:.0f}s)")
            raw.sort(key=lambda r: rows.index(r["method"]))
            results = table_rows(raw, dense_params=kept_parameters(bench.model), stage1_seconds=stage1_seconds)
            _log_tables(tracker, results)
    finally:
        if started:
            ray.shutdown()
    print_results(results, bench=bench, stage1=stage1)
    return results


def _log_stage1(tracker, plots, out: dict, stage1) -> None:
    with tracker.run("stage 1", nested=True, tags={"stage": "1"}):
        for metrics, step in out["history"]:
            tracker.log_metrics(metrics, step)
        tracker.log_figure(plots.gate_trajectories(stage1.gate_history, stage1.round_ends, stage1.drop_order),
                           "stage1_gates.png")
        tracker.log_dict({"drop_order": stage1.drop_order, "round1_ranking": stage1.round1_ranking},
                         "stage1_drop_order.json")
