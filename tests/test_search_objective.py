"""The search's keys and objective (issue 41 item 3): a searched calibration mixture gets its own
selection, stage 1 and fit; every trial is scored on the same validation windows (the base config's
mixture's tail), which no trial trains on; the report compares each trial with the best by a paired SE
over those windows (clustered by document where windows carry one), a tie within 2 SE; `seeds` runs
every point on several seeds."""

import json
import math
from pathlib import Path

import pytest
import torch

from trsp_ray.common.errors import TrspError
from trsp_ray.config import registry
from trsp_ray.config.run_config import load_config
from trsp_ray.search.space import parse_space

SMALL = ["data.seqlen=32", "data.batch_size=2", "data.eval_seqlen=64", "data.eval_max_windows=2",
         "stage1.first_round_steps=2", "stage1.steps_per_round=1", "stage1.refine=0", "stage1.probe=0", "threads=1"]


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    """The tiny workspace with its calibration text cut into two file sources."""
    from trsp_ray.models.tiny import tiny_workspace

    root = tiny_workspace(tmp_path_factory.mktemp("objective"), layers=8, calib_chars=60000, eval_chars=8000)
    text = (root / "calib.txt").read_text()
    (root / "a.txt").write_text(text[: len(text) // 2])
    (root / "b.txt").write_text(text[len(text) // 2:])
    return root


def _mixes(root: Path) -> tuple[str, str]:
    return f"{root / 'a.txt'}:1,{root / 'b.txt'}:1", f"{root / 'a.txt'}:1"


def _base(root: Path, method: str, *extra):
    return load_config(overrides=[f"model={root / 'model'}", f"data.calib_mix={_mixes(root)[0]}",
                                  f"data.eval_text={root / 'eval.txt'}", f"method={method}", *SMALL, *extra])


def _two(root: Path, method: str) -> tuple[dict, dict]:
    """Two trial configs that differ only in data.calib_mix."""
    from trsp_ray.search.space import apply_point

    base = _base(root, method).to_dict()
    return base, apply_point(base, {"data.calib_mix": _mixes(root)[1]})


def test_a_searched_mixture_gets_its_own_selection_stage1_and_fit_keys(assets):
    from trsp_ray.run.stage1_store import stage1_key
    from trsp_ray.search.pipeline import fit_key, selection_key, trial_stage1_key

    a, b = _two(assets, "shortgpt+comp+heal")
    sa = selection_key(a, "fp", spec=registry.method(a["method"]), num_layers=8)
    sb = selection_key(b, "fp", spec=registry.method(b["method"]), num_layers=8)
    assert sa != sb
    assert fit_key(a, selection=sa, drop=[3, 4]) != fit_key(b, selection=sb, drop=[3, 4])
    a, b = _two(assets, "trsp+comp+heal")
    assert stage1_key(a, "fp") != stage1_key(b, "fp")
    ta, tb = trial_stage1_key(a, "fp", n_drop=2), trial_stage1_key(b, "fp", n_drop=2)
    assert ta != tb and fit_key(a, selection=ta, drop=[3, 4]) != fit_key(b, selection=tb, drop=[3, 4])


def test_a_mixture_file_rewritten_changes_the_keys(assets, tmp_path):
    """The mixture enters by its text, not only its spelling: the same spec over other bytes is other work."""
    from trsp_ray.search.pipeline import selection_key

    (tmp_path / "c.txt").write_text((assets / "a.txt").read_text())
    base = _base(assets, "shortgpt+heal", f"data.calib_mix={tmp_path / 'c.txt'}:1").to_dict()
    before = selection_key(base, "fp", spec=registry.method(base["method"]), num_layers=8)
    (tmp_path / "c.txt").write_text((assets / "b.txt").read_text())
    assert selection_key(base, "fp", spec=registry.method(base["method"]), num_layers=8) != before


def test_a_domain_enters_the_keys_by_its_text(assets, monkeypatch):
    """A domain's source files changed (another package version): the same mixture spec is other work."""
    from trsp_ray.data import domains
    from trsp_ray.search.pipeline import selection_key

    base = _base(assets, "shortgpt+heal", "data.calib_mix=news:1").to_dict()
    monkeypatch.setattr(domains, "text_key", lambda name: "old")
    before = selection_key(base, "fp", spec=registry.method(base["method"]), num_layers=8)
    monkeypatch.setattr(domains, "text_key", lambda name: "new")
    assert selection_key(base, "fp", spec=registry.method(base["method"]), num_layers=8) != before


def test_a_searched_mixture_names_its_files_by_absolute_paths(assets, monkeypatch):
    """Tune runs a trial in its own working directory: a relative file in a searched mixture would not
    be found there (nor fingerprinted the same)."""
    monkeypatch.chdir(assets)
    (dim,) = parse_space({"params": {"data.calib_mix": ["a.txt:1,news:1", "b.txt:1"]}}).dims
    assert dim.values == (f"{assets / 'a.txt'}:0.5,news:0.5", f"{assets / 'b.txt'}:1")  # domains.absolute_mix


def test_the_search_plans_one_stage1_per_mixture(assets):
    from trsp_ray.search.run import plan_trials

    mixes = list(_mixes(assets))
    plan = plan_trials(_base(assets, "trsp+heal"), parse_space({"params": {"data.calib_mix": mixes}}))
    assert len(plan.points) == 2 and len(plan.n_drop) == 2


def test_a_key_that_changes_work_but_not_its_key_is_refused(assets, monkeypatch):
    """The safety net: a searched setting read before the heal that no selection / stage-1 / fit key
    holds is refused in one line before any trial (here the key is made to forget data.batch_size)."""
    from trsp_ray.run import content
    from trsp_ray.search.run import plan_trials

    base = _base(assets, "trsp+heal")
    space = parse_space({"params": {"data.batch_size": [2, 4]}})
    assert len(plan_trials(base, space).n_drop) == 2
    monkeypatch.setattr(content, "CALIBRATION_DATA", ("calib_text", "calib_mix", "seqlen"))
    with pytest.raises(TrspError, match="'data.batch_size' changes .* but no selection, stage-1 or fit key") as info:
        plan_trials(base, space)
    assert "\n" not in str(info.value)


def test_the_objective_settings_are_not_a_trial_dimension(assets):
    """Every trial is scored on the base config's validation windows, so data.eval_seqlen changes no trial."""
    from trsp_ray.search.run import plan_trials

    with pytest.raises(TrspError, match="'data.eval_seqlen' changes nothing"):
        plan_trials(_base(assets, "tail+heal"), parse_space({"params": {"data.eval_seqlen": [32, 64]}}))


def _independent_nll(model_dir: str, val_ids: torch.Tensor, *, windows: int, seqlen: int) -> float:
    """Mean NLL of an export over the first `windows` windows of `val_ids`, with plain transformers."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from trsp_ray.data.perplexity import bos_token

    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    bos = bos_token(AutoTokenizer.from_pretrained(model_dir))
    body = seqlen - (bos is not None)
    nlls = []
    with torch.no_grad():
        for w in range(windows):
            ids = val_ids[w * body:(w + 1) * body]
            ids = torch.cat([torch.tensor([bos]), ids]) if bos is not None else ids
            logits = model(input_ids=ids[None]).logits[0].float()
            nlls.append(torch.nn.functional.cross_entropy(logits[:-1], ids[1:]).item())
    return sum(nlls) / len(nlls)


def _trial_config(search_dir: Path, run: dict, point: dict) -> dict:
    """A trial's Tune config as run_search builds it (the search's fingerprint left to the trial)."""
    return {"run": run, "point": point, "search_dir": str(search_dir), "invocation": "test", "reuse": True,
            "plan_n_drop": {}, "default_plan_n_drop": 0, "val_every": None, "val_windows": 2, "threads": 1,
            "num_layers": 8}


def test_every_trial_is_scored_on_the_base_mixtures_validation_windows(assets, tmp_path):
    """Two trials that calibrate on different mixtures report the NLL of their own export on the same
    windows: the base mixture's tail, recomputed here with plain transformers."""
    from transformers import AutoTokenizer

    from trsp_ray.data import calibration
    from trsp_ray.data.perplexity import bos_token
    from trsp_ray.search.trial import _execute

    base = _base(assets, "tail+heal", "heal.steps=2").to_dict()
    records = [_execute(_trial_config(tmp_path / "search", base, point), report=lambda m: None)
               for point in ({}, {"data.calib_mix": _mixes(assets)[1]})]
    tok = AutoTokenizer.from_pretrained(assets / "model")
    val_ids = calibration.load(tok, calib_text=None, calib_mix=_mixes(assets)[0], seqlen=32, bos=bos_token(tok)).val_ids
    # windows of one chunk of the tail (data.seqlen 32): each one source's text (issue 49)
    nlls = [_independent_nll(r["model_dir"], val_ids, windows=r["objective"]["windows"], seqlen=32) for r in records]
    assert [r["val_loss"] for r in records] == pytest.approx(nlls, rel=1e-4)
    for record, nll in zip(records, nlls):
        windows = record["objective"]["windows"]
        assert windows == val_ids.numel() // (32 - (bos_token(tok) is not None))  # every window of the tail
        assert len(record["val_docs"]) == windows
        assert len(record["val_nlls"]) == windows and sum(record["val_nlls"]) / windows == pytest.approx(nll, rel=1e-4)
    assert records[0]["objective"]["text"] == records[1]["objective"]["text"]


def test_no_trial_trains_on_the_validation_windows():
    """A trial whose stream draws a source past the base's validation cut (another mixture, another
    window length) would train on the base's tail: the chunks holding a run of NGRAM tokens of it leave
    its training stream (and only those), wherever in the chunk the run starts."""
    from trsp_ray.data.calibration import NGRAM, Calibration, without_text

    gen = torch.Generator().manual_seed(0)
    text = torch.randint(0, 1000, (300,), generator=gen)  # the validation text
    chunk = 31
    rows = torch.randint(1000, 2000, (20, chunk), generator=gen)  # other text
    rows[3, 5:] = text[50:76]  # 26 tokens of it, not aligned with its windows
    rows[7, :NGRAM] = text[200:200 + NGRAM]  # exactly one run
    rows[12, 10:10 + NGRAM - 1] = text[0:NGRAM - 1]  # one token short of a run: kept
    strata = torch.arange(20) % 3
    cal = Calibration(ids=rows.reshape(-1), val_ids=text[:62], strata=strata, chunk=chunk, source="t", shares={})
    kept = without_text(cal, text)
    left = [r for r in range(20) if r not in (3, 7)]
    assert kept.ids.equal(rows[left].reshape(-1)) and kept.strata.equal(strata[left])
    assert without_text(cal, text[:40]) is cal  # nothing shared: the stream as it was
    with pytest.raises(TrspError, match="every calibration window"):
        without_text(Calibration(ids=text[:62], val_ids=text[:31], strata=None, chunk=chunk, source="t", shares={}),
                     text)


def test_paired_se_clusters_windows_of_one_document():
    from trsp_ray.common.paired import paired_se

    # windows of one document share a shift: 4 documents x 4 windows
    shift = [0.3, -0.2, 0.25, -0.3]
    a = [1.0 + 0.01 * (w % 3) for w in range(16)]
    b = [x - 0.05 - shift[w // 4] - 0.002 * (w % 2) for w, x in enumerate(a)]
    diff, se = paired_se(a, b)
    _, clustered = paired_se(a, b, clusters=[w // 4 for w in range(16)])
    d = [x - y for x, y in zip(a, b)]
    mean = sum(d) / 16
    assert diff == pytest.approx(mean)
    assert se == pytest.approx(math.sqrt(sum((x - mean) ** 2 for x in d) / 15 / 16))
    sums = [sum(d[4 * g:4 * g + 4]) - 4 * mean for g in range(4)]
    assert clustered == pytest.approx(math.sqrt(4 / 3 * sum(s * s for s in sums)) / 16)
    assert clustered > 1.5 * se


def _record(key: str, nlls: list[float], *, seed: int = 0, lr: float = 1e-4, drop=(3, 4)) -> dict:
    mean = sum(nlls) / len(nlls)
    return {"trial_key": key, "status": "finished", "point": {"heal.lr": lr}, "method": "tail+heal",
            "config": {"seed": seed, "heal": {"lr": lr}}, "drop": list(drop), "val_loss": mean,
            "val_ppl": math.exp(mean), "val_nlls": nlls, "objective": {"text": "t", "windows": len(nlls)}}


def test_the_tie_call_uses_the_paired_se():
    """Windows vary far more than the trials differ on them: unpaired, every gap is a tie; paired, a
    consistent 0.02-nat gap is not, and a gap that changes sign window by window is."""
    from trsp_ray.search.objective import ranking

    windows = [2.0, 3.5, 1.2, 4.0, 2.7, 3.1, 1.8, 2.2]
    best = _record("best", windows)
    worse = _record("worse", [x + 0.02 + 0.001 * (i % 2) for i, x in enumerate(windows)], lr=2e-4)
    noisy = _record("noisy", [x + (0.3 if i % 2 else -0.28) for i, x in enumerate(windows)], lr=3e-4)
    rows = {r["trials"][0]: r for r in ranking([noisy, worse, best])}
    assert rows["best"]["best"] and rows["best"]["diff"] == 0.0
    w = rows["worse"]
    d = [0.02 + 0.001 * (i % 2) for i in range(8)]
    mean = sum(d) / 8
    assert w["diff"] == pytest.approx(mean)
    assert w["se"] == pytest.approx(math.sqrt(sum((x - mean) ** 2 for x in d) / 7 / 8))
    assert not w["tie"]  # unpaired, the windows' spread (~0.9 nats) would call it a tie
    n = rows["noisy"]
    assert n["diff"] == pytest.approx(0.01) and n["tie"] and abs(n["diff"]) <= 2 * n["se"]


def test_seeds_average_a_point_and_report_its_spread():
    from trsp_ray.search.objective import ranking

    windows = [2.0, 3.5, 1.2, 4.0]
    recs = [_record("a0", windows, seed=0), _record("a1", [x + 0.1 for x in windows], seed=1),
            _record("b0", [x + 0.3 for x in windows], seed=0, lr=2e-4),
            _record("b1", [x + 0.25 for x in windows], seed=1, lr=2e-4)]
    rows = ranking(recs)
    assert [r["trials"] for r in rows] == [["a0", "a1"], ["b0", "b1"]]
    a, b = rows
    assert a["val_loss"] == pytest.approx(sum(windows) / 4 + 0.05) and a["seeds"] == 2
    assert a["spread"] == pytest.approx(0.1) and b["spread"] == pytest.approx(0.05)
    # paired over windows (a constant gap here: 0) and over seeds (per-seed gaps 0.3, 0.15)
    assert b["diff"] == pytest.approx(0.225) and b["se"] == pytest.approx(math.sqrt(0.15 ** 2 / 2 / 2))
    assert not b["tie"]
    closer = ranking(recs[:3] + [_record("b1", [x - 0.05 for x in windows], seed=1, lr=2e-4)])[1]
    assert closer["diff"] == pytest.approx(0.075) and closer["tie"]  # per-seed gaps 0.3, -0.15


def test_seeds_expand_every_point_and_refuse_a_searched_seed(assets):
    from trsp_ray.search.run import plan_trials

    base = _base(assets, "tail+heal")
    plan = plan_trials(base, parse_space({"seeds": 2, "params": {"heal.steps": [1, 2]}}))
    assert plan.points == [{"heal.steps": 1, "seed": 0}, {"heal.steps": 1, "seed": 1},
                           {"heal.steps": 2, "seed": 0}, {"heal.steps": 2, "seed": 1}]
    assert len(plan.ignored) == 4
    with pytest.raises(TrspError, match="seeds"):
        plan_trials(base, parse_space({"seeds": 2, "params": {"seed": [0, 1]}}))


def test_the_search_summary_ranks_trials_with_paired_ses(tmp_path):
    """`_finish` (what every search ends with) writes the ranking and names the trials tied with the best."""
    from trsp_ray.search import run
    from trsp_ray.search.cache import RunLog
    from trsp_ray.search.layout import trial_record_path

    windows = [2.0, 3.5, 1.2, 4.0, 2.7, 3.1]
    recs = [_record("best", windows), _record("tied", [x + (0.2 if i % 2 else -0.19) for i, x in enumerate(windows)],
                                            lr=2e-4)]
    for r in recs:
        trial_record_path(tmp_path, r["trial_key"]).parent.mkdir(parents=True, exist_ok=True)
        trial_record_path(tmp_path, r["trial_key"]).write_text(json.dumps(r))
    base = load_config(overrides=["tracking.enabled=false"])
    space = parse_space({"params": {"heal.lr": [1e-4, 2e-4]}})
    summary = run._finish(base, space, run.SearchOptions(search_dir=str(tmp_path)), tmp_path,
                          RunLog(tmp_path, invocation="x"), [], "x", lambda msg: None)
    assert summary["best_trial"] == "best" and summary["tied_with_best"] == ["tied"]
    saved = json.loads((tmp_path / "ranking.json").read_text())
    assert [r["trials"] for r in saved] == [["best"], ["tied"]] and saved[1]["tie"]


def test_the_cli_takes_seeds_and_refuses_a_mixture_key_it_cannot_hold_in_one_line(assets, tmp_path, capsys,
                                                                                   monkeypatch):
    """`trsp-ray search --seeds 2` reaches the space; a dimension refused before any trial exits 2 with one line."""
    import argparse

    from trsp_ray import cli
    from trsp_ray.search import run
    from trsp_ray.search.cli import register, search_config

    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    argv = ["search", "--model", str(assets / "model"), "--method", "tail+heal", "--seeds", "2",
            "--space", "heal.steps=1,2", "--search-dir", str(tmp_path / "s")]
    assert search_config(parser.parse_args(argv))[1].seeds == 2
    monkeypatch.setattr(run.ray_session, "connect", lambda *a, **k: pytest.fail("Ray started"))
    code = cli.main(["search", "--model", str(assets / "model"), "--method", "tail+heal", "--calib-text",
                     str(assets / "calib.txt"), "--space", "data.eval_seqlen=32,64",
                     "--search-dir", str(tmp_path / "s")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "'data.eval_seqlen' changes nothing" in err[0]


def _smollm2_tokenizer():
    from transformers import AutoTokenizer

    from trsp_ray.data.assets import smollm2_dir

    return AutoTokenizer.from_pretrained(smollm2_dir())


def test_each_search_validation_window_is_one_sources_text_and_names_its_document():
    """Issue 49: a 256-token validation window joined two 128-token chunks of different domains and no
    record said which documents it held. Now a window is one chunk of the base's tail (one source),
    and val_docs names the document of each, so the tie band can cluster."""
    from trsp_ray.config.run_config import load_config
    from trsp_ray.data import domains
    from trsp_ray.data.perplexity import bos_token, windows
    from trsp_ray.run.workbench import calibration_of
    from trsp_ray.search.objective import validation_seqlen

    tok = _smollm2_tokenizer()
    bos = bos_token(tok)
    cal = calibration_of(load_config(None, []), tok, bos=bos)
    wins = windows(cal.val_ids, validation_seqlen(cal, bos), None, bos=bos)
    assert wins.shape[0] == len(cal.val_docs) == cal.val_ids.numel() // cal.chunk
    sources = [d.split("#")[0] for d in cal.val_docs]
    assert set(sources) == set(domains.parse_mix(domains.DEFAULT_MIX))
    for k in range(0, wins.shape[0], 3):
        source, index = cal.val_docs[k].split("#")
        doc = "".join(domains.split_texts(source)[0][int(index)].split())
        middle = "".join(tok.decode(wins[k][1 + cal.chunk // 2: 1 + cal.chunk // 2 + 6]).split())
        assert middle in doc, (k, cal.val_docs[k])
        # no validation document is a training document of the heal stream's sources
        assert int(index) >= len(cal.parts[source].starts)


def test_a_trials_training_text_loses_the_base_validation_text_on_every_route():
    """Issue 49: only the single-device trial removed the base's validation text; the Ray Train
    workers read their calibration through workbench.calibration_of, which now removes it (from the
    mixture and from the heal's sources) for any run whose data.validation_base names another
    calibration."""
    import json

    from trsp_ray.config.run_config import load_config, replace
    from trsp_ray.data.calibration import NGRAM, _hashes
    from trsp_ray.data.perplexity import bos_token
    from trsp_ray.run.workbench import calibration_of, validation_base

    tok = _smollm2_tokenizer()
    bos = bos_token(tok)
    base_cfg = load_config(None, [])
    base = calibration_of(base_cfg, tok, bos=bos)
    seen = _hashes(base.val_ids, NGRAM)

    def shared(cal) -> tuple[int, int]:
        mixture = int(torch.isin(_hashes(cal.ids, NGRAM), seen).sum())
        return mixture, sum(int(torch.isin(_hashes(p.ids, NGRAM), seen).sum()) for p in cal.parts.values())

    trial = load_config(None, ["data.seqlen=64"])  # another window length: another validation cut
    before = calibration_of(trial, tok, bos=bos)
    assert shared(before)[1] > 0  # the trial's heal sources hold the base's validation text
    mark = {"data.validation_base": json.dumps(validation_base(base_cfg))}  # what a search trial sets
    marked = replace(trial, **mark)
    after = calibration_of(marked, tok, bos=bos)
    assert shared(after) == (0, 0)
    assert after.left_out == (before.ids.numel() - after.ids.numel()) // after.chunk
    own = replace(base_cfg, **mark)
    assert calibration_of(own, tok, bos=bos).ids.equal(base.ids)  # its own tail: nothing to remove
