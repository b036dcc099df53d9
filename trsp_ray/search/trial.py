"""One search trial as a Ray Tune function trainable: its pipeline's selection (TRSP's stage 1 or a
baseline's, reused or computed once), the heal steps a compute budget leaves, stage 2 or the heal
with validation loss reported for ASHA, removal, export, and a finished-trial record with the
trial's compute (selection / fit / heal / total, dense-forward tokens) and kept parameters.

Everything the trial needs arrives in Tune's `config` as plain data (SPEC: plain dicts cross Ray
boundaries). Selection signals come from one validation text for every trial (the base config's
calibration tail, which no trial trains on: search/objective.py), kept window by window; held-out
perplexity is measured afterwards by the evaluation pool, so no held-out text steers the search.
MLflow is written by the driver only, to keep one writer per tracking store.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

from trsp_ray.config import registry
from trsp_ray.run.pipeline import training_steps
from trsp_ray.run.stage1_store import stage1_content
from trsp_ray.search.cache import RunLog, fit_for_trial, selection_for_trial, stage1_for_trial
from trsp_ray.search.layout import MODELS, planned_n_drop, trial_record_path, trial_store
from trsp_ray.search.pipeline import budgeted
from trsp_ray.search.space import apply_point, trial_key

REPORTS = 4  # validation reports over a trial's training steps when the search sets no val_every


def validation_nlls(bench, model, *, windows: int | None = None) -> list[float]:
    """Mean next-token NLL (nats) of each of the first `windows` (None: every) window of the search's
    validation text (bench.val_ids: objective.validation_text), leaving the model's mode as it was."""
    from trsp_ray.data.perplexity import window_nlls

    was_training = model.training
    try:
        return window_nlls(model, bench.val_ids, seqlen=bench.val_seqlen, batch_size=4,
                           max_windows=windows, bos=bench.bos)
    finally:
        model.train(was_training)


def validation_loss(bench, model, *, windows: int) -> float:
    """Mean NLL (nats) over the first `windows` validation windows: what ASHA reads mid-training."""
    nlls = validation_nlls(bench, model, windows=windows)
    return sum(nlls) / len(nlls)


def with_objective(bench, config: dict, cfg_dict: dict) -> dict:
    """Point `bench` at the search's validation text (the base config's calibration tail, the same
    for every trial: its chunks, each one source's, and their documents). The trial's training text
    is already without it (data.validation_base, workbench.calibration_of). Returns what the record
    says of the objective."""
    from trsp_ray.search.objective import text_id, validation_seqlen, validation_text

    val = validation_text(config["run"], bench.tokenizer, bos=bench.bos)
    bench.val_ids, bench.val_docs, bench.val_seqlen = val.val_ids, list(val.val_docs), validation_seqlen(val, bench.bos)
    return {"split": "the base config's calibration held-out tail (no trial trains on it)", "source": val.source,
            "text": text_id(val.val_ids), "tokens": int(val.val_ids.numel()), "seqlen": bench.val_seqlen,
            "left_out_training_chunks": bench.calibration.left_out}


def expected_kept_parameters(bench, drop: list[int]) -> int:
    """Parameters left once `drop` is removed (known before stage 2: a multi-objective searcher wants
    every intermediate report to carry the same metrics as the final one)."""
    from trsp_ray.models.families import decoder_layers
    from trsp_ray.run.workbench import kept_parameters

    layers = decoder_layers(bench.model)
    return kept_parameters(bench.model) - sum(p.numel() for i in drop for p in layers[i].parameters())


TRAINING_METRICS = ("stage2/ce", "heal/ce")  # what a step of stage 2 or of a heal reports


