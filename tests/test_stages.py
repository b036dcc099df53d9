"""Stage 1 lowers the loss and separates the gates; stage 2 drives the drop set toward identity."""

import pytest
import torch

from trsp_ray.baselines import block_influence, random_drop, shortgpt_drop, sleb_drop
from trsp_ray.gates import attach_gates
from trsp_ray.stage1 import run_stage1
from trsp_ray.stage2 import run_stage2
from trsp_ray.surgery import remove_layers
from trsp_ray.tiny import tiny_model
from trsp_ray.training import Batches, TorchStepper, freeze

IDENTITY = (2, 4)  # layers whose residual contribution is zeroed: nothing is lost by dropping them


def _pattern_ids(n_tokens=6000, seed=0):
    """A learnable stream: tokens follow t_{k+1} = (3 * t_k + 7) mod 61 with occasional resets."""
    gen = torch.Generator().manual_seed(seed)
    out, t = [], 5
    for k in range(n_tokens):
        t = int(torch.randint(0, 61, (1,), generator=gen)) if k % 37 == 0 else (3 * t + 7) % 61
        out.append(t + 3)
    return torch.tensor(out)


@pytest.fixture(scope="module")
def trained():
    """A tiny Llama trained briefly on the pattern, with two layers made exact identities."""
    torch.manual_seed(0)
    model = tiny_model("llama", layers=6)
    ids = _pattern_ids()
    batches = Batches(ids, seqlen=32, batch_size=8, seed=0)
    freeze(model, except_params=list(model.parameters()))
    stepper = TorchStepper(model, [{"params": list(model.parameters()), "lr": 3e-3}])
    for _ in range(120):
        loss = stepper.forward(batches.next())
        stepper.backward(loss)
        stepper.step()
    with torch.no_grad():
        for i in IDENTITY:
            layer = model.model.layers[i]
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
    freeze(model)
    return model.eval(), ids


def test_stage1_lowers_loss_and_finds_identity_layers(trained):
    model, ids = trained
    gates = attach_gates(model)
    losses = []
    result = run_stage1(model=model, gates=gates, batches=Batches(ids, seqlen=32, batch_size=8, seed=1),
                        n_drop=2, candidates=[1, 2, 3, 4], lambda1=0.01, lr=0.05, first_round_steps=30,
                        steps_per_round=10, report=lambda m, s: losses.append(m.get("stage1/loss")))
    losses = [x for x in losses if x is not None]
    assert sorted(result.drop_order) == sorted(IDENTITY)
    assert result.rounds_computed == 2 and result.steps == 40
    assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5  # the stage-1 objective decreases
    round1 = result.gate_history[29]
    # separation: the L1 pull takes the identity layers' gates to exactly 0 (projection onto s >= 0)
    # while CE holds the useful layers' gates up; protected layers keep s = 1
    assert [round1[i] for i in IDENTITY] == [0.0, 0.0]
    assert min(round1[1], round1[3]) > 0.05
    assert round1[0] == 1.0 and round1[5] == 1.0
    assert gates.bypassed() == result.drop_order
    for w in gates.wrappers:
        assert not w.gate.requires_grad


def test_stage1_oneshot_is_round1_prefix(trained):
    model, ids = trained
    gates = attach_gates(model)
    result = run_stage1(model=model, gates=gates, batches=Batches(ids, seqlen=32, batch_size=8, seed=1),
                        n_drop=2, candidates=[1, 2, 3, 4], lambda1=0.01, lr=0.05, first_round_steps=30,
                        steps_per_round=10, selection="oneshot")
    assert result.rounds_computed == 1 and result.steps == 30
    assert result.drop_order == result.round1_ranking[:2]


def test_stage1_resume_skips_finished_rounds(trained):
    model, ids = trained
    states = []
    first = run_stage1(model=model, gates=attach_gates(model), batches=Batches(ids, seqlen=32, batch_size=8, seed=1),
                       n_drop=2, candidates=[1, 2, 3, 4], lambda1=0.01, lr=0.05, first_round_steps=8,
                       steps_per_round=4, on_round=states.append)
    model2 = tiny_model("llama", layers=6)
    model2.load_state_dict(model.state_dict(), strict=False)
    resumed = run_stage1(model=model, gates=attach_gates(model), batches=Batches(ids, seqlen=32, batch_size=8, seed=1),
                         n_drop=2, candidates=[1, 2, 3, 4], lambda1=0.01, lr=0.05, first_round_steps=8,
                         steps_per_round=4, resume=states[0])
    assert resumed.rounds_computed == 1
    assert resumed.drop_order == first.drop_order
    assert resumed.gate_history[-1] == pytest.approx(first.gate_history[-1], abs=1e-6)


@pytest.mark.parametrize("schedule", ["constant", "anneal"])
def test_stage2_relative_update_falls(trained, schedule):
    model, ids = trained
    import copy

    model = copy.deepcopy(model)
    gates = attach_gates(model)
    drop = [1, 3]  # useful layers, so the penalty has work to do
    result = run_stage2(model=model, gates=gates, batches=Batches(ids, seqlen=32, batch_size=8, seed=2),
                        drop=drop, lambda2=1.0, steps=16, lr=3e-3, schedule=schedule, anneal_fraction=0.5)
    for i in drop:
        series = result.relative_update[i]
        assert series[-1] < 0.7 * series[0], (i, series)
    if schedule == "anneal":
        with torch.no_grad():  # at the end the drop set is exactly identity: removal changes nothing
            x = ids[:64].view(2, 32)
            gates.set_bypass(drop)
            bypassed = model(x).logits
            remove_layers(model, drop)
            assert torch.equal(model(x).logits, bypassed)


def test_block_influence_ranks_identity_layers_lowest(trained):
    model, ids = trained
    gates = attach_gates(model)
    calib = [ids[:256].view(8, 32)]
    bi = block_influence(model, gates, calib)
    assert bi[2] == pytest.approx(0.0, abs=1e-5) and bi[4] == pytest.approx(0.0, abs=1e-5)
    assert min(bi[1], bi[3]) > 1e-3
    assert sorted(shortgpt_drop(model, gates, calib, n_drop=2, candidates=[1, 2, 3, 4])) == [2, 4]


def test_sleb_replay_matches_full_forward(trained):
    model, ids = trained
    gates = attach_gates(model)
    calib = [ids[:256].view(8, 32)]
    drop = sleb_drop(model, gates, calib, n_drop=2, candidates=[1, 2, 3, 4])
    assert sorted(drop) == [2, 4]
    from trsp_ray.baselines import _calibration_nll, _layer_inputs, _score_without

    inputs = _layer_inputs(model, gates, calib, bypass=[])
    for j in (1, 3):
        replay = _score_without(model, gates, calib, inputs, bypass=[], j=j)
        gates.set_bypass([j])
        full = _calibration_nll(model, calib)
        assert replay == pytest.approx(full, abs=1e-5)
    gates.set_bypass([])


def test_random_drop_is_seeded():
    assert random_drop(n_drop=3, candidates=list(range(1, 29)), seed=4) == random_drop(
        n_drop=3, candidates=list(range(1, 29)), seed=4)
    assert len(set(random_drop(n_drop=3, candidates=list(range(1, 29)), seed=4))) == 3
