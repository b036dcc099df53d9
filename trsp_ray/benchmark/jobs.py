"""The work units of the comparison (`trsp-ray benchmark`): one selection, one row.

They take and return plain dicts so that a runner can execute them in this process
(comparison.run_local) or as Ray tasks (benchmark/cluster.py). A row is scored on the
held-out documents of every text domain (trsp_ray.data.domains; per-window losses kept for paired
verdicts) and, when asked, on LAMBADA's last-word accuracy through lm-eval, per passage (a
passage-level task users prune for; reported, never used to select or tune anything).
"""

from __future__ import annotations

import dataclasses
import math
import time

from trsp_ray.config import registry
from trsp_ray.config.budgets import COMPUTE_BUDGET_FROM, budget_label
from trsp_ray.config.run_config import RunConfig, compensated, from_dict, replace
from trsp_ray.plan import compute


def seeded(cfg_dict: dict, seed: int) -> RunConfig:
    return replace(from_dict(cfg_dict), seed=seed)


def selection_job(cfg_dict: dict, selector: str, seed: int) -> dict:
    """One selection (trsp = a stage-1 run; shortgpt, sleb, random) for one seed, as a plain dict."""
    from trsp_ray.common.logs import log
    from trsp_ray.method.gates import attach_gates
    from trsp_ray.run.methods import run_stage1_for, select
    from trsp_ray.run.workbench import prepare

    bench = prepare(seeded(cfg_dict, seed))
    t0 = time.time()
    log(f"selection {selector} (seed {seed}): {bench.n_drop()} of {bench.num_layers} layers")
    history: list = []
    method = next(m for m in registry.METHODS.values() if m.selector == selector)  # its registered spec
    model = bench.fresh_model()
    gates = attach_gates(model, gate_mode=bench.cfg.gates.gate)
    stage1 = None
    if selector == registry.TRSP_SELECTOR:
        stage1 = run_stage1_for(bench, model=model, report=lambda m, s: history.append((dict(m), s)))
    drop, info = select(bench, method, model=model, gates=gates, stage1=stage1)
    out = {"selector": selector, "seed": seed, "seconds": time.time() - t0, "info": info, "history": history,
           "drops": {m.name: (stage1.drop_for(m.ranking, bench.n_drop()) if stage1 else drop)
                     for m in registry.METHODS.values() if m.selector == selector}}
    if stage1 is not None:
        out["stage1"] = dataclasses.asdict(stage1)
    log(f"selection {selector} (seed {seed}) done in {out['seconds']:.0f}s: {drop}")
    return out


def export_row(model, bench, *, row_name: str, drop: list[int], target: str, metrics: dict) -> str:
    """A row's model for the zero-shot scorers (a scratch directory of this benchmark)."""
    from trsp_ray.run.export import export_model, pruned_manifest

    manifest = pruned_manifest(method=row_name, drop=drop, num_layers_original=bench.num_layers,
                               config=bench.cfg.to_dict(), metrics=metrics)
    return str(export_model(model, bench.tokenizer, target, manifest=manifest, overwrite=True))


def heal_steps(row: registry.Row, cfg: RunConfig, *, budget: int = 1, extra_steps: int = 0) -> int:
    """Weight-update batches of a trained row: stage2.steps times the budget multiplier, plus the
    extra heal steps an equal-compute row is given (what `trsp+heal` heals is methods.method_heal)."""
    return cfg.stage2.steps * budget + extra_steps if row.group == "trained" else 0


def budget_configs(row: registry.Row, cfg: RunConfig, *, budget: int = 1, extra_steps: int = 0):
    """(stage-2 config, heal config) that give a row its share: trained rows all get the same
    weight-update batches with the same objective (equal-compute rows more, see heal_steps)."""
    no_heal = replace(cfg.heal, steps=0)
    steps = heal_steps(row, cfg, budget=budget, extra_steps=extra_steps)
    if row.recovery == "heal":
        return replace(cfg.stage2, enabled=False), replace(cfg.heal, steps=steps, lr=cfg.stage2.lr,
                                                            trainable=cfg.stage2.trainable,
                                                            lora_rank=cfg.stage2.lora_rank)
    if row.recovery == "stage2":
        return replace(cfg.stage2, enabled=True, steps=steps), no_heal
    return replace(cfg.stage2, enabled=False), no_heal