def _stage2_reporter(bench, made: list, *, every: int, steps: int, windows: int, report, curve: list,
                     constant: dict | None = None):
    """The `report` a trial hands the method: every `every` training steps (stage 2's or the heal's)
    the calibration held-out loss of the working copy, for ASHA."""
    def on_metrics(metrics: dict, step: int) -> None:
        name = next((m for m in TRAINING_METRICS if m in metrics), None)
        if name is None or not made:
            return
        if step % every and step != steps:
            return
        loss = validation_loss(bench, made[-1], windows=windows)
        phase = name.split("/")[0]
        curve.append({"step": step, "val_loss": loss, "stage2_ce": metrics[name], "phase": phase})
        report({"val_loss": loss, "val_ppl": math.exp(loss), "stage2_step": step,
                "stage2_ce": metrics[name], "phase": phase, **(constant or {})})
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
    data_fp, reuse, plan_n_drop ({stage-1 key: layers}), default_plan_n_drop, num_layers, ignored
    ({trial key: keys dropped from its point}), val_every, val_windows, threads, invocation, route
    (route.TrialRoute as a dict)."""
    import ray
    from ray import tune

    _execute(config, report=tune.report, gpu_ids=[str(i) for i in ray.get_gpu_ids()])


def _selection(bench, cfg_dict: dict, config: dict, *, spec: registry.Method, key: str, log, trial: str):
    """(drop set, selection info, stage-1 result or None) of the trial's pipeline (`spec`, resolved
    where the trial starts): TRSP's from the stage-1 store, a baseline's from the selection store,
    each computed once per key (search/cache.py)."""
    from trsp_ray.method.gates import attach_gates
    from trsp_ray.method.stage1 import stage1_cost
    from trsp_ray.run.methods import run_stage1_for, select
    from trsp_ray.search.pipeline import selection_content

    cfg, n_drop = bench.cfg, bench.n_drop()
    if spec.uses_stage1:
        stage1 = stage1_for_trial(need=n_drop, compute=lambda n: run_stage1_for(bench, n_drop=n),
                                  content=stage1_content(cfg_dict), store=trial_store(config), key=key,
                                  plan_n_drop=planned_n_drop(config, key), log=log, trial=trial)
        info = {"calib_tokens": stage1.tokens + stage1.probe_tokens, "stage1_steps": stage1.steps,
                "select_cost": stage1_cost(stage1, num_layers=bench.num_layers, train_base=cfg.stage1.train_base)}
        return stage1.drop_for(spec.ranking, n_drop), info, stage1

    def compute() -> tuple[list[int], dict]:
        model = bench.fresh_model()
        try:
            return select(bench, spec, model=model, gates=attach_gates(model, gate_mode=cfg.gates.gate))
        finally:
            del model

    drop, info = selection_for_trial(need=n_drop, compute=compute, content=selection_content(cfg, n_drop, spec=spec),
                                     store=trial_store(config), key=key, log=log, trial=trial)
    return drop, info, None


def compute_record(info: dict, *, budget: float) -> dict:
    """A trial's compute in dense-forward tokens (SPEC section 5): selection, fit, heal, total."""
    from trsp_ray.plan import compute

    heal = compute.train_spent(info)
    return {"select": info.get("select_cost", 0.0), "fit": compute.fit_spent(info), "heal": heal,
            "total": compute.total_cost(info), "budget": budget or None,
            "heal_steps": info.get("heal_steps", 0) + info.get("stage2_steps", 0)}


