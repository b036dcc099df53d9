"""Issue 50, item 3: layers chosen by how well they recover. The candidate drop sets, the audition's
compute plan inside one budget, its ranking, a trial's training text, and the whole selection on
Ray Tune with ASHA on a tiny model."""

from __future__ import annotations

import dataclasses
import json
import re

import pytest
import torch

from trsp_ray.common.errors import TrspError
from trsp_ray.method import candidates as cands

RECOVER = "recover+comp+heal"


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    """An 8-layer tiny Llama with SmolLM2's tokenizer."""
    from transformers import AutoTokenizer

    from trsp_ray.data.assets import smollm2_dir
    from trsp_ray.models.tiny import tiny_model

    path = tmp_path_factory.mktemp("tiny")
    tiny_model("llama", layers=8, vocab=49152).save_pretrained(path)
    AutoTokenizer.from_pretrained(smollm2_dir()).save_pretrained(path)
    return path


def _cfg(*overrides):
    from trsp_ray.config.run_config import load_config

    return load_config(overrides=["tracking.enabled=false", f"method={RECOVER}", *overrides])


def test_candidate_names_are_checked_with_one_line_naming_the_bad_one():
    assert cands.parse("bi, bi-tail2,block-3,angular-block,tail-cut") == [
        "bi", "bi-tail2", "block-3", "angular-block", "tail-cut"]
    for bad, word in (("bi,blok-2", "'blok-2'"), ("block-0", "'block-0'"), ("bi,bi", "twice"), ("", "no candidate")):
        with pytest.raises(TrspError) as err:
            cands.parse(bad)
        assert word in str(err.value) and "\n" not in str(err.value)
    with pytest.raises(TrspError, match="selection.candidates has 'tail'"):
        _cfg("selection.candidates=bi,tail")


def test_candidate_sets_on_a_twelve_layer_model():
    # layers 1..10 may go (head and last layer protected); Block Influence lowest at 9, 10, 2, then 8
    influence = {i: 1.0 for i in range(12)} | {9: 0.1, 10: 0.2, 2: 0.3, 8: 0.4, 3: 0.5}
    allowed = list(range(1, 11))
    names = ["bi", "bi-tail2", "block-1", "block-3", "angular-block", "tail-cut"]
    sets = cands.drop_sets(names, n_drop=3, num_layers=12, candidates=allowed, influence=influence,
                           angular=[6, 7, 8])
    assert sets == {"bi": [2, 9, 10], "bi-tail2": [2, 3, 8], "block-1": [8, 9, 10], "block-3": [6, 7, 8]}
    # block-3's set is the angular block's, block-1's the tail cut's: each set is run once, first name kept
    narrow = cands.drop_sets(["block-1", "block-3"], n_drop=3, num_layers=12, candidates=list(range(1, 10)))
    assert narrow == {"block-3": [6, 7, 8]}  # block-1 would drop layer 10, which is protected here


def _smollm2(*overrides):
    """SmolLM2's default pipeline config with a 1M budget, resolved (its fit sized to the model)."""
    from trsp_ray.run.pipeline import resolve

    return resolve(_cfg("heal.compute_budget=1000000", *overrides), budget_layers=False).cfg


def test_the_audition_spends_its_share_of_the_budget_and_the_heal_the_rest():
    from trsp_ray.config import registry
    from trsp_ray.run import budget
    from trsp_ray.run.budget import audition_plan as plan

    cfg = _smollm2()
    spec = registry.method(RECOVER)
    p = plan(cfg, spec=spec, num_layers=30)
    share = cfg.selection.share * 1e6
    assert p.candidates == 5 and p.steps >= 2  # the tail cut is block-1's set while the last layer is protected
    assert p.fit > 10e3  # each candidate's least-squares fit is planned
    assert p.total <= share < p.total + p.candidates * p.step  # the most steps the share buys
    assert budget.planned_select_cost(cfg, spec=spec, num_layers=30) == p.total
    resolved = budget.resolve(cfg, spec=spec, num_layers=30)
    split = budget.split(resolved, spec=spec, num_layers=30, steps=resolved.stage2.steps)
    step = (split.heal + split.teacher) / split.steps
    assert split.selection == p.total
    assert 1e6 - step < split.spent <= 1e6  # selection trials + fit + teacher + heal: the whole budget
    assert split.selection > 0.2 * 1e6  # the trials are a real part of it, not rounding


