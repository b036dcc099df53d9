"""Stage 1 lowers the loss and separates the gates; stage 2 drives the drop set toward identity."""

import pytest
import torch

from trsp_ray.method.gates import attach_gates
from trsp_ray.method.selectors import block_influence, random_drop, shortgpt_drop, sleb_drop
from trsp_ray.method.stage1 import candidate_layers, head_protected, run_stage1
from trsp_ray.method.stage2 import run_stage2
from trsp_ray.method.surgery import remove_layers
from trsp_ray.method.training import Batches, TorchStepper, freeze
from trsp_ray.models.families import FAMILIES
from trsp_ray.models.tiny import tiny_model

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
    first_ema = [w.grad_ema for w in attach_gates(model).wrappers]
    model2 = tiny_model("llama", layers=6)
    model2.load_state_dict(model.state_dict(), strict=False)
    resumed = run_stage1(model=model, gates=attach_gates(model), batches=Batches(ids, seqlen=32, batch_size=8, seed=1),
                         n_drop=2, candidates=[1, 2, 3, 4], lambda1=0.01, lr=0.05, first_round_steps=8,
                         steps_per_round=4, resume=states[0])
    assert resumed.rounds_computed == 1
    assert resumed.drop_order == first.drop_order
    # the tie-break EMA is part of the state: a resumed run ends where the uninterrupted one did
    assert any(v != 0.0 for v in states[0]["grad_ema"])
    assert [w.grad_ema for w in attach_gates(model).wrappers] == pytest.approx(first_ema, rel=1e-5, abs=1e-9)
    assert resumed.gate_history[-1] == pytest.approx(first.gate_history[-1], abs=1e-6)


@pytest.mark.parametrize("schedule", ["constant", "anneal"])
def test_stage2_relative_update_falls(trained, schedule):
    model, ids = trained
    import copy

    model = copy.deepcopy(model)
    gates = attach_gates(model)
    drop = [0, 3]  # removing layer 0 of this model costs a lot (held-out CE 0.20 -> 0.82): work to do
    untrained = copy.deepcopy(model)
    result = run_stage2(model=model, gates=gates, batches=Batches(ids[:-512], seqlen=32, batch_size=8, seed=2),
                        drop=drop, lambda2=1.0, steps=16, lr=3e-3, schedule=schedule, anneal_fraction=0.5)
    if schedule == "constant":
        # the penalty alone (the layers stay fully in the network) shrinks what they add
        for i in drop:
            series = result.relative_update[i]
            assert series[-1] < 0.7 * series[0], (i, series)
    held = ids[-512:].view(16, 32)  # never trained on
    with torch.no_grad():
        gates.set_bypass(drop)
        bypassed = model(held).logits
        remove_layers(model, drop)
        after = model(input_ids=held, labels=held).loss.item()
        if schedule == "anneal":  # the drop set ends as exact identities: removal changes nothing
            assert torch.equal(model(held).logits, bypassed)
        from trsp_ray.method.gates import detach_gates

        detach_gates(untrained)
        remove_layers(untrained, drop)
        cut = untrained(input_ids=held, labels=held).loss.item()
    # what the removed layers did moved into the kept ones: removal after stage 2 costs less than
    # removal of the same layers from the untrained model
    assert after < cut - 0.1, (after, cut)


def test_block_influence_ranks_identity_layers_lowest(trained):
    model, ids = trained
    gates = attach_gates(model)
    calib = [ids[:256].view(8, 32)]
    bi = block_influence(model, gates, calib)
    assert bi[2] == pytest.approx(0.0, abs=1e-5) and bi[4] == pytest.approx(0.0, abs=1e-5)
    assert min(bi[1], bi[3]) > 1e-3
    assert sorted(shortgpt_drop(model, gates, calib, n_drop=2, candidates=[1, 2, 3, 4])) == [2, 4]


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_block_influence_without_the_lm_head_equals_the_whole_forward(family):
    """Block Influence runs the decoder stack only (`base_model`, no LM head: ~30% of SmolLM2's
    selection forward); on every family that stack must pass through every gated layer, as the
    whole model's forward does (OPT's decoder sits one level deeper, GPT-NeoX's is `gpt_neox`)."""
    from trsp_ray.method.selectors import influence_sums

    model = tiny_model(family, layers=4)
    gates = attach_gates(model)
    batches = [torch.randint(3, 200, (2, 24), generator=torch.Generator().manual_seed(k)) for k in range(2)]
    whole, n_whole = influence_sums(model, gates, batches, head=True)
    stack, n_stack = influence_sums(model, gates, batches)
    assert n_whole == n_stack == 96 and sorted(stack) == [0, 1, 2, 3]
    for i in whole:
        assert stack[i] == pytest.approx(whole[i], rel=1e-6), (family, i)
        assert 0.0 < whole[i] < 96.0  # a random layer changes its input: cos < 1 at some token


