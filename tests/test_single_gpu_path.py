"""The single-process path at GPU scale, proven small on CPU: bf16 with fp32 masters, activation
checkpointing with unchanged gradients, fresh models that never put a second copy on the device,
SLEB that streams its batches, and one planner that routes every job before any work."""

import math

import pytest
import torch

from trsp_ray.common.errors import TrspError
from trsp_ray.config import registry
from trsp_ray.method.gates import attach_gates
from trsp_ray.method.training import TorchStepper, causal_lm_loss, checkpointing_enabled, set_checkpointing
from trsp_ray.models.tiny import tiny_model


def _batch(seed=0, rows=2, seqlen=24, vocab=256):
    return torch.randint(0, vocab, (rows, seqlen), generator=torch.Generator().manual_seed(seed))


def _grads(model, gates, batch, *, stage: int):
    """Parameter gradients of one stage-1 (gates + L1) or stage-2 (all weights + penalty) loss."""
    from trsp_ray.method.training import freeze

    model.zero_grad(set_to_none=True)
    if stage == 1:
        freeze(model, except_params=gates.gate_params())  # base frozen, as stage 1 runs it
        gates.set_gated(True)
        loss = causal_lm_loss(model, batch) + 0.01 * gates.l1(range(1, len(gates)))
    else:
        for p in model.parameters():
            p.requires_grad_(True)
        for w in gates.wrappers:
            w.penalty_norm = "l2" if w.index == 2 else None
        loss = causal_lm_loss(model, batch) + 0.1 * gates[2].distance
    loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("family", ["llama", "opt", "gemma3_text"])
@pytest.mark.parametrize("stage", [1, 2])
def test_checkpointing_gives_the_same_gradients(family, stage):
    """OPT has dropout 0.1: checkpointing must not need training mode (which would switch it on)."""
    plain = tiny_model(family, layers=4)
    ckpt = tiny_model(family, layers=4)
    g_plain, g_ckpt = attach_gates(plain), attach_gates(ckpt)
    set_checkpointing(ckpt, True)
    assert checkpointing_enabled(ckpt) and not checkpointing_enabled(plain) and not ckpt.training
    batch = _batch()
    expected, got = _grads(plain, g_plain, batch, stage=stage), _grads(ckpt, g_ckpt, batch, stage=stage)
    assert expected.keys() == got.keys() and len(got) > (3 if stage == 1 else 20)
    for name in expected:
        assert torch.allclose(got[name], expected[name], rtol=1e-6, atol=1e-7), name


def test_checkpointing_keeps_only_layer_inputs():
    model = tiny_model("llama", layers=6)
    gates = attach_gates(model)
    gates.set_gated(True)
    saved = {}
    for on in (False, True):
        set_checkpointing(model, on)
        total = [0]

        def pack(t, total=total):
            total[0] += t.numel() * t.element_size()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = causal_lm_loss(model, _batch(seqlen=64))
        loss.backward()
        saved[on] = total[0]
    assert saved[True] < 0.3 * saved[False]
    set_checkpointing(model, False)
    assert not checkpointing_enabled(model)


def test_bf16_stepper_trains_through_fp32_masters():
    """A bf16 weight stepped in place loses updates below its 8-bit precision; the master keeps them."""
    torch.manual_seed(0)
    ref = torch.nn.Linear(64, 64)
    low = torch.nn.Linear(64, 64).to(torch.bfloat16)
    with torch.no_grad():
        ref.weight.copy_(low.weight.float())
        ref.bias.copy_(low.bias.float())
    x = torch.randn(32, 64)
    fp32_step = TorchStepper(ref, [{"params": list(ref.parameters()), "lr": 1e-4}])
    master_step = TorchStepper(low, [{"params": list(low.parameters()), "lr": 1e-4}])
    assert len(master_step.masters) == 2 and all(m.dtype == torch.float32 for _, m in master_step.masters)
    start = low.weight.detach().float().clone()
    for _ in range(20):
        for module, stepper, inp in ((ref, fp32_step, x), (low, master_step, x.bfloat16())):
            loss = module(inp).float().pow(2).mean()
            stepper.backward(loss)
            stepper.step()
    state = master_step.optimizer.state[master_step.masters[0][1]]
    assert state["exp_avg"].dtype == torch.float32
    moved = (low.weight.float() - start).abs().mean().item()
    assert 0.5 * 20 * 1e-4 < moved < 1.5 * 20 * 1e-4  # Adam moves ~lr per step; bf16 alone would round it away
    # The bf16 weights track the fp32 run to bf16 rounding (~0.4% of a weight of ~0.1).
    assert (low.weight.float() - ref.weight).abs().max().item() < 2e-3
    naive = low.weight.detach().clone()
    naive += 1e-4 * torch.sign(naive)  # what an in-place bf16 update of lr does to most weights
    assert (naive == low.weight.detach()).float().mean() > 0.5


