"""A selection by recovery (the `recover` selector) on Ray Tune: each candidate drop set a trial
under ASHA, the winner handed back to the pipeline, which fits and heals it with the rest of the
budget. What runs and what it may spend is planned in run/audition_plan.py.

The driver computes the candidates on its own model (one Block Influence forward, one angular
forward) and starts Tune; each trial loads the model in its own process (`reuse_actors` keeps it
loaded for the next), prunes a copy to its candidate set, fits it as the pipeline does and heals it
for the planned steps, reporting its loss and cloze accuracy (next-token, greedy) on the
calibration's validation tail, which no trial trains on. Every report is also written to the
trial's record (atomically), so a stopped trial's compute is counted too. Ray is joined or started
by ray_session (and stopped again if started here).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import tempfile
import time
from pathlib import Path

from trsp_ray.common.errors import TrspError
from trsp_ray.common.logs import log
from trsp_ray.config import registry
from trsp_ray.config.run_config import trial_config
from trsp_ray.run.audition_plan import rank
from trsp_ray.run.budget import audition_plan as plan


def audition(bench, spec: registry.Method, *, model, gates) -> tuple[list[int], dict]:
    """(drop set, selection info) of the candidate that recovers best; `model` / `gates`: the working
    copy the candidates' forwards run on (methods.select)."""
    from trsp_ray.method import candidates as cands

    cfg = bench.cfg
    p = plan(cfg, spec=spec, num_layers=bench.num_layers)
    sets, forward = candidate_sets(bench, model=model, gates=gates)
    log(f"{spec.name}: {len(sets)} candidate drop sets, each a trial of at most {p.steps} heal steps "
        f"({cfg.selection.objective}), reports every {p.every} steps, ASHA keeps 1/{cfg.selection.reduction} "
        "at each rung:")
    for name, drop in sets.items():
        log(f"  {name:>14}: {drop}")
    if not sets:
        raise TrspError(f"selection.candidates={cfg.selection.candidates!r} gives no drop set on this model "
                        f"({bench.num_layers} layers, candidates {bench.candidates()}); name others")
    with _directory(cfg, spec, sets, p) as root:
        done = _done(root / "trials", sets)
        if done:
            log(f"  {len(done)} trial(s) read back from {root}: {', '.join(sorted(done))}")
        todo = {name: drop for name, drop in sets.items() if name not in done}
        if todo:
            failed = _tune(cfg, spec, todo, p, root)
            _mark_stopped(root / "trials", [n for n in todo if n not in failed], steps=p.steps)
        trials = [json.loads(f.read_text()) for f in sorted((root / "trials").glob("*.json"))
                  if f.stem in sets]
    ranked = rank([t for t in trials if t.get("nlls")])
    spent = forward + sum(t["cost"] for t in trials)
    _table(ranked, p)
    best = ranked[0]
    log(f"{spec.name}: {best['name']} recovers best, drop set {best['drop']}; the selection spent "
        f"{spent / 1e3:.1f}k dense-forward tokens (planned at most {p.total / 1e3:.1f}k"
        + (f"; {len(done)} trial(s) in an earlier run" if done else "") + ")")
    summary = [{k: t.get(k) for k in ("name", "drop", "step", "loss", "cloze", "cost", "diff", "se", "tie")}
               for t in ranked]
    info = {"select_cost": spent, "calib_tokens": 0, "audition": summary, "audition_winner": best["name"],
            "audition_steps": p.steps, "candidates": cands.parse(cfg.selection.candidates)}
    steps = heal_steps_left(bench, spec, drop=list(best["drop"]), select_cost=spent)
    if steps is not None:
        info["budget_heal_steps"] = steps
    return list(best["drop"]), info


def heal_steps_left(bench, spec: registry.Method, *, drop: list[int], select_cost: float) -> int | None:
    """The heal steps a compute budget leaves after a selection that spent `select_cost` (its plan
    reserved the most it could spend) and the fit of `drop`; None without a budget."""
    from trsp_ray.config.run_config import for_method, sized
    from trsp_ray.models import families
    from trsp_ray.plan.compute import heal_steps
    from trsp_ray.run.budget import fit_cost

    cfg = bench.cfg
    if not (cfg.heal.compute_budget and spec.heal):
        return None
    fit = fit_cost(sized(for_method(cfg), hidden=families.text_config(bench.model).hidden_size), spec=spec,
                   drop=drop, num_layers=bench.num_layers)
    steps = heal_steps(cfg, spec=spec, select=select_cost, comp=fit, drop=drop)
    log(f"{spec.name}: the heal gets the {steps} steps the budget leaves after what the trials spent")
    return steps