def equal_compute_steps(cfg: RunConfig, selection: dict, reference: dict | None, *, spec: registry.Method,
                        drop=None) -> int:
    """Extra heal steps that bring a baseline's selection compute up to TRSP's (the reference), at the
    cost of one step of the row's own recipe (`cfg` the row's config, `spec` its pipeline's registry
    entry, `drop` its drop set)."""
    if reference is None:
        return 0
    extra = reference["info"]["select_cost"] - selection["info"]["select_cost"]
    return compute.extra_heal_steps(extra, step_cost=compute.step_cost(cfg, spec=spec, drop=drop))


def full_heal_steps(cfg: RunConfig, row: registry.Row, *, spec: registry.Method, drop, budget: int = 1) -> int:
    """Extra steps of a partial heal (`spec`'s recipe: tail, map, LoRA) that spend what a full heal of
    the row's steps would cost beyond it (an '@full' row: partial and full heals at equal compute)."""
    steps = heal_steps(row, cfg, budget=budget)
    own = compute.step_cost(cfg, spec=spec, drop=drop)
    full = compute.step_cost(cfg, spec=spec, drop=drop, trainable="all")
    return compute.extra_heal_steps(steps * (full - own), step_cost=own)


def objective_steps(cfg: RunConfig, row: registry.Row, *, spec: registry.Method, drop, budget: int = 1) -> int:
    """Steps to add (negative: to take away) so that a row trained with its own objective (an '@kd'
    row: `cfg` distils, each step also runs the dense teacher) spends what the same row's heal steps
    cost with cross-entropy: the objectives compared at equal training compute."""
    steps = heal_steps(row, cfg, budget=budget)
    own = compute.step_cost(cfg, spec=spec, drop=drop)
    ce = compute.step_cost(replace(cfg, **{"recovery.objective": "ce"}), spec=spec, drop=drop)
    return max(1, round(steps * ce / own)) - steps if steps else 0


def compensation_steps(cfg: RunConfig, drop, *, spec: registry.Method, num_layers: int,
                       row_cfg: RunConfig | None = None) -> int:
    """Heal steps of the row's recipe (`row_cfg`, default `cfg`, whose pipeline's registry entry is
    `spec`) that spend what a +comp row's fit of `drop` costs (its passes and float64 solve: an
    '@comp' row's extra)."""
    from trsp_ray.run import budget

    cost = budget.fit_cost(compensated(cfg), spec=spec, drop=drop, num_layers=num_layers)
    return compute.extra_heal_steps(cost, step_cost=compute.step_cost(row_cfg or cfg, spec=spec, drop=drop))


def compute_budget_steps(cfg: RunConfig, row: registry.Row, selection: dict, *, spec: registry.Method, drop,
                         num_layers: int) -> int:
    """Steps of a trained row at total compute cfg.heal.compute_budget: what it leaves after the row's
    selection (as measured) and its fit (plan.compute.heal_steps, each step at the row's recipe's and
    objective's cost, a distillation's teacher included)."""
    from trsp_ray.run import budget

    comp = budget.fit_cost(cfg, spec=spec, drop=drop, num_layers=num_layers)
    return compute.heal_steps(cfg, spec=spec, select=selection["info"].get("select_cost", 0.0), comp=comp, drop=drop)


def lambada(bench, model, *, limit: int) -> dict:
    """LAMBADA last-word accuracy (lm-eval's lambada_openai rule) on the first `limit` test passages,
    with its standard error and the per-passage results (0/1, in passage order) for paired verdicts,
    through lm-eval's offline task."""
    from trsp_ray.evaluation.harness import run_tasks
    from trsp_ray.evaluation.tasks import CAPABILITY_TASK

    scores = run_tasks(model, bench.tokenizer, tasks=[CAPABILITY_TASK], limit=limit, batch_size=16, items=True)
    entry = scores["tasks"][CAPABILITY_TASK]
    acc, n = entry["acc"], entry.get("n") or limit
    return {"acc": acc, "se": math.sqrt(acc * (1 - acc) / n), "n": n, "items": entry["items"]["acc"]}


def domain_windows(bench, name: str):
    """A domain's held-out windows (trsp_ray.data.heldout): one per held-out document (short ones
    joined until they fill a window), up to data.eval_max_windows, each with its document."""
    from trsp_ray.data.heldout import domain_windows as windows_of

    d = bench.cfg.data
    return windows_of(bench.tokenizer, name, seqlen=d.eval_seqlen, max_windows=d.eval_max_windows)