def test_sleb_replay_matches_full_forward(trained):
    model, ids = trained
    gates = attach_gates(model)
    calib = [ids[:256].view(8, 32)]
    drop = sleb_drop(model, gates, calib, n_drop=2, candidates=[1, 2, 3, 4])
    assert sorted(drop) == [2, 4]
    from trsp_ray.method.selectors import _calibration_nll, _layer_inputs, _score_without

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


def _useful_copy(trained):
    """The trained tiny model with its zeroed layers restored to useful ones (no layer is free)."""
    import copy

    model, ids = trained
    model = copy.deepcopy(model)
    torch.manual_seed(5)
    with torch.no_grad():
        for i in IDENTITY:
            layer = model.model.layers[i]
            layer.self_attn.o_proj.weight.normal_(0, 0.05)
            layer.mlp.down_proj.weight.normal_(0, 0.05)
    return model, ids


class _FixedCost:
    """A scorer stub: removal cost = sum of fixed per-layer costs."""

    def __init__(self, cost):
        self.cost_of, self.tokens, self.cost, self.calls = cost, 64, 0, []

    def __call__(self, drop):
        self.calls.append(list(drop))
        self.cost += 64
        return sum(self.cost_of[i] for i in drop)


def test_stage1_probes_decide_among_the_smallest_gates(trained):
    model, ids = _useful_copy(trained)
    kwargs = dict(n_drop=2, candidates=[1, 2, 3, 4], lambda1=0.01, lr=0.05, first_round_steps=6, steps_per_round=3)
    plain = run_stage1(model=model, gates=attach_gates(model), batches=Batches(ids, seqlen=32, batch_size=8, seed=1),
                       **kwargs)
    ranking = plain.round1_ranking
    # make the layer with the smallest gate the most expensive to remove, the 2nd smallest the cheapest
    cost = {ranking[0]: 9.0, ranking[1]: 1.0, ranking[2]: 5.0, ranking[3]: 7.0}
    stub = _FixedCost(cost)
    probed = run_stage1(model=model, gates=attach_gates(model), batches=Batches(ids, seqlen=32, batch_size=8, seed=1),
                        probe=3, scorer=stub, **kwargs)
    assert probed.drop_order[0] == ranking[1]  # the measurement overrules the gate order
    assert stub.calls[:3] == [[ranking[0]], [ranking[1]], [ranking[2]]]  # only the 3 smallest gates
    assert probed.probes[0]["scores"] == {str(j): cost[j] for j in ranking[:3]}
    assert probed.probe_cost == 64 * len(stub.calls) and probed.round1_ranking == ranking


@pytest.mark.parametrize("criterion", ["ce", "kl"])
def test_removal_scorer_measures_the_pruned_model(trained, criterion):
    from trsp_ray.method.probes import RemovalScorer

    model, ids = _useful_copy(trained)
    gates = attach_gates(model)
    windows = [ids[:256].view(8, 32), ids[256:512].view(8, 32)]
    scorer = RemovalScorer(model=model, gates=gates, windows=windows, criterion=criterion)
    gates.set_gated(True)
    with torch.no_grad():
        gates[3].gate.fill_(0.3)  # a stage-1 gate value must not leak into the measurement
    score = scorer([2, 4])
    # the same quantity computed on a model with layers 2 and 4 deleted
    import copy

    import torch.nn.functional as F

    pruned = copy.deepcopy(model)
    from trsp_ray.method.gates import detach_gates

    detach_gates(pruned)
    remove_layers(pruned, [2, 4])
    ref = []
    for w in windows:
        with torch.no_grad():
            lp = torch.log_softmax(pruned(input_ids=w).logits.float(), -1)
            if criterion == "ce":
                ref.append(F.cross_entropy(lp[:, :-1].reshape(-1, lp.shape[-1]), w[:, 1:].reshape(-1)).item())
            else:
                detach_gates(model)
                lt = torch.log_softmax(model(input_ids=w).logits.float(), -1)
                gates = attach_gates(model)
                ref.append((lt.exp() * (lt - lp)).sum(-1).mean().item())
    assert score == pytest.approx(sum(ref) / len(ref), rel=1e-3)
    nothing_removed = scorer([])
    if criterion == "kl":
        assert nothing_removed == pytest.approx(0.0, abs=1e-6) and score > 1e-4
    else:
        assert score > nothing_removed  # removing two useful layers costs calibration CE
    # every pass is one window batch; KL computes the dense teacher once, then reuses it
    assert scorer.cost == (2 * 2 + (2 if criterion == "kl" else 0)) * 256


