"""Heal recipes (issue 32 item 3): `tail` trains lm_head + the last k kept layers, `map` only the
down_proj weights a least-squares fold wrote its maps into; nothing else moves or reaches the
optimizer (ce and kd alike), bad inputs are one-line errors before any work, and the memory plans
count the recipe's optimizer state by hand."""

import functools
import json

import pytest
import torch
from test_distributed_ray import tiny_dir  # noqa: F401  (a fixture)

from trsp_ray.common.errors import TrspError
from trsp_ray.config import registry
from trsp_ray.config.run_config import load_config, replace
from trsp_ray.method.heal import run_heal
from trsp_ray.method.surgery import remove_layers
from trsp_ray.method.training import Batches, DistillLoss, TorchStepper
from trsp_ray.models import families
from trsp_ray.models.tiny import tiny_config, tiny_model

LLAMA2_70B = {"model_type": "llama", "vocab_size": 32000, "hidden_size": 8192, "intermediate_size": 28672,
              "num_hidden_layers": 80, "num_attention_heads": 64, "num_key_value_heads": 8,
              "tie_word_embeddings": False}


def _batches(seed: int = 0) -> Batches:
    ids = torch.randint(0, 256, (4000,), generator=torch.Generator().manual_seed(seed))
    return Batches(ids, seqlen=16, batch_size=4, seed=seed)


def _pruned(drop, *, tied: bool = False, layers: int = 6):
    import copy

    if tied:
        from transformers import AutoModelForCausalLM

        torch.manual_seed(0)
        config = tiny_config("llama", layers=layers)
        config.tie_word_embeddings = True
        dense = AutoModelForCausalLM.from_config(config).eval()
    else:
        dense = tiny_model("llama", layers=layers)
    model = copy.deepcopy(dense)
    kept = remove_layers(model, drop)
    return dense, model, kept


class Spy:
    """make_stepper that keeps the TorchStepper it builds (its optimizer state is what we check)."""

    def __init__(self, **kwargs):
        self.kwargs, self.stepper = kwargs, None

    def __call__(self, model, groups):
        self.stepper = TorchStepper(model, groups, **self.kwargs)
        return self.stepper


def _snapshot(model) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def _changed(before: dict, model) -> set[str]:
    return {name for name, p in model.named_parameters() if not torch.equal(before[name], p.detach())}


def _state_ids(stepper) -> set[int]:
    state = stepper.optimizer.state
    assert all(torch.is_tensor(v) for s in state.values() for v in s.values())
    return {id(p) for p in state}


@pytest.mark.parametrize("objective", ["ce", "kd"])
def test_a_tail_heal_moves_only_lm_head_and_the_last_k_layers(objective):
    dense, model, kept = _pruned([2, 3])  # 4 kept layers: original 0, 1, 4, 5
    spy = Spy(objective=DistillLoss(dense) if objective == "kd" else None)
    before = _snapshot(model)
    run_heal(model=model, batches=_batches(), steps=3, lr=1e-2, trainable="tail", tail_layers=2, make_stepper=spy)
    inside = {n for n in before if n.startswith(("lm_head.", "model.layers.2.", "model.layers.3."))}
    assert len(inside) == 1 + 2 * 9  # lm_head.weight + 9 tensors per Llama layer
    changed = _changed(before, model)
    assert changed and changed <= inside  # nothing outside the set moved ...
    assert "lm_head.weight" in changed and any(n.startswith("model.layers.2.") for n in changed)
    named = dict(model.named_parameters())
    ids = {id(named[n]) for n in inside}
    assert _state_ids(spy.stepper) == ids  # ... and the optimizer holds state for the set only
    assert {id(p) for g in spy.stepper.optimizer.param_groups for p in g["params"]} == ids
    assert not any(p.requires_grad for p in model.parameters())  # frozen again after the heal


