"""Settings on Ray Train workers are honoured or refused in one line before any worker starts
(issue 19): dtype, heal.steps; a heal method heals there whatever stage2.enabled says, in joint
mode, and with the dropped layers frozen and out of the optimizer, through the single process's heal loop."""

from pathlib import Path

import pytest
import torch

from trsp_ray.common.errors import TrspError
from trsp_ray.config import registry
from trsp_ray.config.run_config import load_config
from trsp_ray.distributed.recovery import heal_on_workers, recovery_settings
from trsp_ray.method.gates import attach_gates
from trsp_ray.method.training import Batches, TorchStepper
from trsp_ray.models.tiny import tiny_model
from trsp_ray.run.pipeline import named

LLAMA2_70B = Path(__file__).resolve().parents[1] / "cluster" / "models" / "llama-2-70b.json"


def _cfg(*overrides):
    return load_config(None, ["distributed.workers=2", *overrides])


def _pipe(*overrides):
    """The pipeline a worker reads (worker.train_loop: the driver's resolved config, as named)."""
    return named(_cfg(*overrides))


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


def test_a_heal_method_heals_on_workers_with_stage2_disabled_with_the_single_process_heal():
    heal = recovery_settings(_pipe("method=trsp+heal", "stage2.enabled=false", "stage2.mode=sequential",
                                   "stage2.steps=7", "stage2.lr=3e-4"))
    # run_heal's arguments, methods.method_heal's budget: no stage-2 schedule or mode reaches a heal
    assert heal == {"steps": 7, "lr": 3e-4, "trainable": "all", "lora_rank": 8, "tail_layers": 3,
                    "schedule": "constant"}
    assert recovery_settings(_pipe("method=trsp", "stage2.enabled=false")) is None
    assert recovery_settings(_pipe("method=trsp-no-stage2")) is None
    paper = recovery_settings(_pipe("method=trsp", "stage2.mode=sequential"))
    assert paper["mode"] == "sequential" and paper["schedule"] == load_config(None, []).stage2.schedule


def test_the_plan_counts_the_heal_of_a_heal_method_with_stage2_disabled():
    from trsp_ray.plan import zero3_plan
    from trsp_ray.plan.shape import read_shape

    shape = read_shape(str(LLAMA2_70B))
    heal = zero3_plan.zero3_plan(_cfg("method=trsp+heal", "stage2.enabled=false"), shape,
                                 spec=registry.method("trsp+heal"))
    assert [s.name for s in heal.stages] == ["stage 1", "stage 2 (all weights)"]
    trsp = zero3_plan.zero3_plan(_cfg("method=trsp", "stage2.enabled=false"), shape, spec=registry.method("trsp"))
    assert len(trsp.stages) == 1


def _ids():
    return torch.randint(3, 200, (4000,), generator=torch.Generator().manual_seed(0))


def test_a_worker_heal_freezes_the_dropped_layers():
    """The optimizer holds no parameter of a dropped layer or gate; those weights stay exactly as they
    were while the kept layers train."""
    torch.manual_seed(0)
    model = tiny_model("llama", layers=6)
    gates = attach_gates(model)
    drop = [1, 4]
    built = []

    def make(m, groups):
        built.append(TorchStepper(m, groups))
        return built[-1]

    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    heal_on_workers(_pipe("method=trsp+heal", "stage2.steps=3", "stage2.lr=1e-3"), model=model, gates=gates,
                    drop=drop, comp=None, batches=Batches(_ids(), seqlen=32, batch_size=4, seed=0), make_stepper=make,
                    report=lambda metrics, step: None)
    (stepper,) = built
    in_optimizer = {id(p) for g in stepper.optimizer.param_groups for p in g["params"]}
    frozen = {id(p) for i in drop for p in gates[i].layer.parameters()} | {id(p) for p in gates.gate_params()}
    assert in_optimizer and not in_optimizer & frozen
    assert not any(stepper.optimizer.state.get(p) for i in drop for p in gates[i].layer.parameters())
    moved = {n for n, p in model.named_parameters() if n in before and not torch.equal(p, before[n])}
    assert moved and not [n for n in moved if any(f"layers.{i}." in n for i in drop)]
    assert any("layers.0." in n for n in moved) and not any(n.endswith(".gate") for n in moved)
    assert gates.bypassed() == [] and not any(p.requires_grad for p in model.parameters())


class _Factory:
    """The workers' StepperFactory on one process: TorchSteppers, with the build hook and list."""

    def __init__(self):
        self.built, self.on_build = [], None

    def __call__(self, model, groups):
        self.built.append(TorchStepper(model, groups))
        return self.built[-1]