def _execute(config: dict, *, report, gpu_ids: list | tuple = ()) -> dict:
    """One trial; `gpu_ids` are the GPUs Ray assigned to it (the route in `config` says how many)."""
    import torch

    from trsp_ray.config.run_config import from_dict, replace
    from trsp_ray.models import families
    from trsp_ray.run.methods import apply_method
    from trsp_ray.run.pipeline import resolve
    from trsp_ray.run.workbench import check_inputs, kept_parameters, prepare, validation_base
    from trsp_ray.search.pipeline import fit_key, search_fingerprint, selection_key_of
    from trsp_ray.search.route import trial_device

    torch.set_num_threads(int(config.get("threads") or 1))
    search_dir = Path(config["search_dir"])
    cfg_dict = apply_point(config["run"], config["point"])
    pipe = resolve(from_dict(cfg_dict), budget_layers=False)  # the trial's pipeline on this model, resolved once
    spec = pipe.spec
    # both routes' calibration (workbench.calibration_of) leave out the text the trial is scored on
    cfg = replace(pipe.cfg, **{"data.validation_base": json.dumps(validation_base(from_dict(config["run"])))})
    tkey = trial_key(cfg_dict)
    num_layers = int(config.get("num_layers") or check_inputs(cfg))
    skey = selection_key_of(cfg_dict, config.get("search_fp") or search_fingerprint(config["run"]), spec=spec,
                            num_layers=num_layers)
    log = RunLog(search_dir, invocation=config["invocation"])
    if (config.get("route") or {}).get("workers"):
        from trsp_ray.search.distributed_trial import run_distributed_trial

        return run_distributed_trial(config, cfg, spec=spec, report=report, log=log, tkey=tkey, skey=skey)
    device = trial_device(cfg.device, gpu_ids=list(gpu_ids))
    log.write("trial_started", trial=tkey, device=device, gpu_ids=list(gpu_ids))
    start = time.perf_counter()
    bench = prepare(replace(cfg, device=device))
    objective = with_objective(bench, config, cfg_dict)
    windows = int(config.get("val_windows") or 8)
    drop, select_info, stage1 = _selection(bench, cfg_dict, config, spec=spec, key=skey, log=log, trial=tkey)
    bench.cfg, _ = budgeted(bench.cfg, spec=spec, drop=drop, select_cost=select_info["select_cost"],
                            num_layers=bench.num_layers, hidden=families.text_config(bench.model).hidden_size)
    # a trial Tune stops is never resumed (a rerun of the search starts it again): no heal checkpoints
    bench.cfg = replace(bench.cfg, **{"heal.checkpoint_minutes": None})
    steps = training_steps(bench.cfg, spec=spec)
    every = int(config.get("val_every") or max(1, -(-steps // REPORTS)))
    made: list = []  # the working copy apply_method trains (on_model): validation loss is measured on it
    curve: list = []
    dense = kept_parameters(bench.model)
    expected = expected_kept_parameters(bench, drop)
    on_metrics = _stage2_reporter(bench, made, every=every, steps=steps, windows=windows, report=report, curve=curve,
                                  constant={"kept_parameters": expected, "kept_fraction": expected / dense})
    log.write("stage2_run", trial=tkey, key=skey, ratio=cfg.ratio, point=config["point"], method=cfg.method,
              steps=steps)
    fits = fit_for_trial(store=trial_store(config), key=fit_key(bench.cfg.to_dict(), selection=skey, drop=drop),
                         log=log, trial=tkey)
    outcome = apply_method(bench, spec, drop=drop, report=on_metrics, on_model=made.append, fit_store=fits)
    info = {**select_info, **outcome.info}
    nlls = validation_nlls(bench, outcome.model)  # every window of the validation text: the objective
    val = sum(nlls) / len(nlls)
    kept = kept_parameters(outcome.model)
    if kept != expected:  # the removal must cut exactly the parameters of the chosen layers
        raise RuntimeError(f"removal left {kept} parameters, expected {expected} for drop {outcome.drop}")
    record = {"trial_key": tkey, "stage1_key": skey, "point": config["point"], "config": cfg_dict,
              "method": cfg.method, "ignored": (config.get("ignored") or {}).get(tkey, {}),
              "resolved": {"stage2.steps": bench.cfg.stage2.steps, "heal.steps": bench.cfg.heal.steps},
              "status": "finished", "drop": outcome.drop, "kept": outcome.kept,
              "num_layers_original": bench.num_layers, "val_loss": val, "val_ppl": math.exp(val), "val_nlls": nlls,
              "val_docs": bench.val_docs[: len(nlls)],
              "objective": {**objective, "windows": len(nlls), "report_windows": windows},
              "compute": compute_record(info, budget=bench.cfg.heal.compute_budget),
              "kept_parameters": kept, "dense_parameters": dense, "kept_fraction": kept / dense,
              "gates": gates_at_ratio(stage1, len(outcome.drop)) if stage1 is not None else [], "curve": curve,
              "seconds": time.perf_counter() - start, "device": device, "gpu_ids": list(gpu_ids), "route": "single",
              "info": {k: v for k, v in info.items() if k != "relative_update"}}
    record["total_compute"] = record["compute"]["total"]
    record["model_dir"] = _export(outcome, bench, search_dir, tkey, record)
    from trsp_ray.common import atomic

    atomic.write_json(trial_record_path(search_dir, tkey), record)
    log.write("trial_finished", trial=tkey, val_ppl=record["val_ppl"], total_compute=record["total_compute"])
    report({"val_loss": val, "val_ppl": record["val_ppl"], "kept_parameters": kept,
            "kept_fraction": record["kept_fraction"], "trial_key": tkey, "phase": "final", "done_trial": 1})
    return record


def _export(outcome, bench, search_dir: Path, key: str, record: dict) -> str:
    from trsp_ray.run.export import export_model, pruned_manifest

    manifest = pruned_manifest(method=bench.cfg.method, drop=outcome.drop, num_layers_original=bench.num_layers,
                               config=record["config"], search_trial=key,
                               metrics={k: record[k] for k in ("val_ppl", "kept_parameters", "kept_fraction",
                                                                "total_compute")})
    # overwrite: a trial retried after a crash replaces its own half-finished export
    path = export_model(outcome.model, bench.tokenizer, str(search_dir / MODELS / key), manifest=manifest,
                        overwrite=True)
    return str(path)
