"""The fair comparison behind `trsp-ray benchmark` (SPEC section 5).

Rows (registry.ROWS) fall into budget groups: *selection only* (a drop set, no training) and
*trained* (every row trains the same number of weight-update tokens with the same recovery
objective: TRSP spends them in stage 2, a baseline in a heal after its selection). Each selection is
computed once per seed and shared by the rows that use it. Every row is run for `seeds` seeds (data
order, calibration windows, random's draw) and scored on held-out text of the calibration domain,
on a text of another domain and, optionally, on the paper's five zero-shot tasks through the
evaluation pool. Each row is compared with the best baseline of its own group; a difference inside
the seeds' spread (max - min) is a tie.

The work units (`selection_job`, `row_job`) take plain dicts so that a runner can execute them in
this process (`run_local`) or as Ray tasks (distributed/comparison.py).
"""

from __future__ import annotations

import dataclasses
import math
import statistics
import time

from trsp_ray import registry
from trsp_ray.config import RunConfig, from_dict, replace
from trsp_ray.errors import TrspError

# every baseline in both budget groups (the comparison is only fair with all of them); the one-shot
# ablation is left to --rows to keep the README's run within 15 minutes on 2 CPU cores
DEFAULT_ROWS = registry.DEFAULT_ROWS
PPL_COLUMNS = ("held-out PPL", "domain-2 PPL")


@dataclasses.dataclass(frozen=True)
class Job:
    kind: str  # "selection" | "row"
    name: str  # selector or row name
    seed: int

    @property
    def key(self) -> str:
        return f"{self.kind}:{self.name}:{self.seed}"


def check_request(cfg: RunConfig, row_names, seeds: int, zeroshot_limit: int) -> list[registry.Row]:
    """Validate what was asked before any work: rows, seed count, zero-shot limit, recovery."""
    if not isinstance(seeds, int) or seeds < 1:
        raise TrspError(f"seeds={seeds!r} is not valid; pass an integer >= 1")
    if not isinstance(zeroshot_limit, int) or zeroshot_limit < 0:
        raise TrspError(f"zeroshot_limit={zeroshot_limit!r} is not valid; pass 0 (off) or a positive item count")
    rows = registry.rows(list(row_names))
    if any(r.group == "trained" for r in rows) and cfg.stage2.steps < 1:
        raise TrspError("stage2.steps=0 leaves the trained rows no weight-update budget; set stage2.steps >= 1 "
                        "or list only dense and selection rows")
    return rows


def plan_jobs(rows: list[registry.Row], seeds: list[int]) -> list[Job]:
    """Selections first (each once per seed), then rows: the order a sequential runner uses."""
    jobs = [Job("selection", s, seed) for seed in seeds for s in registry.selectors_for(rows)]
    return jobs + [Job("row", r.name, seed) for seed in seeds for r in rows]


def _seeded(cfg_dict: dict, seed: int) -> RunConfig:
    return replace(from_dict(cfg_dict), seed=seed)


def selection_job(cfg_dict: dict, selector: str, seed: int) -> dict:
    """One selection (trsp = a stage-1 run; shortgpt, sleb, random) for one seed, as a plain dict."""
    from trsp_ray.gates import attach_gates
    from trsp_ray.logs import log
    from trsp_ray.methods import select
    from trsp_ray.workbench import prepare

    bench = prepare(_seeded(cfg_dict, seed))
    t0 = time.time()
    log(f"selection {selector} (seed {seed}): {bench.n_drop()} of {bench.num_layers} layers")
    history: list = []
    method = next(m.name for m in registry.METHODS.values() if m.selector == selector)
    model = bench.fresh_model()
    gates = attach_gates(model, gate_mode=bench.cfg.gates.gate)
    stage1 = None
    if selector == registry.TRSP_SELECTOR:
        from trsp_ray.methods import run_stage1_for

        stage1 = run_stage1_for(bench, model=model, report=lambda m, s: history.append((dict(m), s)))
    drop, info = select(bench, method, model=model, gates=gates, stage1=stage1)
    out = {"selector": selector, "seed": seed, "seconds": time.time() - t0, "info": info, "history": history,
           "drops": {m.name: (stage1.drop_for(m.name, bench.n_drop()) if stage1 else drop)
                     for m in registry.METHODS.values() if m.selector == selector}}
    if stage1 is not None:
        out["stage1"] = dataclasses.asdict(stage1)
    log(f"selection {selector} (seed {seed}) done in {out['seconds']:.0f}s: {drop}")
    return out


