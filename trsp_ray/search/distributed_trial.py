"""A search trial whose model needs several GPUs: the trial process holds one CPU and drives
Ray Train from inside the trial (the Train V2 pattern for Tune), never loading the model itself.

    stage 1   TRSP: from the search's stage-1 store, else learned once by a Ray task on one device;
              another selector runs on the workers (run_distributed), its budget planned by budget.py
    stage 2   + export on `route.workers` Ray Train workers (trsp_ray/distributed/handoff.py)
    score     per-window validation NLLs of the export on the search's one validation text (the base
              config's calibration tail: search/objective.py), by a Ray task holding the evaluation GPUs

It reports only the final validation loss (ASHA never stops it early: Ray Train runs stage 2 as
one unit) and writes the same finished-trial record as a single-device trial, with the route,
the worker count and whether the exported drop set is the shared stage-1 one.
"""

from __future__ import annotations

import math
import time
from pathlib import Path

from trsp_ray.config import registry
from trsp_ray.run.stage1_store import result_dict, result_from, stage1_content
from trsp_ray.search.cache import stage1_for_trial
from trsp_ray.search.layout import MODELS, planned_n_drop, trial_record_path, trial_store

# Tune captures a trial's child tasks into the trial's own placement group, which holds only the
# trial's CPU; these tasks (like the Ray Train workers) take free cluster resources instead.
OUTSIDE_TRIAL = {"scheduling_strategy": "DEFAULT"}


def _stage1_task(run: dict, n_drop: int) -> dict:
    """Ray task body: stage 1 of `run` for `n_drop` layers on the device the task was given."""
    import ray

    from trsp_ray.config.run_config import from_dict, replace
    from trsp_ray.run.methods import run_stage1_for
    from trsp_ray.run.workbench import prepare
    from trsp_ray.search.route import trial_device

    cfg = from_dict(run)
    device = trial_device(cfg.device, gpu_ids=[str(i) for i in ray.get_gpu_ids()])
    return result_dict(run_stage1_for(prepare(replace(cfg, device=device)), n_drop=n_drop))