def test_a_tied_head_trains_as_the_head_and_stays_tied():
    """A tied lm_head is the input embedding: it trains (from the head's gradient only, its embedding
    output detached), the model stays tied, the earlier layers stay put and the hook is removed."""
    _, model, _ = _pruned([2, 3], tied=True)
    embedding = model.get_input_embeddings()
    assert model.get_output_embeddings().weight is embedding.weight
    spy = Spy()
    before = _snapshot(model)
    run_heal(model=model, batches=_batches(), steps=2, lr=1e-2, trainable="tail", tail_layers=1, make_stepper=spy)
    changed = _changed(before, model)
    assert "model.embed_tokens.weight" in changed and changed <= {"model.embed_tokens.weight"} | {
        n for n in before if n.startswith("model.layers.3.")}
    assert model.get_output_embeddings().weight is embedding.weight and not embedding._forward_hooks
    assert len(_state_ids(spy.stepper)) == 1 + 9  # the shared weight once + one layer


def test_a_tied_heads_gradient_is_the_heads_own():
    """With the embedding's output detached (heal.output_side_only), the shared weight's gradient is
    exactly an untied head's (same values, input embedding frozen): the input side adds nothing."""
    import copy

    from trsp_ray.method.heal import output_side_only

    _, tied, _ = _pruned([2, 3], tied=True)
    untied = copy.deepcopy(tied)
    untied.lm_head.weight = torch.nn.Parameter(tied.lm_head.weight.detach().clone())
    for model, head in ((tied, tied.lm_head.weight), (untied, untied.lm_head.weight)):
        for p in model.parameters():
            p.requires_grad_(p is head)
    batch = _batches().next()
    hook = output_side_only(tied)
    assert hook is not None and output_side_only(untied) is None
    for model in (tied, untied):
        model(input_ids=batch, labels=batch).loss.backward()
    hook.remove()
    assert torch.allclose(tied.lm_head.weight.grad, untied.lm_head.weight.grad, atol=1e-6)
    tied.zero_grad(set_to_none=True)
    tied(input_ids=batch, labels=batch).loss.backward()  # without the hook the input side adds its part
    assert not torch.allclose(tied.lm_head.weight.grad, untied.lm_head.weight.grad, atol=1e-6)


@pytest.mark.parametrize("objective", ["ce", "kd"])
def test_a_map_heal_moves_only_the_folded_down_projections(objective):
    """Two blocks (layers 1 and 3 of 6): the fold writes into kept layers 0 and 2 (pruned indices 0
    and 1, from the fold's own report); the heal trains those two down_proj and nothing else."""
    from trsp_ray.method import compensation
    from trsp_ray.method.boundaries import fold_layers

    drop = [1, 3]
    dense, model, kept = _pruned(drop)
    windows = [torch.randint(0, 256, (4, 32), generator=torch.Generator().manual_seed(k)) for k in range(16)]
    done = compensation.compensate(model=model, dense=dense, drop=drop, windows=windows, method="lstsq")
    maps = [kept.index(i) for i in fold_layers(done["blocks"])]
    assert maps == [0, 1]
    spy = Spy(objective=DistillLoss(dense) if objective == "kd" else None)
    before = _snapshot(model)
    run_heal(model=model, batches=_batches(), steps=3, lr=1e-2, trainable="map", map_layers=maps, make_stepper=spy)
    targets = {"model.layers.0.mlp.down_proj.weight", "model.layers.1.mlp.down_proj.weight"}
    assert _changed(before, model) == targets
    named = dict(model.named_parameters())
    assert _state_ids(spy.stepper) == {id(named[n]) for n in targets}


def test_a_map_heal_on_gemma_trains_the_mlp_norms_the_diagonal_maps_folded_into():
    """Gemma 2 folds its (diagonal) map into post_feedforward_layernorm: the map heal trains those norm
    weights of the fold targets and nothing else (not the down_proj, which the fold left alone)."""
    import copy

    from trsp_ray.method import compensation
    from trsp_ray.method.boundaries import fold_layers

    drop = [1, 3]
    dense = tiny_model("gemma2", layers=6)
    model = copy.deepcopy(dense)
    kept = remove_layers(model, drop)
    windows = [torch.randint(0, 256, (4, 32), generator=torch.Generator().manual_seed(k)) for k in range(16)]
    done = compensation.compensate(model=model, dense=dense, drop=drop, windows=windows, method="lstsq")
    maps = [kept.index(i) for i in fold_layers(done["blocks"])]
    spy = Spy()
    before = _snapshot(model)
    run_heal(model=model, batches=_batches(), steps=3, lr=1e-2, trainable="map", map_layers=maps, make_stepper=spy)
    targets = {f"model.layers.{i}.post_feedforward_layernorm.weight" for i in maps}
    assert maps == [0, 1] and _changed(before, model) == targets
    named = dict(model.named_parameters())
    assert _state_ids(spy.stepper) == {id(named[n]) for n in targets}