def test_a_budget_too_small_for_the_trials_is_refused_naming_the_minimum():
    from trsp_ray.config import registry
    from trsp_ray.run.budget import audition_plan as plan

    spec = registry.method(RECOVER)
    with pytest.raises(TrspError) as err:
        plan(_smollm2("heal.compute_budget=100000"), spec=spec, num_layers=30)
    msg = str(err.value)
    assert "\n" not in msg and "heal.compute_budget=100000" in msg and "selection.share=0.25" in msg
    minimum = float(msg.split("raise the budget to at least ")[1].split(",")[0])
    assert plan(_smollm2(f"heal.compute_budget={minimum}"), spec=spec, num_layers=30).steps == 2
    with pytest.raises(TrspError):
        plan(_smollm2(f"heal.compute_budget={minimum * 0.98}"), spec=spec, num_layers=30)


def _trial(name, loss, *, step=8, cost=100.0, noise=0.0, seed=0, acc=None):
    windows = 2.0 + torch.randn(40, generator=torch.Generator().manual_seed(99))  # what every trial finds hard
    own = noise * torch.randn(40, generator=torch.Generator().manual_seed(seed))
    nlls = (windows - windows.mean() + loss + own - own.mean()).tolist()
    accs = None if acc is None else (acc + 0.02 * (own - own.mean()) / max(noise, 1e-9)).tolist()
    return {"name": name, "drop": [1], "nlls": nlls, "docs": [f"d{i // 2}" for i in range(40)], "cost": cost,
            "step": step, "loss": sum(nlls) / 40, **({"accs": accs} if accs else {})}


def test_the_ranking_puts_survivors_first_breaks_ties_by_compute_and_keeps_clear_wins():
    from trsp_ray.run.audition_plan import rank

    clear = rank([_trial("a", 3.0, noise=0.01, seed=1), _trial("b", 2.5, noise=0.01, seed=2), _trial("c", 1.0, step=4)])
    assert [t["name"] for t in clear] == ["b", "a", "c"]  # c was stopped at a rung: last, however low
    assert clear[1]["tie"] is False and clear[1]["diff"] == pytest.approx(0.5, abs=0.01)
    # within two paired SE: the cheaper one leads although its loss is a little higher
    x, y = _trial("x", 2.000, noise=0.05, cost=300.0, seed=3), _trial("y", 2.001, noise=0.05, cost=100.0, seed=4)
    tied = rank([x, y])
    assert [t["name"] for t in tied] == ["y", "x"] and all(t["tie"] for t in tied)
    with pytest.raises(TrspError, match="finished no trial"):
        rank([])


def test_a_tie_on_loss_goes_to_the_trial_that_answers_more_cloze_items_before_the_cheaper_one():
    from trsp_ray.run.audition_plan import rank

    # x and y tie on loss; y is cheaper but answers clearly fewer next tokens: x leads
    x = _trial("x", 2.000, noise=0.05, cost=300.0, seed=3, acc=0.40)
    y = _trial("y", 2.001, noise=0.05, cost=100.0, seed=4, acc=0.30)
    z = _trial("z", 2.6, noise=0.05, cost=50.0, seed=5, acc=0.50)  # clearly worse loss: its accuracy does not lift it
    ranked = rank([y, z, x])
    assert [t["name"] for t in ranked] == ["x", "y", "z"]
    assert ranked[1]["acc_diff"] == pytest.approx(-0.10, abs=0.01) and ranked[1]["tie"] is True
    assert ranked[2]["acc_diff"] is None and ranked[2]["tie"] is False
    # the same accuracies within noise: the cheaper one leads again
    close = rank([_trial("x", 2.000, noise=0.05, cost=300.0, seed=3, acc=0.400),
                  _trial("y", 2.001, noise=0.05, cost=100.0, seed=4, acc=0.401)])
    assert [t["name"] for t in close] == ["y", "x"]


def test_the_heal_gets_what_the_selection_did_not_spend(tiny_dir):
    from trsp_ray.config import registry
    from trsp_ray.distributed.audition import heal_steps_left
    from trsp_ray.run import budget
    from trsp_ray.run.pipeline import resolve
    from trsp_ray.run.workbench import prepare

    pipe = resolve(_cfg(f"model={tiny_dir}", "data.seqlen=32", "heal.compute_budget=300000"))
    bench = prepare(pipe.cfg)
    spec = registry.method(RECOVER)
    planned = budget.planned_select_cost(pipe.cfg, spec=spec, num_layers=8)
    same = heal_steps_left(bench, spec, drop=[3, 4], select_cost=planned)
    more = heal_steps_left(bench, spec, drop=[3, 4], select_cost=planned / 2)
    per_step = budget.split(pipe.cfg, spec=spec, num_layers=8, steps=1).heal  # one step of the heal, teacher apart
    assert same >= pipe.cfg.stage2.steps  # the plan's fit bound covers [3, 4]'s fit
    assert more - same == pytest.approx(planned / 2 / per_step, abs=1.5)
    assert heal_steps_left(prepare(_cfg(f"model={tiny_dir}", "data.seqlen=32")), spec, drop=[3, 4],
                           select_cost=planned) is None  # no budget: the configured steps


