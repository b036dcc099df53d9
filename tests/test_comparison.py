"""The fair comparison: rows share selections, trained rows share one weight-update budget, seeds
give means and spreads, and each row is compared with its own group's best baseline."""

import re

import pytest

from trsp_ray.benchmark.comparison import check_request, plan_jobs
from trsp_ray.benchmark.stats import GEO, summarize, verdict
from trsp_ray.common.errors import TrspError
from trsp_ray.common.paired import paired_se
from trsp_ray.config import registry
from trsp_ray.config.run_config import load_config

SMALL = ["data.seqlen=32", "data.batch_size=2", "data.eval_seqlen=64", "data.eval_max_windows=3",
         "stage1.first_round_steps=3", "stage1.steps_per_round=2", "stage2.steps=3",
         "baselines.sleb_windows=2", "threads=1", "tracking.enabled=false"]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    from trsp_ray.models.tiny import tiny_workspace

    root = tiny_workspace(tmp_path_factory.mktemp("tiny"), layers=8, calib_chars=40000, eval_chars=12000)
    return root


def _cfg(root, *extra):
    return load_config(None, [*SMALL, *extra], base={
        "model": str(root / "model"), "ratio": 0.25,
        "data": {"calib_text": str(root / "calib.txt"), "eval_text": str(root / "eval.txt")}})


def test_bad_requests_fail_before_any_work(tiny_dir):
    cfg = _cfg(tiny_dir)
    with pytest.raises(TrspError, match="seeds=0 is not valid"):
        check_request(cfg, ["dense"], 0, 0)
    with pytest.raises(TrspError, match=re.escape("unknown benchmark row 'shortgpt+lora'; valid rows: dense")):
        check_request(cfg, ["dense", "shortgpt+lora"], 1, 0)
    with pytest.raises(TrspError, match="listed twice"):
        check_request(cfg, ["sleb", "sleb"], 1, 0)
    with pytest.raises(TrspError, match="stage2.steps=0 leaves the trained rows"):
        check_request(_cfg(tiny_dir, "stage2.steps=0"), ["shortgpt+heal"], 1, 0)
    with pytest.raises(TrspError, match="recovery.objective='mse' is not valid"):
        _cfg(tiny_dir, "recovery.objective=mse")


def test_plan_computes_each_selection_once_per_seed():
    rows = registry.rows(["dense", "trsp", "trsp-no-stage2", "trsp-oneshot", "trsp-selection+heal",
                          "shortgpt", "shortgpt+heal", "sleb+heal"])
    jobs = plan_jobs(rows, [3, 4])
    selections = [(j.name, j.seed) for j in jobs if j.kind == "selection"]
    assert sorted(selections) == sorted([(s, seed) for s in ("trsp", "shortgpt", "sleb") for seed in (3, 4)])
    assert sum(j.kind == "row" for j in jobs) == 16
    assert jobs.index(next(j for j in jobs if j.kind == "row")) == len(selections)  # selections come first


def _stat(values):
    return {"mean": sum(values) / len(values), "min": min(values), "max": max(values),
            "spread": max(values) - min(values), "n": len(values)}


def test_the_ray_driver_starts_the_critical_path_first_whenever_a_worker_frees():
    """Ray runs ready tasks in the order they became ready, so in the README job the TRSP rows,
    ready only after the 462 s stage 1, queued behind every ShortGPT row and the dense row (15:47
    wall). The driver now keeps `workers` tasks in flight and picks the next by priority among the
    jobs whose selections are done."""
    from trsp_ray.benchmark.cluster import next_job, submission_order

    rows = registry.rows(list(registry.QUICK_ROWS))
    waiting = sorted(plan_jobs(rows, [0]), key=submission_order)

    def take(done):
        job = next_job(waiting, done)
        waiting.remove(job)
        return job.name

    assert [take(set()), take(set())] == ["trsp", "shortgpt"]  # both selections start at once
    shortgpt, trsp = ("shortgpt", 0), ("trsp", 0)
    # the trained rows before the untrained ones
    assert {take({shortgpt}), take({shortgpt})} == {"shortgpt+heal", "shortgpt+comp+heal"}
    assert take({shortgpt}) == "shortgpt"  # TRSP's rows are not ready: the next ShortGPT row
    assert take({shortgpt, trsp}) == "trsp-selection+heal"  # ready now: before the dense row
    assert [take({shortgpt, trsp}), take({shortgpt, trsp})] == ["trsp-no-stage2", "dense"]
    assert next_job(waiting, {shortgpt, trsp}) is None and not waiting


def test_paired_se_of_two_fixed_0_1_vectors_is_the_hand_formula():
    a = [1, 1, 0, 1, 0, 0, 1, 1]
    b = [1, 0, 0, 0, 0, 1, 1, 0]
    # d = 0 1 0 1 0 -1 0 1: mean 2/8; sum of squared deviations 4 x 0.25^2 + 3 x 0.75^2 + 1.25^2 = 3.5
    mean, se = paired_se(a, b)
    assert mean == pytest.approx(0.25)
    assert se == pytest.approx((3.5 / 7 / 8) ** 0.5)  # sd with n - 1, over sqrt(n): 0.25


def test_verdict_needs_two_paired_se_and_the_seed_spread_and_says_when_there_is_no_spread():
    p = {"diff": -0.05, "se": 0.02, "spread": 0.0, "seeds": 3}
    assert verdict(p, higher_is_better=False) == "better"
    assert verdict({**p, "se": 0.03}, higher_is_better=False) == "tie"  # inside 2 SE
    assert verdict({**p, "spread": 0.06}, higher_is_better=False) == "tie"  # inside the seeds' spread
    assert verdict(p, higher_is_better=True) == "worse"
    assert verdict({**p, "seeds": 1}, higher_is_better=False) == "better (no spread)"


def _nll(ppl, n=9, jitter=0.0):  # 9 windows: the jitter sums to zero
    import math

    return [math.log(ppl) + jitter * ((i % 3) - 1) for i in range(n)]


def _result(row, seed, ppl, drop=(1, 2), weight=0, lambada=None):
    import math

    nll = {"wiki": _nll(ppl, jitter=0.01), "news": _nll(2 * ppl, jitter=0.02), "prose": _nll(3 * ppl, jitter=0.01)}
    r = {"row": row, "seed": seed, "drop": list(drop), "params": 75, "seconds": 1.0,
         "info": {"weight_tokens": weight}, "nll": nll,
         "ppl": {d: math.exp(sum(v) / len(v)) for d, v in nll.items()}}
    if lambada is not None:
        r["lambada"] = {"acc": sum(lambada) / len(lambada), "se": 0.0, "n": len(lambada), "items": list(lambada)}
    return r


