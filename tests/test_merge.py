"""Merge instead of drop (trsp_ray/method/merge.py, merge_blocks.py, merge_select.py): a block merged with
a silent block is the other block; the flattened attention is both blocks' attention on one input; the
merged model keeps every count of heads and channels, exports as a stock model and generates; the
closed-form refits beat plain dropping of heads and channels on held-out tokens; every family merges or refuses
in one line; pairs are chosen greedily among candidates."""

import copy

import pytest
import torch

from trsp_ray.common.errors import TrspError
from trsp_ray.method.gates import attach_gates
from trsp_ray.method.merge import columns, merge_pairs, refit_sums, scores, solve_refit
from trsp_ray.method.merge_blocks import flatten, module_at
from trsp_ray.method.merge_costs import merge_cost
from trsp_ray.method.merge_select import choose_pairs, merge_select, pair_starts, select_cost
from trsp_ray.method.surgery import remove_layers
from trsp_ray.models import families
from trsp_ray.models.tiny import tiny_config, tiny_model, with_random_biases

MERGING = ["llama", "mistral", "qwen2", "phi3", "opt", "gpt_neox"]  # qwen2: with one attention type throughout


def _ids(seed, batch=4, length=40):
    # longer than the tiny sliding window (16), so a windowed attention really differs from a full one
    return torch.randint(3, 256, (batch, length), generator=torch.Generator().manual_seed(seed))


def _windows(n=8, seed=0):
    return [_ids(seed + k) for k in range(n)]


def _model(family, *, layers=6, seed=0, tied=False):
    """A tiny model with random biases and random norm scales and shifts (at init they are 1 and 0, where
    a fold that forgot them would still look exact); Qwen2 with full attention in every layer."""
    from transformers import AutoModelForCausalLM

    config = tiny_config(family, layers=layers)
    if family == "qwen2":
        config.layer_types = ["full_attention"] * layers
    if tied:
        config.tie_word_embeddings = True
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).to(torch.float32).eval()
    with_random_biases(model)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(p + 0.3 * torch.randn(p.shape, generator=gen))
    return model


def _silence(model, index):
    """Zero what decoder layer `index` writes to the residual stream (its output projections and biases)."""
    family, layer = families.family_of(model), families.decoder_layers(model)[index]
    with torch.no_grad():
        for path in (family.attn_out_path, family.mlp_out_path):
            linear = module_at(layer, path)
            linear.weight.zero_()
            if linear.bias is not None:
                linear.bias.zero_()


def _logits(model, ids):
    with torch.no_grad():
        return model(ids).logits


@pytest.mark.parametrize("family", MERGING)
def test_a_block_merged_with_a_silent_block_is_the_block(family):
    model = _model(family)
    _silence(model, 3)
    removed = copy.deepcopy(model)
    remove_layers(removed, [3])
    # the energy choice: units="loss" scores each unit set by the next-token loss on calibration windows, where
    # a refitted mix of both blocks' units may score below the exact block by chance (merge_choice.py)
    info = merge_pairs(model=model, firsts=[2], windows=_windows(), units="energy")
    ids = _ids(99)
    assert torch.allclose(_logits(model, ids), _logits(removed, ids), atol=1e-5, rtol=0)
    pair = info["per_pair"][0]
    assert pair["units_from"][1] == 0 and pair["channels_from"][1] == 0  # nothing of the silent block kept
    assert max(pair[f"{k}_error_{e}"] for k in ("attn", "mlp") for e in ("drop", "refit")) < 1e-10


@pytest.mark.parametrize("family", MERGING)
def test_the_wide_attention_is_both_blocks_attention_on_one_input(family):
    model = _model(family)
    family_row, layers = families.family_of(model), families.decoder_layers(model)
    ids, got = _ids(7), {}

    def keep(key):
        return lambda _m, _i, out: got.__setitem__(key, out)

    def feed_x(_m, args, kwargs):  # block b reads the stream entering block a
        return ((got["x"],) + tuple(args[1:]), kwargs) if args else (args, {**kwargs, "hidden_states": got["x"]})

    handles = [layers[2].register_forward_pre_hook(lambda _m, a, k: got.__setitem__("x", a[0] if a else
                                                                                  k["hidden_states"]),
                                                   with_kwargs=True),
               layers[3].register_forward_pre_hook(feed_x, with_kwargs=True),
               module_at(layers[2], family_row.attn_out_path).register_forward_hook(keep("a")),
               module_at(layers[3], family_row.attn_out_path).register_forward_hook(keep("b"))]
    _logits(model, ids)
    for h in handles:
        h.remove()
    flatten(model, 2)
    wide = module_at(families.decoder_layers(model)[2], family_row.attn_out_path)
    handle = wide.register_forward_hook(keep("wide"))
    _logits(model, ids)
    handle.remove()
    assert torch.allclose(got["wide"], got["a"] + got["b"], atol=1e-5, rtol=0)
    assert not torch.allclose(got["b"], torch.zeros_like(got["b"]), atol=1e-3)  # block b's heads count


