"""Compare methods on one model: dense, TRSP and its ablations, ShortGPT, SLEB, and heal variants.

One stage-1 run serves every TRSP row (the one-shot ablation uses its round-1 ranking). Every row
that trains weights gets the same number of weight-update tokens (`stage2.steps` batches):
trsp spends them in stage 2, shortgpt+heal in heal, trsp+heal half in stage 2 and half in heal.
"""

from __future__ import annotations

import time

from trsp_ray.config import RunConfig, replace

ROWS = ("dense", "trsp", "trsp-no-stage2", "trsp-oneshot", "shortgpt", "sleb", "random",
        "shortgpt+heal", "trsp+heal")
DEFAULT_ROWS = ("dense", "trsp", "trsp-no-stage2", "trsp-oneshot", "shortgpt", "sleb",
                "shortgpt+heal", "trsp+heal")
COLUMNS = ["method", "dropped layers", "kept params (M)", "kept %", "held-out PPL", "vs ShortGPT",
           "weight tokens", "wall s"]


def _row_plan(row: str, cfg: RunConfig):
    """(base method, stage-2 config, heal config) that give `row` its share of the token budget."""
    budget = cfg.stage2.steps
    no_heal = replace(cfg.heal, steps=0)
    if row == "shortgpt+heal":
        return "shortgpt", cfg.stage2, replace(cfg.heal, steps=budget)
    if row == "trsp+heal":
        half = budget // 2
        return "trsp", replace(cfg.stage2, steps=half), replace(cfg.heal, steps=budget - half)
    return row, cfg.stage2, no_heal


def run_row(bench, row: str, *, stage1=None, report=None) -> dict:
    """Prune (or not, for "dense") and score one benchmark row on a prepared Workbench."""
    from trsp_ray.methods import apply_method
    from trsp_ray.pipeline import kept_parameters

    t0 = time.time()
    if row == "dense":
        return {"method": row, "drop order": [], "params": kept_parameters(bench.model),
                "held-out PPL": bench.heldout_ppl(), "info": {}, "seconds": time.time() - t0}
    method, s2, heal = _row_plan(row, bench.cfg)
    out = apply_method(bench, method, stage1=stage1, stage2_cfg=s2, heal_cfg=heal,
                       report=report or (lambda m, s: None))
    return {"method": row, "drop order": out.drop, "params": kept_parameters(out.model),
            "held-out PPL": bench.heldout_ppl(out.model), "info": out.info, "seconds": time.time() - t0}


def table_rows(raw: list[dict], *, dense_params: int, stage1_seconds: float) -> list[dict]:
    """The printed columns (see COLUMNS) from run_row results."""
    shortgpt = next((r["held-out PPL"] for r in raw if r["method"] == "shortgpt"), None)
    rows = []
    for r in raw:
        seconds = r["seconds"] + (stage1_seconds if r["method"].startswith("trsp") else 0.0)
        rows.append({"method": r["method"], "dropped layers": " ".join(map(str, sorted(r["drop order"]))) or "-",
                     "kept params (M)": r["params"] / 1e6, "kept %": 100.0 * r["params"] / dense_params,
                     "held-out PPL": r["held-out PPL"], "vs ShortGPT": r["held-out PPL"] / shortgpt if shortgpt else "",
                     "weight tokens": r["info"].get("weight_tokens", 0), "wall s": seconds,
                     "drop order": r["drop order"], "info": r["info"]})
    return rows


def run_benchmark(cfg: RunConfig, rows: tuple[str, ...] = DEFAULT_ROWS) -> list[dict]:
    """Run every row on the same model and data in this process; returns one dict per row."""
    from trsp_ray import plots
    from trsp_ray.methods import run_stage1_for
    from trsp_ray.pipeline import kept_parameters, log, prepare
    from trsp_ray.tracking import make_tracker

    bench = prepare(cfg)
    t = cfg.tracking
    tracker = make_tracker(enabled=t.enabled, tracking_uri=t.tracking_uri, experiment=t.experiment)
    raw: list[dict] = []
    with tracker.run(f"benchmark-r{cfg.ratio}", tags={"kind": "benchmark", "model": cfg.model}):
        tracker.log_params(cfg.to_dict())
        tracker.log_params({"data.heldout_source": bench.texts.heldout_source, "rows": ",".join(rows)})
        stage1, stage1_seconds = None, 0.0
        if any(r.startswith("trsp") for r in rows):
            log(f"stage 1 (shared by every TRSP row): {bench.n_drop()} of {bench.num_layers} layers")
            t0 = time.time()
            stage1 = run_stage1_for(bench, report=lambda m, s: tracker.log_metrics(m, s))
            stage1_seconds = time.time() - t0
            tracker.log_figure(plots.gate_trajectories(stage1.gate_history, stage1.round_ends, stage1.drop_order),
                               "stage1_gates.png")
            tracker.log_dict({"drop_order": stage1.drop_order, "round1_ranking": stage1.round1_ranking},
                             "stage1_drop_order.json")
        for k, row in enumerate(rows, 1):
            log(f"[{k}/{len(rows)}] {row}")
            with tracker.run(row, nested=True, tags={"method": row}):
                result = run_row(bench, row, stage1=stage1, report=lambda m, s: tracker.log_metrics(m, s))
                tracker.log_metrics({"heldout_ppl": result["held-out PPL"]})
                tracker.log_dict({"drop_order": result["drop order"], **result["info"]}, "result.json")
            raw.append(result)
            log(f"[{k}/{len(rows)}] {row}: held-out PPL {result['held-out PPL']:.2f}")
        results = table_rows(raw, dense_params=kept_parameters(bench.model), stage1_seconds=stage1_seconds)
        _log_tables(tracker, results)
    print_results(results, bench=bench, stage1=stage1)
    return results


def _log_tables(tracker, results: list[dict]) -> None:
    from trsp_ray.table import markdown, render

    tracker.log_text(markdown(results, COLUMNS), "benchmark.md")
    tracker.log_text(render(results, COLUMNS), "benchmark.txt")


def print_results(results: list[dict], *, bench, stage1) -> None:
    from trsp_ray.table import render

    cfg = bench.cfg
    print()
    print(render(results, COLUMNS))
    print(f"\nheld-out text: {bench.texts.heldout_source}; PPL over {cfg.data.eval_max_windows or 'all'} "
          f"windows of {cfg.data.eval_seqlen} tokens. Rows that train weights get {cfg.stage2.steps} batches "
          f"of {cfg.data.batch_size}x{cfg.data.seqlen} tokens each.")
    if stage1 is not None:
        print(f"stage 1: {stage1.tokens} calibration tokens ({stage1.steps} gate-only steps, shared by the trsp rows); "
              f"drop order {stage1.drop_order}")