def test_fp16_stepper_skips_an_overflowing_step():
    layer = torch.nn.Linear(8, 8).to(torch.float16)
    stepper = TorchStepper(layer, [{"params": list(layer.parameters()), "lr": 1e-2}])
    before = layer.weight.detach().clone()
    stepper.backward(layer(torch.full((2, 8), 60000.0, dtype=torch.float16)).float().sum())  # inf grads
    stepper.step()
    assert stepper.skipped_steps == 1 and stepper.loss_scale == 2.0**15
    assert torch.equal(layer.weight, before)
    stepper.backward(layer(torch.ones(2, 8, dtype=torch.float16)).float().mean())
    stepper.step()
    assert not torch.equal(layer.weight, before) and torch.isfinite(layer.weight).all()


def _bench(model, device="cpu", ckpt=False):
    from trsp_ray.config.run_config import load_config
    from trsp_ray.run.workbench import Workbench

    cfg = load_config(overrides=[f"distributed.activation_checkpointing={str(ckpt).lower()}"])
    return Workbench(cfg=cfg, model=model, tokenizer=None, calib_ids=torch.arange(10),
                     texts=None, device=device)


def test_fresh_model_is_an_equal_independent_copy():
    original = tiny_model("llama", layers=4)
    bench = _bench(original, ckpt=True)
    copy = bench.fresh_model()
    batch = _batch()
    with torch.no_grad():
        assert torch.equal(copy(input_ids=batch).logits, original(input_ids=batch).logits)
    assert checkpointing_enabled(copy) and not checkpointing_enabled(original)
    ours = {p.data_ptr() for p in copy.parameters()}
    assert not ours & {p.data_ptr() for p in original.parameters()}
    with torch.no_grad():  # training or cutting the copy cannot reach the original
        for p in copy.parameters():
            p.add_(1.0)
    with torch.no_grad():
        assert not torch.equal(copy(input_ids=batch).logits, original(input_ids=batch).logits)
    assert torch.equal(bench.fresh_model().model.layers[0].mlp.up_proj.weight,
                       original.model.layers[0].mlp.up_proj.weight)


def test_fresh_model_is_made_on_the_device_without_a_host_copy():
    """The copy's tensors are created on the target device straight from the original's (the meta
    device stands in for a GPU: nothing is allocated, so a host-side copy would show as real data)."""
    from trsp_ray.run.workbench import copy_model

    original = tiny_model("llama", layers=2)
    copied = copy_model(original, torch.device("meta"))
    assert all(p.device.type == "meta" for p in copied.parameters())
    assert all(b.device.type == "meta" for b in copied.buffers())
    assert all(p.device.type == "cpu" for p in original.parameters())
    assert sum(1 for _ in copied.parameters()) == sum(1 for _ in original.parameters())


# --- SLEB with bounded memory: the same drop list and scores as holding every batch's inputs ---

def _sleb_before(model, gates, batches, *, n_drop, candidates, progress):
    """sleb_drop as it was before streaming (commit c8f7704): every batch's layer inputs at once."""
    from trsp_ray.method.selectors import _layer_inputs, _score_without

    drop = []
    for r in range(n_drop):
        inputs = _layer_inputs(model, gates, batches, bypass=drop)
        scores = {j: _score_without(model, gates, batches, inputs, bypass=drop, j=j)
                  for j in (c for c in candidates if c not in drop)}
        best = min(scores, key=scores.get)
        drop.append(best)
        progress(r + 1, n_drop, math.exp(scores[best]))
    gates.set_bypass([])
    return drop