DENSE = {"wiki": _nll(10.0), "news": _nll(20.0), "prose": _nll(30.0)}


def _summarize(results, rows, left_out=("prose",)):
    return summarize(results, rows, dense_params=100, dense_nll=DENSE, left_out=list(left_out))


def test_select_recover_and_total_compute_are_seed_means_that_add_up():
    """A TRSP selection's refinement spends a different number of scorer calls per seed (56 and 106
    in the 3-seed run): the select column showed the first seed's cost (126.2k) beside the seeds'
    mean total (143.2k), so select + recover != total in the printed row."""
    rows = registry.rows(["trsp-selection+heal"])
    costs = ((0, 126160.0), (1, 126160.0), (2, 176870.0))
    results = [{**_result("trsp-selection+heal", seed, 30.0, weight=64),
                "info": {"weight_tokens": 64, "select_cost": c, "recovery_cost": 30720.0, "total_cost": c + 30720.0}}
               for seed, c in costs]
    (s,) = _summarize(results, rows)
    assert s["select cost"] == pytest.approx(sum(c for _, c in costs) / 3)
    assert s["select cost"] + s["recovery cost"] == pytest.approx(s["total cost"])


def test_summary_has_per_domain_ppl_the_geometric_mean_over_dense_and_the_left_out_domain():
    rows = registry.rows(["dense", "shortgpt"])
    results = [_result("dense", s, 10.0) for s in (0, 1)] + [_result("shortgpt", s, 40.0 + s) for s in (0, 1)]
    by = {s["row"]: s for s in _summarize(results, rows)}
    g = by["shortgpt"]
    # every domain's PPL is 4x (4.1x) dense's: the geometric mean of the ratios is the same
    assert g[GEO]["min"] == pytest.approx(4.0, rel=1e-9) and g[GEO]["max"] == pytest.approx(4.1, rel=1e-9)
    assert by["dense"][GEO]["mean"] == pytest.approx(1.0)
    assert g["news PPL"]["mean"] == pytest.approx(2 * 40.5, rel=1e-3)
    assert g["left-out PPL"]["mean"] == pytest.approx(3 * 40.5, rel=1e-3)  # prose, the domain left out
    assert "left-out PPL" not in _summarize(results, rows, left_out=())[0]


def test_a_pair_that_ties_unpaired_is_better_paired_on_the_same_items():
    """LAMBADA-like 0/1 items: 200 passages, the row answers 12 more and 2 fewer than the baseline.
    Two independent samples would call 0.05 a tie (2 x hypot(SE, SE) = 0.10); on the same passages
    the paired SE is 0.018, so the verdict is 'better', at every seed."""
    import math

    base = [1] * 40 + [0] * 160
    better = list(base)
    for i in range(40, 52):
        better[i] = 1
    better[0] = better[1] = 0
    p_a, p_b, n = sum(better) / 200, sum(base) / 200, 200
    unpaired = 2 * math.hypot(math.sqrt(p_a * (1 - p_a) / n), math.sqrt(p_b * (1 - p_b) / n))
    assert abs(p_a - p_b) <= unpaired  # unpaired: a tie

    rows = registry.rows(["shortgpt+heal", "shortgpt+comp+heal"])
    results = [_result("shortgpt+heal", s, 30.0, weight=64, lambada=base) for s in (0, 1)]
    results += [_result("shortgpt+comp+heal", s, 30.0, weight=64, lambada=better) for s in (0, 1)]
    by = {s["row"]: s for s in _summarize(results, rows)}
    v = by["shortgpt+comp+heal"]["default vs"]["shortgpt+heal"]["LAMBADA acc"]
    assert v["diff"] == pytest.approx(0.05) and 2 * v["se"] < 0.05
    assert v["verdict"] == "better"
    assert by["shortgpt+comp+heal"]["default vs"]["shortgpt+heal"][GEO]["verdict"] == "tie"  # same PPL


def test_summary_compares_each_row_with_its_own_groups_best_baseline():
    rows = registry.rows(["dense", "trsp-no-stage2", "shortgpt", "sleb", "trsp", "shortgpt+heal", "sleb+heal",
                          "shortgpt+comp+heal"])
    results = [_result("dense", s, 10.0) for s in (0, 1)]
    results += [_result("trsp-no-stage2", 0, 40.0), _result("trsp-no-stage2", 1, 44.0, drop=(1, 3))]
    results += [_result("shortgpt", s, p) for s, p in ((0, 50.0), (1, 52.0))]
    results += [_result("sleb", s, p) for s, p in ((0, 60.0), (1, 58.0))]
    results += [_result("trsp", s, p, weight=64) for s, p in ((0, 30.0), (1, 31.0))]
    results += [_result("shortgpt+heal", s, p, weight=64) for s, p in ((0, 25.0), (1, 27.0))]
    results += [_result("sleb+heal", s, p, weight=64) for s, p in ((0, 24.0), (1, 27.5))]
    results += [_result("shortgpt+comp+heal", s, p, weight=64) for s, p in ((0, 20.0), (1, 20.5))]
    by = {s["row"]: s for s in _summarize(results, rows)}
    # selection group: ShortGPT (51) is its best baseline, not the better-looking trained rows
    assert by["trsp-no-stage2"]["best baseline"] == "shortgpt"
    assert by["trsp-no-stage2"]["vs best"][GEO]["verdict"] == "better"  # 42 vs 51, spread of the diffs 0.04
    assert not by["trsp-no-stage2"]["same drop over seeds"]
    # trained group: sleb+heal is the best baseline (the compensated default is no baseline)
    assert by["trsp"]["best baseline"] == "sleb+heal"
    assert by["trsp"]["vs best"][GEO]["verdict"] == "worse"
    assert by["shortgpt+heal"]["wiki PPL"]["spread"] == pytest.approx(2.0, rel=1e-3)
    # the best baseline is judged against the others, never itself: per seed -4% and +2%, a tie
    assert by["sleb+heal"]["best baseline"] == "shortgpt+heal"
    assert by["sleb+heal"]["vs best"][GEO]["verdict"] == "tie"
    assert "vs best" not in by["dense"] and by["dense"]["kept %"] == pytest.approx(75.0)
    # the default row is judged against every other row of its group, and only it
    assert set(by["shortgpt+comp+heal"]["default vs"]) == {"trsp", "shortgpt+heal", "sleb+heal"}
    assert [s["row"] for s in by.values() if "default vs" in s] == ["shortgpt+comp+heal"]


