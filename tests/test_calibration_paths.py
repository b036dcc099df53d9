"""A user's calibration file reaches every path that reads calibration data (issue 31): the
selection, the fold's fit and the heal of a tiny model see its tokens and nothing else; without it,
the same paths read the domain mixture."""

import pytest
import torch

from trsp_ray.config import registry
from trsp_ray.config.run_config import load_config

SMALL = ["data.seqlen=32", "data.batch_size=2", "data.eval_seqlen=64", "data.eval_max_windows=2",
         "stage2.steps=2", "threads=1", "tracking.enabled=false", "compensation.windows=16"]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    from trsp_ray.models.tiny import tiny_workspace

    root = tiny_workspace(tmp_path_factory.mktemp("tiny"), layers=6, calib_chars=2000, eval_chars=8000)
    # a text of few distinct words: every token id it has is known, and Wikipedia has many more
    (root / "mine.txt").write_text(" ".join(["zebra apple river", "moon zebra", "apple moon river"] * 400))
    return root


def _embedding_inputs(monkeypatch) -> set:
    seen: set = set()
    forward = torch.nn.Embedding.forward

    def spy(self, ids):
        seen.update(ids.flatten().tolist())
        return forward(self, ids)

    monkeypatch.setattr(torch.nn.Embedding, "forward", spy)
    return seen


def test_a_calibration_file_is_all_that_selection_fold_and_heal_see(tiny_dir, monkeypatch):
    from trsp_ray.data.perplexity import encode
    from trsp_ray.run.methods import apply_method
    from trsp_ray.run.pipeline import resolve
    from trsp_ray.run.workbench import prepare

    cfg = resolve(load_config(None, SMALL, base={
        "model": str(tiny_dir / "model"), "ratio": 0.34, "method": "shortgpt+comp+heal",
        "data": {"calib_text": str(tiny_dir / "mine.txt"), "eval_text": str(tiny_dir / "eval.txt")}})).cfg
    bench = prepare(cfg)
    allowed = set(encode(bench.tokenizer, (tiny_dir / "mine.txt").read_text()).tolist())
    assert bench.calibration.source == str(tiny_dir / "mine.txt") and bench.calib_strata is None
    seen = _embedding_inputs(monkeypatch)
    out = apply_method(bench, registry.method(cfg.method))
    assert out.info.get("compensation_tokens", 0) > 0 and cfg.stage2.steps > 0  # the fold and the heal ran
    assert seen and seen <= allowed, sorted(seen - allowed)[:10]

    # the same paths on the default mixture read other tokens (so the check above can fail)
    mixed = resolve(load_config(None, SMALL, base={"model": str(tiny_dir / "model"), "ratio": 0.34,
                                                         "method": "shortgpt+comp+heal"})).cfg
    seen.clear()
    apply_method(prepare(mixed), registry.method(mixed.method))
    assert len(seen - allowed) > 100
