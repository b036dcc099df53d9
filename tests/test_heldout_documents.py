"""Issue 41, item 1: held-out perplexity is scored on windows spread over documents, and paired SEs
are clustered on documents. Before, every wiki figure came from the first 8-16 windows of one
article ("Alabama", 19,678 tokens) and windows of one document were counted as independent."""

import math
import random
from types import SimpleNamespace

import pytest
import torch

from trsp_ray.benchmark import stats
from trsp_ray.common.paired import paired_se
from trsp_ray.data import heldout


def _one_document_effect(docs: int = 4, per_doc: int = 4, seed: int = 0):
    """Row a and row b on docs x per_doc windows: b is a plus a per-document offset (large) plus a
    per-window noise (small), the way two models differ on texts of different kinds."""
    rng = random.Random(seed)
    a, b, clusters = [], [], []
    for d in range(docs):
        offset = rng.gauss(0.0, 0.3)
        for _ in range(per_doc):
            x = rng.uniform(2.0, 4.0)
            a.append(x)
            b.append(x + offset + rng.gauss(0.0, 0.02))
            clusters.append(f"doc{d}")
    return a, b, clusters


def test_the_clustered_se_of_windows_of_one_document_is_larger_than_the_unclustered_one():
    a, b, clusters = _one_document_effect()
    mean, plain = paired_se(a, b)
    mean_c, clustered = paired_se(a, b, clusters)
    assert mean_c == pytest.approx(mean)
    assert clustered > 1.5 * plain, (clustered, plain)
    # the cluster-robust formula, by hand: sum the deviations per document, then across documents
    d = [x - y for x, y in zip(a, b)]
    sums = [sum(d[i] - mean for i in range(k * 4, k * 4 + 4)) for k in range(4)]
    assert clustered == pytest.approx(math.sqrt(4 / 3 * sum(s * s for s in sums)) / len(d))
    # one window per document: the clustered SE is the plain one
    assert paired_se(a, b, list(range(len(a))))[1] == pytest.approx(plain)
    # one document: nothing can be decided
    assert paired_se(a, b, ["one"] * len(a))[1] == math.inf


def test_a_verdict_that_is_a_win_by_windows_is_a_tie_by_documents():
    a, b, clusters = _one_document_effect(docs=3, per_doc=8, seed=3)
    runs_a, runs_b = {0: {"wiki": a}}, {0: {"wiki": b}}
    unclustered = stats.paired(runs_a, runs_b)
    clustered = stats.paired(runs_a, runs_b, {"wiki": clusters})
    assert clustered["diff"] == pytest.approx(unclustered["diff"])
    assert clustered["se"] > 2 * unclustered["se"]
    assert stats.verdict(unclustered, higher_is_better=False) != "tie"
    assert stats.verdict(clustered, higher_is_better=False) == "tie"


def test_windows_start_at_documents_and_short_documents_share_one():
    # documents of 300, 40, 50, 200, 700 and 20 tokens; token value = its document's index
    lengths = [300, 40, 50, 200, 700, 20]
    ids = torch.cat([torch.full((n,), d) for d, n in enumerate(lengths)])
    starts = [sum(lengths[:d]) for d in range(len(lengths))]
    w = heldout.spread(ids, starts, seqlen=100, max_windows=4, bos=None)
    # units: [0] (300), [1, 2, 3] (290), [4] (700), [5] (20: no window); round 0 first
    assert [row[0].item() for row in w.windows] == [0, 1, 4, 0]
    assert w.docs == (0, 1, 4, 0) and w.clusters == 3 and w.too_few()
    assert w.windows[1].tolist() == [1] * 40 + [2] * 50 + [3] * 10  # joined until the window fills
    assert w.documents == 5 and w.held_out == 6 and w.tokens == 400
    w2 = heldout.spread(ids, starts, seqlen=100, max_windows=3, bos=7)  # BOS first, then 99 text tokens
    assert w2.docs == (0, 1, 4) and not w2.too_few() and w2.windows[:, 0].tolist() == [7, 7, 7]
    assert w2.windows[2, 1:].tolist() == [4] * 99


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    from trsp_ray.data.assets import smollm2_dir

    return AutoTokenizer.from_pretrained(smollm2_dir())