def domain_coverage(bench) -> dict[str, dict]:
    """{domain: its held-out windows' documents, tokens and the document of each window} of every
    scored domain: what the report prints beside each column and what paired SEs cluster on."""
    from trsp_ray.data.domains import eval_domain_names

    out = {}
    for name in eval_domain_names(bench.cfg.data.eval_domains):
        w = domain_windows(bench, name)
        out[name] = {**w.coverage(), "docs": list(w.docs)}
    return out


def domain_nlls(bench, model) -> dict[str, list[float]]:
    """{domain: per-window mean NLL} of `model` on every scored domain's held-out windows
    (data.eval_domains; `domain_windows`, BOS per window)."""
    from trsp_ray.data.domains import eval_domain_names
    from trsp_ray.data.perplexity import nlls_of

    return {name: nlls_of(model, domain_windows(bench, name).windows, batch_size=4)
            for name in eval_domain_names(bench.cfg.data.eval_domains)}


def domain_ppl(bench, model, name: str) -> float:
    """One domain's held-out PPL, with `domain_nlls`' windows."""
    from trsp_ray.data.perplexity import nlls_of, ppl_of

    return ppl_of(nlls_of(model, domain_windows(bench, name).windows, batch_size=4))


def _dense_cached(bench, what: dict, compute, *, files: tuple = ()):
    """`compute()` of the original model, computed once and cached on disk under what determines it
    (run.content.store_key: `what`, the model's files, the bytes of `files`, the library versions
    and the resolved precision): every seed's dense row and every row's ratio to dense read the same
    figures, whichever process computes them."""
    import json

    from trsp_ray.common import atomic
    from trsp_ray.common.digest import content_key, file_digest
    from trsp_ray.data import assets
    from trsp_ray.run.content import model_fingerprint, store_key

    cfg = bench.cfg.to_dict()
    data = content_key({"model": model_fingerprint(bench.cfg.model), "files": sorted(map(file_digest, files))})
    path = assets.cache_dir() / "scores" / f"dense-{store_key(what, cfg=cfg, data=data)}.json"
    if path.exists():
        return json.loads(path.read_text())
    out = compute()
    atomic.write_text(path, json.dumps(out))
    return out


def dense_nlls(bench) -> dict[str, list[float]]:
    """`domain_nlls` of the original model (cached: _dense_cached)."""
    from trsp_ray.data import domains

    d = bench.cfg.data
    names = domains.eval_domain_names(d.eval_domains)
    what = {"domains": [domains.DOMAINS[n].source for n in names], "texts": [domains.text_key(n) for n in names],
            "split": domains.HELDOUT_EVERY, "seqlen": d.eval_seqlen, "windows": d.eval_max_windows, "bos": bench.bos,
            "spread": "a window per document"}
    return _dense_cached(bench, what, lambda: domain_nlls(bench, bench.scoring_model()))


def dense_lambada(bench, *, limit: int) -> dict:
    """`lambada` of the original model, per passage (cached: _dense_cached)."""
    from trsp_ray.evaluation.tasks import CAPABILITY_TASK, source_files

    what = {"task": CAPABILITY_TASK, "limit": limit}
    return _dense_cached(bench, what, lambda: lambada(bench, bench.scoring_model(), limit=limit),
                         files=tuple(source_files(CAPABILITY_TASK)))


def row_config(run_cfg: RunConfig, row: registry.Row) -> RunConfig:
    """The config a row runs: its pipeline (Row.pipeline) resolved as `prune` resolves one
    (pipeline.resolve: the fit a +comp row's name spells with the configured compensation, a +cos or
    +scalar row's fit, the heal recipe, the calibration sized to the model). A row without a fit fits
    none, whatever compensation.method says: a --set compensation.method=... configures the +comp
    rows' fit, it does not turn every row into a compensated one. The dense row keeps run_cfg."""
    from trsp_ray.run.pipeline import resolve

    if row.pipeline is None:
        return replace(run_cfg, **{"compensation.method": "none"})
    cfg = run_cfg if row.fit is not None else replace(run_cfg, **{"compensation.method": "none"})
    if row.objective is not None:
        cfg = replace(cfg, **{"recovery.objective": row.objective})
    return resolve(replace(cfg, method=row.pipeline), budget_layers=False).cfg