def test_one_seed_verdicts_say_no_spread_and_win_nothing(capsys):
    from trsp_ray.benchmark.report import render_report

    rows = registry.rows(["shortgpt+heal", "shortgpt+comp+heal"])
    results = [_result("shortgpt+heal", 0, 30.0, weight=64), _result("shortgpt+comp+heal", 0, 25.0, weight=64)]
    summary = _summarize(results, rows)
    v = summary[1]["default vs"]["shortgpt+heal"]
    assert v[GEO]["verdict"] == "better (no spread)" and v[GEO]["seeds"] == 1
    report = render_report(summary, calibration_source="mixture", left_out=["prose"], cfg=load_config(None, []),
                           seeds=[0], zeroshot_limit=0, lambada_limit=0)
    assert "better (no spread) -16.7" in report and "prose PPL (left out)" in report
    assert "smallest difference each column can detect" in report


def test_equal_compute_rows_get_the_selection_difference_as_heal_steps():
    from trsp_ray.benchmark.jobs import budget_configs, equal_compute_steps
    from trsp_ray.plan.compute import extra_heal_steps, recovery_cost, total_cost

    cfg = load_config(None, ["data.batch_size=4", "data.seqlen=128", "stage2.steps=20"])
    # TRSP's selection spent 126k dense-forward tokens, ShortGPT's 20k: 106k / (3 x 512) = 69 steps
    spec = registry.method(cfg.method)
    steps = equal_compute_steps(cfg, {"info": {"select_cost": 20_480.0}}, {"info": {"select_cost": 126_464.0}},
                                spec=spec)
    assert steps == 69 == extra_heal_steps(106_000, step_cost=3 * 512)  # a full heal's step (compute.step_cost)
    assert equal_compute_steps(cfg, {"info": {"select_cost": 9e9}}, {"info": {"select_cost": 1.0}}, spec=spec) == 0
    _, heal = budget_configs(registry.ROWS["shortgpt+heal@compute"], cfg, budget=4, extra_steps=steps)
    assert heal.steps == 20 * 4 + 69 and heal.lr == cfg.stage2.lr
    s2, heal = budget_configs(registry.ROWS["trsp"], cfg, budget=4)
    assert s2.steps == 80 and s2.enabled and heal.steps == 0
    info = {"select_cost": 100.0, "weight_tokens": 10, "heal_cost": 30.0, "compensation_cost": 7.0}
    assert recovery_cost(info) == 37.0 and total_cost(info) == 137.0


def test_comp_compute_rows_get_the_compensations_cost_as_heal_steps():
    """'@comp': ShortGPT's set of SmolLM2 (8 of 30), 32 x 128 calibration tokens, 512 tokens a step."""
    from trsp_ray.benchmark.jobs import compensation_steps

    drop = [12, 13, 14, 15, 16, 17, 25, 26]
    cfg = load_config(None, ["data.batch_size=4", "data.seqlen=128", "compensation.windows=32"])
    # dense activations: one pass to layer 26, 4096 x 27/30 = 3686 tokens, and the 2 blocks' float64
    # sums and solves, 700 (compute.fit_solve_cost): 4386 / 1536 = 2.9 steps
    assert compensation_steps(cfg, drop, spec=registry.method(cfg.method), num_layers=30) == 3
    # sequential: per block a dense pass to b and a pruned one to a-1: 4096 x (18 + 12 + 27 + 19) / 30 +
    # 700 = 11076 tokens, 7.2 steps
    seq = load_config(None, ["data.batch_size=4", "data.seqlen=128", "compensation.windows=32",
                             "compensation.activations=sequential"])
    assert compensation_steps(seq, drop, spec=registry.method(seq.method), num_layers=30) == 7
    row = registry.ROWS["shortgpt+heal@comp"]
    assert row.comp_compute and not row.is_default and not row.compensate


def test_plan_runs_trained_rows_per_budget_and_needs_trsp_for_equal_compute():
    rows = registry.rows(["dense", "shortgpt", "shortgpt+heal@compute"])
    jobs = plan_jobs(rows, [0], (1, 4))
    assert [(j.name, j.budget) for j in jobs if j.kind == "selection"] == [("shortgpt", 1), ("trsp", 1)]
    assert [(j.name, j.budget) for j in jobs if j.kind == "row"] == [
        ("dense", 1), ("shortgpt", 1), ("shortgpt+heal@compute", 1), ("shortgpt+heal@compute", 4)]
    cfg = load_config(None, [])
    for bad, match in (({"lambada_limit": -1}, "lambada_limit=-1"), ({"budgets": (0,)}, "budgets=.0."),
                       ({"budgets": (1, 1)}, "distinct")):
        with pytest.raises(TrspError, match=match):
            check_request(cfg, ["dense"], 1, 0, **bad)