@contextlib.contextmanager
def _directory(cfg, spec: registry.Method, sets: dict, p):
    """Where the trials' records and Tune's files live: a directory keyed by everything a trial
    reads (the trial config, the candidate sets, the plan's steps, the model and calibration bytes)
    under the checkpoint directory, kept, so that an interrupted or repeated audition reads its
    finished trials back; a temporary one where the checkpoint directory is remote."""
    from trsp_ray.common.filesystems import is_remote
    from trsp_ray.run.content import checkpoint_root, run_inputs, store_key

    base = checkpoint_root(cfg.checkpoint_dir)
    if is_remote(base):
        with tempfile.TemporaryDirectory(prefix="trsp-audition-") as tmp:
            yield Path(tmp)
        return
    run = {k: v for k, v in trial_config(cfg).to_dict().items() if k not in ("output", "tracking", "threads",
                                                                             "checkpoint_dir")}
    what = {"audition": {"run": run, "method": spec.name, "sets": sets, "steps": p.steps, "every": p.every}}
    key = store_key(what, cfg=cfg.to_dict(), data=run_inputs(cfg.to_dict(), evaluation=False))
    root = Path(base).expanduser().resolve() / "auditions" / key
    (root / "trials").mkdir(parents=True, exist_ok=True)
    yield root


def _done(trials: Path, sets: dict) -> dict[str, dict]:
    """{name: record} of the trials an earlier run finished, or that ASHA stopped there."""
    out = {}
    for name in sets:
        path = trials / f"{name}.json"
        if path.is_file():
            record = json.loads(path.read_text())
            if record.get("finished") or record.get("stopped"):
                out[name] = record
    return out


def _mark_stopped(trials: Path, names: list[str], *, steps: int) -> None:
    """Mark the trials `names` (this run's, none failed) that reported but did not reach `steps` as
    stopped by ASHA: a rerun does not revisit ASHA's decision (a failed trial runs again)."""
    from trsp_ray.common import atomic

    for name in names:
        path = trials / f"{name}.json"
        if path.is_file():
            record = json.loads(path.read_text())
            if record.get("nlls") and record["step"] < steps:
                atomic.write_json(path, {**record, "stopped": True})


def candidate_sets(bench, *, model, gates) -> tuple[dict[str, list[int]], float]:
    """({name: drop set}, the forwards' dense-forward tokens) of the configured candidates."""
    from trsp_ray.method import candidates as cands
    from trsp_ray.method import selectors
    from trsp_ray.method.training import SELECTION_STREAM
    from trsp_ray.run.methods import fixed_windows, shortgpt_windows

    cfg, n_drop, allowed = bench.cfg, bench.n_drop(), bench.candidates()
    names = cands.parse(cfg.selection.candidates)
    need = cands.needs_forward(names)
    count = shortgpt_windows(cfg, n_drop)
    windows = fixed_windows(bench.batches(SELECTION_STREAM), count) if need else []
    influence = selectors.block_influence(model, gates, windows) if "bi" in need else None
    angular = None
    if "angular-block" in need:
        try:
            angular = selectors.angular_drop(model, gates, windows, n_drop=n_drop, candidates=allowed)
        except TrspError as e:
            log(f"  angular-block left out: {e}")
    sets = cands.drop_sets(names, n_drop=n_drop, num_layers=bench.num_layers, candidates=allowed,
                           influence=influence, angular=angular)
    return sets, float(len(need) * count * cfg.data.seqlen)