def test_streamed_sleb_matches_the_unbounded_one(monkeypatch):
    from trsp_ray.method import selectors

    model = tiny_model("llama", layers=7, seed=3)
    gates = attach_gates(model)
    batches = [_batch(seed=s, rows=3, seqlen=32) for s in range(5)]
    kwargs = dict(n_drop=3, candidates=[1, 2, 3, 4, 5, 6])  # 6 = the last layer: the full-forward branch
    before, after = [], []
    expected = _sleb_before(model, gates, batches, progress=lambda *a: before.append(a), **kwargs)
    held = []
    real = selectors._layer_inputs
    monkeypatch.setattr(selectors, "_layer_inputs", lambda m, g, b, **k: held.append(len(b)) or real(m, g, b, **k))
    got = selectors.sleb_drop(model, gates, batches, progress=lambda *a: after.append(a), **kwargs)
    assert got == expected and after == before  # bit-identical scores, not approximately equal
    assert set(held) == {1} and len(held) == 3 * len(batches)  # one batch of layer inputs at a time


# --- one planner: estimates, routes and one-line refusals before any work ---

LLAMA2_13B = {"vocab_size": 32000, "hidden_size": 5120, "intermediate_size": 13824, "num_hidden_layers": 40,
              "num_attention_heads": 40, "num_key_value_heads": 40}
LLAMA2_7B = {"vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32,
             "num_attention_heads": 32, "num_key_value_heads": 32}


def _cfg(*overrides):
    from trsp_ray.config.run_config import load_config

    return load_config(overrides=["device=cuda", "data.seqlen=2048", "data.batch_size=8", *overrides])


def test_single_plan_reads_dtype_and_checkpointing():
    from trsp_ray.plan import shape, single_plan

    s = shape.shape_from_config(LLAMA2_7B)
    stage1 = {}
    for dtype in ("bf16", "fp32"):
        for ckpt in ("false", "true"):
            p = single_plan.single_plan_for_run(_cfg("method=trsp-no-stage2", f"dtype={dtype}",
                                                 f"distributed.activation_checkpointing={ckpt}"),
                                            device="gpu", memory_gb=80, shape=s)
            stage1[dtype, ckpt] = p.stages[0].total
    # the figure: stage 1 on 7B at 8 x 2048 tokens in fp32 needs ~200 GB of activations
    assert 150 < stage1["fp32", "false"] < 260
    assert stage1["bf16", "true"] < 40 and stage1["bf16", "true"] < stage1["bf16", "false"] < stage1["fp32", "false"]
    sleb = [single_plan.single_plan_for_run(_cfg("method=sleb", f"baselines.sleb_windows={n}"), device="gpu",
                                        memory_gb=80, shape=s).stages[0].total for n in (2, 128)]
    assert sleb[0] == sleb[1] < 40  # bounded: independent of the number of calibration windows


def test_route_single_gpu_when_it_fits_else_workers_else_one_line_error():
    from trsp_ray.plan import route, shape

    s7, s13 = shape.shape_from_config(LLAMA2_7B), shape.shape_from_config(LLAMA2_13B)
    ckpt = "distributed.activation_checkpointing=true"
    trsp = registry.method("trsp")
    r = route.route(_cfg("method=trsp-no-stage2", ckpt), spec=registry.method("trsp-no-stage2"), shape=s13,
                    max_workers=0)
    assert r.workers == 0 and r.plan.fits and "single process" in r.describe()
    r = route.route(_cfg("method=trsp", ckpt), spec=trsp, shape=s13, max_workers=8)  # stage 2: 16+ bytes/param
    assert r.workers in (2, 4, 8) and r.plan.fits and "ZeRO-3" in r.describe()
    with pytest.raises(TrspError) as err:
        route.route(_cfg("method=trsp", ckpt), spec=trsp, shape=s7, max_workers=0)
    msg = str(err.value)
    assert "\n" not in msg and "stage 2 needs" in msg and "80.0 GB of one GPU" in msg
    assert "stage2.trainable=lora" in msg
    with pytest.raises(TrspError, match="distributed.workers"):
        route.route(_cfg("method=trsp", ckpt, "stage2.trainable=lora", "data.batch_size=64"), spec=trsp, shape=s13,
                    max_workers=0)
    with pytest.raises(TrspError, match="sleb"):  # SLEB has no Ray Train route
        route.route(_cfg("method=sleb", "data.batch_size=512"), spec=registry.method("sleb"), shape=s13, max_workers=8)