def test_benchmark_rows_share_selections_and_budget(tiny_dir, capsys):
    from trsp_ray.benchmark.comparison import run_benchmark

    names = ["dense", "trsp", "trsp-no-stage2", "trsp-oneshot", "trsp-selection+heal", "shortgpt",
             "shortgpt+heal", "shortgpt+comp+heal", "sleb", "sleb+heal", "random", "random+heal"]
    summary = run_benchmark(_cfg(tiny_dir, "compensation.windows=16"), names, seeds=2)  # 8 per column, the floor
    by = {s["row"]: s for s in summary}
    budget = 3 * 2 * 32  # stage2.steps x batch x seqlen
    for name in ("trsp", "trsp-oneshot", "trsp-selection+heal", "shortgpt+heal", "shortgpt+comp+heal", "sleb+heal",
                 "random+heal"):
        assert by[name]["weight tokens"] == budget, name
        assert by[name]["group"] == "trained"
    for name in ("trsp-no-stage2", "shortgpt", "sleb", "random", "dense"):
        assert by[name]["weight tokens"] == 0, name
    assert by["trsp"]["drop"] == by["trsp-no-stage2"]["drop"] == by["trsp-selection+heal"]["drop"]
    assert by["shortgpt"]["drop"] == by["shortgpt+heal"]["drop"] and by["sleb"]["drop"] == by["sleb+heal"]["drop"]
    # rounds x steps x batch x seqlen (2 layers dropped), plus the removal probes' 8 windows
    stage1_tokens = (3 + 1 * 2) * 2 * 32 + 8 * 32
    assert by["trsp"]["calib tokens"] == stage1_tokens
    assert by["shortgpt"]["calib tokens"] == stage1_tokens  # ShortGPT sees what stage 1 sees
    assert by["sleb"]["calib tokens"] == 2 * 32 and by["sleb"]["select cost"] > 2 * 32
    domains = ["wiki", "news", "code", "math", "prose"]
    for s in summary:
        assert s["seeds"] == 2 and s["domains"] == domains and s[GEO]["n"] == 2
        for d in domains:
            assert s[f"{d} PPL"]["min"] <= s[f"{d} PPL"]["mean"] <= s[f"{d} PPL"]["max"]
    # a random model: trained rows move, selection rows of different drop sets differ
    assert by["dense"][GEO]["mean"] == pytest.approx(1.0) and by["dense"]["wiki PPL"]["spread"] == 0.0
    assert by["shortgpt+heal"]["wiki PPL"]["mean"] != by["shortgpt"]["wiki PPL"]["mean"]
    out = capsys.readouterr().out
    assert ("the default `trsp-ray prune` (method shortgpt+comp+heal = row shortgpt+comp+heal" in out)
    assert "calibration: " + str(tiny_dir / "calib.txt") in out and "no domain is left out" in out
    # the default's row is the uncompensated heal's drop set, compensated: another model, its fit counted
    assert by["shortgpt+comp+heal"]["drop"] == by["shortgpt+heal"]["drop"]
    assert by["shortgpt+comp+heal"]["recovery cost"] > by["shortgpt+heal"]["recovery cost"]
    assert by["shortgpt+comp+heal"]["wiki PPL"]["mean"] != by["shortgpt+heal"]["wiki PPL"]["mean"]
    # every trained row is judged against the default, paired, with its total compute printed beside it
    assert set(by["shortgpt+comp+heal"]["default vs"]) == {"trsp", "trsp-oneshot", "trsp-selection+heal",
                                                           "shortgpt+heal", "sleb+heal", "random+heal"}
    assert "SLEB scored its removals on 2 calibration windows" in out  # a SLEB row ran


def test_benchmark_compensated_equal_compute_and_lambada_rows(tiny_dir, capsys):
    """The '+comp' row compensates the same drop set (a different model, its fit counted as recovery
    compute), the '@compute' row heals with TRSP's extra selection compute, and every row carries
    LAMBADA's accuracy with its standard error."""
    from trsp_ray.benchmark.comparison import run_benchmark
    from trsp_ray.benchmark.jobs import equal_compute_steps

    names = ["trsp-no-stage2", "shortgpt", "shortgpt+comp", "shortgpt+heal@compute", "shortgpt+comp+heal",
             "shortgpt+heal@comp"]
    # the method set for the whole run configures the +comp rows' fit; the other rows stay uncompensated
    cfg = _cfg(tiny_dir, "compensation.windows=16", "compensation.method=lstsq")
    by = {s["row"]: s for s in run_benchmark(cfg, names, lambada_limit=3)}
    assert by["shortgpt+comp"]["drop"] == by["shortgpt"]["drop"]
    assert by["shortgpt+comp"][GEO]["mean"] != pytest.approx(by["shortgpt"][GEO]["mean"])
    assert by["shortgpt+comp"]["recovery cost"] > 0 == by["shortgpt"]["recovery cost"]
    cfg = _cfg(tiny_dir)
    extra = equal_compute_steps(cfg, {"info": {"select_cost": by["shortgpt"]["select cost"]}},
                                {"info": {"select_cost": by["trsp-no-stage2"]["select cost"]}},
                                spec=registry.method("shortgpt+heal"))
    assert extra > 0
    assert by["shortgpt+heal@compute"]["weight tokens"] == (cfg.stage2.steps + extra) * 2 * 32
    # '@comp' heals with the compensation's compute instead: the two rows' totals within one heal step
    comp, healed = by["shortgpt+comp+heal"], by["shortgpt+heal@comp"]
    assert healed["weight tokens"] > comp["weight tokens"] == cfg.stage2.steps * 2 * 32
    assert healed["recovery cost"] == 3 * healed["weight tokens"] < comp["recovery cost"] + 3 * 2 * 32
    assert abs(healed["total cost"] - comp["total cost"]) <= 0.5 * 3 * 2 * 32
    for s in by.values():  # the per-passage results are kept: the accuracy is their mean
        (items,) = s["items"]["LAMBADA acc"].values()
        assert len(items["lambada"]) == 3 and s["LAMBADA acc"]["mean"] == pytest.approx(sum(items["lambada"]) / 3)
    assert "SLEB scored" not in capsys.readouterr().out  # no SLEB row: no note about SLEB's windows


@pytest.mark.ray
def test_benchmark_on_local_ray_matches_in_process(tiny_dir, tmp_path):
    from mlflow.tracking import MlflowClient

    from trsp_ray.benchmark.cluster import run_benchmark_ray
    from trsp_ray.benchmark.comparison import run_benchmark

    names = ("dense", "trsp", "shortgpt", "shortgpt+heal")
    local = {s["row"]: s for s in run_benchmark(_cfg(tiny_dir), names)}
    uri = f"sqlite:///{tmp_path / 'ml.db'}"
    summary = run_benchmark_ray(_cfg(tiny_dir, "tracking.enabled=true", f"tracking.tracking_uri={uri}"), names,
                                workers=2)
    assert [s["row"] for s in summary] == list(names)
    for s in summary:  # the same jobs on Ray give the same numbers as in this process
        assert s[GEO]["mean"] == pytest.approx(local[s["row"]][GEO]["mean"], rel=1e-5)
        assert s["drop"] == local[s["row"]]["drop"]
    client = MlflowClient(tracking_uri=uri)
    runs = client.search_runs([client.get_experiment_by_name("trsp_ray").experiment_id])
    parent = [r for r in runs if r.data.tags.get("kind") == "benchmark"][0]
    children = {r.info.run_name for r in runs if r.data.tags.get("mlflow.parentRunId") == parent.info.run_id}
    assert children == {"dense seed 0", "trsp seed 0", "shortgpt seed 0", "shortgpt+heal seed 0",
                        "selection trsp seed 0", "selection shortgpt seed 0"}
    artifacts = {a.path for a in client.list_artifacts(parent.info.run_id)}
    assert {"benchmark.txt", "benchmark.json", "benchmark_ppl.png"} <= artifacts


