"""Reproduction grid: bad input fails before anything runs; grid, presets, planner routing, tables."""

import pytest

from trsp_ray.common.errors import TrspError
from trsp_ray.config import registry
from trsp_ray.reproduce.grid import Cell, CellStore, build_grid
from trsp_ray.reproduce.presets import LOCAL, PAPER, get_preset, paper_numbers
from trsp_ray.reproduce.report import table_rows, to_csv, to_markdown
from trsp_ray.reproduce.run import run_reproduce


@pytest.mark.parametrize("kwargs, fragment", [
    ({"preset": "nope"}, "unknown preset 'nope'"),
    ({"preset": "local", "models": ["llama2-7b"]}, "unknown model 'llama2-7b'"),
    ({"preset": "paper", "methods": ["trsp", "magic"]}, "unknown method 'magic'"),
    ({"preset": "local", "ratios": [1.5]}, "ratio 1.5"),
    ({"preset": "local", "overrides": ["stage1.lambda9=1"]}, "unknown config key"),
])
def test_bad_input_is_one_line_before_anything_runs(tmp_path, monkeypatch, kwargs, fragment):
    import sys

    out = tmp_path / "out"
    with pytest.raises(TrspError) as err:
        run_reproduce(kwargs.pop("preset"), out=str(out), use_ray=True, **kwargs)
    assert fragment in str(err.value) and "\n" not in str(err.value)
    assert not out.exists(), "nothing may be written before the input is checked"
    assert "ray" not in sys.modules or not sys.modules["ray"].is_initialized()


def test_cli_subcommand_raises_the_one_line_error_for_a_bad_preset():
    import argparse

    from trsp_ray.reproduce.cli import register

    parser = argparse.ArgumentParser()
    register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["reproduce", "--preset", "laptop", "--out", "/nonexistent/x"])
    with pytest.raises(TrspError, match="unknown preset 'laptop'"):
        args.func(args)


def test_grid_has_one_dense_cell_per_model_and_shares_nothing_else():
    cells = build_grid(PAPER)
    assert len(cells) == 3 * (1 + 8)
    assert Cell("llama2-7b", "dense", 0.0) in cells
    two = build_grid(LOCAL, methods=["dense", "sleb"], ratios=[0.1, 0.25])
    assert [c.id for c in two] == ["smollm2-135m__dense__r0.000", "smollm2-135m__sleb__r0.100",
                                   "smollm2-135m__sleb__r0.250"]
    assert get_preset("local") is LOCAL


def test_paper_numbers_only_for_the_papers_cells():
    assert paper_numbers("llama2-7b", "trsp", 0.25) == (7.08, 60.57)
    assert paper_numbers("llama2-7b", "trsp-no-stage2", 0.25) == (10.15, 54.36)
    assert paper_numbers("llama2-13b", "trsp-oneshot", 0.25) is None
    assert paper_numbers("llama2-7b", "trsp", 0.5) is None
    assert paper_numbers("smollm2-135m", "dense", 0.25) is None


def test_planner_routes_stage2_cells_of_7b_and_larger_to_ray_train():
    from trsp_ray.reproduce.work import cell_config, cell_route, gpus_needed

    spec = PAPER.model("llama2-7b")
    trsp = cell_route(PAPER, spec, cell_config(PAPER, spec, method="trsp", ratio=0.25), "trsp")
    shortgpt = cell_route(PAPER, spec, cell_config(PAPER, spec, method="shortgpt", ratio=0.25), "shortgpt")
    assert trsp.workers > 1 and trsp.plan.peak <= 80  # all 7B weights + Adam do not fit one 80 GB GPU
    assert shortgpt.workers == 0 and shortgpt.plan.peak <= 80  # frozen weights fit one GPU
    assert 1 < gpus_needed(PAPER) <= 8
    assert gpus_needed(LOCAL) == 0


def test_paper_preset_trsp_rows_of_a_model_share_one_stage1_run():
    from trsp_ray.reproduce.run import plan_grid

    plans = plan_grid(PAPER, build_grid(PAPER), [])
    for model in ("llama2-7b", "llama2-13b", "llama3-8b"):
        trsp, no_stage2, oneshot = (plans[f"{model}__{m}__r0.250"] for m in ("trsp", "trsp-no-stage2", "trsp-oneshot"))
        assert trsp.stage1 is no_stage2.stage1 is oneshot.stage1  # one run, whatever each cell's route
        assert trsp.route.workers > 1 and no_stage2.route.workers == 0
        assert trsp.stage1.route.workers == 0 and trsp.stage1.n_drop == round(0.25 * trsp.route.plan.shape.layers)
        assert plans[f"{model}__shortgpt__r0.250"].stage1 is None