def export_row(model, bench, *, row_name: str, drop: list[int], target: str, metrics: dict) -> str:
    """A row's model for the zero-shot scorers (a scratch directory of this benchmark)."""
    from trsp_ray.export import export_model, pruned_manifest

    manifest = pruned_manifest(method=row_name, drop=drop, num_layers_original=bench.num_layers,
                               config=bench.cfg.to_dict(), metrics=metrics)
    return str(export_model(model, bench.tokenizer, target, manifest=manifest, overwrite=True))


def _budget(row: registry.Row, cfg: RunConfig):
    """(stage-2 config, heal config) that give a row its share: trained rows all get stage2.steps
    batches of weight updates with the same objective; the others none."""
    no_heal = replace(cfg.heal, steps=0)
    if row.recovery == "heal":
        return replace(cfg.stage2, enabled=False), replace(cfg.heal, steps=cfg.stage2.steps, lr=cfg.stage2.lr,
                                                            trainable=cfg.stage2.trainable,
                                                            lora_rank=cfg.stage2.lora_rank)
    if row.recovery == "stage2":
        return replace(cfg.stage2, enabled=True), no_heal
    return replace(cfg.stage2, enabled=False), no_heal


def _sleb_note(cfg: RunConfig) -> str:
    from trsp_ray.config import FULL_SLEB_WINDOWS

    n, seqlen = cfg.baselines.sleb_windows, cfg.data.seqlen
    if n >= FULL_SLEB_WINDOWS:
        return (f"SLEB scored its removals on {n} calibration windows of {seqlen} tokens (in full: on SmolLM2 its "
                f"drop set did not change from {FULL_SLEB_WINDOWS // 2} to {FULL_SLEB_WINDOWS} windows).")
    return (f"SLEB scored its removals on {n} calibration windows of {seqlen} tokens: CUT to fit 15 minutes on 2 CPU "
            f"cores; --full-baselines runs it on {FULL_SLEB_WINDOWS}, where its drop set stops changing.")


def row_job(cfg_dict: dict, row_name: str, seed: int, selection: dict | None, export_dir: str | None = None) -> dict:
    """Prune (or not, for dense), recover as the row says and score one row for one seed."""
    from trsp_ray.logs import log
    from trsp_ray.methods import apply_method
    from trsp_ray.workbench import kept_parameters, prepare

    row = registry.ROWS[row_name]
    bench = prepare(_seeded(cfg_dict, seed))
    t0 = time.time()
    history: list = []
    if row.method is None:  # the original on the run's device (it waits in host memory on a GPU run)
        model, drop, info = bench.scoring_model(), [], {}
    else:
        s2, heal = _budget(row, bench.cfg)
        out = apply_method(bench, row.method, drop=selection["drops"][row.method], stage2=row.recovery == "stage2",
                           stage2_cfg=s2, heal_cfg=heal, report=lambda m, s: history.append((dict(m), s)))
        model, drop, info = out.model, out.drop, {**selection["info"], **out.info}
    result = {"row": row_name, "seed": seed, "drop": drop, "params": kept_parameters(model), "info": info,
              "held-out PPL": bench.heldout_ppl(model), "domain-2 PPL": domain2_ppl(bench, model),
              "history": history}
    if export_dir is not None:
        metrics = {k: result[k] for k in ("held-out PPL", "domain-2 PPL", "params")}
        result["export"] = export_row(model, bench, row_name=row_name, drop=drop, metrics=metrics,
                                      target=f"{export_dir}/{row_name}-s{seed}")
    result["seconds"] = time.time() - t0 + (selection["seconds"] if selection else 0.0)
    log(f"row {row_name} (seed {seed}): held-out PPL {result['held-out PPL']:.2f}, "
        f"domain-2 PPL {result['domain-2 PPL']:.2f} ({result['seconds']:.0f}s)")
    return result


def run_local(jobs: list[Job], *, cfg_dict: dict, export_dir: str | None, on_done) -> None:
    """Run the plan in this process, in order (selections before the rows that need them)."""
    selections: dict[tuple[str, int], dict] = {}
    for job in jobs:
        if job.kind == "selection":
            out = selection_job(cfg_dict, job.name, job.seed)
            selections[(job.name, job.seed)] = out
        else:
            row = registry.ROWS[job.name]
            sel = selections[(registry.METHODS[row.method].selector, job.seed)] if row.method else None
            out = row_job(cfg_dict, job.name, job.seed, sel, export_dir)
        on_done(job, out)


# ---------------------------------------------------------------------------------------------- summary

