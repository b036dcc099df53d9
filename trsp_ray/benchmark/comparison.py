"""The fair comparison behind `trsp-ray benchmark` (SPEC section 5): what runs, in which order, and
what is logged.

Rows (registry.ROWS) fall into budget groups: *selection only* (a drop set, no training) and
*trained* (every row trains the same number of weight-update tokens with the same recovery
objective: TRSP spends them in stage 2, a baseline in a heal after its selection; '@compute' rows
also get the TRSP selection's extra compute as heal steps, so they compare at equal total compute).
Each selection is computed once per seed and shared by the rows that use it; trained rows run once
per heal budget (`budgets`, multiples of stage2.steps). The work units are in jobs.py, the
statistics and verdicts in stats.py, the tables in report.py.
"""

from __future__ import annotations

import dataclasses

from trsp_ray.benchmark.jobs import dense_lambada, dense_nlls, row_job, selection_job
from trsp_ray.common.errors import TrspError
from trsp_ray.config import registry
from trsp_ray.config.budgets import COMPUTE_BUDGET_FROM, budget_label
from trsp_ray.config.run_config import RunConfig, compensated

DEFAULT_ROWS = registry.DEFAULT_ROWS  # --full: every baseline in both budget groups
QUICK_ROWS = registry.QUICK_ROWS  # the README's run: what fits 15 minutes on 2 CPU cores


@dataclasses.dataclass(frozen=True)
class Job:
    kind: str  # "selection" | "row"
    name: str  # selector or row name
    seed: int
    budget: int = 1  # heal-budget multiplier of a trained row

    @property
    def key(self) -> str:
        return f"{self.kind}:{self.name}:{self.seed}:{self.budget}"