def test_an_audition_trial_trains_on_no_validation_or_heldout_document(tiny_dir, tmp_path, monkeypatch):
    """A trial heals on the calibration's training stream only: no window it trains on holds a run of
    NGRAM tokens of a validation document (the text it is ranked on) or of the held-out text."""
    from trsp_ray.config import registry
    from trsp_ray.config.run_config import trial_config
    from trsp_ray.data.calibration import NGRAM
    from trsp_ray.distributed import audition
    from trsp_ray.run import methods
    from trsp_ray.run.workbench import prepare

    cfg = trial_config(_cfg(f"model={tiny_dir}", "data.seqlen=32"))
    seen = []
    heal = methods.run_heal

    def recording(*, batches, **kw):
        class Tap:
            def __getattr__(self, name):
                return getattr(batches, name)

            def next(self):
                seen.append(batches.next())
                return seen[-1]
        return heal(batches=Tap(), **kw)

    monkeypatch.setattr(methods, "run_heal", recording)
    reports = []
    spec = dataclasses.asdict(registry.method(RECOVER))
    config = {"run": cfg.to_dict(), "spec": spec, "name": "block-3", "sets": {"block-3": [3, 4]}, "steps": 4,
              "every": 2, "report_cost": 10.0, "val_windows": 6, "threads": 1, "out": str(tmp_path)}
    record = audition.execute(config, report=reports.append)
    assert [r["heal_step"] for r in reports] == [2, 4] and len(record["nlls"]) == 6
    assert json.loads((tmp_path / "block-3.json").read_text())["step"] == 4
    assert len(seen) == 4
    bench = prepare(cfg)
    trained = {tuple(w[i:i + NGRAM].tolist()) for b in seen for w in b for i in range(w.numel() - NGRAM + 1)}
    chunk = bench.calibration.chunk

    def runs(text):
        return {tuple(text[i:i + NGRAM].tolist()) for i in range(text.numel() - NGRAM + 1)}

    assert len(bench.calibration.val_docs) >= 8 and bench.heldout.windows.shape[0] >= 8
    for k, doc in enumerate(bench.calibration.val_docs):
        assert not runs(bench.val_ids[k * chunk:(k + 1) * chunk]) & trained, f"trained on validation document {doc}"
    for w, doc in zip(bench.heldout.windows, bench.heldout.docs):
        assert not runs(w[1:]) & trained, f"a trial trained on held-out document {doc}"
    # the check can fail: the windows it trained on are found in the calibration's training text
    assert len(trained & runs(bench.calib_ids)) > 0.9 * len(trained)


def test_a_path_that_cannot_start_trials_refuses_the_recover_selector(tiny_dir):
    from trsp_ray.config import registry
    from trsp_ray.method.gates import attach_gates
    from trsp_ray.run.methods import select
    from trsp_ray.run.workbench import prepare

    bench = prepare(_cfg(f"model={tiny_dir}", "data.seqlen=32"))
    model = bench.fresh_model()
    with pytest.raises(TrspError, match=re.escape(f"method={RECOVER} auditions its candidates as Ray Tune trials")):
        select(bench, registry.method(RECOVER), model=model, gates=attach_gates(model, gate_mode=bench.cfg.gates.gate))