def _stats(values: list[float]) -> dict:
    return {"mean": statistics.fmean(values), "min": min(values), "max": max(values),
            "spread": max(values) - min(values), "n": len(values)}


def zeroshot_stats(tasks: dict) -> tuple[float, float] | None:
    """(mean acc over the paper's five tasks, its standard error) from one evaluation result."""
    from trsp_ray.evaluation.tasks import PAPER_TASKS

    if not all(t in tasks for t in PAPER_TASKS):
        return None
    accs = [tasks[t]["acc"] for t in PAPER_TASKS]
    ses = [tasks[t].get("acc_stderr") or math.sqrt(a * (1 - a) / max(1, tasks[t].get("n", 1)))
           for t, a in zip(PAPER_TASKS, accs)]
    return sum(accs) / len(accs), math.sqrt(sum(s * s for s in ses)) / len(ses)


def verdict(row: dict, best: dict, metric: str, *, higher_is_better: bool = False) -> str:
    """better / worse / tie for `row` against `best` on `metric`; a tie when the difference of the
    means is not larger than the larger seed spread (or, for zero-shot, two standard errors)."""
    a, b = row.get(metric), best.get(metric)
    if not a or not b:
        return ""
    diff = a["mean"] - b["mean"]
    noise = max(a["spread"], b["spread"], 2 * math.hypot(a.get("se", 0.0), b.get("se", 0.0)))
    if abs(diff) <= noise:
        return "tie"
    good = diff > 0 if higher_is_better else diff < 0
    return "better" if good else "worse"


def summarize(results: list[dict], rows: list[registry.Row], *, dense_params: int) -> list[dict]:
    """One dict per row: means and spreads over seeds, and the comparison with its group's best baseline."""
    out = []
    for row in rows:
        runs = sorted((r for r in results if r["row"] == row.name), key=lambda r: r["seed"])
        if not runs:
            continue
        s = {"row": row.name, "group": row.group, "seeds": len(runs), "drop": runs[0]["drop"],
             "same drop over seeds": all(sorted(r["drop"]) == sorted(runs[0]["drop"]) for r in runs),
             "params": runs[0]["params"], "kept %": 100.0 * runs[0]["params"] / dense_params,
             "calib tokens": runs[0]["info"].get("calib_tokens", 0),
             "select cost": runs[0]["info"].get("select_cost", 0.0),
             "weight tokens": runs[0]["info"].get("weight_tokens", 0),
             "seconds": statistics.fmean(r["seconds"] for r in runs), "is_baseline": row.is_baseline}
        for col in PPL_COLUMNS:
            s[col] = _stats([r[col] for r in runs])
        zs = [zeroshot_stats(r["zeroshot"]) for r in runs if r.get("zeroshot")]
        zs = [z for z in zs if z]
        if zs:
            s["zero-shot"] = {**_stats([z[0] for z in zs]), "se": statistics.fmean(z[1] for z in zs)}
        out.append(s)
    for group in ("selection", "trained"):
        members = [s for s in out if s["group"] == group]
        baselines = [s for s in members if s["is_baseline"]]
        if not baselines:
            continue
        best = min(baselines, key=lambda s: s["held-out PPL"]["mean"])
        for s in members:
            s["best baseline"] = best["row"]
            s["vs best"] = s["held-out PPL"]["mean"] / best["held-out PPL"]["mean"]
            s["verdicts"] = {} if s is best else {
                col: verdict(s, best_for(baselines, col), col) for col in PPL_COLUMNS}
            if "zero-shot" in s and s is not best:
                zbest = max((b for b in baselines if "zero-shot" in b), key=lambda b: b["zero-shot"]["mean"])
                s["verdicts"]["zero-shot"] = verdict(s, zbest, "zero-shot", higher_is_better=True)
    return out


def best_for(baselines: list[dict], col: str) -> dict:
    return min(baselines, key=lambda s: s[col]["mean"])


def _fmt(stat: dict | None, digits: int = 2, scale: float = 1.0) -> str:
    if not stat:
        return "-"
    mean = f"{stat['mean'] * scale:.{digits}f}"
    if "se" in stat:
        mean += f" ±{stat['se'] * scale:.{digits}f}"
    if stat["n"] > 1:
        mean += f" [{stat['min'] * scale:.{digits}f}-{stat['max'] * scale:.{digits}f}]"
    return mean


COLUMNS = ["row", "dropped (first seed)", "kept %", "calib tokens", "select cost (M)", "weight tokens",
           "held-out PPL", "domain-2 PPL", "zero-shot %", "vs best", "wall s"]