@pytest.mark.parametrize("family", MERGING)
def test_a_merged_model_keeps_every_count_of_heads_and_channels(family):
    model = _model(family, layers=8)
    shapes = {n: p.shape for n, p in families.decoder_layers(model)[0].named_parameters()}
    counts = {k: getattr(families.text_config(model), k, None)
              for k in ("num_attention_heads", "num_key_value_heads", "intermediate_size", "hidden_size")}
    info = merge_pairs(model=model, firsts=[1, 3, 5], windows=_windows())
    layers = families.decoder_layers(model)
    assert len(layers) == 5 == families.text_config(model).num_hidden_layers
    assert info["kept"] == [0, 1, 3, 5, 7] and info["removed"] == [2, 4, 6]
    for index, layer in enumerate(layers):
        assert {n: p.shape for n, p in layer.named_parameters()} == shapes
        assert {m.layer_idx for m in layer.modules() if isinstance(m.__dict__.get("layer_idx"), int)} <= {index}
        # the wide attention's own config copy is gone: every module reads the model's config again
        assert all(m.config is model.config for m in layer.modules() if "config" in m.__dict__)
    assert {k: getattr(families.text_config(model), k, None) for k in counts} == counts
    heads = [(p["units_from"], p["channels_from"]) for p in info["per_pair"]]
    units, channels = info["sizes"]["attention_units"], info["sizes"]["intermediate"]
    assert all(sum(u) == units and sum(c) == channels and min(c) > 0 for u, c in heads)


def _held_out_rows(model, flat, windows):
    """{"attn" | "mlp": (Z, Y)}: the wide block's output linears' inputs [n, 2k] and outputs less their
    biases [n, d] on `windows`."""
    layer, rows = families.decoder_layers(model)[flat.index], {"attn": [], "mlp": []}
    handles = []
    for key, layout in (("attn", flat.attention), ("mlp", flat.mlp)):
        linear = module_at(layer, layout.output.path)

        def hook(_m, inputs, output, key=key, bias=linear.bias):
            z, y = inputs[0].reshape(-1, inputs[0].shape[-1]), output.reshape(-1, output.shape[-1])
            rows[key].append((z.double(), y.double() - (0 if bias is None else bias.double())))

        handles.append(linear.register_forward_hook(hook))
    for ids in windows:
        _logits(model, ids)
    for h in handles:
        h.remove()
    return {k: (torch.cat([z for z, _ in v]), torch.cat([y for _, y in v])) for k, v in rows.items()}


@pytest.mark.parametrize("family", ["llama", "opt"])
def test_the_refits_beat_plain_dropping_on_held_out_tokens(family):
    model = _model(family)
    flat = flatten(model, 2)
    fit, held = _windows(24, seed=0), _windows(8, seed=500)
    unit_scores, channel_scores = scores(model, flat, fit)
    units = torch.sort(torch.topk(unit_scores, flat.attention.units).indices).values
    channels = torch.sort(torch.topk(channel_scores, flat.mlp.units).indices).values
    sums = refit_sums(model, flat, fit, units=units, channels=channels)
    rows = _held_out_rows(model, flat, held)
    layer = families.decoder_layers(model)[flat.index]
    kept = {"attn": columns(units, flat.attention.output.sizes[0]), "mlp": channels}
    for (key, layout), stats in zip((("attn", flat.attention), ("mlp", flat.mlp)), sums):
        w0 = module_at(layer, layout.output.path).weight.detach().double()[:, kept[key]].T
        refit = solve_refit(stats, w0, ridge=1e-2)
        z, y = rows[key]
        drop_error = (z[:, kept[key]] @ w0 - y).pow(2).sum() / y.pow(2).sum()
        refit_error = (z[:, kept[key]] @ refit - y).pow(2).sum() / y.pow(2).sum()
        assert refit_error < 0.8 * drop_error, (key, float(refit_error), float(drop_error))
        assert stats.residual(refit) < stats.residual(w0)  # and on the fit's own tokens, from the sums


