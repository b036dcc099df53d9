"""The product's default calibration and the benchmark's left-out runs (issue 42), on the real domain
texts and SmolLM2's tokenizer: the default mixture includes narrative prose and holds its stated
shares within one window; each leave-one-out run calibrates on the other domains and never on a
window of the one it leaves out, checked against that domain's own documents (not against the
mixture's labels, which the run itself writes)."""

import collections

import pytest

from trsp_ray.config.run_config import load_config
from trsp_ray.data import calibration, domains
from trsp_ray.data.perplexity import bos_token

SEQLEN = 128  # data.seqlen's default


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    from trsp_ray.data.assets import smollm2_dir

    return AutoTokenizer.from_pretrained(smollm2_dir())


def _load(tokenizer, mix):
    return calibration.load(tokenizer, calib_text=None, calib_mix=mix, seqlen=SEQLEN, bos=bos_token(tokenizer))


def test_the_default_mixture_includes_prose_and_holds_its_shares_within_one_window(tokenizer):
    stated = domains.parse_mix(domains.DEFAULT_MIX)
    assert set(stated) == set(domains.DOMAIN_NAMES)  # nothing the product calibrates on is left out
    assert stated["prose"] == max(stated.values())  # narrative prose has the largest share
    assert load_config(None, []).data.calib_mix == domains.DEFAULT_MIX  # what `prune` reads by default
    cal = _load(tokenizer, domains.DEFAULT_MIX)
    names = list(stated)
    counts = collections.Counter()
    for k, source in enumerate(cal.strata.tolist(), start=1):  # every prefix of the training stream
        counts[names[source]] += 1
        for name, share in stated.items():
            assert abs(counts[name] - share * k) <= 1, (k, name, dict(counts))
    assert cal.shares == pytest.approx(stated, abs=1 / len(cal.strata) + 1e-9)
    assert cal.ids.numel() // cal.chunk >= 20 * 16 * 4  # a x16 heal budget's windows are distinct


def _windows_text(tokenizer, cal) -> list[str]:
    ids = list(cal.ids.view(-1, cal.chunk)) + list(cal.val_ids.view(-1, cal.chunk))
    return [tokenizer.decode(w.tolist()) for w in ids]


def _found_in(snippet: str, texts: dict[str, str]) -> set[str]:
    return {name for name, text in texts.items() if snippet in text}


def test_each_left_out_run_never_sees_a_window_of_its_left_out_domain(tokenizer):
    """Every training and validation window of each leave-one-out run is located in the domains'
    documents (a stretch from its middle, decoded, searched in each domain's calibration and held-out
    documents): none lies in the left-out domain's, and the run's other domains are all there. The
    same search finds the left-out domain's windows in the full mixture, so it can fail."""
    from trsp_ray.benchmark.comparison import leave_one_out_configs

    texts = {name: "\n\n".join(part for part in domains.texts(name)) for name in domains.DOMAIN_NAMES}
    runs = leave_one_out_configs(load_config(None, []))
    assert [name for name, _ in runs] == list(domains.parse_mix(domains.DEFAULT_MIX))
    full = _windows_text(tokenizer, _load(tokenizer, domains.DEFAULT_MIX))
    for left, cfg in runs:
        assert left not in domains.parse_mix(cfg.data.calib_mix)
        seen = collections.Counter()
        for text in _windows_text(tokenizer, _load(tokenizer, cfg.data.calib_mix))[::3]:
            middle = text[len(text) // 3: len(text) // 3 + 60]
            if len(middle.strip()) < 40:
                continue
            where = _found_in(middle, texts)
            assert left not in where, (left, middle)
            seen.update(where)
        assert set(seen) == set(domains.DOMAIN_NAMES) - {left}, (left, dict(seen))
        # the positive control: the full mixture's windows include the left-out domain's documents
        assert any(left in _found_in(t[len(t) // 3: len(t) // 3 + 60], {left: texts[left]}) for t in full[::7])


def test_the_benchmark_table_leaves_out_one_domain_of_the_products_mixture_not_of_its_default():
    from trsp_ray.cli import build_parser
    from trsp_ray.common.errors import TrspError

    assert domains.without(domains.DEFAULT_MIX, "prose") == "wiki:0.285714,news:0.285714,code:0.214286,math:0.214286"
    assert domains.BENCHMARK_LEFT_OUT in domains.parse_mix(domains.DEFAULT_MIX)
    args = build_parser().parse_args(["benchmark", "--leave-one-out", "--left-out", "wiki"])
    with pytest.raises(TrspError, match="--leave-one-out"):
        args.func(args)
    with pytest.raises(TrspError, match="'fiction'.*wiki, news, code, math, prose"):
        domains.without(domains.DEFAULT_MIX, "fiction")
    with pytest.raises(TrspError, match="leaves nothing"):
        domains.without("wiki:1", "wiki")