def test_report_says_when_sleb_was_cut_and_full_baselines_lifts_it(monkeypatch):
    from trsp_ray import cli
    from trsp_ray.benchmark.report import sleb_note as _sleb_note
    from trsp_ray.config.sections import FULL_SLEB_WINDOWS

    assert "CUT" in _sleb_note(load_config(None, [])) and "--full-baselines" in _sleb_note(load_config(None, []))
    seen = {}
    monkeypatch.setattr("trsp_ray.benchmark.comparison.run_benchmark",
                        lambda cfg, rows, **kw: seen.setdefault("cfg", cfg))
    monkeypatch.setattr("trsp_ray.run.workbench.check_single_plan", lambda cfg, methods: None)
    assert cli.main(["benchmark", "--full-baselines", "--workers", "0", "--rows", "sleb", "--no-mlflow"]) == 0
    assert seen["cfg"].baselines.sleb_windows == FULL_SLEB_WINDOWS
    assert "CUT" not in _sleb_note(seen["cfg"])


def test_the_readme_run_cuts_trsps_refinement_and_says_so(monkeypatch):
    """The README's quick run turns TRSP's swap refinement off (about 6 of its 15 minutes on 2
    cores) and its report says so; --full, --rows or a refine setting the user gave keep it."""
    from trsp_ray import cli

    seen = []
    monkeypatch.setattr("trsp_ray.benchmark.cluster.run_benchmark_ray",
                        lambda cfg, rows, **kw: seen.append((cfg.stage1.refine, kw["cut"])))
    monkeypatch.setattr("trsp_ray.benchmark.comparison.run_benchmark",
                        lambda cfg, rows, **kw: seen.append((cfg.stage1.refine, kw["cut"])))
    monkeypatch.setattr("trsp_ray.run.workbench.check_single_plan", lambda cfg, methods: None)
    default = load_config(None, []).stage1.refine
    assert default > 0
    for argv, refine, cut in ((["benchmark"], 0, "TRSP's swap refinement (stage1.refine=0"),
                              (["benchmark", "--set", "stage1.refine=1"], 1, "CUT the rows"),
                              (["benchmark", "--rows", "trsp-no-stage2"], default, None),
                              (["benchmark", "--full"], default, None)):
        seen.clear()
        assert cli.main([*argv, "--no-mlflow"]) == 0
        assert seen[0][0] == refine, argv
        assert (cut in seen[0][1]) if cut else seen[0][1] == "", argv
        if refine:
            assert "refinement" not in seen[0][1], argv


def test_bar_plot_takes_a_mean_an_ulp_outside_its_range():
    """Three equal PPLs can average to a float just above their max; the plot must still draw."""
    from trsp_ray.common.plots import benchmark_bars

    v = 29.267000000000003
    cell = {"mean": v + 3.6e-15, "min": v, "max": v}
    summary = [{"row": "trsp", "group": "trained", GEO: cell, "left-out PPL": cell},
               {"row": "shortgpt", "group": "selection", GEO: {"mean": 50.0, "min": 49.0, "max": 51.0},
                "left-out PPL": {"mean": 90.0, "min": 80.0, "max": 95.0}}]
    fig = benchmark_bars(summary)
    assert len(fig.axes) == 2


def test_quality_vs_compute_plot_draws_each_row_across_budgets():
    from trsp_ray.common.plots import close, quality_vs_compute

    def cell(v):
        return {"mean": v, "min": v, "max": v, "spread": 0.0, "n": 1}

    summary = [{"row": "dense", "group": "dense", "total cost": 0.0, GEO: cell(17.0),
                "LAMBADA acc": cell(0.3)}]
    for budget, cost in ((1, 50_000.0), (4, 140_000.0)):
        summary += [{"row": "shortgpt+heal", "group": "trained", "total cost": cost,
                     GEO: cell(30.0 / budget), "LAMBADA acc": cell(0.1 * budget)},
                    {"row": "trsp-selection+heal", "group": "trained", "total cost": cost + 9e4,
                     GEO: cell(28.0 / budget), "LAMBADA acc": cell(0.05 * budget)}]
    fig = quality_vs_compute(summary)
    ppl, acc = fig.axes[:2]
    lines = {bars.get_label(): bars.lines[0] for bars in ppl.containers}  # each row drawn with its error bars
    lines |= {line.get_label(): line for line in ppl.get_lines() if line.get_label() == "dense"}
    assert list(lines["shortgpt+heal"].get_xdata()) == [50.0, 140.0]  # thousands of tokens, budget order
    assert list(lines["trsp-selection+heal"].get_ydata()) == [28.0, 7.0]
    assert lines["dense"].get_ydata()[0] == 17.0 and len(acc.containers) == 2
    close(fig)


def test_benchmark_tasks_request_a_gpu_when_the_device_is_one():
    from trsp_ray.benchmark.cluster import task_gpus

    assert task_gpus("cuda", 0) == 1 and task_gpus("auto", 2) == 1
    assert task_gpus("auto", 0) == 0 and task_gpus("cpu", 8) == 0


@pytest.mark.ray
def test_benchmark_task_sees_the_gpu_it_requested_on_a_cluster_with_gpus(private_ray, monkeypatch):
    """A local cluster started with a (fake) GPU: the runner's tasks request it, so Ray hands each
    task a GPU id (with CPUs alone the task would see none)."""
    import ray

    from trsp_ray.benchmark import cluster as dc

    private_ray(num_cpus=2, num_gpus=1)
    seen = []
    monkeypatch.setattr(dc, "_selection_task", lambda cfg, selector, seed, threads: {
        "gpus": ray.get_gpu_ids(), "seconds": 0.0})
    run = dc.RayRunner(1)
    job = type("J", (), {"kind": "selection", "name": "shortgpt", "seed": 0, "budget": 1})()
    run([job], cfg_dict={"device": "auto"}, export_dir=None, on_done=lambda j, out: seen.append(out), options={})
    assert seen and len(seen[0]["gpus"]) == 1


