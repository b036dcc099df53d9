"""The stage-1 store's keys (issue 19): a refined drop order is served to its own n_drop only (swap
refinement breaks the prefix rule), and a hub model is keyed by its revision as well as its id."""

import json

import pytest

from trsp_ray.method.stage1 import Stage1Result
from trsp_ray.run.content import model_fingerprint
from trsp_ray.run.stage1_store import Stage1Store, prefix_serves

REFINED = {"stage1": {"selection": "iterative", "probe": 4, "refine": 2}}
GREEDY = {"stage1": {"selection": "iterative", "probe": 4, "refine": 0}}


def _result(order):
    return Stage1Result(drop_order=list(order), round1_ranking=sorted(order))


def test_prefix_rule_holds_only_without_refinement():
    assert not prefix_serves(REFINED) and not prefix_serves({"config": REFINED})  # the reproduction's content
    assert prefix_serves(GREEDY)
    assert prefix_serves({"stage1": {"selection": "oneshot", "probe": 4, "refine": 2}})
    assert prefix_serves({"stage1": {"selection": "iterative", "probe": 1, "refine": 2}})  # no probes: no refinement


def test_a_refined_result_serves_its_own_n_drop_only(tmp_path):
    store = Stage1Store(tmp_path)
    # refinement swapped layer 9 in at position 0: the 2-layer greedy set would be [3, 5], not [9, 5]
    store.put("k", _result([9, 5, 7, 2]), content=REFINED)
    assert store.get("k", 4).drop_order == [9, 5, 7, 2]
    assert store.get("k", 2) is None and store.get("k", 3) is None
    computed = []

    def compute(n):
        computed.append(n)
        return _result([3, 5][:n])

    result, fresh = store.obtain("k", need=2, plan=4, compute=compute, content=REFINED)
    assert fresh and computed == [2] and result.drop_order == [3, 5]  # its own stage 1, not the plan's 4
    again, fresh = store.obtain("k", need=2, plan=4, compute=compute, content=REFINED)
    assert not fresh and again.drop_order == [3, 5] and computed == [2]
    assert store.get("k", 4).drop_order == [9, 5, 7, 2]  # both kept
    assert sorted(p.name for p in tmp_path.glob("*.json")) == ["k.n2.json", "k.n4.json"]
    assert json.loads((tmp_path / "k.n2.json").read_text())["content"] == REFINED


def test_a_greedy_result_still_serves_every_smaller_ratio(tmp_path):
    store = Stage1Store(tmp_path)
    computed = []

    def compute(n):
        computed.append(n)
        return _result([3, 5, 7, 2][:n])

    result, fresh = store.obtain("k", need=2, plan=4, compute=compute, content=GREEDY)
    assert fresh and computed == [4] and result.drop_order == [3, 5, 7, 2]
    assert store.get("k", 3).drop_order[:3] == [3, 5, 7] and store.get("k", 5) is None
    assert [p.name for p in tmp_path.glob("*.json")] == ["k.json"]


def _snapshot(hf_home, repo_id: str, commit: str) -> None:
    """A Hugging Face cache entry as `hf download` leaves it: refs/main -> snapshots/<commit>/."""
    repo = hf_home / "hub" / f"models--{repo_id.replace('/', '--')}"
    (repo / "snapshots" / commit).mkdir(parents=True)
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / "main").write_text(commit)
    (repo / "snapshots" / commit / "config.json").write_text(json.dumps({"model_type": "llama"}))


def test_a_hub_model_is_keyed_by_its_revision(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    old, new = "a" * 40, "b" * 40
    _snapshot(tmp_path / "hf", "org/model", old)
    first = model_fingerprint("org/model")
    assert first == f"hub:org/model@{old}"
    _snapshot(tmp_path / "hf", "org/model", new)  # `hf download` of a new revision moves refs/main
    assert model_fingerprint("org/model") == f"hub:org/model@{new}" != first


@pytest.mark.parametrize("content", [REFINED, GREEDY])
def test_put_then_get_round_trips_the_refinement_cost(tmp_path, content):
    store = Stage1Store(tmp_path)
    result = _result([1, 2])
    result.refine_calls, result.refine_cost = 7, 7 * 256
    store.put("k", result, content=content)
    back = store.get("k", 2)
    assert (back.refine_calls, back.refine_cost) == (7, 7 * 256)