@pytest.mark.parametrize("family,tied", [("phi3", False), ("llama", True), ("opt", True)])
def test_a_merged_model_exports_reloads_and_generates(family, tied, tmp_path):
    from transformers import AutoModelForCausalLM

    model = _model(family, layers=6, tied=tied)
    merge_pairs(model=model, firsts=[1, 3], windows=_windows())
    model.save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert loaded.config.num_hidden_layers == 4
    ids = _ids(3)
    assert torch.equal(_logits(loaded, ids), _logits(model, ids))
    prompt = ids[:1, :12]
    with torch.no_grad():
        cached = loaded.generate(prompt, max_new_tokens=8, do_sample=False, use_cache=True, pad_token_id=0)
        plain = loaded.generate(prompt, max_new_tokens=8, do_sample=False, use_cache=False, pad_token_id=0)
    assert cached.shape == (1, 20) and torch.equal(cached, plain)


@pytest.mark.parametrize("family", sorted(families.FAMILIES))
def test_every_family_merges_or_refuses_in_one_line(family):
    model = tiny_model(family)
    ids = _ids(1)
    before = _logits(model, ids)
    try:
        merge_pairs(model=model, firsts=[2], windows=_windows(4))
    except TrspError as e:
        assert "\n" not in str(e) and repr(family) in str(e), str(e)
        return
    after = _logits(model, ids)
    assert after.shape == before.shape and torch.isfinite(after).all() and families.num_layers(model) == 5


def test_bad_requests_are_refused_in_one_line():
    model = _model("llama")
    cases = {"overlap": dict(firsts=[1, 2]), "out of range": dict(firsts=[5]), "weighting": dict(weighting="x"),
             "ridge": dict(ridge=-1.0), "tokens": dict(windows=[_ids(0, batch=1, length=16)]),
             "no windows": dict(windows=[])}
    for what, change in cases.items():
        kwargs = dict(model=model, firsts=[1], windows=_windows(2)) | change
        with pytest.raises(TrspError) as e:
            merge_pairs(**kwargs)
        assert "\n" not in str(e.value), what
    assert families.num_layers(model) == 6  # nothing was merged by a refused request


def test_pairs_are_chosen_greedily_among_candidates_without_overlap():
    model = _model("llama", layers=8)
    distances = {0: 0.40, 1: 0.30, 2: 0.10, 3: 0.12, 4: 0.20, 5: 0.50, 6: 0.60}
    assert choose_pairs(distances, model=model, n_pairs=2) == [2, 4]
    assert choose_pairs(distances, model=model, n_pairs=4) == [2, 4, 0, 6]  # a prefix grows
    with pytest.raises(TrspError, match="found 4 non-overlapping"):
        choose_pairs(distances, model=model, n_pairs=5)
    assert pair_starts([1, 2, 3, 5, 6]) == [1, 2, 5]
    gates = attach_gates(model)
    got = merge_select(model, gates, _windows(2), n_pairs=2, candidates=list(range(1, 7)))
    assert len(got) == 2 and all(1 <= a <= 5 for a in got) and abs(got[0] - got[1]) >= 2


def test_the_selector_skips_pairs_of_two_attention_types():
    model = tiny_model("qwen2", layers=6)  # sliding and full attention alternate: no pair can merge
    with pytest.raises(TrspError, match="differ in config.layer_types"):
        merge_select(model, attach_gates(model), _windows(1), n_pairs=1, candidates=list(range(1, 5)))
    with pytest.raises(TrspError, match="family 'gemma2' cannot merge"):
        merge_select(tiny_model("gemma2"), None, [], n_pairs=1, candidates=[1, 2])


