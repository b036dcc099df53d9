"""Settings on Ray Train workers are honoured or refused in one line before any worker starts
(issue 19): dtype, heal.steps; a heal method heals there whatever stage2.enabled says, in joint
mode, and with the dropped layers frozen and out of the optimizer."""

from pathlib import Path

import pytest
import torch

from trsp_ray.config import load_config
from trsp_ray.distributed.recovery import heal_stepper, recovery_settings
from trsp_ray.errors import TrspError
from trsp_ray.gates import attach_gates
from trsp_ray.stage2 import run_stage2
from trsp_ray.tiny import tiny_model
from trsp_ray.training import Batches, TorchStepper

LLAMA2_70B = Path(__file__).resolve().parents[1] / "cluster" / "models" / "llama-2-70b.json"


def _cfg(*overrides):
    return load_config(None, ["distributed.workers=2", *overrides])


@pytest.mark.parametrize("overrides, refused", [
    (["dtype=bf16"], "dtype=bf16 is not available on Ray Train workers on CPU: they run fp32"),
    (["dtype=fp16", "distributed.use_gpu=true"],
     "dtype=fp16 is not available on Ray Train workers on GPU: they run bf16"),
    (["dtype=fp32", "distributed.use_gpu=true"], "dtype=fp32 is not available on Ray Train workers on GPU"),
    (["heal.steps=5"], "heal.steps=5 is not run on Ray Train workers"),
    (["heal.steps=5", "heal.lr=3e-4", "heal.trainable=lora"], "heal.steps=5 is not run on Ray Train workers"),
])
def test_settings_the_workers_would_drop_are_refused_before_any_worker(overrides, refused):
    from trsp_ray.distributed.train import prepare_run

    with pytest.raises(TrspError, match=refused.replace("(", r"\(")):
        prepare_run(_cfg(*overrides))  # fails first: no storage, model or Ray is touched


@pytest.mark.parametrize("overrides, dtype", [([], "float32"), (["dtype=fp32"], "float32"),
                                              (["distributed.use_gpu=true"], "bfloat16"),
                                              (["distributed.use_gpu=true", "dtype=bf16"], "bfloat16")])
def test_the_dtypes_the_workers_run_are_accepted(overrides, dtype):
    from trsp_ray.distributed.deepspeed_config import worker_dtype
    from trsp_ray.distributed.train import check_worker_settings

    cfg = _cfg(*overrides)
    check_worker_settings(cfg)
    assert worker_dtype(cfg) == dtype


def test_a_heal_method_heals_on_workers_with_stage2_disabled_in_joint_mode():
    heal = recovery_settings(_cfg("method=trsp+heal", "stage2.enabled=false", "stage2.mode=sequential",
                                  "stage2.steps=7", "stage2.lr=3e-4"))
    assert (heal["steps"], heal["lr"], heal["schedule"], heal["mode"]) == (7, 3e-4, "skip", "joint")
    assert recovery_settings(_cfg("method=trsp", "stage2.enabled=false")) is None
    assert recovery_settings(_cfg("method=trsp-no-stage2")) is None
    paper = recovery_settings(_cfg("method=trsp", "stage2.mode=sequential"))
    assert paper["mode"] == "sequential" and paper["schedule"] == load_config(None, []).stage2.schedule


def test_the_plan_counts_the_heal_of_a_heal_method_with_stage2_disabled():
    from trsp_ray.distributed import planner

    shape = planner.read_shape(str(LLAMA2_70B))
    heal = planner.zero3_plan(_cfg("method=trsp+heal", "stage2.enabled=false"), shape)
    assert [s.name for s in heal.stages] == ["stage 1", "stage 2 (all weights)"]
    assert len(planner.zero3_plan(_cfg("method=trsp", "stage2.enabled=false"), shape).stages) == 1