@pytest.mark.ray
def test_a_warmed_runner_s_workers_have_imported_torch_and_transformers_before_any_task(own_ray_tmpdir):
    """RayRunner.warm starts Ray with a worker setup hook, so the local workers import what every
    benchmark task imports first (transformers' generation code pulls torch._dynamo: seconds of CPU)
    while the driver still sets up MLflow; a worker of a plain Ray start has imported none of it."""
    import ray

    from trsp_ray.benchmark import cluster as dc

    def imported():
        import sys

        return ["transformers.generation.utils" in sys.modules, "trsp_ray.run.workbench" in sys.modules]

    runner = dc.RayRunner(1)
    runner.warm()
    try:
        assert runner.started and ray.get(ray.remote(num_cpus=1)(imported).remote()) == [True, True]
    finally:
        runner.close()
    assert not ray.is_initialized()  # close() stops what warm() started
    ray.init(address="local", num_cpus=1, include_dashboard=False)
    try:
        assert ray.get(ray.remote(num_cpus=1)(imported).remote()) == [False, False]
    finally:
        ray.shutdown()


def test_mlflow_sets_up_in_a_thread_while_the_runner_warms_on_the_main_thread(monkeypatch):
    """ray.init hung when called from a thread (its GCS client timed out), so the runner warms on the
    main thread and the tracker is made in another one, at the same time."""
    import threading
    import time

    from trsp_ray.benchmark import comparison
    from trsp_ray.run import tracking

    seen = {}

    def make_tracker(**kwargs):
        seen["tracker thread"] = threading.current_thread() is threading.main_thread()
        time.sleep(0.5)
        return "tracker"

    def warm():
        seen["warm thread"] = threading.current_thread() is threading.main_thread()
        time.sleep(0.5)

    monkeypatch.setattr(tracking, "make_tracker", make_tracker)
    t0 = time.monotonic()
    got = comparison._tracker_while_warming(load_config(None, []).tracking, warm)
    assert got == "tracker" and seen == {"tracker thread": False, "warm thread": True}
    assert time.monotonic() - t0 < 0.9  # side by side, not one after the other


