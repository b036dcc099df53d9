"""The heal stream (data/stream.py): every calibration document, never a held-out or validation one,
each source at its weight until it reaches its pass limit, the same prefix whatever length is asked."""

from __future__ import annotations

import collections
import math

import pytest
import torch

from trsp_ray.common.errors import TrspError
from trsp_ray.data.calibration import SourceText
from trsp_ray.data.stream import HealStream


def _source(name: str, docs: int, length: int, base: int) -> SourceText:
    ids = torch.cat([torch.full((length,), base + d) for d in range(docs)])  # a token names its document
    return SourceText(name=name, ids=ids, starts=[d * length for d in range(docs)])


def test_each_source_at_its_weight_until_it_reaches_its_pass_limit_then_the_others_share_it():
    sources = {"big": _source("big", 100, 40, 0), "small": _source("small", 4, 40, 1000)}  # 100 and 4 windows of 40
    stream = HealStream(sources, {"big": 0.5, "small": 0.5}, seqlen=40, batch_size=2, bos=None, seed=0, max_passes=2)
    assert stream.capacity == 2 * 100 + 2 * 4
    first = [stream.take(k).source for k in range(8)]
    assert collections.Counter(first) == {0: 4, 1: 4}  # half and half while the small source lasts
    assert stream.passes(40) == {"big": pytest.approx(0.32), "small": pytest.approx(2.0)}  # capped at 2 passes
    # each pass over the small source reads each of its windows once, in a new order
    small = [stream.take(k).window for k in range(40) if stream.take(k).source == 1]
    assert sorted(small[:4]) == sorted(small[4:]) == [0, 1, 2, 3] and small[:4] != small[4:]
    with pytest.raises(TrspError) as err:
        stream.check(209)
    assert "needs 209 windows of 40 tokens" in str(err.value) and "gives 208 at heal.max_passes=2" in str(err.value)
    assert "\n" not in str(err.value)
    stream.check(208)


def test_the_first_windows_are_the_same_whatever_length_a_heal_asks_for():
    sources = {"a": _source("a", 30, 50, 0), "b": _source("b", 9, 50, 1000)}
    long = HealStream(sources, {"a": 0.7, "b": 0.3}, seqlen=51, batch_size=3, bos=7, seed=5)
    short = HealStream(sources, {"a": 0.7, "b": 0.3}, seqlen=51, batch_size=3, bos=7, seed=5)
    long.check(100)
    batches = [short.next() for _ in range(10)]
    assert torch.equal(torch.cat(batches), torch.stack([long.window(k) for k in range(30)]))
    assert all(int(w[0]) == 7 for w in torch.cat(batches))  # BOS first, then 50 text tokens
    other = HealStream(sources, {"a": 0.7, "b": 0.3}, seqlen=51, batch_size=3, bos=7, seed=6)
    assert not torch.equal(torch.stack([other.window(k) for k in range(30)]), torch.cat(batches))
    assert other.key() != long.key() and short.key() == long.key()


def test_a_window_names_the_documents_it_was_cut_from():
    sources = {"a": SourceText(name="a", ids=torch.cat([torch.full((n,), d) for d, n in enumerate((30, 50, 10, 70))]),
                               starts=[0, 30, 80, 90])}
    stream = HealStream(sources, {"a": 1.0}, seqlen=40, batch_size=1, bos=None, seed=0)
    for k in range(stream.counts[0]):
        name, docs = stream.documents(k)
        assert name == "a" and set(stream.window(k).tolist()) == set(docs)


def test_no_heal_batch_of_a_large_budget_holds_a_held_out_or_validation_document():
    """The default mixture streamed for a 1M-token budget's heal: every window's documents are
    calibration documents of its source, by content id, and the window's text is theirs."""
    from transformers import AutoTokenizer

    from trsp_ray.config.run_config import load_config
    from trsp_ray.data import domains
    from trsp_ray.data.assets import smollm2_dir
    from trsp_ray.data.calibration import document_ids
    from trsp_ray.data.perplexity import bos_token
    from trsp_ray.run.workbench import calibration_of, heal_stream

    tok = AutoTokenizer.from_pretrained(smollm2_dir())
    cfg = load_config(None, ["heal.compute_budget=1000000"])
    cal = calibration_of(cfg, tok, bos=bos_token(tok))
    stream = heal_stream(cfg, cal, bos=bos_token(tok), seed_offset=2)
    assert stream.seqlen == 512 and stream.batch_size == 2 * cfg.data.batch_size
    windows = 2000  # ~1M trained tokens of 512
    held = {s: {c for c in map(_key, domains.split_texts(s)[1])} for s in cal.parts}
    trained_docs = collections.defaultdict(set)
    for k in range(windows):
        source, docs = stream.documents(k)
        ids = document_ids(source)
        trained_docs[source] |= {ids[i] for i in docs}
        if k % 97 == 0:  # the window's text lies in the documents it names
            text = "".join("".join(domains.split_texts(source)[0][i].split()) for i in docs)
            assert "".join(tok.decode(stream.window(k)[1:12]).split()) in text
    for source, docs in trained_docs.items():
        assert not docs & held[source], source
        # validation documents (cal.val_ids) come after the training cut: none of them is trained on
        n_train = len(cal.parts[source].starts)
        assert docs <= set(document_ids(source)[:n_train])
        assert n_train < len(document_ids(source))
    passes = stream.passes(windows)
    assert max(passes.values()) <= cfg.heal.max_passes and min(passes.values()) > 0
    assert passes["code"] > passes["math"]  # the small source is read more often, within its limit


def _key(doc: str) -> str:
    from trsp_ray.common.digest import content_key

    return content_key(doc.strip())


@pytest.mark.parametrize("budget, expect", [(0, (256, 4)), (70_000, (256, 4)), (300_000, (512, 4)),
                                            (1_000_000, (512, 8)), (20e6, (1024, 16))])
def test_the_heals_windows_grow_with_the_budget(budget, expect):
    from trsp_ray.config.run_config import load_config
    from trsp_ray.plan.compute import heal_schedule, heal_shape

    cfg = load_config(None, [f"heal.compute_budget={budget}", "data.seqlen=256", "data.batch_size=4"])
    assert heal_shape(cfg) == expect
    assert heal_schedule(cfg.heal) == ("cosine" if budget >= 200_000 else "constant")
    fixed = load_config(None, [f"heal.compute_budget={budget}", "heal.seqlen=300", "heal.batch_size=3"])
    assert heal_shape(fixed) == (300, 3)


def test_the_cosine_schedule_warms_up_then_decays_to_its_floor():
    from trsp_ray.method.heal import FLOOR, lr_factor

    steps = 100
    f = [lr_factor("cosine", s, steps) for s in range(1, steps + 1)]
    assert f[:5] == pytest.approx([0.2, 0.4, 0.6, 0.8, 1.0])
    assert all(a >= b for a, b in zip(f[4:], f[5:]))
    assert f[-1] == pytest.approx(FLOOR) and f[52] == pytest.approx(FLOOR + (1 - FLOOR) * 0.5 * (1 + math.cos(
        math.pi * 48 / 95)))
    assert lr_factor("constant", 7, steps) == 1.0