def test_the_workers_heal_hands_the_engine_only_the_recipe():
    """The Ray Train path (recovery.heal_on_workers -> heal.run_heal, before deepspeed.initialize): on
    the gated model with the drop set still in it, the engine's param groups hold exactly lm_head +
    the last k kept layers (tail) or the fold targets' down_proj (map, original indices), the rest is
    frozen when the engine is built."""
    from trsp_ray.distributed.recovery import heal_on_workers
    from trsp_ray.method.gates import attach_gates
    from trsp_ray.run.pipeline import named

    drop = [2, 3]
    for recipe, comp, expect in (("tail", None, ["lm_head", 4, 5]), ("map", {"blocks": [(2, 3)]}, ["down_proj 1"])):
        model = tiny_model("llama", layers=6)
        gates = attach_gates(model)
        cfg = load_config(overrides=["method=tail+comp+heal", "compensation.method=lstsq", "stage2.steps=1",
                                     f"heal.trainable={recipe}", "heal.tail_layers=2"])
        got: dict = {}
        heal_on_workers(named(cfg), model=model, gates=gates, drop=drop, comp=comp, batches=_batches(),
                        make_stepper=functools.partial(_keep_groups, got), report=lambda metrics, step: None)
        want = []
        for e in expect:
            if e == "lm_head":
                want += list(model.lm_head.parameters())
            elif isinstance(e, int):
                want += list(gates[e].layer.parameters())
            else:
                want += list(families.mlp_output(gates[int(e.split()[1])].layer, model).parameters())
        handed = [p for g in got["groups"] for p in g["params"]]
        assert {id(p) for p in handed} == {id(p) for p in want} and len(handed) == len(want)
        assert got["trainable"] == {id(p) for p in want}


def _keep_groups(store: dict, model, groups):
    store["groups"] = groups
    store["trainable"] = {id(p) for p in model.parameters() if p.requires_grad}
    return TorchStepper(model, groups)


def _one_line(err) -> str:
    message = str(err.value)
    assert "\n" not in message
    return message


def test_bad_recipes_are_one_line_errors_before_any_work(tmp_path):
    """An unknown recipe and heal.tail_layers < 1 fail in the config; tail_layers >= the kept layers
    and map without a fold fail in driver.run from config.json alone (the model directory has no
    weights: nothing was loaded); the library refuses the same before any step."""
    from trsp_ray.driver import run

    with pytest.raises(TrspError) as err:
        load_config(overrides=["heal.trainable=last"])
    assert "heal.trainable='last' is not valid" in _one_line(err) and "tail" in str(err.value)
    with pytest.raises(TrspError) as err:
        load_config(overrides=["heal.tail_layers=0"])
    assert "heal.tail_layers=0" in _one_line(err)
    tiny_config("llama", layers=8).save_pretrained(tmp_path / "model")  # config.json only
    base = [f"model={tmp_path / 'model'}", "tracking.enabled=false", "ratio=0.25"]  # 6 of 8 layers kept
    with pytest.raises(TrspError) as err:
        run(load_config(overrides=base + ["method=shortgpt+heal", "heal.trainable=tail", "heal.tail_layers=6"]))
    assert "heal.tail_layers=6 is not valid for a heal of 6 kept layers; use 1..5" in _one_line(err)
    with pytest.raises(TrspError) as err:
        run(load_config(overrides=base + ["method=shortgpt+heal", "heal.trainable=map"]))
    assert "heal.trainable=map" in _one_line(err) and "compensation.method=none" in str(err.value)
    with pytest.raises(TrspError) as err:
        run(load_config(overrides=base + ["method=trsp", "stage2.trainable=tail"]))
    assert "TRSP's stage 2" in _one_line(err)
    _, model, _ = _pruned([2, 3])
    spy = Spy()
    for kwargs in ({"trainable": "tail", "tail_layers": 4}, {"trainable": "map", "map_layers": ()}):
        with pytest.raises(TrspError) as err:
            run_heal(model=model, batches=_batches(), steps=1, lr=1e-2, make_stepper=spy, **kwargs)
        _one_line(err)
    assert spy.stepper is None  # refused before a stepper was built