def table_rows(summary: list[dict]) -> list[dict]:
    """The printed cells; a row's "vs best" is its held-out PPL over its group's best baseline's."""
    out = []
    for s in summary:
        verdicts = s.get("verdicts") or {}
        vs = "-" if "vs best" not in s else ("best baseline" if s["row"] == s["best baseline"] else
                                             f"{s['vs best']:.2f} ({verdicts.get('held-out PPL', '')})")
        out.append({"group": s["group"], "row": s["row"],
                    "dropped (first seed)": (" ".join(map(str, sorted(s["drop"])))
                                         + ("" if s["same drop over seeds"] else " *")),
                    "kept %": s["kept %"], "calib tokens": s["calib tokens"],
                    "select cost (M)": s["select cost"] / 1e6, "weight tokens": s["weight tokens"],
                    "held-out PPL": _fmt(s["held-out PPL"]), "domain-2 PPL": _fmt(s["domain-2 PPL"]),
                    "zero-shot %": _fmt(s.get("zero-shot"), 1, 100.0), "vs best": vs, "wall s": s["seconds"]})
    return out


def render_report(summary: list[dict], *, heldout_source: str, domain2_source: str, cfg: RunConfig,
                  seeds: list[int], zeroshot_limit: int) -> str:
    """The terminal report: one table per budget group, then the verdicts of the TRSP rows."""
    from trsp_ray.table import render

    cells = table_rows(summary)
    d = cfg.data
    parts = []
    for group in ("dense", "selection", "trained"):
        rows = [c for c in cells if c["group"] == group]
        if rows:
            parts += [f"\n{registry.GROUP_TITLES[group]}", render(rows, COLUMNS)]
    parts.append(
        f"\nseeds {seeds} (PPL: mean [min-max]; '*' = the drop set changed across seeds); a difference inside the "
        f"larger spread is a tie.\nheld-out: {heldout_source}; domain 2: {domain2_source}; PPL over "
        f"{d.eval_max_windows or 'all'} windows of {d.eval_seqlen} tokens.\n"
        f"trained rows: {cfg.stage2.steps} batches of {d.batch_size}x{d.seqlen} tokens of weight updates each, "
        f"objective {cfg.recovery.objective}; select cost = dense-forward tokens (millions) spent choosing the "
        "drop set.\n"
        + _sleb_note(cfg))
    if zeroshot_limit:
        parts.append(f"zero-shot: mean acc over PIQA, WinoGrande, HellaSwag, ARC-e, ARC-c, {zeroshot_limit} items "
                     f"per task, ± standard error.")
    for s in summary:
        if registry.ROWS[s["row"]].uses_stage1 and s.get("verdicts"):
            v = ", ".join(f"{k} {val}" for k, val in s["verdicts"].items() if val)
            parts.append(f"{s['row']} vs {s['best baseline']} (best {s['group']} baseline): {v}")
    return "\n".join(parts)


# ---------------------------------------------------------------------------------------------- driver

def domain2_ids(bench):
    """Token ids of the second-domain text (data.domain2_text, default: gensim's news corpus)."""
    from trsp_ray import assets
    from trsp_ray.workbench import encode_cached

    text, _ = assets.domain2_text(bench.cfg.data.domain2_text)
    return encode_cached(bench.tokenizer, text)


def domain2_ppl(bench, model) -> float:
    """Perplexity on the second-domain text, with the held-out text's windows and conventions."""
    from trsp_ray.perplexity import perplexity

    d = bench.cfg.data
    return perplexity(model, domain2_ids(bench), seqlen=d.eval_seqlen, batch_size=4, max_windows=d.eval_max_windows,
                      bos=bench.bos)