def row_job(cfg_dict: dict, row_name: str, seed: int, selection: dict | None, export_dir: str | None = None,
            options: dict | None = None, reference: dict | None = None) -> dict:
    """Prune (or not, for dense), recover as the row says and score one row for one seed.

    `options`: {"budget": heal multiplier of trained rows, "lambada": passages (0 = off)};
    `reference`: TRSP's selection of the same seed, whose compute an equal-compute row matches."""
    from trsp_ray.common.logs import log
    from trsp_ray.run.methods import apply_method
    from trsp_ray.run.pipeline import named
    from trsp_ray.run.workbench import kept_parameters, prepare

    options = options or {}
    budget = options.get("budget", 1)
    row = registry.ROWS[row_name]
    run_cfg = seeded(cfg_dict, seed)
    # only +comp rows compensate: a --set compensation.method=... configures their fit, it does not
    # turn every row into a compensated one (it did: shortgpt+heal and shortgpt+comp+heal were one model)
    cfg = row_config(run_cfg, row)
    bench = prepare(cfg)
    t0 = time.time()
    history: list = []
    if row.method is None:  # the original on the run's device (it waits in host memory on a GPU run)
        model, drop, info = bench.scoring_model(), [], {}
    else:
        drop = selection["drops"][row.method]
        # the row's pipeline, resolved by row_config, prices its recipe's steps; its selection method
        # (a registered name) is what apply_method runs on the shared drop set with the row's budgets
        spec = named(bench.cfg).spec
        if budget >= COMPUTE_BUDGET_FROM:  # a total compute: every row spends the same
            bench.cfg = replace(bench.cfg, **{"heal.compute_budget": float(budget)})  # the heal's windows grow
            extra = compute_budget_steps(bench.cfg, row, selection, spec=spec, drop=drop,
                                         num_layers=bench.num_layers) - bench.cfg.stage2.steps
            s2, heal = budget_configs(row, bench.cfg, budget=1, extra_steps=extra)
        else:
            extra = equal_compute_steps(bench.cfg, selection, reference, spec=spec, drop=drop) \
                if row.equal_compute else 0
            if row.comp_compute:
                extra += compensation_steps(run_cfg, drop, spec=spec, num_layers=bench.num_layers, row_cfg=bench.cfg)
            if row.full_compute:
                extra += full_heal_steps(bench.cfg, row, spec=spec, drop=drop, budget=budget)
            if row.objective is not None:
                extra += objective_steps(bench.cfg, row, spec=spec, drop=drop, budget=budget)
            s2, heal = budget_configs(row, bench.cfg, budget=budget, extra_steps=extra)
        out = apply_method(bench, registry.METHODS[row.method], drop=drop, stage2=row.recovery == "stage2",
                           stage2_cfg=s2, heal_cfg=heal, report=lambda m, s: history.append((dict(m), s)))
        model, drop, info = out.model, out.drop, {**selection["info"], **out.info, "extra_heal_steps": extra}
    info["recovery_cost"], info["total_cost"] = compute.recovery_cost(info), compute.total_cost(info)
    from trsp_ray.data.perplexity import ppl_of

    nlls = dense_nlls(bench) if row.method is None else domain_nlls(bench, model)
    result = {"row": row_name, "seed": seed, "budget": budget, "drop": drop, "params": kept_parameters(model),
              "info": info, "nll": nlls, "ppl": {name: ppl_of(v) for name, v in nlls.items()}, "history": history,
              "coverage": domain_coverage(bench)}
    if options.get("lambada"):
        limit = options["lambada"]
        result["lambada"] = dense_lambada(bench, limit=limit) if row.method is None else lambada(bench, model,
                                                                                                 limit=limit)
    if export_dir is not None:
        metrics = {**{f"{name} PPL": v for name, v in result["ppl"].items()}, "params": result["params"]}
        result["export"] = export_row(model, bench, row_name=row_name, drop=drop, metrics=metrics,
                                      target=f"{export_dir}/{row_name}-b{budget}-s{seed}")
    result["seconds"] = time.time() - t0 + (selection["seconds"] if selection else 0.0)
    lamb = f", LAMBADA acc {result['lambada']['acc']:.3f}" if "lambada" in result else ""
    ppls = ", ".join(f"{name} {v:.2f}" for name, v in result["ppl"].items())
    log(f"row {row_name} {budget_label(budget)} (seed {seed}): PPL {ppls}{lamb} ({result['seconds']:.0f}s)")
    return result