def test_a_worker_heal_freezes_the_dropped_layers():
    """The optimizer holds no parameter of a dropped layer; those weights stay exactly as they were
    while the kept layers train."""
    torch.manual_seed(0)
    model = tiny_model("llama", layers=6)
    gates = attach_gates(model)
    drop = [1, 4]
    built = []

    def make(m, groups):
        built.append(TorchStepper(m, groups))
        return built[-1]

    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    ids = torch.randint(3, 200, (4000,), generator=torch.Generator().manual_seed(0))
    settings = recovery_settings(_cfg("method=trsp+heal", "stage2.steps=3", "stage2.lr=1e-3"))
    run_stage2(model=model, gates=gates, batches=Batches(ids, seqlen=32, batch_size=4, seed=0), drop=drop,
               make_stepper=heal_stepper(make, gates=gates, drop=drop), **settings)
    (stepper,) = built
    in_optimizer = {id(p) for g in stepper.optimizer.param_groups for p in g["params"]}
    dropped = {id(p) for i in drop for p in gates[i].layer.parameters()}
    assert in_optimizer and not in_optimizer & dropped
    assert not any(stepper.optimizer.state.get(p) for i in drop for p in gates[i].layer.parameters())
    moved = {n for n, p in model.named_parameters() if n in before and not torch.equal(p, before[n])}
    assert moved and not [n for n in moved if any(f"layers.{i}." in n for i in drop)]
    assert any("layers.0." in n for n in moved)


def test_the_plan_of_a_worker_heal_leaves_the_drop_set_out_of_the_optimizer():
    """Llama-2-70B, trsp+heal at 25% on 16 workers: 20 of 80 layers frozen in the heal, so its
    optimizer state, gradients and every save are a quarter smaller than stage 2 of trsp."""
    from trsp_ray.distributed import planner

    shape = planner.read_shape(str(LLAMA2_70B))
    common = ["distributed.workers=16", "distributed.use_gpu=true", "data.batch_size=16", "data.seqlen=2048",
              "distributed.activation_checkpointing=true"]
    heal = planner.zero3_plan(_cfg("method=trsp+heal", *common), shape)
    trsp = planner.zero3_plan(_cfg("method=trsp", *common), shape)
    frozen = 20 * shape.layer_params
    assert heal.setup.frozen_layers == 20 and trsp.setup.frozen_layers == 0
    assert heal.host().checkpoint_gb == pytest.approx(planner.checkpoint_bytes(
        shape, heal.setup, trained=shape.params - frozen) / 2**30)
    assert round(trsp.host().checkpoint_gb, 1) == 770.9 and round(heal.host().checkpoint_gb, 1) == 579.6
    optim = "optimizer fp32 + Adam (partition)"
    assert round(trsp.stages[1].parts[optim], 2) == 48.18 and round(heal.stages[1].parts[optim], 2) == 36.23


def test_worker_activation_checkpointing_keeps_dropout_off(monkeypatch):
    """OPT has dropout 0.1, off in one process (eval mode); the workers' stepper factory used to
    switch training mode on for HF's gradient checkpointing, so worker training ran with dropout."""
    from trsp_ray.distributed import engine
    from trsp_ray.training import checkpointing_enabled

    monkeypatch.setattr(engine, "DeepSpeedStepper", lambda model, groups, **_: ("stepper", model.training))
    model = tiny_model("opt", layers=4).eval()
    assert model.config.dropout > 0
    factory = engine.StepperFactory(ds_config={}, rank=0, world=1, activation_checkpointing=True)
    assert factory(model, [{"params": list(model.parameters())}]) == ("stepper", False)
    assert checkpointing_enabled(model) and not model.training
    ids = torch.randint(3, 200, (2, 16), generator=torch.Generator().manual_seed(0))
    first, second = (model(input_ids=ids, labels=ids).loss for _ in range(2))  # with gradients: recomputed
    assert torch.equal(first, second)  # no dropout: the same loss twice
    first.backward()
    assert all(p.grad is not None for p in model.model.decoder.layers[0].parameters())