def _llama70b_shape():
    from trsp_ray.plan import shape

    return shape.shape_from_config(LLAMA2_70B)


def _hand_tail(k: int) -> int:
    """lm_head + k Llama-2-70B decoder layers, from the config's sizes (not the planner's counts)."""
    h, i, v, kv = 8192, 28672, 32000, 8 * 128
    layer = 2 * h * h + 2 * h * kv + 3 * h * i + 2 * h  # q, o; k, v; gate, up, down; two RMSNorms
    return v * h + k * layer


def test_the_zero3_plan_counts_the_tail_recipes_optimizer_state_by_hand():
    from trsp_ray.plan import memory, zero3_plan, zero3_setup
    from trsp_ray.plan.zero3_plan import with_heal_setup

    s = _llama70b_shape()
    cfg = load_config(overrides=["method=shortgpt+heal", "heal.trainable=tail"])
    st = with_heal_setup(cfg, zero3_setup.Setup(workers=16, activation_checkpointing=True), s,
                         spec=registry.method(cfg.method))
    assert (st.trainable, st.tail_layers, st.frozen_layers) == ("tail", 3, 20)
    stage2 = zero3_plan.estimate(s, st)[1]
    hand = _hand_tail(3)
    assert hand == 2_829_107_200
    assert stage2.parts["optimizer fp32 + Adam (partition)"] == pytest.approx(hand * 12 / 16 / memory.GB)  # 1.98
    assert stage2.parts["gradients (partition)"] == pytest.approx(hand * 2 / 16 / memory.GB)
    assert zero3_plan.plan(s, st).host().checkpoint_gb == pytest.approx((hand * 12 + 64 * 1024 * 16) / memory.GB)
    full = zero3_plan.estimate(s, with_heal_setup(replace(cfg, **{"heal.trainable": "all"}), zero3_setup.Setup(
        workers=16, activation_checkpointing=True), s, spec=registry.method(cfg.method)))[1]
    assert full.parts["optimizer fp32 + Adam (partition)"] > 18 * stage2.parts["optimizer fp32 + Adam (partition)"]
    # map: one folded down_proj (h x I) per block, at most one per dropped layer (20 of 80)
    mapped = with_heal_setup(replace(load_config(overrides=["method=shortgpt+comp+heal"]),
                                     **{"heal.trainable": "map"}), zero3_setup.Setup(workers=16), s,
                             spec=registry.method("shortgpt+comp+heal"))
    assert zero3_plan.estimate(s, mapped)[1].parts["optimizer fp32 + Adam (partition)"] == pytest.approx(
        20 * 8192 * 28672 * 12 / 16 / memory.GB)


@pytest.mark.parametrize("dtype,bytes_per_param", [("bf16", 12), ("fp32", 8)])
def test_the_single_plan_counts_the_tail_recipes_optimizer_state_by_hand(dtype, bytes_per_param):
    """One process: Adam's two fp32 moments (8 bytes), plus an fp32 master for bf16 weights (12)."""
    from trsp_ray.plan.memory import GB
    from trsp_ray.plan.single_plan import single_plan_for_run

    cfg = load_config(overrides=["method=shortgpt+heal", "heal.trainable=tail", "heal.tail_layers=2",
                                 f"dtype={dtype}"])
    p = single_plan_for_run(cfg, device="gpu", memory_gb=1000, shape=_llama70b_shape())
    heal = next(stage for stage in p.stages if stage.name == "heal")
    assert heal.parts["optimizer state"] == pytest.approx(_hand_tail(2) * bytes_per_param / GB)