def _validation_task(model_dir: str, base: dict) -> dict:
    """Ray task body: per-window NLLs (nats) of an export on the search's validation text (the `base`
    config's calibration tail: search/objective.py), its parameters and layers, and the dense model's
    parameter count (from its config, on the meta device: no weights). Scored in the run's dtype
    (workbench.run_dtype, `dtype` resolved on this task's device), as a single-device trial scores:
    bf16 whenever a GPU was visible made the two kinds of trial rank on different numbers."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from trsp_ray.config.run_config import from_dict
    from trsp_ray.data import assets
    from trsp_ray.data.perplexity import bos_token, window_nlls
    from trsp_ray.evaluation.evaluator import load_candidate
    from trsp_ray.run.workbench import DTYPES, kept_parameters, run_dtype
    from trsp_ray.search.objective import text_id, validation_seqlen, validation_text

    dtype = str(DTYPES[run_dtype(from_dict(base))]).removeprefix("torch.")
    model, tokenizer = load_candidate(model_dir, dtype=dtype)
    bos = bos_token(tokenizer)
    val = validation_text(base, tokenizer, bos=bos)
    seqlen = validation_seqlen(val, bos)
    nlls = window_nlls(model, val.val_ids, seqlen=seqlen, batch_size=4, bos=bos)
    with torch.device("meta"):
        dense = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(assets.resolve_model(base["model"])))
    return {"val_loss": sum(nlls) / len(nlls), "val_nlls": nlls, "val_docs": list(val.val_docs[: len(nlls)]),
            "kept_parameters": kept_parameters(model),
            "dense_parameters": kept_parameters(dense), "layers": model.config.num_hidden_layers,
            "objective": {"split": "the base config's calibration held-out tail (no trial trains on it)",
                          "source": val.source, "text": text_id(val.val_ids), "tokens": int(val.val_ids.numel()),
                          "seqlen": seqlen, "windows": len(nlls)}}


def _budgeted(cfg, *, spec: registry.Method, stage1: dict | None, n_drop: int, num_layers: int) -> tuple:
    """(cfg with a budgeted heal's steps, the planned compute record): from stage 1's measured cost
    when this trial holds it, else budget.py's plan (the workers select; they report no cost here).
    `spec`: the trial's pipeline's registry entry (resolved where the trial starts)."""
    from trsp_ray.method.stage1 import stage1_cost
    from trsp_ray.plan import compute
    from trsp_ray.run import budget
    from trsp_ray.run.pipeline import training_steps
    from trsp_ray.run.workbench import model_hidden
    from trsp_ray.search.pipeline import budgeted

    select, fit, drop = budget.planned_select_cost(cfg, spec=spec, num_layers=num_layers), None, None
    if stage1 is not None:
        s1 = result_from(stage1)
        select = stage1_cost(s1, num_layers=num_layers, train_base=cfg.stage1.train_base)
        drop = s1.drop_for(spec.ranking, n_drop)
        cfg, fit = budgeted(cfg, spec=spec, drop=drop, select_cost=select, num_layers=num_layers,
                            hidden=model_hidden(cfg.model) or 1)
    elif cfg.heal.compute_budget:
        cfg = budget.resolve(cfg, spec=spec, num_layers=num_layers)
    fit = budget.planned_compensation_cost(cfg, spec=spec, num_layers=num_layers) if fit is None else fit
    select, steps = select or 0.0, training_steps(cfg, spec=spec)
    heal = compute.step_cost(cfg, spec=spec, drop=drop) * steps
    return cfg, {"select": select, "fit": fit, "heal": heal, "total": select + fit + heal,
                 "budget": cfg.heal.compute_budget or None, "heal_steps": steps, "planned": True}


def run_distributed_trial(config: dict, cfg, *, spec: registry.Method, report, log, tkey: str, skey: str) -> dict:
    """The trial as above; `config` is the Tune config (see trial.run_trial), `cfg` its RunConfig,
    `spec` its pipeline's registry entry (trial._execute resolved both)."""
    import ray

    from trsp_ray.common import atomic
    from trsp_ray.config.run_config import replace
    from trsp_ray.distributed.handoff import run_stage2_distributed
    from trsp_ray.method.stage1 import n_drop_for
    from trsp_ray.run.workbench import check_inputs

    route, search_dir, start = config["route"], Path(config["search_dir"]), time.perf_counter()
    num_layers = check_inputs(cfg)  # config.json only: the trial never holds the model
    n_drop = n_drop_for(cfg.ratio, num_layers)
    cfg_dict = cfg.to_dict()
    stage1 = None
    if spec.uses_stage1 and route.get("stage1_on_one_device", True):
        task = ray.remote(_stage1_task).options(num_cpus=1, num_gpus=1 if route["use_gpu"] else 0, **OUTSIDE_TRIAL)
        stage1 = result_dict(stage1_for_trial(
            need=n_drop, compute=lambda n: result_from(ray.get(task.remote(cfg_dict, n))),
            content=stage1_content(cfg_dict), store=trial_store(config), key=skey,
            plan_n_drop=planned_n_drop(config, skey), log=log, trial=tkey))
    cfg, planned = _budgeted(cfg, spec=spec, stage1=stage1, n_drop=n_drop, num_layers=num_layers)
    out = search_dir / MODELS / tkey
    dcfg = replace(cfg, output=str(out), **{
        "distributed.workers": route["workers"], "distributed.use_gpu": route["use_gpu"],
        "tracking.enabled": False,  # trials never write MLflow (one writer per store: the driver)
        "distributed.storage_path": cfg.distributed.storage_path or str(search_dir / "ray")})
    log.write("stage2_run", trial=tkey, key=skey, ratio=cfg.ratio, point=config["point"],
              route=f"ray-train x{route['workers']}")
    result, shared = run_stage2_distributed(dcfg, stage1=stage1, n_drop=n_drop, name=f"trial-{tkey}")
    scored = ray.get(ray.remote(_validation_task).options(num_cpus=1, num_gpus=route["eval_gpus"], **OUTSIDE_TRIAL)
                     .remote(str(out), config["run"]))
    drop = list(result.drop_order)
    record = {"trial_key": tkey, "stage1_key": skey, "point": config["point"], "config": cfg_dict,
              "status": "finished", "drop": drop, "kept": [i for i in range(num_layers) if i not in drop],
              "num_layers_original": num_layers, "val_loss": scored["val_loss"], "val_nlls": scored["val_nlls"],
              "val_docs": scored["val_docs"],
              "objective": scored["objective"], "val_ppl": math.exp(scored["val_loss"]),
              "kept_parameters": scored["kept_parameters"],
              "dense_parameters": scored["dense_parameters"],
              "kept_fraction": scored["kept_parameters"] / scored["dense_parameters"],
              "gates": [], "curve": [], "seconds": time.perf_counter() - start, "model_dir": str(out),
              "route": "ray-train", "workers": route["workers"], "stage1_shared": shared, "method": cfg.method,
              "compute": planned, "total_compute": planned["total"],
              "info": {"storage": result.storage}}
    if scored["layers"] != num_layers - len(drop):
        raise RuntimeError(f"export {out} has {scored['layers']} layers, expected {num_layers - len(drop)}")
    atomic.write_json(trial_record_path(search_dir, tkey), record)
    log.write("trial_finished", trial=tkey, val_ppl=record["val_ppl"])
    report({"val_loss": record["val_loss"], "val_ppl": record["val_ppl"], "kept_parameters": record["kept_parameters"],
            "kept_fraction": record["kept_fraction"], "trial_key": tkey, "phase": "final", "done_trial": 1})
    return record