@pytest.mark.parametrize("family", MERGING)
def test_the_pair_target_brings_the_merged_block_closer_to_the_two_blocks_output(family):
    """Target "pair" refits the MLP towards the stream the two original blocks leave; "wide" towards the
    flattened block's. On the calibration tokens the pair target's merged block must come closer to the
    pair's own output: a misaligned target (wrong token, sign or bias) would not."""
    model, windows = _model(family), _windows(16, seed=3)
    layers, got = families.decoder_layers(model), {}

    def keep(key):
        return lambda _m, _i, out: got.setdefault(key, []).append(out[0] if isinstance(out, tuple) else out)

    handles = [layers[3].register_forward_hook(keep("truth")), layers[1].register_forward_hook(keep("x"))]
    for ids in windows:
        _logits(model, ids)
    for h in handles:
        h.remove()
    errors = {}
    for target in ("wide", "pair"):
        merged = copy.deepcopy(model)
        merge_pairs(model=merged, firsts=[2], windows=windows, target=target, weighting="none")
        handle = families.decoder_layers(merged)[2].register_forward_hook(keep(target))
        for ids in windows:
            _logits(merged, ids)
        handle.remove()
        errors[target] = sum(float((m - y).pow(2).sum()) for m, y in zip(got[target], got["truth"])) / sum(
            float((y - x).pow(2).sum()) for y, x in zip(got["truth"], got["x"]))
    assert errors["pair"] < 0.9 * errors["wide"], errors


@pytest.mark.parametrize("family", ["llama", "opt"])
def test_the_dense_target_is_the_pair_target_on_the_first_pair_and_closer_to_dense_after_it(family):
    """Target "dense" refits the MLP towards the stream the dense model leaves after the pair (stored in one
    pass before any merge). On the first pair that stream is the two original blocks' output on the same
    input, so the merge must equal the pair target's bit for bit in function; on a later pair the input
    carries the first merge's error, and the dense target must leave the pair's output closer to the dense
    stream than the pair target, which repairs only the pair's own error: a target taken from the wrong
    window, layer or token order would not."""
    model, windows = _model(family, layers=8), _windows(16, seed=3)
    layers, got = families.decoder_layers(model), {}

    def keep(key):
        return lambda _m, _i, out: got.setdefault(key, []).append(out[0] if isinstance(out, tuple) else out)

    handle = layers[5].register_forward_hook(keep("dense"))
    for ids in windows:
        _logits(model, ids)
    handle.remove()
    logits, errors = {}, {}
    for target in ("pair", "dense"):
        first = copy.deepcopy(model)
        merge_pairs(model=first, firsts=[1], windows=windows, target=target, weighting="none")
        logits[target] = torch.cat([_logits(first, ids) for ids in windows])
        both = copy.deepcopy(model)
        merge_pairs(model=both, firsts=[1, 4], windows=windows, target=target, weighting="none")
        handle = families.decoder_layers(both)[3].register_forward_hook(keep(target))  # the pair (4, 5) merged
        for ids in windows:
            _logits(both, ids)
        handle.remove()
        errors[target] = sum(float((m - y).pow(2).sum()) for m, y in zip(got[target], got["dense"]))
    torch.testing.assert_close(logits["dense"], logits["pair"], rtol=1e-4, atol=1e-5)
    assert errors["dense"] < 0.95 * errors["pair"], errors


def test_costs_count_the_passes_up_to_each_pair():
    # pairs at 2 and 10 of 30 layers: the first pass runs layers 0..3 (4 of 30), the second the model merged
    # once up to layer 11 (11 layers); two passes each with the refit
    assert merge_cost(firsts=[10, 2], num_layers=30, tokens=300) == pytest.approx(2 * 300 * (4 + 11) / 30)
    assert merge_cost(firsts=[2], num_layers=30, tokens=300, refit=False, stops=False) == pytest.approx(300)
    # target "pair": a third pass after the attention's cut, which also runs the pair's two original blocks
    assert merge_cost(firsts=[10, 2], num_layers=30, tokens=300, target="pair") == pytest.approx(
        300 * (3 * (4 + 11) + 2 * 2) / 30)
    # target "dense": the same three passes without the original blocks, and one dense pass to layer 11
    assert merge_cost(firsts=[10, 2], num_layers=30, tokens=300, target="dense") == pytest.approx(
        300 * (3 * (4 + 11) + 12) / 30)
    assert select_cost(tokens=512) == 512.0
