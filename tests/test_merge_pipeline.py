"""Merge as a pipeline (issue 51): `trsp-ray prune --method merge` exports a stock model with the merged
model's logits (not a dropped model's) on families whose configs differ from Llama's; every family's tiny
model merges or is refused in one line; the registry, the benchmark rows, the search space, the compute
budget and the workers' route all know `merge` and `merge+heal`."""

import json
from pathlib import Path

import pytest
import torch

from trsp_ray.cli import main
from trsp_ray.common.errors import TrspError
from trsp_ray.config import registry
from trsp_ray.config.run_config import load_config, replace
from trsp_ray.models import families

SMALL = ["data.seqlen=32", "data.batch_size=2", "data.eval_seqlen=64", "data.eval_max_windows=4",
         "stage2.steps=2", "baselines.calib_windows=2", "merging.windows=64", "threads=1", "tracking.enabled=false"]


def _args(root: Path, *extra):
    out = ["--model", str(root / "model"), "--calib-text", str(root / "calib.txt"), "--eval-text",
           str(root / "eval.txt")]
    for item in SMALL:
        out += ["--set", item]
    return out + list(extra)


def _config(root: Path, method: str):
    data = {"calib_text": str(root / "calib.txt"), "eval_text": str(root / "eval.txt")}
    return load_config(None, [f"model={root / 'model'}", f"method={method}", "ratio=0.25", *SMALL],
                       base={"data": data})


def _logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids, use_cache=False).logits


@pytest.mark.parametrize("family", ["llama", "phi3", "gpt_neox"])
def test_prune_merge_exports_the_merged_model(family, workspaces, tmp_path):
    """The export reloads with plain from_pretrained and gives the logits of the model the merge made in
    this process; a model with the same layers dropped instead gives other logits."""
    from transformers import AutoModelForCausalLM

    from trsp_ray.method.surgery import remove_layers
    from trsp_ray.run.methods import apply_method
    from trsp_ray.run.workbench import prepare

    root = workspaces(family)
    out = tmp_path / "merged"
    assert main(["prune", *_args(root, "--method", "merge", "--ratio", "0.25", "--output", str(out))]) == 0
    manifest = json.loads((out / "trsp_ray.json").read_text())
    loaded = AutoModelForCausalLM.from_pretrained(out).eval()
    assert loaded.config.num_hidden_layers == 6 == manifest["num_layers_kept"]

    bench = prepare(_config(root, "merge"))
    outcome = apply_method(bench, registry.method("merge"))
    assert manifest["dropped_layers"] == outcome.drop and len(outcome.drop) == 2
    assert outcome.kept == [i for i in range(8) if i not in outcome.drop]
    assert [p[1] for p in outcome.info["merge_pairs"]] == sorted(outcome.drop)
    ids = torch.randint(3, 1000, (2, 24), generator=torch.Generator().manual_seed(1))
    merged = _logits(outcome.model, ids)
    torch.testing.assert_close(_logits(loaded, ids), merged, atol=1e-5, rtol=0)
    dropped = bench.fresh_model()
    remove_layers(dropped, outcome.drop)
    assert (_logits(dropped, ids) - merged).abs().max() > 1e-2  # a merge, not a drop, was exported


@pytest.mark.parametrize("family", sorted(families.FAMILIES))
def test_every_family_merges_through_prune_or_is_refused_in_one_line(family, workspaces, tmp_path, capsys):
    root = workspaces(family)
    capsys.readouterr()  # the workspace's own output
    code = main(["prune", *_args(root, "--method", "merge", "--ratio", "0.25")])
    got = capsys.readouterr()
    err = got.err.strip().splitlines()
    if code == 0:  # one progress line a pair, as it is done, with what it kept
        lines = [line.split("merge: pair ")[1] for line in got.out.splitlines() if "merge: pair " in line]
        assert [line.split()[0] for line in lines] == ["1/2", "2/2"], got.out
        assert all(" done in " in line and "the KV groups kept leave loss" in line and "refitted" in line
                   for line in lines), lines
        return
    assert code == 2 and len(err) == 1, err
    why = families.merge_refusal(_config_of(root))
    assert (why and why in err[0]) or "pairs to merge asked" in err[0], err[0]


