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


def run_benchmark(cfg: RunConfig, rows: tuple[str, ...] = DEFAULT_ROWS) -> list[dict]:
    """Run every row on the same model and data; returns one dict per row (see COLUMNS)."""
    from trsp_ray import plots
    from trsp_ray.methods import apply_method, run_stage1_for
    from trsp_ray.pipeline import kept_parameters, log, prepare
    from trsp_ray.table import markdown, render
    from trsp_ray.tracking import make_tracker

    bench = prepare(cfg)
    t = cfg.tracking
    tracker = make_tracker(enabled=t.enabled, tracking_uri=t.tracking_uri, experiment=t.experiment)
    dense_params = kept_parameters(bench.model)
    results: list[dict] = []
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
            t0 = time.time()
            if row == "dense":
                ppl, drop, params, info = bench.heldout_ppl(), [], dense_params, {}
            else:
                method, s2, heal = _row_plan(row, cfg)
                with tracker.run(row, nested=True, tags={"method": row}):
                    out = apply_method(bench, method, stage1=stage1, stage2_cfg=s2, heal_cfg=heal,
                                       report=lambda m, s: tracker.log_metrics(m, s))
                    ppl, drop, params, info = bench.heldout_ppl(out.model), out.drop, kept_parameters(out.model), out.info
                    tracker.log_metrics({"heldout_ppl": ppl})
                    tracker.log_dict({"drop_order": drop, **info}, "result.json")
            seconds = time.time() - t0 + (stage1_seconds if row.startswith("trsp") else 0.0)
            results.append({"method": row, "dropped layers": " ".join(map(str, sorted(drop))) or "-",
                            "kept params (M)": params / 1e6, "kept %": 100.0 * params / dense_params,
                            "held-out PPL": ppl, "weight tokens": info.get("weight_tokens", 0), "wall s": seconds,
                            "drop order": drop, "info": info})
            log(f"[{k}/{len(rows)}] {row}: held-out PPL {ppl:.2f}")
        shortgpt = next((r["held-out PPL"] for r in results if r["method"] == "shortgpt"), None)
        for r in results:
            r["vs ShortGPT"] = r["held-out PPL"] / shortgpt if shortgpt else ""
        table = render(results, COLUMNS)
        tracker.log_text(markdown(results, COLUMNS), "benchmark.md")
        tracker.log_text(table, "benchmark.txt")
    print()
    print(table)
    print(f"\nheld-out text: {bench.texts.heldout_source}; {bench.heldout_ids.numel()} tokens, "
          f"PPL over {cfg.data.eval_max_windows or 'all'} windows of {cfg.data.eval_seqlen}.")
    if stage1 is not None:
        print(f"stage 1: {stage1.tokens} calibration tokens ({stage1.steps} gate-only steps, shared by the trsp rows); "
              f"drop order {stage1.drop_order}")
    return results