def test_distillation_heal_moves_the_pruned_model_toward_the_dense_one(trained):
    """recovery.objective=kd: the stepper's loss is KL(dense || pruned), and healing with it lowers
    that KL on windows it never trained on (CE healing is not asked to)."""
    import copy

    from trsp_ray.method.heal import run_heal
    from trsp_ray.method.training import DistillLoss, TorchStepper

    teacher, ids = _useful_copy(trained)
    student = copy.deepcopy(teacher)
    remove_layers(student, [1, 3])
    objective = DistillLoss(teacher)
    held = ids[-256:].view(8, 32)
    with torch.no_grad():
        lt = torch.log_softmax(teacher(input_ids=held).logits.float(), -1)
        ls = torch.log_softmax(student(input_ids=held).logits.float(), -1)
    manual = (lt.exp() * (lt - ls)).sum(-1).mean().item()
    with torch.no_grad():
        assert objective(student, held).item() == pytest.approx(manual, rel=1e-5)
    before = manual
    make = lambda m, groups: TorchStepper(m, groups, objective=objective)
    run_heal(model=student, batches=Batches(ids[:-256], seqlen=32, batch_size=8, seed=3), steps=30, lr=3e-3,
             make_stepper=make)
    with torch.no_grad():
        after = objective(student, held).item()
    assert after < 0.7 * before, (before, after)


def test_distillation_on_ray_train_workers_is_refused_unless_the_heal_reads_a_stored_teacher():
    """Issue 50 item 2: the workers distil from the teacher store in a heal on the heal stream; a live
    teacher (a second model beside the student), stage 2 or a short heal is refused in one line."""
    from trsp_ray.common.errors import TrspError
    from trsp_ray.config.run_config import load_config
    from trsp_ray.distributed.train import check_worker_settings

    with pytest.raises(TrspError, match="teacher=live, kd_topk=64 is not available with distributed.workers=2"):
        load_config(None, ["recovery.objective=kd", "recovery.teacher=live", "distributed.workers=2"])
    kd = ["recovery.objective=kd", "distributed.workers=2", "compensation.method=none", "heal.steps=0"]
    for method, extra in (("trsp", ["heal.seqlen=64"]), ("shortgpt+heal", [])):  # stage 2; a short heal
        with pytest.raises(TrspError, match="would run the dense teacher beside the student") as err:
            check_worker_settings(load_config(None, kd + [f"method={method}"] + extra))
        assert "\n" not in str(err.value)
    check_worker_settings(load_config(None, kd + ["method=shortgpt+heal", "heal.seqlen=64"]))  # stored: accepted


def test_stage2_skip_schedule_is_a_heal_of_the_pruned_model(trained):
    """stage2.schedule=skip (P bypassed from step 1, no penalty) trains the kept layers exactly as a
    heal of the pruned model does: same batches and lr give the same weights, and they moved."""
    import copy

    from trsp_ray.method.heal import run_heal

    model, ids = trained
    drop = [0, 3]
    skip = copy.deepcopy(model)
    gates = attach_gates(skip)
    run_stage2(model=skip, gates=gates, batches=Batches(ids[:-512], seqlen=32, batch_size=8, seed=4), drop=drop,
               lambda2=1.0, steps=6, lr=3e-3, schedule="skip")
    from trsp_ray.method.gates import detach_gates

    detach_gates(skip)
    remove_layers(skip, drop)
    healed = copy.deepcopy(model)
    remove_layers(healed, drop)
    before = copy.deepcopy(healed)
    run_heal(model=healed, batches=Batches(ids[:-512], seqlen=32, batch_size=8, seed=4), steps=6, lr=3e-3)
    held = ids[-512:].view(16, 32)
    with torch.no_grad():
        a, b, c = skip(held).logits, healed(held).logits, before(held).logits
    assert (b - c).abs().max().item() > 1e-2  # the heal changed the model
    assert torch.allclose(a, b, atol=1e-4), (a - b).abs().max().item()


def test_refinement_undoes_a_myopic_greedy_choice():
    """Greedy took layer 1 (cheapest alone) but {2, 3} costs less than {1, 3}: the swap pass finds
    it among the probed layers, and keeps the drop order's positions."""
    from trsp_ray.method.stage1 import Stage1Result, _refine

    costs = {frozenset({1, 3}): 1.0, frozenset({2, 3}): 0.5, frozenset({1, 2}): 0.8, frozenset({3, 4}): 0.9,
             frozenset({1, 4}): 1.2, frozenset({2, 4}): 0.7}
    calls = []

    def scorer(drop):
        calls.append(list(drop))
        return costs[frozenset(drop)]

    result = Stage1Result(drop_order=[1, 3], round1_ranking=[])
    result.probes = [{"round": 1, "scores": {"1": 0.1, "2": 0.2, "4": 0.3}},
                     {"round": 2, "scores": {"3": 1.0, "4": 1.2}}]
    _refine(result, scorer=scorer, passes=2, current=1.0)
    assert result.drop_order == [2, 3]
    assert result.swaps == [{"out": 1, "in": 2, "score": 0.5}]
    assert [4, 3] in calls and [2, 1] in calls  # the second pass tried the rest and found nothing better