def test_refined_stage1_is_shared_only_by_cells_of_one_n_drop():
    """Swap refinement can reorder any position of the drop order, so a 12.5% cell may not take a
    prefix of the 25% cell's refined order: each ratio gets its own stage 1; without refinement the
    prefix rule holds and one stage 1 (of the larger n_drop) serves both."""
    from trsp_ray.reproduce.run import plan_grid

    model = PAPER.models[0].key
    cells = build_grid(PAPER, models=[model], methods=["trsp", "trsp-no-stage2"], ratios=[0.125, 0.25])
    refined = plan_grid(PAPER, cells, [])
    small, large = (refined[f"{model}__trsp__r{r:.3f}"].stage1 for r in (0.125, 0.25))
    assert small is not large and small is refined[f"{model}__trsp-no-stage2__r0.125"].stage1
    assert small.n_drop < large.n_drop
    greedy = plan_grid(PAPER, cells, ["stage1.refine=0"])
    small, large = (greedy[f"{model}__trsp__r{r:.3f}"].stage1 for r in (0.125, 0.25))
    assert small is large and large.n_drop == round(0.25 * greedy[f"{model}__trsp__r0.250"].route.plan.shape.layers)


def test_paper_dry_run_prints_every_cell_with_route_and_plan_within_8x80gb(tmp_path):
    import subprocess
    import sys
    from pathlib import Path

    job = Path(__file__).resolve().parents[1] / "jobs" / "reproduce.py"
    done = subprocess.run([sys.executable, str(job), "--preset", "paper", "--dry-run"], capture_output=True,
                          text=True, cwd=tmp_path, timeout=120)
    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert not list(tmp_path.iterdir()), "a dry run writes nothing"
    cells = build_grid(PAPER)
    lines = {c.id: next(line for line in out.splitlines() if line.strip().startswith(c.id)) for c in cells}
    for _cid, line in lines.items():
        assert ("single process on one GPU" in line or "Ray Train worker(s), ZeRO-3 on GPU" in line) and " GB" in line
        peak = float(line.split("peak ")[1].split(" of")[0])
        assert 0 < peak <= 80, line
    assert "shared stage 1 for 4 cell(s)" in out and out.count("shared stage 1 for") == 3
    assert "every cell fits one node of 8 x 80 GB: yes" in out


def test_tables_show_paper_numbers_with_difference_and_name_the_text(tmp_path):
    results = [{"model": "llama2-7b", "method": "trsp", "ratio": 0.25, "layers": 24, "layers_original": 32,
                "dropped": [20, 21], "ppl": 7.50, "mean5_acc": 60.0, "paper_ppl": 7.08, "paper_acc": 60.57},
               {"model": "llama2-7b", "method": "dense", "ratio": 0.0, "layers": 32, "layers_original": 32,
                "dropped": [], "ppl": 5.5, "mean5_acc": None, "paper_ppl": 5.47, "paper_acc": 69.0}]
    rows = table_rows(results)
    assert [r["method"] for r in rows] == ["dense", "trsp"]
    assert rows[1]["d PPL"] == pytest.approx(0.42)
    md = to_markdown(rows, "footer NOT WikiText-2")
    assert "+0.42" in md and "-0.57" in md and "NOT WikiText-2" in md
    assert to_csv(rows).splitlines()[0].startswith("model,method,ratio")


def test_store_writes_cells_atomically_and_logs_events(tmp_path):
    store = CellStore(tmp_path / "o")
    cell = Cell("m", "sleb", 0.25)
    assert not store.is_done(cell)
    store.save(cell, {"ppl": 3.0})
    store.log("computed", cell=cell.id)
    assert store.is_done(cell) and store.load(cell)["cell_id"] == cell.id
    assert [e["event"] for e in store.events()] == ["computed"]
    assert not list((tmp_path / "o" / "cells").glob(".tmp-*"))


def test_a_gpu_preset_on_a_machine_without_cuda_fails_on_one_line_before_any_work(tmp_path, monkeypatch):
    import dataclasses

    import torch
    from test_reproduce_resume import tiny_preset

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    preset = tiny_preset(tmp_path)
    gpu = dataclasses.replace(preset, run={**preset.run, "device": "cuda"}, gpus_per_model=1)
    out = tmp_path / "out"
    with pytest.raises(TrspError, match="CUDA") as err:
        run_reproduce(gpu, out=str(out), methods=["dense", "trsp"], use_ray=False)
    assert "\n" not in str(err.value)
    assert not (out / "run_log.jsonl").exists() and not list((out / "stage1").glob("*.json"))


