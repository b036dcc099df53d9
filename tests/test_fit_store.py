"""Issue 32 item 4: a search's trials share fits as they share selections. A stored least-squares fit,
replayed into another trial's model, gives that model exactly the weights computing the fit gives it,
on a family whose fold writes a bias (OPT) and one whose fold writes a norm's diagonal (Gemma 2)."""

import pytest
import torch

from trsp_ray.config import registry
from trsp_ray.config.run_config import load_config
from trsp_ray.models.tiny import tiny_workspace
from trsp_ray.run.methods import apply_method
from trsp_ray.run.workbench import prepare


@pytest.mark.parametrize("family", ["llama", "opt", "gemma2"])
def test_a_stored_fit_replays_the_computed_fold_exactly(tmp_path, family):
    root = tiny_workspace(tmp_path / "ws", layers=6, calib_chars=20000, eval_chars=6000, family=family)
    if family == "opt":  # zero biases would stay zero under the fold: a store that lost them would pass
        from transformers import AutoModelForCausalLM

        from trsp_ray.models.tiny import with_random_biases

        with_random_biases(AutoModelForCausalLM.from_pretrained(root / "model")).save_pretrained(root / "model")
    cfg = load_config(overrides=[f"model={root / 'model'}", f"data.calib_text={root / 'calib.txt'}",
                                 f"data.eval_text={root / 'eval.txt'}", "data.seqlen=32", "ratio=0.34", "threads=1",
                                 "tracking.enabled=false", "method=shortgpt+comp", "compensation.windows=16"])
    bench = prepare(cfg)
    store: dict = {}
    computed = []

    def fit_store(compute, apply):
        if "fit" in store:
            apply(store["fit"][1])
            return store["fit"]
        computed.append(1)
        store["fit"] = compute()
        return store["fit"]

    drop = [2, 4]  # two blocks: two folds
    comp = registry.method("shortgpt+comp")
    first = apply_method(bench, comp, drop=drop, fit_store=fit_store)
    again = apply_method(bench, comp, drop=drop, fit_store=fit_store)
    plain = apply_method(bench, registry.method("shortgpt"), drop=drop)  # the same cut, no fit
    assert computed == [1] and again.info["compensation_tokens"] == first.info["compensation_tokens"] == 16 * 32
    info, weights = store["fit"]
    assert [tuple(b) for b in info["blocks"]] == [(2, 2), (4, 4)]
    a, b, c = (dict(o.model.named_parameters()) for o in (first, again, plain))
    for name in a:
        assert torch.equal(a[name], b[name]), name  # the replayed fit is the computed one, bit for bit
    changed = sorted(n for n in a if not torch.equal(a[n], c[n]))
    assert changed == sorted(weights)  # the store holds exactly what the fold wrote, nothing else
    if family == "opt":
        assert any(n.endswith("bias") for n in changed)
    if family == "gemma2":
        assert all("post_feedforward_layernorm" in n for n in changed)


def test_trials_that_differ_only_in_their_heal_share_one_fit(tmp_path):
    """search/pipeline.fit_key ignores the heal and keeps every fit setting; fit_for_trial computes a
    key's fit once, under its lock, and replays it for the next trial, each logged."""
    import json

    from trsp_ray.run.stage1_store import Stage1Store
    from trsp_ray.search.cache import RunLog, fit_for_trial
    from trsp_ray.search.pipeline import fit_key

    def key(*overrides, drop=(3, 4)):
        cfg = load_config(overrides=["method=shortgpt+comp+heal", "compensation.windows=64", *overrides])
        return fit_key(cfg.to_dict(), selection="sel", drop=list(drop))

    assert key() == key("stage2.lr=3e-4") == key("heal.trainable=tail", "method=shortgpt+comp+heal.tail")
    assert len({key(), key("compensation.ridge=0.1"), key("method=shortgpt+cos+heal"), key(drop=(2, 4)),
                key("compensation.windows=32"), key("data.seqlen=64")}) == 6

    store, log = Stage1Store(tmp_path / "store"), RunLog(tmp_path, invocation="t")
    calls, applied = [], []
    weights = {"w": torch.arange(4.0)}
    compute = lambda: calls.append(1) or ({"blocks": [(3, 4)], "tokens": 64}, weights)
    for trial in ("a", "b"):
        info, got = fit_for_trial(store=store, key=key(), log=log, trial=trial)(compute, applied.append)
        assert info["tokens"] == 64 and torch.equal(got["w"], weights["w"])
    assert calls == [1] and len(applied) == 1 and torch.equal(applied[0]["w"], weights["w"])
    events = [json.loads(line)["event"] for line in (tmp_path / "events.jsonl").read_text().splitlines()]
    assert events == ["fit_computed", "fit_reused"]
    assert fit_for_trial(store=None, key=key(), log=log, trial="c") is None  # --no-reuse: every trial fits
