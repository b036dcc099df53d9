"""One search trial as a Ray Tune function trainable: stage 1 (reused or computed once), stage 2
with validation loss reported for ASHA, removal, export, and a finished-trial record.

Everything the trial needs arrives in Tune's `config` as plain data (SPEC: plain dicts cross Ray
boundaries). Selection signals come from the validation split (the calibration tail, never trained
on); held-out perplexity is measured afterwards by the evaluation pool, so no held-out text steers
the search. MLflow is written by the driver only, to keep one writer per tracking store.
"""

from __future__ import annotations

import math
import time
from pathlib import Path

from trsp_ray.search.cache import RunLog, stage1_for_trial
from trsp_ray.search.layout import MODELS, planned_n_drop, trial_record_path, trial_store
from trsp_ray.search.space import apply_point, trial_key
from trsp_ray.stage1_store import compute_stage1, stage1_content, stage1_key


def validation_loss(bench, model, *, windows: int) -> float:
    """Mean next-token NLL (nats) on the validation split, leaving the model's train/eval mode as it was."""
    from trsp_ray.perplexity import perplexity

    was_training = model.training
    try:
        ppl = perplexity(model, bench.val_ids, seqlen=bench.cfg.data.eval_seqlen, batch_size=4,
                         max_windows=windows, bos=bench.bos)
    finally:
        model.train(was_training)
    return math.log(ppl)


def expected_kept_parameters(bench, drop: list[int]) -> int:
    """Parameters left once `drop` is removed (known before stage 2: a multi-objective searcher wants
    every intermediate report to carry the same metrics as the final one)."""
    from trsp_ray.families import decoder_layers
    from trsp_ray.workbench import kept_parameters

    layers = decoder_layers(bench.model)
    return kept_parameters(bench.model) - sum(p.numel() for i in drop for p in layers[i].parameters())


def _stage2_reporter(bench, made: list, *, every: int, steps: int, windows: int, report, curve: list,
                     constant: dict | None = None):
    def on_metrics(metrics: dict, step: int) -> None:
        if "stage2/ce" not in metrics or not made:
            return
        if step % every and step != steps:
            return
        loss = validation_loss(bench, made[-1], windows=windows)
        curve.append({"step": step, "val_loss": loss, "stage2_ce": metrics["stage2/ce"]})
        report({"val_loss": loss, "val_ppl": math.exp(loss), "stage2_step": step,
                "stage2_ce": metrics["stage2/ce"], "phase": "stage2", **(constant or {})})
    return on_metrics


def gates_at_ratio(stage1, n_drop: int) -> list[float]:
    """Gate values when the n_drop-th layer was chosen (end of that selection round)."""
    if not stage1.gate_history:
        return []
    rounds = stage1.round_ends
    end = rounds[min(n_drop, len(rounds)) - 1] if rounds else len(stage1.gate_history)
    return list(stage1.gate_history[end - 1])


def run_trial(config: dict) -> None:
    """Tune entry point. `config`: run (base config dict), point (searched values), search_dir,
    data_fp, reuse, plan_n_drop ({stage-1 key: layers}), default_plan_n_drop, val_every,
    val_windows, threads, invocation, route (route.TrialRoute as a dict)."""
    import ray
    from ray import tune

    _execute(config, report=tune.report, gpu_ids=[str(i) for i in ray.get_gpu_ids()])