def run_benchmark(cfg: RunConfig, rows=DEFAULT_ROWS, *, seeds: int = 1, zeroshot_limit: int = 0,
                  runner=None, zeroshot_actors: int = 1) -> list[dict]:
    """Run every row for `seeds` seeds, print the tables and log everything to MLflow.

    `runner(jobs, cfg_dict=, export_dir=, on_done=)` executes the plan (default: `run_local`, in this
    process); distributed/comparison.py passes one that runs the jobs as Ray tasks."""
    import shutil
    import tempfile

    from trsp_ray import assets, plots
    from trsp_ray.logs import log
    from trsp_ray.tracking import make_tracker
    from trsp_ray.workbench import kept_parameters, prepare

    selected = check_request(cfg, rows, seeds, zeroshot_limit)
    seed_list = [cfg.seed + k for k in range(seeds)]
    methods = tuple(sorted({r.method for r in selected if r.method}))
    bench = prepare(cfg, methods=methods)  # every input check and cache warm-up before any job starts
    _, domain2_source = assets.domain2_text(cfg.data.domain2_text)
    domain2_ids(bench)
    jobs = plan_jobs(selected, seed_list)
    t = cfg.tracking
    tracker = make_tracker(enabled=t.enabled, tracking_uri=t.tracking_uri, experiment=t.experiment)
    export_dir = tempfile.mkdtemp(prefix="trsp-bench-") if zeroshot_limit else None
    results: list[dict] = []
    done = {"n": 0}
    try:
        with tracker.run(f"benchmark-r{cfg.ratio}", tags={"kind": "benchmark", "model": cfg.model}):
            tracker.log_params(cfg.to_dict())
            tracker.log_params({"data.heldout_source": bench.texts.heldout_source,
                                "data.domain2_source": domain2_source,
                                "rows": ",".join(r.name for r in selected), "seeds": seeds,
                                "zeroshot_limit": zeroshot_limit})

            def on_done(job: Job, out: dict) -> None:
                done["n"] += 1
                log(f"[{done['n']}/{len(jobs)}] {job.kind} {job.name} seed {job.seed} done")
                _log_job(tracker, plots, job, out)
                if job.kind == "row":
                    results.append(out)

            log(f"benchmark: {len(selected)} rows x {seeds} seed(s) = {len(jobs)} jobs "
                f"({sum(j.kind == 'selection' for j in jobs)} selections)")
            (runner or run_local)(jobs, cfg_dict=cfg.to_dict(), export_dir=export_dir, on_done=on_done)
            if zeroshot_limit:
                _zeroshot(results, limit=zeroshot_limit, actors=zeroshot_actors, tracker=tracker, log=log)
            summary = summarize(results, selected, dense_params=kept_parameters(bench.model))
            report = render_report(summary, heldout_source=bench.texts.heldout_source, domain2_source=domain2_source,
                                   cfg=cfg, seeds=seed_list, zeroshot_limit=zeroshot_limit)
            tracker.log_text(report, "benchmark.txt")
            tracker.log_dict({"summary": summary, "runs": [{k: v for k, v in r.items() if k != "history"}
                                                           for r in results]}, "benchmark.json")
            tracker.log_figure(plots.benchmark_bars(summary), "benchmark_ppl.png")
            for s in summary:
                tracker.log_metrics({f"{s['row']}/heldout_ppl": s["held-out PPL"]["mean"],
                                     f"{s['row']}/domain2_ppl": s["domain-2 PPL"]["mean"]})
    finally:
        if export_dir:
            shutil.rmtree(export_dir, ignore_errors=True)
    print(report)
    return summary


def _log_job(tracker, plots, job: Job, out: dict) -> None:
    name = f"{job.name} seed {job.seed}" if job.kind == "row" else f"selection {job.name} seed {job.seed}"
    with tracker.run(name, nested=True, tags={"kind": job.kind, "name": job.name, "seed": str(job.seed)}):
        for metrics, step in out.get("history", []):
            tracker.log_metrics(metrics, step)
        if job.kind == "row":
            tracker.log_metrics({"heldout_ppl": out["held-out PPL"], "domain2_ppl": out["domain-2 PPL"]})
        if out.get("stage1"):
            s1 = out["stage1"]
            tracker.log_figure(plots.gate_trajectories(s1["gate_history"], s1["round_ends"], s1["drop_order"]),
                               "stage1_gates.png")
        tracker.log_dict({k: v for k, v in out.items() if k not in ("history", "stage1")}, "result.json")


def _zeroshot(results: list[dict], *, limit: int, actors: int, tracker, log) -> None:
    """Score every exported row model on the paper's five tasks with the evaluation pool."""
    from trsp_ray.evaluation.evaluator import EvalSettings
    from trsp_ray.evaluation.pool import evaluate_pool
    from trsp_ray.evaluation.tasks import PAPER_TASKS

    settings = EvalSettings(tasks=PAPER_TASKS, limit=limit, ppl=False, speed=None)
    paths = [r["export"] for r in results]
    log(f"zero-shot: {len(paths)} models x {len(PAPER_TASKS)} tasks x {limit} items on {actors} evaluation actor(s)")
    scored = evaluate_pool(paths, settings=settings, actors=actors, tracker=tracker, log=log)
    for r, s in zip(results, scored):
        if s.get("status") != "ok":
            raise TrspError(f"zero-shot evaluation of {r['row']} seed {r['seed']} failed: {s.get('error')}")
        r["zeroshot"] = s["tasks"]