def test_trsp_ray_plan_prints_the_tail_heal_at_70b(tmp_path, capsys):
    import argparse

    from trsp_ray.plan_cli import register

    path = tmp_path / "config.json"
    path.write_text(json.dumps(LLAMA2_70B))
    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())

    def plan(*extra):
        args = parser.parse_args(["plan", "--model-config", str(path), "--workers", "16", "--gpu-memory-gb", "80",
                                  "--activation-checkpointing", "--method", "shortgpt+heal", *extra])
        return args.func(args), capsys.readouterr().out

    rc, text = plan("--set", "heal.trainable=tail")
    assert rc == 0 and "stage 2 (lm_head + last 3 layers)" in text
    assert f"optimizer fp32 + Adam (partition): {_hand_tail(3) * 12 / 16 / 2**30:.2f} GB" in text  # 1.98
    rc, full = plan()
    assert rc == 0 and "stage 2 (all weights)" in full and "optimizer fp32 + Adam (partition): 36.23 GB" in full
    with pytest.raises(TrspError, match="heal.tail_layers=60 is not valid for a heal of 60 kept layers"):
        plan("--set", "heal.trainable=tail", "--set", "heal.tail_layers=60")


def _changed_from_dense(dense_dir, export_dir, kept: list[int]) -> set[str]:
    """Names (export numbering) of the exported tensors that differ from the dense model's kept ones."""
    from transformers import AutoModelForCausalLM

    dense = dict(AutoModelForCausalLM.from_pretrained(dense_dir).named_parameters())
    out = set()
    for name, p in AutoModelForCausalLM.from_pretrained(export_dir).named_parameters():
        parts = name.split(".")
        if name.startswith("model.layers."):
            parts[2] = str(kept[int(parts[2])])
        if not torch.equal(dense[".".join(parts)], p):
            out.add(name)
    return out


@pytest.mark.ray
@pytest.mark.slow  # ~90 s each (a 2-worker run and one process) on 2 cores
@pytest.mark.parametrize("recipe", ["tail", "map"])
def test_two_zero3_workers_heal_only_the_recipe(tiny_dir, tmp_path, recipe):  # noqa: F811
    """tail+heal (drop set 3, 4 of 6: kept 0, 1, 2, 5) on 2 ZeRO-3 gloo workers: a tail heal (k = 2)
    exports a model whose lm_head and last two kept layers moved and nothing else did; a map heal
    after the fold moves the fold target's down_proj (layer 2) only; both with one process's logits
    (and one process's map heal does move the map: test_a_map_heal_moves_only_the_folded_down_projections)."""
    from test_distributed_ray import OVERRIDES, _logits, start_own_ray, stop_own_ray

    from trsp_ray.distributed.train import run_distributed
    from trsp_ray.driver import run

    method = "tail+heal" if recipe == "tail" else "tail+comp+heal"
    base = [f"model={tiny_dir}"] + OVERRIDES + [f"method={method}", "stage2.steps=2", f"heal.trainable={recipe}",
                                                 "heal.tail_layers=2", "stage2.lr=1e-2", "compensation.windows=16"]
    start_own_ray()
    try:
        result = run_distributed(load_config(overrides=base + [f"distributed.storage_path={tmp_path / 'storage'}",
                                                               f"output={tmp_path / 'ray'}"]))
    finally:
        stop_own_ray()
    assert sorted(result.drop_order) == [3, 4]
    changed = _changed_from_dense(tiny_dir, tmp_path / "ray", kept=[0, 1, 2, 5])
    if recipe == "map":
        assert changed == {"model.layers.2.mlp.down_proj.weight"}  # the fold and the heal wrote only there
    else:
        assert "lm_head.weight" in changed and changed <= {"lm_head.weight"} | {
            f"model.layers.{i}.{n}" for i in (2, 3) for n in (
                "self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
                "self_attn.o_proj.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight",
                "input_layernorm.weight", "post_attention_layernorm.weight")}
    # one process (methods.apply_method: the fold's report names the map's layer) exports the same model
    single = run(load_config(overrides=base + [f"output={tmp_path / 'single'}", "distributed.workers=0",
                                               "data.eval_max_windows=2"]))
    assert sorted(single["dropped_layers"]) == [3, 4]
    diff = (_logits(tmp_path / "single") - _logits(tmp_path / "ray")).abs().max().item()
    print(f"max |logit difference| ZeRO-3 vs single process, {recipe} heal:", diff)
    assert diff < 1e-4