@pytest.mark.parametrize("max_windows", [8, 16])
def test_the_wiki_columns_windows_span_one_held_out_article_each(tokenizer, max_windows):
    from trsp_ray.benchmark.jobs import domain_coverage
    from trsp_ray.config.run_config import load_config
    from trsp_ray.data import domains

    cfg = load_config(None, [f"data.eval_max_windows={max_windows}", "data.eval_domains=wiki"])
    bench = SimpleNamespace(cfg=cfg, tokenizer=tokenizer, bos=None)
    cov = domain_coverage(bench)["wiki"]
    assert cov["documents"] >= 8 and cov["clusters"] == max_windows and len(set(cov["docs"])) == max_windows
    assert cov["tokens"] == max_windows * 256 and cov["held_out"] == len(domains.split_texts("wiki")[1])
    # each window is the start of another held-out article
    held = domains.split_texts("wiki")[1]
    w = heldout.domain_windows(tokenizer, "wiki", seqlen=256, max_windows=max_windows)
    for row, d in zip(w.windows, w.docs):
        assert held[d].startswith(tokenizer.decode(row[:20]))


def test_prunes_held_out_figure_spans_the_held_out_articles(tokenizer):
    from trsp_ray.data import domains

    texts = domains.load_texts(None)
    w = heldout.text_windows(tokenizer, texts, seqlen=256, max_windows=8)
    assert w.clusters == 8 and w.documents == 8
    one_file = domains.TextSplit(heldout=texts.documents[0], heldout_source="file", documents=(texts.documents[0],))
    single = heldout.text_windows(tokenizer, one_file, seqlen=256, max_windows=8)
    assert single.clusters == 1 and single.too_few()  # a file is one document: its windows say so
    assert "TOO FEW" in single.describe()


def _run(row: str, nll: dict, docs: dict) -> dict:
    cov = {d: {"windows": len(v), "documents": len(set(v)), "clusters": len(set(v)), "held_out": 20,
               "tokens": 256 * len(v), "too_few": len(set(v)) < len(v), "docs": v} for d, v in docs.items()}
    return {"row": row, "seed": 0, "budget": 1, "drop": [1], "params": 10, "info": {}, "seconds": 1.0,
            "nll": nll, "ppl": {d: math.exp(sum(v) / len(v)) for d, v in nll.items()}, "coverage": cov}


def test_the_report_prints_each_columns_documents_and_flags_too_few():
    from trsp_ray.benchmark.report import column_coverage
    from trsp_ray.config import registry

    a, b, clusters = _one_document_effect(docs=2, per_doc=8)
    wiki_docs = list(range(16))
    rows = [registry.ROWS["shortgpt+heal"], registry.ROWS["shortgpt+comp+heal"]]
    results = [_run("shortgpt+heal", {"wiki": a, "code": a}, {"wiki": wiki_docs, "code": clusters}),
               _run("shortgpt+comp+heal", {"wiki": b, "code": b}, {"wiki": wiki_docs, "code": clusters})]
    summary = stats.summarize(results, rows, dense_params=20, dense_nll={"wiki": a, "code": a}, left_out=["code"])
    cols = stats.columns(["wiki", "code"], ["code"])
    cov = {c["column"]: c for c in column_coverage(summary, cols, lambada_limit=100)}
    assert cov["wiki PPL"]["documents"] == 16 and cov["wiki PPL"]["tokens"] == 16 * 256
    assert cov["left-out PPL"]["documents"] == 2 and "TOO FEW" in cov["left-out PPL"]["note"]
    assert cov[stats.GEO]["documents"] == 18 and cov["LAMBADA acc"]["documents"] == 100
    # the code column's SE is clustered on its two documents, wiki's on sixteen
    verdicts = summary[1]["default vs"]["shortgpt+heal"]
    assert verdicts[stats.LEFT_OUT]["se"] > 2 * paired_se(b, a)[1]
    assert verdicts["wiki PPL"]["se"] == pytest.approx(paired_se(b, a)[1])