def _weight_updates(cfg) -> tuple:
    """(steps, lr, trainable, lora rank) of what a cell trains after its selection."""
    from trsp_ray.config import registry
    from trsp_ray.run.methods import method_heal

    spec = registry.method(cfg.method)
    if spec.heal:
        h = method_heal(cfg)
        return h.steps, h.lr, h.trainable, h.lora_rank
    assert spec.stage2, cfg.method
    s = cfg.stage2
    return s.steps, s.lr, s.trainable, s.lora_rank


TRAINED_CELLS = ("trsp", "trsp-oneshot", "trsp+heal", "shortgpt+heal", "sleb+heal")


@pytest.mark.parametrize("preset", [LOCAL, PAPER], ids=["local", "paper"])
def test_every_trained_cell_trains_the_same_weights_for_as_many_steps(preset):
    """Issue 19: the paper preset healed shortgpt+heal / sleb+heal with LoRA while trsp and trsp+heal
    fine-tuned every weight, so the grid compared unequal budgets. Every trained cell now trains
    stage 2's steps at stage 2's lr on stage 2's trainable set; the paper's (LoRA-healed) figures
    still sit on the +heal rows as a reference."""
    from trsp_ray.config import registry
    from trsp_ray.reproduce.work import cell_config

    spec = preset.models[0]
    updates = {m: _weight_updates(cell_config(preset, spec, method=m, ratio=0.25)) for m in TRAINED_CELLS}
    print(updates)
    assert len(set(updates.values())) == 1, updates
    steps, _, trainable, _ = updates["trsp"]
    assert steps >= 1 and trainable == "all"
    for m in ("shortgpt", "sleb", "trsp-no-stage2"):  # the selection-only cells train nothing
        cfg = cell_config(preset, spec, method=m, ratio=0.25)
        spec_m = registry.method(cfg.method)
        assert cfg.heal.steps == 0 and not spec_m.heal and not spec_m.stage2, m
    assert paper_numbers("llama2-7b", "shortgpt+heal", 0.25) == (8.89, 57.10)
    assert paper_numbers("llama2-7b", "shortgpt", 0.25) is None


@pytest.mark.parametrize("method", ["shortgpt+heal", "sleb+heal"])
def test_a_healed_baseline_cell_too_big_for_one_gpu_routes_to_ray_train(method):
    """A full heal of 13B (weights, gradients, fp32 master and Adam) fits no 80 GB GPU: the +heal
    cells go to Ray Train workers like trsp's stage 2, instead of a LoRA heal in one process (the old
    grid) or a refusal (a heal.steps heal has no worker route). ShortGPT selects on the workers;
    SLEB's drop set is chosen in the model's one-device task and handed over (hands_over)."""
    from trsp_ray.reproduce.work import cell_config, cell_route, hands_over

    spec = PAPER.model("llama2-13b")
    cfg = cell_config(PAPER, spec, method=method, ratio=0.25)
    heal = cell_route(PAPER, spec, cfg, method)
    trsp = cell_route(PAPER, spec, cell_config(PAPER, spec, method="trsp", ratio=0.25), "trsp")
    print(method, heal.workers, heal.plan.peak, "| trsp:", trsp.workers, trsp.plan.peak)
    assert heal.workers > 1 and heal.plan.peak <= 80
    assert 1 < trsp.workers and heal.workers <= trsp.workers
    assert hands_over(cfg, heal.workers) == (method == "sleb+heal")


def test_a_handed_over_selection_is_the_one_process_selection(tmp_path):
    """prune_cells chooses a handed-over cell's drop set on its one device: SLEB's drop set of the
    cell's own config, as `select` gives it, with its cost."""
    from trsp_ray.config.run_config import load_config
    from trsp_ray.method.gates import attach_gates
    from trsp_ray.models import tiny
    from trsp_ray.reproduce.work import prune_cells
    from trsp_ray.run.methods import select
    from trsp_ray.run.workbench import prepare

    ws = tiny.tiny_workspace(tmp_path / "ws", layers=6)
    cfg = load_config(overrides=[f"model={ws / 'model'}", f"data.calib_text={ws / 'calib.txt'}",
                                 f"data.eval_text={ws / 'eval.txt'}", "method=sleb+heal", "ratio=0.34",
                                 "data.seqlen=32", "baselines.sleb_windows=3", "tracking.enabled=false"])
    out = prune_cells(cfg.to_dict(), [], model_dirs={}, stage1=[], selections=[{"id": "c", "run": cfg.to_dict()}])
    bench = prepare(cfg)
    model = bench.fresh_model()
    drop, info = select(bench, registry.method("sleb"), model=model, gates=attach_gates(model))
    assert out["records"] == [] and out["selections"]["c"]["drop"] == drop and len(drop) == 2
    assert out["selections"]["c"]["info"]["select_cost"] == info["select_cost"] > 0
