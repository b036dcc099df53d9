"""Issue 21: the least-squares map's restricted forms (trsp_ray/method/compensation_forms.py). Each form
minimises the same ridge objective over its own class of maps: the diagonal one is the per-channel
regression of the gathered activations, the low-rank one beats every other rank-k correction tried
and reaches the full map at k = d, and the folded model reproduces each form's residual."""

import pytest
import torch

from trsp_ray.common.errors import TrspError
from trsp_ray.method import compensation
from trsp_ray.method.compensation_forms import objective, solve
from trsp_ray.method.surgery import remove_layers
from trsp_ray.models import families
from trsp_ray.models.tiny import VOCAB, tiny_model, with_random_biases
from trsp_ray.run.workbench import copy_model


def _windows(count=4, batch=4, seqlen=32, seed=1):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (batch, seqlen), generator=gen) for _ in range(count)]


def _h(out):
    return (out[0] if isinstance(out, tuple) else out).flatten(0, -2)


@torch.no_grad()
def _gathered(dense, windows, a, b):
    """M and Y of block [a..b] from forward hooks of the test's own (not compensation.accumulate)."""
    layers = families.decoder_layers(dense)
    ms, before, after = [], [], []
    hooks = [families.mlp_output(layers[a - 1], dense).register_forward_hook(
                 lambda _m, _i, out: ms.append(out.flatten(0, -2))),
             layers[a - 1].register_forward_hook(lambda _m, _i, out: before.append(_h(out))),
             layers[b].register_forward_hook(lambda _m, _i, out: after.append(_h(out)))]
    for w in windows:
        dense(input_ids=w, use_cache=False)
    for h in hooks:
        h.remove()
    m = torch.cat(ms).double()
    return m, torch.cat(after).double() - (torch.cat(before).double() - m)


@pytest.fixture(scope="module")
def block():
    dense, windows = tiny_model("llama", layers=6), _windows()
    stats, = compensation.accumulate(dense=dense, windows=windows, drop=[2, 3], weighting="none")
    m, y = _gathered(dense, windows, 2, 3)
    return stats, m, y


@pytest.mark.parametrize("ridge", [0.0, 1e-2])
def test_the_diagonal_form_is_the_per_channel_regression(block, ridge):
    stats, m, y = block
    r = ridge * (m * m).sum(0).mean()
    expected = ((m * y).sum(0) + r) / ((m * m).sum(0) + r)  # channel j: argmin ||m_j t - y_j||^2 + r (t - 1)^2
    t = solve(stats.mtm, stats.mty, ridge=ridge, form="diagonal")
    assert torch.count_nonzero(t - torch.diag(t.diagonal())) == 0
    assert torch.allclose(t.diagonal(), expected, rtol=1e-8)
    assert stats.residual(t) == pytest.approx(((m @ t - y) ** 2).sum().item(), rel=1e-6)
    eye = torch.eye(t.shape[0], dtype=torch.float64)
    assert stats.residual(t) < stats.residual(eye)


@pytest.mark.parametrize("ridge", [0.0, 1e-2])
def test_the_lowrank_form_is_the_best_rank_k_correction(block, ridge):
    stats, _m, _y = block
    d = stats.mtm.shape[0]
    eye = torch.eye(d, dtype=torch.float64)
    f = lambda t: objective(stats.mtm, stats.mty, stats.yty, t, ridge=ridge)
    full = solve(stats.mtm, stats.mty, ridge=ridge)
    u, s, vh = torch.linalg.svd(full - eye)
    gen = torch.Generator().manual_seed(0)
    previous = float("inf")
    for k in (1, 4, 16):
        t = solve(stats.mtm, stats.mty, ridge=ridge, form="lowrank", rank=k)
        assert torch.linalg.matrix_rank(t - eye).item() == k
        truncated = eye + u[:, :k] @ torch.diag(s[:k]) @ vh[:k]  # another rank-k correction, not the optimum
        assert f(t) < f(truncated)
        # the best correction with a given row space P is D* P (D* = full - I); other row spaces do worse
        rows = torch.linalg.svd(t - eye).Vh[:k].T
        for _ in range(3):
            q, _ = torch.linalg.qr(rows + 0.05 * torch.randn(d, k, dtype=torch.float64, generator=gen))
            assert f(t) < f(eye + (full - eye) @ q @ q.T)
        assert f(t) < f(eye + 1.01 * (t - eye)) and f(t) < f(eye + 0.99 * (t - eye))
        assert f(full) <= f(t) < previous
        previous = f(t)
    whole = solve(stats.mtm, stats.mty, ridge=ridge, form="lowrank", rank=d)
    assert torch.allclose(whole, full, atol=1e-8)


FOLDABLE = [f for f, fam in families.FAMILIES.items() if not fam.mlp_fold_refusal]  # every family a fold reaches