def test_missing_device_is_a_one_line_error_before_any_work(monkeypatch, capsys):
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    from trsp_ray.cli import main
    from trsp_ray.run import workbench

    monkeypatch.setattr(workbench, "load_model", lambda *a, **k: pytest.fail("loaded a model"))
    monkeypatch.setattr(workbench.domains, "load_texts", lambda *a, **k: pytest.fail("read the texts"))
    assert main(["prune", "--set", "device=cuda", "--no-mlflow"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "device='cuda'" in err


def test_plan_too_large_for_one_device_is_refused_before_any_work(monkeypatch, capsys):
    from trsp_ray.cli import main
    from trsp_ray.run import workbench

    monkeypatch.setattr(workbench, "device_kind", lambda cfg: ("gpu", 0.5))
    monkeypatch.setattr(workbench, "load_model", lambda *a, **k: pytest.fail("loaded a model"))
    monkeypatch.setattr(workbench.domains, "load_texts", lambda *a, **k: pytest.fail("read the texts"))
    assert main(["prune", "--method", "shortgpt", "--no-mlflow"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "0.5 GB of one GPU" in err and "does not fit" in err


def test_prune_routes_to_ray_train_workers_when_one_device_is_too_small(monkeypatch, tmp_path):
    """driver.run hands a run the planner sends to workers to run_distributed, with that many."""
    from trsp_ray import driver
    from trsp_ray.config.run_config import load_config, replace
    from trsp_ray.distributed import train
    from trsp_ray.plan import route as routing
    from trsp_ray.plan import shape, zero3_plan
    from trsp_ray.run import workbench

    seen = {}

    def fake_run_distributed(cfg, **kwargs):
        seen["cfg"] = cfg
        return train.DistributedResult(drop_order=[3, 5], output=None, storage=str(tmp_path))

    monkeypatch.setattr(train, "run_distributed", fake_run_distributed)
    monkeypatch.setattr(workbench, "prepare", lambda *a, **k: pytest.fail("single-process path taken"))
    cfg = load_config(overrides=["method=trsp", "distributed.workers=4", "tracking.enabled=false"])
    zero = zero3_plan.zero3_plan(replace(cfg, **{"distributed.workers": 2}), shape.shape_from_config(LLAMA2_7B),
                                 spec=registry.method(cfg.method))
    monkeypatch.setattr(routing, "route", lambda *a, **k: routing.Route(2, "cpu", zero))
    results = driver.run(cfg)
    assert seen["cfg"].distributed.workers == 2 and not seen["cfg"].distributed.use_gpu
    assert results["dropped_layers"] == [3, 5] and results["route"] == "2 workers"


def test_prune_dry_run_prints_route_and_plan(capsys, monkeypatch):
    from trsp_ray.cli import main
    from trsp_ray.run import workbench

    monkeypatch.setattr(workbench, "prepare", lambda *a, **k: pytest.fail("dry run did work"))
    assert main(["prune", "--method", "sleb", "--dry-run", "--set", "dtype=bf16"]) == 0
    out = capsys.readouterr().out
    first, second = out.splitlines()[:2]
    assert first == "pipeline sleb: selector sleb, no fit, no training"  # the resolved pipeline, then its route
    assert second.startswith("route: single process on one CPU") and "  sleb: " in out and "  evaluation: " in out
    assert "distributed.workers" not in second  # no workers allowed, none to mention

    # workers allowed but one process fits: the route says why the workers are not started
    assert main(["prune", "--method", "sleb", "--dry-run", "--set", "distributed.workers=2"]) == 0
    second = capsys.readouterr().out.splitlines()[1]
    assert second.startswith("route: single process on one CPU")
    assert second.endswith("one process fits, so the 2 Ray Train worker(s) distributed.workers allows are not started")


def test_benchmark_checks_every_row_plan_before_any_work(monkeypatch, capsys):
    from trsp_ray.benchmark import comparison
    from trsp_ray.cli import main
    from trsp_ray.run import workbench

    monkeypatch.setattr(workbench, "device_kind", lambda cfg: ("cpu", 1.5))
    monkeypatch.setattr(comparison, "run_benchmark", lambda *a, **k: pytest.fail("benchmark started"))
    # 1.5 GB of host memory holds SmolLM2's evaluation, not its stage 2 (the trsp row)
    assert main(["benchmark", "--workers", "0", "--rows", "dense,trsp", "--no-mlflow"]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "stage 2 needs" in err and "host memory" in err