def _tune(cfg, spec, sets: dict, p, root: Path) -> set[str]:
    """Run `sets` as Tune trials under ASHA (records under `root`/trials); the names that failed."""
    import ray
    from ray import tune
    from ray.tune.schedulers import ASHAScheduler

    from trsp_ray.distributed.ray_session import session

    with session():
        cpus = int(ray.cluster_resources().get("CPU", 1))
        gpu = cfg.device != "cpu" and ray.cluster_resources().get("GPU", 0) >= 1
        concurrency = trials_at_once(cfg, len(sets), cpus=cpus, gpu=gpu)
        threads = max(1, cpus // concurrency)
        resources = {"cpu": threads, "gpu": 1} if gpu else {"cpu": threads}
        run = trial_config(cfg).to_dict()
        scheduler = ASHAScheduler(time_attr="training_iteration", metric="val_loss", mode="min", max_t=p.reports,
                                  grace_period=1, reduction_factor=cfg.selection.reduction)
        tuner = tune.Tuner(
            tune.with_resources(run_trial, resources),
            param_space={"run": run, "spec": dataclasses.asdict(spec), "name": tune.grid_search(list(sets)),
                         "sets": sets, "steps": p.steps, "every": p.every, "report_cost": p.report,
                         "val_windows": cfg.selection.val_windows, "threads": threads, "out": str(root / "trials")},
            tune_config=tune.TuneConfig(scheduler=scheduler, max_concurrent_trials=concurrency, reuse_actors=True),
            run_config=tune.RunConfig(name=f"audition-{time.strftime('%Y%m%d-%H%M%S')}",
                                      storage_path=str(root / "tune"), verbose=0))
        results = tuner.fit()
        failed = {r.config["name"]: str(r.error).splitlines()[0][:300] for r in results if r.error}
        if failed:
            log(f"  {len(failed)} audition trial(s) failed: {next(iter(failed.values()))}")
        return set(failed)


def trials_at_once(cfg, trials: int, *, cpus: int, gpu: bool) -> int:
    """selection.concurrency, else one trial per CPU (Ray gives each a GPU of its own on GPUs); on CPU
    no more than host memory holds at a trial's planned peak (plan/single_plan.trial_peak: its copy of
    the model, the dense teacher beside it, the optimizer state, its activations)."""
    n = min(trials, cfg.selection.concurrency or cpus)
    if gpu:
        return max(1, n)
    from trsp_ray.plan.single_plan import trial_peak
    from trsp_ray.run.workbench import device_kind

    _, memory = device_kind(cfg)
    peak = trial_peak(cfg, device="cpu", memory_gb=memory).total
    held = max(1, min(n, int(memory // peak)))
    if held < n:
        log(f"  {n} trials at once would need {n * peak:.1f} GB of host memory ({peak:.1f} GB each) and "
            f"{memory:.1f} GB is there: {held} at a time")
    return held


def run_trial(config: dict) -> None:
    """Tune entry point: one candidate's fit and short heal, reporting validation loss."""
    from ray import tune

    execute(config, report=tune.report)


def execute(config: dict, *, report) -> dict:
    """One audition trial (`config` as _tune builds it); `report(metrics)` is Tune's. Returns its
    last record."""
    import torch

    from trsp_ray.common import atomic
    from trsp_ray.config.run_config import for_method, from_dict, sized
    from trsp_ray.data.perplexity import scores_of, windows
    from trsp_ray.models import families
    from trsp_ray.plan import compute
    from trsp_ray.run.budget import fit_cost
    from trsp_ray.run.methods import apply_method, method_heal
    from trsp_ray.run.workbench import prepare

    torch.set_num_threads(int(config["threads"]))
    cfg = from_dict(config["run"])
    spec = registry.Method(**config["spec"])  # the resolved pipeline's entry, as plain data
    name, drop = config["name"], list(config["sets"][config["name"]])
    bench = prepare(cfg)
    cal = bench.calibration
    val_seqlen = cal.chunk + (bench.bos is not None)
    docs = list(cal.val_docs)
    fit = fit_cost(sized(for_method(cfg), hidden=families.text_config(bench.model).hidden_size), spec=spec,
                   drop=drop, num_layers=bench.num_layers) if spec.compensate else 0.0
    step_cost = compute.step_cost(cfg, spec=spec, drop=drop)
    steps, every = int(config["steps"]), int(config["every"])
    made: list = []
    record = {"name": name, "drop": sorted(drop), "step": 0, "nlls": [], "accs": [], "docs": [], "loss": None,
              "cloze": None, "cost": fit}
    path = Path(config["out"], f"{name}.json")
    reports = 0

    def on_metrics(metrics: dict, step: int) -> None:
        nonlocal reports
        if "heal/ce" not in metrics or not made or (step % every and step != steps):
            return
        model = made[-1]
        was = model.training
        nlls, accs = scores_of(model, windows(bench.val_ids, val_seqlen, int(config["val_windows"]), bos=bench.bos),
                               batch_size=4)
        model.train(was)
        reports += 1
        loss = sum(nlls) / len(nlls)
        # a stopped trial may run on to its next report before Tune stops it: counted as if it did
        ahead = min(steps, step + every) * step_cost
        # the last report finishes the trial: Tune may end it there, before apply_method returns
        record.update(step=step, nlls=nlls, accs=accs, docs=docs[: len(nlls)], loss=loss,
                      cloze=sum(accs) / len(accs), finished=step == steps,
                      cost=fit + ahead + reports * float(config["report_cost"]))
        atomic.write_json(path, record)
        report({"val_loss": loss, "heal_step": step})

    heal = dataclasses.replace(method_heal(cfg), steps=steps, checkpoint_minutes=None)  # a stopped trial: not resumed
    os.makedirs(config["out"], exist_ok=True)
    atomic.write_json(path, record)  # a trial failing in its fit still counts what the fit spent
    apply_method(bench, spec, drop=drop, heal_cfg=heal, report=on_metrics, on_model=made.append)
    return record


def _table(ranked: list[dict], p) -> None:
    from trsp_ray.common import table

    rows = [{"candidate": t["name"], "drop": ",".join(map(str, t["drop"])), "steps": f"{t['step']}/{p.steps}",
             "val NLL": f"{t['loss']:.4f}",
             "vs best": "-" if t["diff"] is None else f"{t['diff']:+.4f} ± {t['se']:.4f}",
             "cloze acc": "-" if t.get("cloze") is None else f"{t['cloze']:.4f}",
             "vs best ": "-" if t.get("acc_diff") is None else f"{t['acc_diff']:+.4f} ± {t['acc_se']:.4f}",
             "call": "best" if t is ranked[0] else ("stopped" if t["diff"] is None else
                                                     ("tie" if t["tie"] else "worse")),
             "compute": f"{t['cost'] / 1e3:.1f}k"} for t in ranked]
    for line in table.render(rows, list(rows[0])).splitlines():
        log("  " + line)
