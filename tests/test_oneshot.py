"""The one-shot ablation (`trsp-oneshot`) drops the first n of the round-1 ranking on every path that
picks a TRSP drop set from a stage-1 result: one process (run/methods.select, which the driver, the
reproduction and a benchmark row go through), the benchmark's selection job, a search trial, and the
hand-over to Ray Train workers. The iterative methods drop the greedy order's prefix."""

import dataclasses

import pytest

from trsp_ray.config import registry
from trsp_ray.config.run_config import load_config, replace
from trsp_ray.method.stage1 import Stage1Result

SMALL = ["data.seqlen=32", "data.batch_size=2", "data.eval_seqlen=64", "data.eval_max_windows=3",
         "stage1.first_round_steps=3", "stage1.steps_per_round=2", "stage2.steps=2", "threads=1",
         "tracking.enabled=false"]
N_DROP = 4  # ratio 0.5 of 8 layers; candidates 1..6


def _by_hand() -> Stage1Result:
    """A stage-1 result whose two rankings disagree on every prefix: the round-1 ranking's first four
    are {1, 2, 3, 6}, the greedy order's {5, 4, 2, 1}."""
    return Stage1Result(drop_order=[5, 4, 2, 1, 3, 6], round1_ranking=[6, 3, 1, 2, 4, 5])


def _expected(method: str, result: Stage1Result, n_drop: int = N_DROP) -> list[int]:
    return (result.round1_ranking if method == "trsp-oneshot" else result.drop_order)[:n_drop]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    from trsp_ray.models.tiny import tiny_workspace

    return tiny_workspace(tmp_path_factory.mktemp("oneshot"), layers=8, calib_chars=30000, eval_chars=8000)


def _cfg(root, method="trsp-oneshot", *extra):
    return load_config(None, [*SMALL, *extra], base={
        "model": str(root / "model"), "ratio": 0.5, "method": method,
        "data": {"calib_text": str(root / "calib.txt"), "eval_text": str(root / "eval.txt")}})


@pytest.fixture(scope="module")
def bench(tiny_dir):
    from trsp_ray.run.workbench import prepare

    return prepare(_cfg(tiny_dir))


def test_drop_for_takes_a_ranking_and_refuses_a_method_name():
    from trsp_ray.method.stage1 import RANKINGS

    result = _by_hand()
    assert result.drop_for("round1", 3) == [6, 3, 1]
    assert result.drop_for("order", 3) == [5, 4, 2]
    # a method name where a ranking belongs is how trsp-oneshot silently ran the iterative order
    for wrong in ("trsp-oneshot", "trsp", "oneshot", ""):
        with pytest.raises(ValueError, match="ranking"):
            result.drop_for(wrong, 3)
    # every TRSP method's registry entry names a ranking drop_for knows, and only one-shot's is round1
    assert {m.name: m.ranking for m in registry.METHODS.values() if m.uses_stage1 and m.ranking != "order"} \
        == {"trsp-oneshot": "round1"}
    assert all(m.ranking in RANKINGS for m in registry.METHODS.values())


@pytest.mark.parametrize("method", registry.TRSP_METHODS)
def test_one_process_select_takes_each_methods_ranking(bench, method):
    from trsp_ray.run.methods import select

    result = _by_hand()
    drop, info = select(bench, registry.method(method), model=None, gates=None, stage1=result)
    assert bench.n_drop() == N_DROP
    assert drop == _expected(method, result)
    if method == "trsp-oneshot":
        assert sorted(drop) == [1, 2, 3, 6] and drop != result.drop_order[:N_DROP]


def test_one_process_oneshot_on_a_real_stage1_run(bench, monkeypatch):
    """select runs stage 1 itself (stage1=None, as `trsp-ray prune --method trsp-oneshot` does): the
    drop set is the round-1 prefix of the run it made, which on this seed is not the greedy order."""
    from trsp_ray.method.gates import attach_gates
    from trsp_ray.run import methods

    made = []
    real = methods.run_stage1_for

    def spy(*args, **kwargs):
        made.append(real(*args, **kwargs))
        return made[-1]

    monkeypatch.setattr(methods, "run_stage1_for", spy)
    model = bench.fresh_model()
    drop, _ = methods.select(bench, registry.method("trsp-oneshot"), model=model,
                             gates=attach_gates(model, gate_mode="delta"))
    (result,) = made
    assert drop == result.round1_ranking[:N_DROP]
    assert set(drop) != set(result.drop_order[:N_DROP]), "this seed no longer separates the two rankings"


def test_benchmark_selection_job_drops_by_each_methods_ranking(tiny_dir, monkeypatch):
    from trsp_ray.benchmark.jobs import selection_job
    from trsp_ray.run import methods

    result = _by_hand()
    monkeypatch.setattr(methods, "run_stage1_for", lambda bench, **kw: result)
    out = selection_job(_cfg(tiny_dir).to_dict(), registry.TRSP_SELECTOR, seed=0)
    assert set(out["drops"]) == set(registry.TRSP_METHODS)
    assert out["drops"] == {m: _expected(m, result) for m in registry.TRSP_METHODS}
    assert out["drops"]["trsp-oneshot"] != out["drops"]["trsp"]


def test_search_trial_selection_takes_the_round1_prefix(bench, tmp_path, monkeypatch):
    from trsp_ray.search import trial

    result = _by_hand()
    monkeypatch.setattr(trial, "stage1_for_trial", lambda **kw: result)
    config = {"search_dir": str(tmp_path), "reuse": False}
    for method in registry.TRSP_METHODS:
        b = dataclasses.replace(bench, cfg=replace(bench.cfg, method=method))
        drop, _, s1 = trial._selection(b, b.cfg.to_dict(), config, spec=registry.method(method), key="k",
                                       log=lambda *a, **k: None, trial="t")
        assert s1 is result and drop == _expected(method, result)


def test_hand_over_to_workers_expects_the_round1_prefix(monkeypatch):
    """The drop set the workers take from a handed-over stage 1 (worker.py, stage1_store.handed_over_drop)
    and the one the hand-over checks their export against (handoff.py) are the method's ranking's prefix."""
    from types import SimpleNamespace

    from trsp_ray.distributed import handoff, train
    from trsp_ray.run.stage1_store import handed_over_drop, result_dict

    result = _by_hand()
    stage1 = result_dict(result)
    for method in registry.TRSP_METHODS:
        cfg = SimpleNamespace(method=method)
        want = _expected(method, result)
        workers = lambda cfg, want=want, **kw: SimpleNamespace(drop_order=list(want))  # noqa: E731
        monkeypatch.setattr(train, "run_distributed", workers)
        _, shared = handoff.run_stage2_distributed(cfg, stage1=stage1, n_drop=N_DROP, name="t")
        assert shared, method
    assert {m: handed_over_drop(stage1, ranking=registry.method(m).ranking, n_drop=N_DROP)
            for m in registry.TRSP_METHODS} \
        == {m: _expected(m, result) for m in registry.TRSP_METHODS}