def test_the_command_exits_with_main_s_status_after_the_atexit_handlers(tmp_path):
    """`trsp-ray` (cli.entry) skips the interpreter's module teardown but still runs every atexit
    handler, lets a non-daemon thread finish, flushes both streams and exits with main's status."""
    import subprocess
    import sys

    script = ("import atexit, sys, threading, time\n"
              "from trsp_ray import cli\n"
              "atexit.register(lambda: print('atexit ran', file=sys.stderr))\n"
              "def main():\n"
              "    threading.Thread(target=lambda: (time.sleep(0.3), print('thread done'))).start()\n"
              "    print('unflushed', end='')\n"
              "    return 3\n"
              "cli.main = main\n"
              "cli.entry()\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 3
    assert done.stdout == "unflushedthread done\n" and done.stderr.strip() == "atexit ran"


def test_the_dense_rows_scores_are_computed_once_and_cached(tiny_dir, tmp_path, monkeypatch):
    """Every seed's dense row and every row's ratio to dense read one computation per model: the
    per-window losses and LAMBADA's per-passage results are cached under the model and settings."""
    from trsp_ray.benchmark import jobs as comparison_jobs
    from trsp_ray.run.workbench import prepare

    monkeypatch.setenv("TRSP_RAY_CACHE", str(tmp_path / "cache"))
    calls = []
    monkeypatch.setattr(comparison_jobs, "lambada",
                        lambda bench, model, *, limit: calls.append(limit) or {"acc": 0.5, "items": [1, 0]})
    bench = prepare(_cfg(tiny_dir, "data.eval_domains=news,code"))
    assert comparison_jobs.dense_lambada(bench, limit=2) == comparison_jobs.dense_lambada(bench, limit=2)
    assert calls == [2]
    comparison_jobs.dense_lambada(bench, limit=3)  # another limit: another entry
    assert calls == [2, 3]
    first = comparison_jobs.dense_nlls(bench)
    assert set(first) == {"news", "code"} and len(first["news"]) == 3  # data.eval_max_windows=3
    monkeypatch.setattr(comparison_jobs, "domain_nlls", lambda *a, **k: pytest.fail("scored the dense model again"))
    assert comparison_jobs.dense_nlls(bench) == first


def test_the_anchor_rows_run_the_fit_and_recipe_their_names_spell(tiny_dir):
    """shortgpt+cos+heal fits the cosine map on the default's drop set; shortgpt+comp+heal.map trains
    only the folded maps and tail+heal.tail only lm_head + the last layers, so each scores another
    model than the full heal of the same drop set, with the same heal budget."""
    from trsp_ray.benchmark.jobs import row_job, selection_job

    cfg = _cfg(tiny_dir, "compensation.windows=16").to_dict()
    sel = {s: selection_job(cfg, s, 0) for s in ("shortgpt", "tail")}
    by = {r: row_job(cfg, r, 0, sel[r.split("+")[0]]) for r in
          ("shortgpt+comp+heal", "shortgpt+cos+heal", "shortgpt+comp+heal.map", "tail+heal", "tail+heal.tail")}
    assert by["shortgpt+cos+heal"]["info"]["compensation_objective"] == "cosine"
    assert by["shortgpt+comp+heal"]["info"]["compensation_objective"] == "mse"
    assert by["tail+heal.tail"]["drop"] == by["tail+heal"]["drop"] == sel["tail"]["drops"]["tail"]
    for a, b in (("shortgpt+cos+heal", "shortgpt+comp+heal"), ("shortgpt+comp+heal.map", "shortgpt+comp+heal"),
                 ("tail+heal.tail", "tail+heal")):
        assert by[a]["drop"] == by[b]["drop"]
        assert by[a]["nll"] != by[b]["nll"], (a, b)  # another model on the same windows
        assert by[a]["info"]["weight_tokens"] == by[b]["info"]["weight_tokens"] > 0


@pytest.mark.parametrize("row_name", ["shortgpt+heal.tail@full", "shortgpt+comp+heal.map@full"])
def test_full_compute_rows_heal_a_partial_recipe_to_a_full_heals_compute(row_name):
    """'@full': a partial heal of SmolLM2's ShortGPT set gets extra steps of its own, cheaper recipe
    until its recovery costs what a full heal of the same 20 steps costs (within one of its steps)."""
    from trsp_ray.benchmark.jobs import full_heal_steps, heal_steps, row_config
    from trsp_ray.plan import compute
    from trsp_ray.run.pipeline import named

    drop = [3, 12, 13, 14, 15, 16, 17, 25]
    row = registry.ROWS[row_name]
    cfg = row_config(load_config(None, ["data.batch_size=4", "data.seqlen=128", "stage2.steps=20"]), row)
    spec = named(cfg).spec
    assert spec.recipe in ("tail", "map") and row.full_compute and not row.is_default
    extra = full_heal_steps(cfg, row, spec=spec, drop=drop)
    own = compute.step_cost(cfg, spec=spec, drop=drop)
    full = compute.token_cost(cfg, spec=spec, drop=drop, trainable="all") * 4 * 128
    steps = heal_steps(row, cfg)
    assert steps == 20 and own < full
    assert extra > 0 and abs((steps + extra) * own - steps * full) <= own / 2 + 1e-6
    plain = registry.ROWS["shortgpt+heal"]  # a full heal row gets nothing extra
    plain_cfg = row_config(load_config(None, ["data.batch_size=4", "data.seqlen=128"]), plain)
    assert full_heal_steps(plain_cfg, plain, spec=named(plain_cfg).spec, drop=drop) == 0


def _budget_result(row, seed, budget, lambada, ppl=20.0):
    r = _result(row, seed, ppl, lambada=lambada)
    r["budget"] = budget
    return r


def test_retention_is_each_seeds_accuracy_as_a_percent_of_the_dense_rows():
    rows = registry.rows(["dense", "shortgpt+heal"])
    dense = [1, 1, 0, 1, 0, 1, 1, 0, 1, 0]  # 0.6
    results = [_result("dense", 0, 10.0, lambada=dense),
               _result("shortgpt+heal", 0, 20.0, lambada=[1, 0, 0, 1, 0, 0, 0, 0, 1, 0]),  # 0.3
               _result("shortgpt+heal", 1, 20.0, lambada=[1, 1, 0, 1, 0, 0, 0, 0, 1, 0])]  # 0.4
    by = {s["row"]: s for s in _summarize(results, rows)}
    kept = by["shortgpt+heal"]["LAMBADA % dense"]
    assert kept["mean"] == pytest.approx(100 * 0.35 / 0.6) and kept["min"] == pytest.approx(50.0)
    assert kept["max"] == pytest.approx(100 * 0.4 / 0.6) and by["dense"]["LAMBADA % dense"]["mean"] == 100.0
    # without a dense row in the run, the dense score is passed in (run_benchmark: the cached dense LAMBADA)
    alone = summarize(results[1:], registry.rows(["shortgpt+heal"]), dense_params=100, dense_nll=DENSE,
                      left_out=["prose"], dense_scores={"LAMBADA acc": 0.5})
    assert alone[0]["LAMBADA % dense"]["mean"] == pytest.approx(70.0)


def test_the_budget_curve_pairs_each_budget_with_the_rows_smallest_and_says_which_way_accuracy_goes():
    from trsp_ray.benchmark.report import budget_curve_table
    from trsp_ray.benchmark.stats import budget_curve

    rows = registry.rows(["shortgpt+heal", "shortgpt+comp+heal@kd"])
    n = 200
    base = [1 if i % 5 == 0 else 0 for i in range(n)]  # 0.20
    worse = [0 if i % 10 == 0 else b for i, b in enumerate(base)]  # 0.10: 20 passages lost, none gained
    better = [1 if i % 5 in (0, 1) else 0 for i in range(n)]  # 0.40
    results = []
    for seed in (0, 1):
        results += [_budget_result("shortgpt+heal", seed, 1, base), _budget_result("shortgpt+heal", seed, 4, worse),
                    _budget_result("shortgpt+comp+heal@kd", seed, 1, base),
                    _budget_result("shortgpt+comp+heal@kd", seed, 4, better)]
    curve = {(e["row"], e["budget"]): e for e in budget_curve(_summarize(results, rows))}
    assert curve[("shortgpt+heal", 4)]["accuracy trend"] == "falls"
    assert curve[("shortgpt+heal", 4)]["vs smallest"]["LAMBADA acc"]["diff"] == pytest.approx(-0.10)
    assert curve[("shortgpt+comp+heal@kd", 1)]["accuracy trend"] == "rises"
    assert curve[("shortgpt+comp+heal@kd", 1)]["vs smallest"] == {}  # the reference
    table = budget_curve_table(_summarize(results, rows))
    assert "worse -10.0±" in table and "better +20.0±" in table and "(reference)" in table
    # the same accuracy at both budgets is flat, not a rise
    flat = [_budget_result("shortgpt+heal", s, b, base) for s in (0, 1) for b in (1, 4)]
    assert {e["accuracy trend"] for e in budget_curve(_summarize(flat, rows[:1]))} == {"flat (within the noise)"}


def test_kd_rows_distil_with_the_steps_that_spend_the_ce_rows_training_compute():
    """'@kd': the teacher's forward makes each step dearer, so the row gets fewer steps, and its
    counted training compute equals the cross-entropy row's within one of its steps."""
    from trsp_ray.benchmark.jobs import heal_steps, objective_steps, row_config
    from trsp_ray.plan import compute
    from trsp_ray.run.pipeline import named

    drop = [3, 12, 13, 14, 15, 16, 17, 25]
    base = load_config(None, ["data.batch_size=4", "data.seqlen=128", "stage2.steps=20"])
    kd_row, ce_row = registry.ROWS["shortgpt+comp+heal@kd"], registry.ROWS["shortgpt+comp+heal"]
    kd_cfg, ce_cfg = row_config(base, kd_row), row_config(base, ce_row)
    assert kd_cfg.recovery.objective == "kd" and ce_cfg.recovery.objective == "ce" and not kd_row.is_default
    kd_step = compute.step_cost(kd_cfg, spec=named(kd_cfg).spec, drop=drop)
    ce_step = compute.step_cost(ce_cfg, spec=named(ce_cfg).spec, drop=drop)
    assert kd_step > ce_step  # the teacher is counted
    for budget in (1, 4, 16):
        steps = heal_steps(kd_row, kd_cfg, budget=budget) + objective_steps(kd_cfg, kd_row, spec=named(kd_cfg).spec,
                                                                            drop=drop, budget=budget)
        assert steps < 20 * budget and abs(steps * kd_step - 20 * budget * ce_step) <= kd_step / 2 + 1e-6
    assert objective_steps(ce_cfg, ce_row, spec=named(ce_cfg).spec, drop=drop) == 0


def test_retention_plot_draws_seed_ranges_as_error_bars():
    from trsp_ray.common.plots import close, retention_vs_compute

    def cell(lo, hi):
        return {"mean": (lo + hi) / 2, "min": lo, "max": hi, "spread": hi - lo, "n": 2, "se": 1.0}

    summary = [{"row": "dense", "group": "dense", "total cost": 0.0}]
    for budget, cost in ((1, 50_000.0), (4, 140_000.0)):
        summary.append({"row": "shortgpt+comp+heal", "group": "trained", "total cost": cost,
                        "LAMBADA % dense": cell(30.0 * budget ** 0.5, 34.0 * budget ** 0.5)})
    fig = retention_vs_compute(summary)
    ax = fig.axes[0]
    bars = [c for c in ax.containers if c.get_label() == "shortgpt+comp+heal"][0]
    line = bars.lines[0]
    assert list(line.get_xdata()) == [50.0, 140.0] and list(line.get_ydata()) == [32.0, 64.0]
    segments = bars.lines[2][0].get_segments()
    assert [round(s[1][1] - s[0][1], 6) for s in segments] == [4.0, 8.0]  # the seed range
    close(fig)
    assert retention_vs_compute([summary[0]]) is None


def test_leave_one_out_runs_each_domain_out_and_its_transfer_table_reads_their_left_out_columns(tiny_dir, capsys):
    """`--leave-one-out` on the tiny model with a two-domain mixture: one run per domain, each
    calibrated on the other (its left-out column is that domain), and the transfer table's
    'D x dense' is the run's held-out PPL of D over the dense model's, its worst the larger."""
    import math

    from trsp_ray.benchmark.comparison import leave_one_out
    from trsp_ray.benchmark.report import transfer_rows

    cfg = load_config(None, [*SMALL, "data.calib_mix=news:1,code:1", "data.eval_domains=news,code",
                             "compensation.windows=16"], base={"model": str(tiny_dir / "model"), "ratio": 0.25})
    names = ["dense", "shortgpt+heal@comp", "shortgpt+comp+heal"]
    per_domain = leave_one_out(cfg, names, lambada_limit=4)
    assert list(per_domain) == ["news", "code"]
    out = capsys.readouterr().out
    assert "Leave-one-out transfer" in out and "news x dense" in out and "worst x dense" in out
    entries = {e["row"]: e for e in transfer_rows(per_domain)}
    assert set(entries) == {"shortgpt+heal@comp", "shortgpt+comp+heal"}
    for left, summary in per_domain.items():
        by = {s["row"]: s for s in summary}
        assert "left-out PPL" in by["shortgpt+comp+heal"]  # the run scored a domain it never calibrated on
        left_ppl = by["shortgpt+comp+heal"]["left-out PPL"]["mean"]
        assert left_ppl == pytest.approx(by["shortgpt+comp+heal"][f"{left} PPL"]["mean"])
        for name, e in entries.items():
            ratio = by[name][f"{left} PPL"]["mean"] / by["dense"][f"{left} PPL"]["mean"]
            assert e["x dense"][left] == pytest.approx(ratio)
            assert math.isfinite(e["x dense"][left]) and e["x dense"][left] != 1.0
        assert "shortgpt+heal@comp" in by["shortgpt+comp+heal"]["default vs"]
    for e in entries.values():
        assert e["worst x dense"] == max(e["x dense"].values())
        assert e["worst domain"] in ("news", "code") and len(e["lambada"]) == 2


def test_a_rerun_reads_finished_rows_back_and_runs_only_what_is_new(tiny_dir, tmp_path, monkeypatch):
    """The row cache: a second run of the same config reads every row back (no job runs, the same
    figures); adding a heal budget runs only that budget's rows and the selection they need; a
    changed config recomputes."""
    from trsp_ray.benchmark import comparison

    monkeypatch.setenv("TRSP_RAY_CACHE", str(tmp_path / "cache"))
    ran = []

    def runner(jobs, **kwargs):
        ran.append([j.key for j in jobs])
        comparison.run_local(jobs, **kwargs)

    names = ["dense", "shortgpt+heal"]
    first = comparison.run_benchmark(_cfg(tiny_dir), names, runner=runner, cache=True, show=False)
    again = comparison.run_benchmark(_cfg(tiny_dir), names, runner=runner, cache=True, show=False)
    assert len(ran) == 1  # the second run ran nothing
    assert [s["geo-mean x dense"]["mean"] for s in again] == \
        [s["geo-mean x dense"]["mean"] for s in first]
    grown = comparison.run_benchmark(_cfg(tiny_dir), names, budgets=(1, 2), runner=runner, cache=True, show=False)
    assert ran[1] == ["selection:shortgpt:0:1", "row:shortgpt+heal:0:2"]  # only the new budget
    assert {(s["row"], s["budget"]) for s in grown} == {("dense", 1), ("shortgpt+heal", 1), ("shortgpt+heal", 2)}
    comparison.run_benchmark(_cfg(tiny_dir, "stage2.steps=2"), names, runner=runner, cache=True, show=False)
    assert len(ran[2]) == 3  # another config: every job again
    comparison.run_benchmark(_cfg(tiny_dir), names, runner=runner, show=False)  # the library default: no cache
    assert len(ran[3]) == 3


def test_at_a_total_compute_budget_every_trained_row_spends_it(tiny_dir):
    """--budgets 20k: the default, its distilled twin and the plain heal each heal with what the budget
    leaves after their own selection and fit, at their own step cost (a distillation step pays the
    teacher's forward), so each row's total lands within one step below the budget."""
    from trsp_ray.benchmark.comparison import run_benchmark
    from trsp_ray.config.budgets import budget_label

    names = ["dense", "shortgpt+heal", "shortgpt+comp+heal", "shortgpt+comp+heal@kd"]
    budget = 20_000
    summary = run_benchmark(_cfg(tiny_dir, "compensation.windows=16"), names, budgets=(budget,), show=False)
    by = {s["row"]: s for s in summary}
    steps = {}
    for name in names[1:]:
        s = by[name]
        step = s["train cost"] / s["heal steps"]
        assert budget - step < s["total cost"] <= budget, name
        steps[name] = s["heal steps"]
    assert steps["shortgpt+comp+heal@kd"] < steps["shortgpt+comp+heal"] <= steps["shortgpt+heal"]
    assert budget_label(budget) == "20k" and budget_label(1_000_000) == "1M" and budget_label(4) == "x4"