def _execute(config: dict, *, report, gpu_ids: list | tuple = ()) -> dict:
    """One trial; `gpu_ids` are the GPUs Ray assigned to it (the route in `config` says how many)."""
    import torch

    from trsp_ray.config import from_dict, replace
    from trsp_ray.methods import apply_method
    from trsp_ray.search.route import trial_device
    from trsp_ray.workbench import kept_parameters, prepare

    torch.set_num_threads(int(config.get("threads") or 1))
    search_dir = Path(config["search_dir"])
    cfg_dict = apply_point(config["run"], config["point"])
    cfg = from_dict(cfg_dict)
    tkey, skey = trial_key(cfg_dict), stage1_key(cfg_dict, config["data_fp"])
    log = RunLog(search_dir, invocation=config["invocation"])
    if (config.get("route") or {}).get("workers"):
        from trsp_ray.search.distributed_trial import run_distributed_trial

        return run_distributed_trial(config, cfg, report=report, log=log, tkey=tkey, skey=skey)
    device = trial_device(cfg.device, gpu_ids=list(gpu_ids))
    log.write("trial_started", trial=tkey, device=device, gpu_ids=list(gpu_ids))
    start = time.perf_counter()
    bench = prepare(replace(cfg, device=device))
    windows = int(config.get("val_windows") or 8)
    stage1 = stage1_for_trial(need=bench.n_drop(), compute=lambda n: compute_stage1(bench, n),
                              content=stage1_content(cfg_dict), store=trial_store(config),
                              key=skey, plan_n_drop=planned_n_drop(config, skey), log=log, trial=tkey)
    made: list = []  # the working copy apply_method trains (on_model): validation loss is measured on it
    every = max(1, int(config.get("val_every") or 1))
    curve: list = []
    n_drop = bench.n_drop()
    drop = stage1.drop_for(cfg.method, n_drop)
    dense = kept_parameters(bench.model)
    expected = expected_kept_parameters(bench, drop)
    on_metrics = _stage2_reporter(bench, made, every=every, steps=cfg.stage2.steps, windows=windows,
                                  report=report, curve=curve,
                                  constant={"kept_parameters": expected, "kept_fraction": expected / dense})
    log.write("stage2_run", trial=tkey, key=skey, ratio=cfg.ratio, point=config["point"])
    outcome = apply_method(bench, cfg.method, stage1=stage1, report=on_metrics, on_model=made.append)
    val = validation_loss(bench, outcome.model, windows=windows)
    n_drop = len(outcome.drop)
    kept = kept_parameters(outcome.model)
    if kept != expected:  # the removal must cut exactly the parameters of the chosen layers
        raise RuntimeError(f"removal left {kept} parameters, expected {expected} for drop {outcome.drop}")
    record = {"trial_key": tkey, "stage1_key": skey, "point": config["point"], "config": cfg_dict,
              "status": "finished", "drop": outcome.drop, "kept": outcome.kept,
              "num_layers_original": bench.num_layers, "val_loss": val, "val_ppl": math.exp(val),
              "kept_parameters": kept, "dense_parameters": dense, "kept_fraction": kept / dense,
              "gates": gates_at_ratio(stage1, n_drop), "curve": curve, "seconds": time.perf_counter() - start,
              "device": device, "gpu_ids": list(gpu_ids), "route": "single",
              "info": {k: v for k, v in outcome.info.items() if k != "relative_update"}}
    record["model_dir"] = _export(outcome, bench, search_dir, tkey, record)
    from trsp_ray import atomic

    atomic.write_json(trial_record_path(search_dir, tkey), record)
    log.write("trial_finished", trial=tkey, val_ppl=record["val_ppl"])
    report({"val_loss": val, "val_ppl": record["val_ppl"], "kept_parameters": kept,
            "kept_fraction": record["kept_fraction"], "trial_key": tkey, "phase": "final", "done_trial": 1})
    return record


def _export(outcome, bench, search_dir: Path, key: str, record: dict) -> str:
    from trsp_ray.export import export_model, pruned_manifest

    manifest = pruned_manifest(method=bench.cfg.method, drop=outcome.drop, num_layers_original=bench.num_layers,
                               config=record["config"], search_trial=key,
                               metrics={k: record[k] for k in ("val_ppl", "kept_parameters", "kept_fraction")})
    # overwrite: a trial retried after a crash replaces its own half-finished export
    path = export_model(outcome.model, bench.tokenizer, str(search_dir / MODELS / key), manifest=manifest,
                        overwrite=True)
    return str(path)