def _config_of(root: Path):
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(root / "model")


def test_merge_is_a_pipeline_everywhere_pipelines_are_listed():
    from trsp_ray.search.space import searchable

    assert registry.method("merge+heal").merges and registry.method("merge+heal").heal
    assert registry.method("merge+heal.lora").recipe == "lora"
    for bad in ("merge+comp+heal", "merge+cos", "merge+scalar+heal"):
        with pytest.raises(TrspError, match="merge or merge\\+heal") as e:
            registry.method(bad)
        assert "\n" not in str(e.value)
    assert [r.pipeline for r in registry.rows(["merge", "merge+heal"])] == ["merge", "merge+heal"]
    assert "merge+heal" in registry.CURVE_ROWS
    assert not registry.ROWS["merge"].is_baseline
    assert registry.name_of({"selector": "merge", "heal": "tail"}) == "merge+heal.tail"
    assert searchable("merging.ridge") and searchable("selector")
    with pytest.raises(TrspError, match="a merge repairs each pair itself"):
        from trsp_ray.config.run_config import for_method

        for_method(replace(load_config(None, ["method=merge"]), **{"compensation.method": "lstsq"}))


def test_the_workers_merge_themselves_and_plan_the_merge_beside_block_influence():
    """merge and merge+heal run on Ray Train workers (distributed/merging.py), never as a drop set handed over
    (the workers would drop, not merge, it); their plan has the pairs' forward and the merge per rank, which
    holds the wide pair whole (more than one process's extra layer); a +FIT stays refused in one line."""
    from trsp_ray.distributed.train import check_worker_settings
    from trsp_ray.plan.merge_plan import merge_memory
    from trsp_ray.plan.shape import shape_from_config
    from trsp_ray.plan.zero3_plan import zero3_plan

    for name in ("merge", "merge+heal", "merge+heal.tail"):
        assert registry.on_workers(name) and name not in registry.HANDED_OVER_METHODS
        check_worker_settings(load_config(None, [f"method={name}", "distributed.workers=2"]))
    cfg = load_config(None, ["method=merge+heal", "distributed.workers=4"])
    shape = shape_from_config({"vocab_size": 128256, "hidden_size": 4096, "intermediate_size": 14336,
                               "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8})
    plan = zero3_plan(cfg, shape, spec=registry.method("merge+heal"))
    assert [p.name for p in plan.stages][:2] == ["shortgpt (Block Influence)", "merge (pairs gathered on every rank)"]
    e = plan.setup.dtype_bytes
    one, host = merge_memory(cfg, dtype_bytes=e, shape=shape)
    ranks, host4 = merge_memory(cfg, dtype_bytes=e, shape=shape, ranks=4)
    layer_gb = shape.layer_params * e / 1024**3
    # two more layers on a rank (the wide pair whole), less the one process's stored block inputs
    inputs_gb = cfg.merging.choice_windows * cfg.data.seqlen * shape.hidden * e / 1024**3
    assert ranks == pytest.approx(one + 2 * layer_gb - inputs_gb, rel=1e-9) and host4 == pytest.approx(host / 4)
    assert plan.stages[1].parts["the wide pair, its copies and the refit sums"] == pytest.approx(ranks)
    with pytest.raises(TrspError, match="a merge repairs each pair itself") as e:
        check_worker_settings(load_config(None, ["method=merge+heal", "compensation.method=lstsq",
                                                 "distributed.workers=2"]))
    assert "\n" not in str(e.value)


def test_a_compute_budget_pays_the_merge_before_the_heal(workspaces):
    """The planned merge bounds what a merge spends (measured on the tiny model), and a budget buys the
    heal steps left after the selection and the merge."""
    from trsp_ray.plan import compute
    from trsp_ray.run import budget
    from trsp_ray.run.methods import apply_method
    from trsp_ray.run.workbench import prepare

    root = workspaces("llama")
    cfg = _config(root, "merge")
    spec = registry.method("merge")
    planned = budget.planned_compensation_cost(cfg, spec=spec, num_layers=8)
    outcome = apply_method(prepare(cfg), spec)
    spent = compute.fit_spent(outcome.info)
    assert 0 < spent <= planned
    assert spent == pytest.approx(budget.fit_cost(cfg, spec=spec, drop=outcome.drop, num_layers=8))
    heal = replace(cfg, method="merge+heal", **{"heal.compute_budget": 4 * planned})
    select = budget.planned_select_cost(heal, spec=registry.method("merge+heal"), num_layers=8)
    steps = budget.resolve(heal, spec=registry.method("merge+heal"), num_layers=8).stage2.steps
    step = compute.step_cost(heal, spec=registry.method("merge+heal"))
    assert select > 0 and steps == int((4 * planned - select - planned) // step)


def test_the_planned_merge_bounds_every_placement_of_its_pairs_and_is_met_by_the_deepest():
    """planned_cost is what a merge of any n pairs can spend (each pass stops after its pair), so a budget
    is never overrun, and no looser: the deepest pairs spend exactly it, but for units=loss's trials, which
    run from each pair's block on and so cost most on the shallowest pairs: their part of it is those's."""
    from trsp_ray.method.merge_costs import trial_cost
    from trsp_ray.plan.compute import model_shape
    from trsp_ray.run.merging import choice, drop_cost, planned_cost

    cfg = load_config(None, ["method=merge", "data.seqlen=32", "merging.windows=256"])
    layers = model_shape(cfg.model).layers  # 30
    for target, units in (("pair", "energy"), ("wide", "energy"), ("dense", "energy"), ("dense", "loss")):
        c = replace(cfg, **{"merging.target": target, "merging.units": units})
        bound = planned_cost(c, model_shape(c.model), n_pairs=3)
        for firsts in ([0, 2, 4], [1, 9, 20], [3, 16, 25], [21, 23, 26], [22, 25, 27]):
            spent = drop_cost(c, drop=[a + 1 for a in firsts], num_layers=layers)
            assert spent <= bound * (1 + 1e-12), (target, units, firsts, spent, bound)
        deepest = drop_cost(c, drop=[25, 27, 29], num_layers=layers)
        if units == "energy":
            assert deepest == pytest.approx(bound)
        else:
            trials = choice(c, model_shape(c.model))
            assert trials["sets"] == 20

            def tried(firsts, trials=trials):
                return trial_cost(firsts=firsts, num_layers=layers, **trials)

            assert tried([0, 2, 4]) > 1.5 * tried([24, 26, 28])
            assert deepest - tried([24, 26, 28]) + tried([0, 2, 4]) == pytest.approx(bound)
        assert drop_cost(c, drop=[1, 3, 5], num_layers=layers) < 0.6 * bound


def test_a_budget_heals_with_what_the_merge_left_not_with_its_planned_bound(workspaces):
    """The budget's steps are resolved on the deepest pairs' cost; pairs chosen shallower leave more, and
    the heal gets it: selection + merge + heal stay within the budget, with less than one step unspent."""
    from trsp_ray.plan import compute
    from trsp_ray.run import budget
    from trsp_ray.run.methods import apply_method
    from trsp_ray.run.workbench import prepare

    spec = registry.method("merge+heal")
    cfg = _config(workspaces("llama"), "merge+heal")
    step = compute.step_cost(cfg, spec=spec)
    total = budget.planned_compensation_cost(cfg, spec=spec, num_layers=8) + 4 * step + 5000
    cfg = budget.resolve(replace(cfg, **{"heal.compute_budget": total}), spec=spec, num_layers=8)
    info = apply_method(prepare(cfg), spec).info
    used = info["select_cost"] + compute.fit_spent(info)
    assert max(int(p[1]) for p in info["merge_pairs"]) < 7  # not the deepest pairs: the merge left more
    assert info["heal_steps"] > cfg.stage2.steps
    assert total - step < used + info["heal_steps"] * step <= total


def test_the_dense_targets_are_the_bytes_the_plan_holds_for_them_on_the_host():
    """Target "dense" stores every pair's dense stream before the first merge: the streams layer_outputs
    returns are target_bytes' count, and the single-process plan of a merge holds targets_gb of them on
    the host beside a GPU (in the one memory on CPU); another target holds none."""
    from trsp_ray.method.boundaries import layer_outputs
    from trsp_ray.method.merge_costs import target_bytes
    from trsp_ray.models.tiny import tiny_model
    from trsp_ray.plan.merge_plan import merge_windows, targets_gb
    from trsp_ray.plan.single_plan import single_plan_for_run

    model = tiny_model("llama", layers=8).float()
    windows = [torch.randint(3, 200, (2, 24), generator=torch.Generator().manual_seed(k)) for k in range(3)]
    got = layer_outputs(model, [2, 6], windows)  # the ends of pairs (1, 2) and (5, 6)
    held = sum(t.numel() * t.element_size() for pair in got for t in pair)
    assert held == target_bytes(pairs=2, tokens=3 * 2 * 24, hidden=model.config.hidden_size, dtype_bytes=4)

    cfg = load_config(None, ["method=merge", "dtype=bf16"])
    gb = targets_gb(cfg, dtype_bytes=2)
    shape_hidden = 576  # SmolLM2-135M, the default model: 8 pairs at ratio 0.25 of 30 layers
    assert gb == pytest.approx(8 * merge_windows(cfg) * cfg.data.seqlen * shape_hidden * 2 / 1024**3)
    part = "merge: wide pair, copies, sums, trial logits"
    on_gpu = single_plan_for_run(cfg, device="gpu", memory_gb=80.0)
    merge_stage = next(st for st in on_gpu.stages if st.name == registry.MERGE_SELECTOR)
    assert merge_stage.host == pytest.approx(gb)
    on_cpu = single_plan_for_run(cfg, device="cpu", memory_gb=24.0)
    assert next(st for st in on_cpu.stages if st.name == registry.MERGE_SELECTOR).parts[part] == pytest.approx(
        merge_stage.parts[part] + gb)
    assert targets_gb(replace(cfg, **{"merging.target": "pair"}), dtype_bytes=2) == 0.0


def test_an_interrupted_merge_resumes_after_its_last_finished_pair(workspaces, tmp_path, monkeypatch, capsys):
    """A merge stores each pair as it is done: interrupted in its second pair, a rerun merges only that
    one and ends with the uninterrupted merge's model and records; a changed merging setting starts afresh;
    a finished merge leaves nothing stored."""
    from trsp_ray.method import merge
    from trsp_ray.run.methods import apply_method
    from trsp_ray.run.workbench import prepare

    root = workspaces("llama")
    store = tmp_path / "checkpoints"
    cfg = replace(_config(root, "merge"), checkpoint_dir=str(store))
    whole = apply_method(prepare(cfg), registry.method("merge"))
    assert len(whole.info["merge_pairs"]) == 2 and not (store / "merged_pairs").exists()

    cut, calls = merge._cut_pair, []

    def interrupted(*args, **kwargs):
        calls.append(args[1].index)
        if len(calls) == 2 and interrupt:
            raise KeyboardInterrupt
        return cut(*args, **kwargs)

    monkeypatch.setattr(merge, "_cut_pair", interrupted)
    interrupt = True
    with pytest.raises(KeyboardInterrupt):
        apply_method(prepare(cfg), registry.method("merge"))
    stored = list((store / "merged_pairs").glob("*/pair-*.pt"))
    assert [p.name for p in stored] == ["pair-0.pt"]
    # the plan's disk figure for the store (`prune --dry-run`, `trsp-ray plan`): one block of the run's precision a pair
    from trsp_ray.plan.merge_plan import store_gb

    per_pair = store_gb(cfg, dtype_bytes=4, shape=None) * 1024**3 / len(whole.info["merge_pairs"])
    assert per_pair <= stored[0].stat().st_size <= 1.1 * per_pair, (stored[0].stat().st_size, per_pair)

    interrupt, calls[:] = False, []
    capsys.readouterr()
    again = apply_method(prepare(cfg), registry.method("merge"))
    assert len(calls) == 1  # only the second pair ran
    assert "merge: resuming after pair 1 of 2" in capsys.readouterr().out
    for key in ("merge_pairs", "merge_units_from", "merge_channels_from", "merge_mlp_error", "merge_cost"):
        assert again.info[key] == whole.info[key], key
    ids = torch.randint(3, 1000, (2, 24), generator=torch.Generator().manual_seed(2))
    torch.testing.assert_close(_logits(again.model, ids), _logits(whole.model, ids), atol=1e-6, rtol=0)
    assert not (store / "merged_pairs").exists()

    interrupt, calls[:] = True, []
    with pytest.raises(KeyboardInterrupt):
        apply_method(prepare(cfg), registry.method("merge"))
    interrupt, calls[:] = False, []
    apply_method(prepare(replace(cfg, **{"merging.ridge": 0.05})), registry.method("merge"))
    assert len(calls) == 2  # another ridge: the stored pair is not this merge's


def test_a_budget_too_small_for_the_trials_names_the_energy_choice_and_a_budget_that_buys_it(workspaces):
    """merge+heal's attention units chosen by trial (units=loss) cost more than the energy choice: a budget
    between the two is refused in one line that names --set merging.units=energy and its least budget,
    and that budget, passed back with the setting, heals at least one step."""
    import re

    from trsp_ray.plan import compute
    from trsp_ray.run import budget

    spec = registry.method("merge+heal")
    cfg = _config(workspaces("llama"), "merge+heal")
    assert cfg.merging.units == "loss"
    energy = replace(cfg, **{"merging.units": "energy"})
    select = budget.planned_select_cost(cfg, spec=spec, num_layers=8)
    loss_fit, energy_fit = (budget.planned_compensation_cost(c, spec=spec, num_layers=8) for c in (cfg, energy))
    assert loss_fit > 1.2 * energy_fit  # the trials' passes
    step = compute.step_cost(energy, spec=spec)
    between = select + energy_fit + 3 * step
    assert between < select + loss_fit
    with pytest.raises(TrspError, match=r"raise it to at least .*--set merging\.units=energy") as refused:
        budget.resolve(replace(cfg, **{"heal.compute_budget": between}), spec=spec, num_layers=8)
    message = str(refused.value)
    assert "\n" not in message and "the merge " in message and "compensation" not in message
    least = re.search(r"give it at least ([0-9.]+)(k|M)?$", message)
    value = float(least.group(1)) * {"k": 1e3, "M": 1e6, None: 1.0}[least.group(2)]
    assert select + energy_fit + step <= value <= (select + energy_fit + step) * 1.01
    healed = budget.resolve(replace(energy, **{"heal.compute_budget": value}), spec=spec, num_layers=8)
    assert healed.stage2.steps == 1


@pytest.mark.parametrize("tokens, up, text", [(192, False, "192"), (12288, False, "12.3k"), (902345, False, "902k"),
                                              (902345, True, "903k"), (1219660, True, "1.22M"),
                                              (999600, False, "1M"), (3e9, False, "3B")])
def test_token_counts_read_as_people_write_them_and_a_least_budget_rounds_up(tokens, up, text):
    from trsp_ray.plan.compute import tokens_text

    assert tokens_text(tokens, up=up) == text