def test_refine_budget_bounds_the_scorer_calls():
    """stage1.refine_budget caps refinement's scorer calls (a pass that finds nothing costs
    n_drop x |pool|); the calls are counted, and the default keeps two whole passes at 8 of 30."""
    from trsp_ray.common.errors import TrspError
    from trsp_ray.config.run_config import load_config
    from trsp_ray.method.stage1 import Stage1Result, _refine

    calls = []

    def scorer(drop):  # no swap ever helps: every pass is a whole pass
        calls.append(list(drop))
        return 2.0

    def fresh():
        result = Stage1Result(drop_order=[1, 3, 5], round1_ranking=[])
        result.probes = [{"round": 1, "scores": {str(j): 0.1 for j in (1, 2, 4, 6, 7)}},
                         {"round": 2, "scores": {"3": 0.2, "8": 0.3}}, {"round": 3, "scores": {"5": 0.3}}]
        return result

    unbounded = fresh()
    _refine(unbounded, scorer=scorer, passes=2, current=1.0)
    assert unbounded.refine_calls == len(calls) == 3 * 5  # one pass (nothing improved): n_drop x |pool|
    for budget in (1, 7, 15, 100):
        calls.clear()
        result = fresh()
        _refine(result, scorer=scorer, passes=2, current=1.0, budget=budget)
        assert result.refine_calls == len(calls) == min(budget, 15)
    # progress every 20 calls (a pass can take minutes of probes): a pool of 7 makes 21 calls
    wide, seen = fresh(), []
    wide.probes[0]["scores"].update({str(j): 0.1 for j in (9, 10)})
    _refine(wide, scorer=scorer, passes=2, current=1.0, report=seen.append)
    assert wide.refine_calls == 21 and seen == [{"stage1/refine_calls_so_far": 20, "stage1/swaps_so_far": 0}]
    s1 = load_config(None, []).stage1
    # SmolLM2 at 8 of 30 (4 + 1 protected: gates.protect_head=auto): a pool of at most 30 - 5 - 8 = 17, and
    # the budget keeps two whole passes
    pool = len(candidate_layers(30, protect_head="auto", protect_tail=1)) - 8
    assert pool == 17 and s1.refine * 8 * pool <= s1.refine_budget == 320
    with pytest.raises(TrspError, match="stage1.refine_budget=0"):
        load_config(None, ["stage1.refine_budget=0"])


def test_refinement_cost_is_counted_in_the_stage1_result(trained):
    """run_stage1 hands the budget to the refinement and records its calls and tokens."""
    model, ids = trained

    class Cost:
        cost, tokens = 0, 64

        def __call__(self, drop):
            self.cost += 64
            return float(sum(drop))

    scorer = Cost()
    result = run_stage1(model=model, gates=attach_gates(model), batches=Batches(ids, seqlen=32, batch_size=8, seed=1),
                        n_drop=2, candidates=[1, 2, 3, 4], lambda1=0.01, lr=0.05, first_round_steps=2,
                        steps_per_round=1, probe=3, scorer=scorer, refine=2, refine_budget=2)
    assert result.refine_calls == 2 and result.refine_cost == 2 * 64
    assert result.probe_cost == 64 * (2 * 3 + 2)  # 2 rounds of 3 probes + the 2 refinement calls


def test_auto_head_protection_is_one_layer_in_eight():
    """gates.protect_head=auto keeps the first ceil(L / 8) layers (Kim et al.'s 4 of 32, scaled to the
    depth); a count is taken as given; anything else is refused in one line."""
    from trsp_ray.common.errors import TrspError
    from trsp_ray.config.run_config import load_config

    assert [head_protected("auto", n) for n in (2, 8, 9, 18, 30, 32, 80)] == [1, 1, 2, 3, 4, 4, 10]
    assert load_config(None, []).gates.protect_head == "auto"
    assert candidate_layers(30, protect_head="auto", protect_tail=1) == list(range(4, 29))
    assert candidate_layers(30, protect_head=0, protect_tail=1) == list(range(0, 29))
    for bad in ("-1", "two", "1.5", "true"):
        with pytest.raises(TrspError, match="gates.protect_head=.* is not valid; it must be an integer >= 0 or auto"):
            load_config(None, [f"gates.protect_head={bad}"])