def check_request(cfg: RunConfig, row_names, seeds: int, zeroshot_limit: int, *, lambada_limit: int = 0,
                  budgets: tuple[int, ...] = (1,)) -> list[registry.Row]:
    """Validate what was asked before any work: rows, seeds, item counts, budgets, recovery."""
    if not isinstance(seeds, int) or seeds < 1:
        raise TrspError(f"seeds={seeds!r} is not valid; pass an integer >= 1")
    for name, value in (("zeroshot_limit", zeroshot_limit), ("lambada_limit", lambada_limit)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise TrspError(f"{name}={value!r} is not valid; pass 0 (off) or a positive item count")
    if not budgets or any(not isinstance(b, int) or isinstance(b, bool) or b < 1 for b in budgets) \
            or len(set(budgets)) != len(budgets):
        raise TrspError(f"budgets={list(budgets)!r} is not valid; pass distinct integers >= 1 (multiples of "
                        f"stage2.steps, e.g. 1,4) or total compute budgets from {COMPUTE_BUDGET_FROM} "
                        "dense-forward tokens up (e.g. 70k,300k,1M)")
    if cfg.heal.compute_budget:
        raise TrspError(f"heal.compute_budget={cfg.heal.compute_budget:g} is a prune setting; the benchmark gives "
                        "its trained rows compute budgets with --budgets (e.g. 300k,1M) and equal-compute rows with "
                        "'@compute'")
    rows = registry.rows(list(row_names))
    if any(r.group == "trained" for r in rows) and cfg.stage2.steps < 1:
        raise TrspError("stage2.steps=0 leaves the trained rows no weight-update budget; set stage2.steps >= 1 "
                        "or list only dense and selection rows")
    return rows


def plan_jobs(rows: list[registry.Row], seeds: list[int], budgets: tuple[int, ...] = (1,)) -> list[Job]:
    """Selections first (each once per seed), then rows (trained rows once per budget): the order a
    sequential runner uses."""
    jobs = [Job("selection", s, seed) for seed in seeds for s in registry.selectors_for(rows)]
    for budget in budgets:
        jobs += [Job("row", r.name, seed, budget) for seed in seeds for r in rows
                 if budget == budgets[0] or r.group == "trained"]
    return jobs


def job_needs(job: Job) -> set:
    """The selections {(selector, seed)} a row job needs done first (job_inputs reads them)."""
    row = registry.ROWS[job.name]
    needs = {(registry.METHODS[row.method].selector, job.seed)} if row.method else set()
    return needs | ({(registry.TRSP_SELECTOR, job.seed)} if row.equal_compute else set())


def job_inputs(job: Job, selections: dict) -> tuple:
    """(selection, reference) a row job needs from the selections done: its own selector's and, for
    an equal-compute row, TRSP's of the same seed."""
    row = registry.ROWS[job.name]
    sel = selections[(registry.METHODS[row.method].selector, job.seed)] if row.method else None
    ref = selections[(registry.TRSP_SELECTOR, job.seed)] if row.equal_compute else None
    return sel, ref


def run_local(jobs: list[Job], *, cfg_dict: dict, export_dir: str | None, on_done, options: dict) -> None:
    """Run the plan in this process, in order (selections before the rows that need them)."""
    selections: dict[tuple[str, int], dict] = {}
    for job in jobs:
        if job.kind == "selection":
            out = selection_job(cfg_dict, job.name, job.seed)
            selections[(job.name, job.seed)] = out
        else:
            sel, ref = job_inputs(job, selections)
            out = row_job(cfg_dict, job.name, job.seed, sel, export_dir, {**options, "budget": job.budget}, ref)
        on_done(job, out)


class RowCache:
    """Finished rows of a benchmark on disk, so that a run that stops (or a later run that adds a heal
    budget, a seed or a row) loses no finished row. Keyed (run.content.store_key) on the run's
    config, the row, its seed and budget, the scoring options, the source of trsp_ray itself (a code
    change recomputes everything), the bytes of everything a row reads (the model's files, the
    calibration text, every scored domain, the evaluation text, the task data the options score),
    the library versions and the device and dtype the config resolves to. Written atomically;
    `trsp-ray benchmark --no-cache` ignores it."""

    def __init__(self, cfg_dict: dict, options: dict):
        from trsp_ray.run.content import run_inputs

        self.cfg = cfg_dict
        self.base = {"cfg": cfg_dict, "options": options, "source": source_fingerprint()}
        self.data = run_inputs(cfg_dict, files=tuple(scored_task_files(options)))

    def path(self, job: Job):
        from trsp_ray.data import assets
        from trsp_ray.run.content import store_key

        key = store_key({**self.base, "job": job.key}, cfg=self.cfg, data=self.data, length=24)
        return assets.cache_dir() / "benchmark" / f"{job.name.replace('/', '_')}-{key}.json"

    def get(self, job: Job) -> dict | None:
        import json

        path = self.path(job)
        return json.loads(path.read_text()) if path.exists() else None

    def put(self, job: Job, out: dict) -> None:
        """JSON, never a pickle (nothing trsp_ray reads back can run code); a row whose result holds
        something JSON cannot say is not cached."""
        import json

        from trsp_ray.common import atomic

        try:
            text = json.dumps(out, default=_plain)
        except (TypeError, ValueError):
            return
        atomic.write_text(self.path(job), text)


def scored_task_files(options: dict) -> list:
    """The source files of the task data a row's scoring `options` read (LAMBADA's passages)."""
    from trsp_ray.evaluation.tasks import CAPABILITY_TASK, source_files

    return source_files(CAPABILITY_TASK) if options.get("lambada") else []


def _plain(value):
    """A numpy or torch scalar as the Python number it is (json.dumps' fallback)."""
    if hasattr(value, "item") and getattr(value, "ndim", 0) == 0:
        return value.item()
    raise TypeError(f"{type(value).__name__} is not JSON")


def source_fingerprint() -> str:
    """A hash of every Python source file of the trsp_ray package (what a cached result was computed by)."""
    import hashlib
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    h = hashlib.sha256()
    for f in sorted(root.rglob("*.py")):
        h.update(str(f.relative_to(root)).encode())
        h.update(f.read_bytes())
    return h.hexdigest()[:16]


def cached_jobs(jobs: list[Job], cache: RowCache) -> tuple[list[Job], list[tuple[Job, dict]]]:
    """(the jobs still to run, the finished rows read from `cache`): a cached row is not run, nor a
    selection that no row left to run needs."""
    hits = [(j, out) for j in jobs if j.kind == "row" for out in [cache.get(j)] if out is not None]
    done = {j.key for j, _ in hits}
    rest = [j for j in jobs if j.key not in done]
    needed = set().union(*(job_needs(j) for j in rest if j.kind == "row"))
    return [j for j in rest if j.kind == "row" or (j.name, j.seed) in needed], hits


def run_benchmark(cfg: RunConfig, rows=DEFAULT_ROWS, *, seeds: int = 1, zeroshot_limit: int = 0,
                  lambada_limit: int = 0, budgets: tuple[int, ...] = (1,), runner=None, zeroshot_actors: int = 1,
                  cut: str = "", show: bool = True, cache: bool = False) -> list[dict]:
    """Run every row for `seeds` seeds (trained rows for every budget), print the tables and log
    everything to MLflow (tables, JSON, the PPL bars and quality against total compute as PNGs).

    `runner(jobs, cfg_dict=, export_dir=, on_done=, options=)` executes the plan (default:
    `run_local`, in this process); benchmark/cluster.py passes one that runs Ray tasks. `cut`
    says what a shortened run left out (printed under the tables); `show=False` logs the report
    without printing it (leave_one_out prints its own table); `cache=True` reads finished rows from
    and writes them to a RowCache (not with zero-shot, whose exported models do not outlive the run)."""
    import shutil
    import tempfile

    from trsp_ray.benchmark.report import render_report
    from trsp_ray.benchmark.stats import summarize
    from trsp_ray.common import plots
    from trsp_ray.common.logs import log
    from trsp_ray.data import domains
    from trsp_ray.run.workbench import kept_parameters, prepare

    budgets = tuple(budgets)
    selected = check_request(cfg, rows, seeds, zeroshot_limit, lambada_limit=lambada_limit, budgets=budgets)
    seed_list = [cfg.seed + k for k in range(seeds)]
    methods = tuple(sorted({r.method for r in selected if r.method}))
    bench = prepare(cfg, methods=methods)  # every input check and cache warm-up before any job starts
    if any(r.compensate or r.comp_compute for r in selected):  # a fit it cannot serve: refused now
        from trsp_ray.config.run_config import sized
        from trsp_ray.data.calibration import check_windows
        from trsp_ray.method.compensation import check_request as check_compensation
        from trsp_ray.models.families import text_config

        cfg = sized(cfg, hidden=text_config(bench.model).hidden_size)  # windows 0: sized to the model
        c = compensated(cfg).compensation
        check_compensation(model=bench.model, method=c.method, tokens=c.windows * cfg.data.seqlen, form=c.form,
                           rank=c.rank, minimum=c.min_tokens_per_column)
        check_windows(bench.calibration, windows=c.windows, what=f"compensation.windows={c.windows}")
    left_out = [] if cfg.data.calib_text else domains.left_out(domains.parse_mix(cfg.data.calib_mix))
    if lambada_limit:
        from trsp_ray.evaluation.tasks import CAPABILITY_TASK, write_task_dir

        write_task_dir([CAPABILITY_TASK])  # the data converted once, before the jobs read it
    jobs = plan_jobs(selected, seed_list, budgets)
    runner = runner or run_local
    export_dir = tempfile.mkdtemp(prefix="trsp-bench-") if zeroshot_limit else None
    results: list[dict] = []
    done = {"n": 0}
    try:
        tracker = _tracker_while_warming(cfg.tracking, getattr(runner, "warm", None))
        with tracker.run(f"benchmark-r{cfg.ratio}", tags={"kind": "benchmark", "model": cfg.model}):
            tracker.log_params(cfg.to_dict())
            tracker.log_params({"data.calibration_source": bench.calibration.source,
                                "data.left_out": ",".join(left_out) or "none",
                                "rows": ",".join(r.name for r in selected), "seeds": seeds,
                                "zeroshot_limit": zeroshot_limit, "lambada_limit": lambada_limit,
                                "budgets": ",".join(map(str, budgets))})

            def on_done(job: Job, out: dict) -> None:
                done["n"] += 1
                log(f"[{done['n']}/{len(jobs)}] {job.kind} {job.name} seed {job.seed} done")
                _log_job(tracker, plots, job, out)
                if job.kind == "row":
                    results.append(out)

            log(f"benchmark: {len(selected)} rows x {seeds} seed(s) x budgets {list(budgets)} = {len(jobs)} jobs "
                f"({sum(j.kind == 'selection' for j in jobs)} selections)")
            options = {"lambada": lambada_limit}
            store = RowCache(cfg.to_dict(), options) if cache and not zeroshot_limit else None
            todo = jobs
            if store is not None:
                todo, hits = cached_jobs(jobs, store)
                if hits:
                    log(f"{len(hits)} finished row(s) read from {store.path(hits[0][0]).parent} (same config, code "
                        "and model; --no-cache recomputes them)")
                for job, out in hits:
                    on_done(job, out)

            def finished(job: Job, out: dict) -> None:
                if store is not None and job.kind == "row":
                    store.put(job, out)
                on_done(job, out)

            if todo:
                runner(todo, cfg_dict=cfg.to_dict(), export_dir=export_dir, on_done=finished, options=options)
            if zeroshot_limit:
                _zeroshot(results, limit=zeroshot_limit, actors=zeroshot_actors, tracker=tracker, log=log)
            # the dense row's job scored the original on every domain (cached); without that row, scored here
            dense_nll = dense_nlls(bench)
            dense_scores = {"LAMBADA acc": dense_lambada(bench, limit=lambada_limit)["acc"]} if lambada_limit else {}
            summary = summarize(results, selected, dense_params=kept_parameters(bench.model), dense_nll=dense_nll,
                                left_out=left_out, dense_scores=dense_scores)
            report = render_report(summary, calibration_source=bench.calibration.source, left_out=left_out,
                                   cfg=cfg, seeds=seed_list, zeroshot_limit=zeroshot_limit,
                                   lambada_limit=lambada_limit, cut=cut)
            tracker.log_text(report, "benchmark.txt")
            tracker.log_dict({"summary": [{k: v for k, v in s.items() if k != "items"} for s in summary],
                              "runs": [{k: v for k, v in r.items() if k != "history"} for r in results]},
                             "benchmark.json")
            tracker.log_figure(plots.benchmark_bars(summary), "benchmark_ppl.png")
            tracker.log_figure(plots.quality_vs_compute(summary), "quality_vs_compute.png")
            retention = plots.retention_vs_compute(summary)
            if retention is not None:
                tracker.log_figure(retention, "retention_vs_compute.png")
            for s in summary:
                prefix = f"{s['row']}/{budget_label(s['budget'])}"
                tracker.log_metrics({f"{prefix}/geo_mean_x_dense": s["geo-mean x dense"]["mean"],
                                     **{f"{prefix}/{d}_ppl": s[f"{d} PPL"]["mean"] for d in s["domains"]},
                                     f"{prefix}/total_cost": s["total cost"],
                                     **({f"{prefix}/lambada_acc": s["LAMBADA acc"]["mean"]}
                                        if "LAMBADA acc" in s else {}),
                                     **({f"{prefix}/lambada_pct_dense": s["LAMBADA % dense"]["mean"]}
                                        if "LAMBADA % dense" in s else {})})
    finally:
        getattr(runner, "close", lambda: None)()  # a runner warmed but never run (MLflow failed) stops too
        if export_dir:
            shutil.rmtree(export_dir, ignore_errors=True)
    if show:
        print(report)
    return summary


def leave_one_out_configs(cfg: RunConfig) -> list[tuple[str, RunConfig]]:
    """(left-out domain, the config that calibrates on the others) for every domain of the configured
    mixture: the runs of `trsp-ray benchmark --leave-one-out`. A calibration text file has no
    domains to leave out: refused in one line."""
    from trsp_ray.config.run_config import replace
    from trsp_ray.data import domains

    if cfg.data.calib_text:
        raise TrspError(f"--leave-one-out leaves each domain of data.calib_mix out in turn; data.calib_text="
                        f"{cfg.data.calib_text!r} is one text: drop it, or pass --calib-mix")
    mix = domains.parse_mix(cfg.data.calib_mix)
    names = [d for d in mix if d in domains.DOMAINS]
    if len(names) < 2:
        raise TrspError(f"--leave-one-out needs a mixture of at least 2 domains; data.calib_mix={cfg.data.calib_mix!r} "
                        f"has {len(names)}")
    return [(d, replace(cfg, **{"data.calib_mix": domains.without(cfg.data.calib_mix, d)})) for d in names]


def leave_one_out(cfg: RunConfig, rows=DEFAULT_ROWS, *, runner_for=None, **kwargs) -> dict[str, list[dict]]:
    """Every domain of the mixture left out in turn (`leave_one_out_configs`): each run calibrates on
    the others and is scored on all, so its left-out column is what the pipelines do to a kind of
    text they never saw. Prints and logs the transfer table (pipelines x left-out domain, PPL
    relative to dense and LAMBADA accuracy, their worst case, the default's paired verdicts).
    `runner_for()` gives each run a fresh runner (benchmark/cluster.py); kwargs go to run_benchmark."""
    from trsp_ray.benchmark.report import transfer_report
    from trsp_ray.common.logs import log
    from trsp_ray.run.tracking import make_tracker

    runs = leave_one_out_configs(cfg)
    per_domain: dict[str, list[dict]] = {}
    for k, (name, run_cfg) in enumerate(runs, 1):
        log(f"leave-one-out {k}/{len(runs)}: calibrating on {run_cfg.data.calib_mix}, {name} left out")
        runner = runner_for() if runner_for else None
        per_domain[name] = run_benchmark(run_cfg, rows, runner=runner, show=False, **kwargs)
    report = transfer_report(per_domain, mixture=cfg.data.calib_mix)
    t = cfg.tracking
    tracker = make_tracker(enabled=t.enabled, tracking_uri=t.tracking_uri, experiment=t.experiment)
    with tracker.run(f"leave-one-out-r{cfg.ratio}", tags={"kind": "leave-one-out", "model": cfg.model}):
        tracker.log_params({"data.calib_mix": cfg.data.calib_mix, "left_out": ",".join(per_domain)})
        tracker.log_text(report, "transfer.txt")
        tracker.log_dict({d: [{k: v for k, v in s.items() if k != "items"} for s in summary]
                          for d, summary in per_domain.items()}, "transfer.json")
    print(report)
    return per_domain


def _tracker_while_warming(t, warm):
    """The run's tracker; with a runner that can warm up (Ray's start and its workers' imports), MLflow's
    import and store set-up (about 6 s of CPU on 2 cores) run in a thread while it does."""
    from concurrent.futures import ThreadPoolExecutor

    from trsp_ray.run.tracking import make_tracker

    def make():
        return make_tracker(enabled=t.enabled, tracking_uri=t.tracking_uri, experiment=t.experiment)

    if warm is None:
        return make()
    with ThreadPoolExecutor(1) as pool:
        future = pool.submit(make)
        warm()
        return future.result()


def _log_job(tracker, plots, job: Job, out: dict) -> None:
    budget = f" {budget_label(job.budget)}" if job.budget != 1 else ""
    name = f"{job.name}{budget} seed {job.seed}" if job.kind == "row" else f"selection {job.name} seed {job.seed}"
    with tracker.run(name, nested=True, tags={"kind": job.kind, "name": job.name, "seed": str(job.seed)}):
        for metrics, step in out.get("history", []):
            tracker.log_metrics(metrics, step)
        if job.kind == "row":
            tracker.log_metrics({**{f"{d}_ppl": v for d, v in out["ppl"].items()},
                                 "total_cost": out["info"]["total_cost"],
                                 **({"lambada_acc": out["lambada"]["acc"]} if "lambada" in out else {})})
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

    settings = EvalSettings(tasks=PAPER_TASKS, limit=limit, ppl=False, speed=None, items=True)
    paths = [r["export"] for r in results]
    log(f"zero-shot: {len(paths)} models x {len(PAPER_TASKS)} tasks x {limit} items on {actors} evaluation actor(s)")
    scored = evaluate_pool(paths, settings=settings, actors=actors, tracker=tracker, log=log)
    for r, s in zip(results, scored):
        if s.get("status") != "ok":
            raise TrspError(f"zero-shot evaluation of {r['row']} seed {r['seed']} failed: {s.get('error')}")
        r["zeroshot"] = s["tasks"]