def test_the_audition_runs_candidates_as_tune_trials_and_hands_back_the_best(tiny_dir, own_ray_tmpdir, monkeypatch,
                                                                            tmp_path):
    """On Ray Tune with ASHA: every candidate set is a trial, the winner is the survivor with the lowest
    validation loss (or a cheaper tie), the spent compute is within the plan, and the Ray it started is gone."""
    import ray

    from trsp_ray.config import registry
    from trsp_ray.distributed import audition as audition_module
    from trsp_ray.distributed.audition import audition, candidate_sets
    from trsp_ray.method.gates import attach_gates
    from trsp_ray.run.budget import audition_plan as plan
    from trsp_ray.run.workbench import prepare

    bench = prepare(_cfg(f"model={tiny_dir}", "data.seqlen=32", "selection.candidates=bi,bi-tail2,block-3",
                         "selection.steps=4", "selection.reports=2", "selection.val_windows=8",
                         "selection.concurrency=2", "threads=1", f"checkpoint_dir={tmp_path}"))
    spec = registry.method(RECOVER)
    model = bench.fresh_model()
    drop, info = audition(bench, spec, model=model, gates=attach_gates(model, gate_mode=bench.cfg.gates.gate))
    assert not ray.is_initialized()
    trials = info["audition"]
    assert len(trials) == 3 and drop == trials[0]["drop"] and info["audition_winner"] == trials[0]["name"]
    finished = [t for t in trials if t["step"] == 4]
    assert finished and trials[0] in finished
    lowest = min(finished, key=lambda t: t["loss"])
    assert trials[0] is lowest or trials[0]["tie"]
    p = plan(bench.cfg, spec=spec, num_layers=8)
    assert 0 < info["select_cost"] <= p.total
    model = bench.fresh_model()
    sets, _ = candidate_sets(bench, model=model, gates=attach_gates(model, gate_mode=bench.cfg.gates.gate))
    assert sorted(tuple(t["drop"]) for t in trials) == sorted(tuple(s) for s in sets.values())
    # run again (an interrupted prune resumed): every trial, finished or stopped by ASHA, is read back
    records = {f.stem: json.loads(f.read_text()) for f in tmp_path.glob("auditions/*/trials/*.json")}
    assert {n: (r["step"], bool(r.get("finished")), bool(r.get("stopped"))) for n, r in records.items()} == {
        t["name"]: (t["step"], t["step"] == 4, t["step"] < 4) for t in trials}
    monkeypatch.setattr(audition_module, "_tune", lambda *a, **k: pytest.fail("a finished trial ran again"))
    model = bench.fresh_model()
    again, info2 = audition(bench, spec, model=model, gates=attach_gates(model, gate_mode=bench.cfg.gates.gate))
    assert again == drop and info2["audition"] == trials and info2["select_cost"] == info["select_cost"]


def test_trials_at_once_are_as_many_as_host_memory_holds(monkeypatch):
    """On CPU every trial process holds its own model, teacher and optimizer state: the audition runs
    no more trials at once than host memory holds at a trial's planned peak."""
    from trsp_ray.distributed import audition
    from trsp_ray.plan.single_plan import trial_peak
    from trsp_ray.run import workbench

    cfg = _cfg()
    peak = trial_peak(cfg, device="cpu", memory_gb=100.0).total
    assert peak > 1.0  # SmolLM2's heal with its teacher beside it
    for memory, expected in ((100 * peak, 5), (3.5 * peak, 3), (0.5 * peak, 1)):
        monkeypatch.setattr(workbench, "device_kind", lambda c, m=memory: ("cpu", m))
        assert audition.trials_at_once(cfg, 5, cpus=8, gpu=False) == expected
    assert audition.trials_at_once(cfg, 5, cpus=2, gpu=False) == 1  # 0.5 peaks of memory: one at a time
    assert audition.trials_at_once(cfg, 5, cpus=8, gpu=True) == 5  # on GPUs Ray gives each trial its own


def test_the_plan_holds_the_trials_side_by_side_on_cpu_and_one_per_gpu():
    """`trsp-ray plan` and the driver's route see the selection trials as a stage: on CPU the trials
    the audition runs at once, each its own process, beside the run's own model."""
    from trsp_ray.config.run_config import load_config
    from trsp_ray.plan.single_plan import SELECTION_TRIALS, single_plan_for_run, trial_peak

    cfg = _cfg("selection.concurrency=3")
    one = trial_peak(cfg, device="cpu", memory_gb=100.0)
    assert one.name in ("heal", "compensation") and one.total > 1.0

    def stage(memory, device="cpu", c=cfg):
        return next(st for st in single_plan_for_run(c, device=device, memory_gb=memory).stages
                    if st.name == SELECTION_TRIALS)

    model = sum(gb for part, gb in one.parts.items() if "model (" in part)
    assert stage(100.0).total == pytest.approx(3 * one.total + model)  # concurrency 3, memory for all
    assert stage(2.5 * one.total).total == pytest.approx(2 * one.total + model)  # memory holds two
    assert stage(80.0, "gpu").total == pytest.approx(trial_peak(cfg, device="gpu", memory_gb=80.0).total)
    plain = load_config(overrides=["tracking.enabled=false"])  # the default pipeline runs no trials
    assert SELECTION_TRIALS not in [st.name for st in single_plan_for_run(plain, device="cpu", memory_gb=100.0).stages]
