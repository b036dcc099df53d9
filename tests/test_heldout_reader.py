"""Issue 49: one reader of held-out windows. `trsp-ray eval` scored other windows than `prune` (48
without BOS where `prune` read 16 with it: 45.41 beside 38.84 on the same SmolLM2 export); a user's
--eval-text was one document, so every such run printed "TOO FEW held-out documents"; a window cap
with short leading documents raised a raw ValueError."""

import pytest
from test_perplexity_bos import _bos_workspace, _text, bos_tokenizer

from trsp_ray.common.errors import TrspError
from trsp_ray.data import domains, heldout


def _documents(n: int, words: int, seed: int = 2) -> list[str]:
    return [_text(words, seed=seed + k) for k in range(n)]


def test_eval_prints_the_held_out_ppl_prune_printed(tmp_path):
    """A BOS model (tiny random Gemma-3 + a tokenizer that adds BOS, where the difference is largest)
    pruned by `prune` with its default held-out windows, then scored by `eval`'s defaults."""
    from trsp_ray.config.run_config import load_config
    from trsp_ray.driver import run
    from trsp_ray.evaluation.evaluator import EvalSettings, Evaluator

    root = _bos_workspace(tmp_path)
    (root / "eval.txt").write_text("\n\n".join(_documents(20, 300)))
    cfg = load_config(overrides=[f"model={root / 'model'}", f"data.calib_text={root / 'calib.txt'}",
                                 f"data.eval_text={root / 'eval.txt'}", "method=shortgpt", "ratio=0.34",
                                 "data.seqlen=16", "baselines.calib_windows=2", "tracking.enabled=false",
                                 "threads=1", f"output={tmp_path / 'out'}"])
    results = run(cfg)
    settings = EvalSettings(tasks=(), speed=None, eval_text=str(root / "eval.txt"))
    out = Evaluator(settings.to_dict(), threads=1).evaluate(results["output"])
    assert out["ppl"] == pytest.approx(results["heldout_ppl"], rel=1e-6)
    held = results["heldout_windows"]
    assert (held["windows"], held["seqlen"], held["bos"]) == (16, 256, 1)
    assert held["clusters"] == 16 and not held["too_few"]  # the file's 20 documents, one window each
    assert out["heldout_windows"] == held and out["manifest"]["metrics"]["heldout_windows"] == held


def test_eval_says_when_prune_scored_other_windows():
    from trsp_ray.evaluation.evaluator import other_windows

    ours = {"source": "eval.txt", "seqlen": 256, "windows": 16, "bos": 1}
    assert other_windows(None, ours) == "" and other_windows({"metrics": {}}, ours) == ""
    assert other_windows({"metrics": {"heldout_windows": dict(ours)}}, ours) == ""
    note = other_windows({"metrics": {"heldout_windows": {**ours, "windows": 48, "bos": None}}}, ours)
    assert "windows 48" in note and "bos None" in note and "not comparable" in note


def test_an_eval_text_file_is_read_as_its_blank_line_separated_documents(tmp_path):
    path = tmp_path / "eval.txt"
    path.write_text("\n\n".join(_documents(12, 40)) + "\n")
    texts = domains.load_texts(str(path))
    assert len(texts.documents) == 12 and texts.heldout == "\n\n".join(_documents(12, 40))
    w = heldout.text_windows(bos_tokenizer(), texts, seqlen=32, max_windows=8)
    assert w.held_out == 12 and w.clusters == 8 and not w.too_few() and "TOO FEW" not in w.describe()
    assert w.windows[:, 0].tolist() == [1] * 8  # BOS first: the tokenizer adds one
    path.write_text(" ".join(_documents(12, 40)))  # no blank line: one document, and the run says how to mark more
    single = heldout.text_windows(bos_tokenizer(), domains.load_texts(str(path)), seqlen=32, max_windows=8)
    assert single.clusters == 1 and "TOO FEW" in single.describe() and "blank lines" in single.describe()


def test_a_window_cap_with_short_leading_documents_reads_on(tmp_path):
    docs = ["w1 w2"] * 40 + _documents(3, 100)  # the first 4 x cap documents hold less than one window
    w = heldout.document_windows(bos_tokenizer(), docs, seqlen=32, max_windows=2)
    assert w.windows.shape == (2, 32) and w.held_out == 43
    with pytest.raises(TrspError) as err:  # the whole text is shorter than one window: one line, not a ValueError
        heldout.document_windows(bos_tokenizer(), ["w1 w2"] * 5, seqlen=32, max_windows=2)
    assert "data.eval_seqlen=32" in str(err.value) and "\n" not in str(err.value)