@pytest.mark.parametrize("family", FOLDABLE)
@pytest.mark.parametrize("form, rank", [("diagonal", None), ("lowrank", 8)])
def test_the_folded_model_reproduces_each_forms_residual(form, rank, family):
    dense, windows, drop = with_random_biases(tiny_model(family, layers=6)), _windows(), [2, 3]
    model = copy_model(dense, torch.device("cpu"))
    remove_layers(model, drop)
    info = compensation.compensate(model=model, dense=dense, drop=drop, windows=windows, ridge=1e-3, form=form,
                                   rank=rank, weighting="none")  # the absolute residual, measured below
    layers, dense_layers, outs, targets = families.decoder_layers(model), families.decoder_layers(dense), [], []
    hooks = [layers[1].register_forward_hook(lambda _m, _i, out: outs.append(_h(out))),
             dense_layers[3].register_forward_hook(lambda _m, _i, out: targets.append(_h(out)))]
    with torch.no_grad():
        for w in windows:
            model(input_ids=w, use_cache=False)
            dense(input_ids=w, use_cache=False)
    for h in hooks:
        h.remove()
    # the folded layer 1 writes h_mid + M T where the dense layer 3 wrote h_mid + Y
    measured = ((torch.cat(outs).double() - torch.cat(targets).double()) ** 2).sum().item()
    assert measured == pytest.approx(info["residual"][0], rel=1e-4)
    assert info["residual"][0] < info["residual_identity"][0]


def test_bad_forms_fail_in_one_line_before_any_forward():
    from trsp_ray.config.run_config import load_config

    dense = tiny_model("llama", layers=6)
    calls = []
    dense.register_forward_hook(lambda *_: calls.append(1))
    for change, message in ((dict(form="tucker"), "compensation.form='tucker' is not valid; choose one of full"),
                            (dict(weighting="tokens"), "compensation.weighting='tokens' is not valid; choose one of "
                                                       "norm, none"),
                            (dict(form="lowrank", rank=0), "compensation.rank=0 is not valid .* 1..64"),
                            (dict(form="lowrank", rank=65), "compensation.rank=65 is not valid .* 1..64")):
        model = copy_model(dense, torch.device("cpu"))
        remove_layers(model, [2, 3])
        with pytest.raises(TrspError, match=message) as err:
            compensation.compensate(model=model, dense=dense, drop=[2, 3], windows=_windows(), **change)
        assert "\n" not in str(err.value)
    assert not calls
    few = _windows(count=1, batch=1, seqlen=16)  # 16 tokens: too few for a 64 x 64 map, enough for 64 scales
    for form in ("full", "lowrank"):
        with pytest.raises(TrspError, match="per column of the 64 x 64 map"):
            compensation.check_request(model=dense, method="lstsq", tokens=16, form=form, rank=4)
    model = copy_model(dense, torch.device("cpu"))
    remove_layers(model, [2, 3])
    info = compensation.compensate(model=model, dense=dense, drop=[2, 3], windows=few, form="diagonal", ridge=1e-2)
    assert info["tokens"] == 16 and info["residual"][0] < info["residual_identity"][0]
    for override, message in (("compensation.form=tucker", "choose one of full, diagonal, lowrank"),
                              ("compensation.form=lowrank compensation.rank=0", "compensation.rank=0"),
                              ("compensation.weighting=tokens", "compensation.weighting='tokens' is not valid")):
        with pytest.raises(TrspError, match=message):
            load_config(overrides=override.split())



@pytest.mark.parametrize("family", FOLDABLE)
@pytest.mark.parametrize("form, rank, weighting", [("diagonal", None, "norm"), ("lowrank", 8, "none"),
                                                   ("full", None, "none")])
def test_the_workers_fit_uses_the_configured_form(form, rank, weighting, family):
    """distributed/compensate.fit (what a Ray Train worker runs) solves each form and token weighting
    like one process: one rank, no all-reduce, on an unpartitioned model (the ZeRO-3 sums are checked
    in the slow tier). The two weightings fold different weights, so a dropped setting fails."""
    from trsp_ray.distributed import compensate
    from trsp_ray.method.gates import attach_gates

    dense, windows, drop = with_random_biases(tiny_model(family, layers=6)), _windows(), [2, 3]
    one = copy_model(dense, torch.device("cpu"))
    remove_layers(one, drop)
    compensation.compensate(model=one, dense=dense, drop=drop, windows=windows, ridge=1e-3, form=form, rank=rank,
                            weighting=weighting)
    other = copy_model(dense, torch.device("cpu"))
    remove_layers(other, drop)
    compensation.compensate(model=other, dense=dense, drop=drop, windows=windows, ridge=1e-3, form=form, rank=rank,
                            weighting="none" if weighting == "norm" else "norm")
    proj = lambda m: families.mlp_output(families.decoder_layers(m)[1], m)  # the layer before the block
    assert not torch.allclose(proj(other).weight, proj(one).weight, rtol=1e-3, atol=1e-5)
    workers = copy_model(dense, torch.device("cpu"))
    info = compensate.fit(model=workers, gates=attach_gates(workers), drop=drop, windows=windows, rank=0, world=1,
                          ridge=1e-3, form=form, map_rank=rank, weighting=weighting, reduce=lambda t: t)
    (block, t), = info["maps"]
    assert block == (2, 3)
    eye = torch.eye(t.shape[0], dtype=t.dtype)
    assert torch.linalg.matrix_rank(t - eye).item() == {"diagonal": 64, "lowrank": 8, "full": 64}[form]
    compensate.fold(model=workers, maps=info["maps"])
    for name in ("weight", "bias"):  # the workers keep every layer: layer 1 is layer 1 in both models
        got, want = getattr(proj(workers), name, None), getattr(proj(one), name, None)
        assert (got is None) == (want is None) and (got is None or torch.allclose(got, want, rtol=1e-5, atol=1e-7))