@pytest.mark.parametrize("recipe", ["all", "tail", "lora"])
def test_the_workers_heal_is_the_single_process_heal_loop(monkeypatch, recipe):
    """worker._stage2 of a heal method goes through heal.run_heal (the one heal loop) and, on one
    process's stepper, gives the single process's healed model (run_heal on the pruned copy, the
    same seed + 2 batch stream): a second heal loop on the workers would fail the first assertion."""
    import copy
    from types import SimpleNamespace

    from trsp_ray.distributed import worker
    from trsp_ray.distributed.events import EventLog, FaultInjector
    from trsp_ray.method.heal import run_heal as original
    from trsp_ray.method.surgery import remove_layers

    calls = []
    monkeypatch.setattr("trsp_ray.method.heal.run_heal", lambda **kwargs: calls.append(kwargs) or original(**kwargs))
    cfg = _cfg("method=shortgpt+heal", "stage2.steps=3", "stage2.lr=1e-2", "data.seqlen=16", "data.batch_size=4",
               "distributed.checkpoint_every=100", f"heal.trainable={recipe}", "heal.tail_layers=2",
               "heal.lora_rank=4")
    torch.manual_seed(0)
    dense = tiny_model("llama", layers=6)
    model, pruned, drop = copy.deepcopy(dense), copy.deepcopy(dense), [2, 3]
    bench = SimpleNamespace(model=model, gates=attach_gates(model), factory=_Factory(), calib_ids=_ids(),
                            calib_strata=None, calibration=SimpleNamespace(ids=_ids(), strata=None), teacher=None,
                            tokenizer=SimpleNamespace(), world=1)
    torch.manual_seed(1)  # LoRA's initialisation: the same draws on both paths (one adapter per kept Linear)
    healed = worker._stage2({}, named(cfg), bench, drop=drop, s1_state={}, events=EventLog(None, 0), meta=None,
                            engine_dir=None, rank=0, fault=FaultInjector(None, 0, None))
    assert len(calls) == 1 and calls[0]["steps"] == 3
    remove_layers(pruned, drop)
    torch.manual_seed(1)
    one = original(model=pruned, batches=Batches(_ids(), seqlen=16, batch_size=4, seed=cfg.seed + 2), steps=3,
                   lr=1e-2, trainable=recipe, tail_layers=2, lora_rank=4).model
    remove_layers(healed, drop)
    held = _ids()[:64].view(2, 32)
    with torch.no_grad():
        a, b, c = healed(input_ids=held).logits, one(input_ids=held).logits, dense(input_ids=held).logits
    assert (a - b).abs().max() < 1e-5 and (a - c).abs().max() > 1e-3  # the same heal, and it moved


def test_the_plan_of_a_worker_heal_leaves_the_drop_set_out_of_the_optimizer():
    """Llama-2-70B, trsp+heal at 25% on 16 workers: 20 of 80 layers frozen in the heal, so its
    optimizer state, gradients and every save are a quarter smaller than stage 2 of trsp."""
    from trsp_ray.plan import host_plan, zero3_plan
    from trsp_ray.plan.shape import read_shape

    shape = read_shape(str(LLAMA2_70B))
    common = ["distributed.workers=16", "distributed.use_gpu=true", "data.batch_size=16", "data.seqlen=2048",
              "distributed.activation_checkpointing=true"]
    heal = zero3_plan.zero3_plan(_cfg("method=trsp+heal", *common), shape, spec=registry.method("trsp+heal"))
    trsp = zero3_plan.zero3_plan(_cfg("method=trsp", *common), shape, spec=registry.method("trsp"))
    frozen = 20 * shape.layer_params
    assert heal.setup.frozen_layers == 20 and trsp.setup.frozen_layers == 0
    assert heal.host().checkpoint_gb == pytest.approx(host_plan.checkpoint_bytes(
        shape, heal.setup, trained=shape.params - frozen) / 2**30)
    assert round(trsp.host().checkpoint_gb, 1) == 770.9 and round(heal.host().checkpoint_gb, 1) == 579.6
    optim = "optimizer fp32 + Adam (partition)"
    assert round(trsp.stages[1].parts[optim], 2) == 48.18 and round(heal.stages[1].parts[optim], 2) == 36.23


def test_worker_activation_checkpointing_keeps_dropout_off(monkeypatch):
    """OPT has dropout 0.1, off in one process (eval mode); the workers' stepper factory used to
    switch training mode on for HF's gradient checkpointing, so worker training ran with dropout."""
    from trsp_ray.distributed import engine
    from trsp_ray.method.training import checkpointing_enabled

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
