"""Issue 21: the closed-form compensation of a removed block (trsp_ray/method/compensation.py) reaches the
least-squares optimum, folds into a stock checkpoint of every family that can take it, handles
non-contiguous drop sets block by block, refuses what it cannot serve in one line, and gives the
same map from data-parallel shards as from one process."""

import ast
from pathlib import Path

import pytest
import torch

from trsp_ray.common.errors import TrspError
from trsp_ray.config import registry
from trsp_ray.method import compensation, compensation_scalar
from trsp_ray.method.surgery import remove_layers
from trsp_ray.models import families
from trsp_ray.models.tiny import VOCAB, tiny_model, with_random_biases
from trsp_ray.run.workbench import copy_model

ROOT = Path(__file__).resolve().parents[1]
FOLDABLE = [f for f, fam in families.FAMILIES.items() if not fam.mlp_fold_refusal]  # every family a fold reaches


def _windows(count=4, batch=4, seqlen=32, seed=1):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (batch, seqlen), generator=gen) for _ in range(count)]


def _pruned(dense, drop):
    model = copy_model(dense, torch.device("cpu"))
    remove_layers(model, drop)
    return model


@torch.no_grad()
def _outputs(model, windows, indices):
    """{decoder-layer index: its output over all windows, [n, d]} by forward hooks of the test's own."""
    layers, got, handles = families.decoder_layers(model), {i: [] for i in indices}, []
    for i in indices:
        hook = lambda _m, _i, out, i=i: got[i].append((out[0] if isinstance(out, tuple) else out).flatten(0, -2))
        handles.append(layers[i].register_forward_hook(hook))
    for batch in windows:
        model(input_ids=batch, use_cache=False)
    for h in handles:
        h.remove()
    return {i: torch.cat(v).double() for i, v in got.items()}


@torch.no_grad()
def _m_and_y(dense, windows, a, b):
    """M and Y of block [a..b] gathered independently of compensation.accumulate's hooks."""
    proj = families.mlp_output(families.decoder_layers(dense)[a - 1], dense)
    ms = []
    handle = proj.register_forward_hook(lambda _m, _i, out: ms.append(out.flatten(0, -2)))
    outs = _outputs(dense, windows, [a - 1, b])
    handle.remove()
    m = torch.cat(ms).double()
    return m, outs[b] - (outs[a - 1] - m)


def _error(out, target, weighting):
    """The summed squared boundary error; under "norm" weighting each token's is relative to its
    target's norm."""
    diff = out - target
    if weighting == "norm":
        diff = diff / target.norm(dim=-1, keepdim=True)
    return (diff ** 2).sum().item()


def test_compensation_imports_no_distributed_or_tracking_library():
    tree = ast.parse((ROOT / "trsp_ray" / "method" / "compensation.py").read_text())
    names = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    names |= {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    assert not names & {"ray", "deepspeed", "mlflow", "lm_eval"}


def test_blocks_are_maximal_contiguous_runs():
    assert compensation.blocks([8, 2, 1, 4], 10) == [(1, 2), (4, 4), (8, 8)]
    assert compensation.blocks([], 10) == []
    with pytest.raises(TrspError, match="not valid for a 10-layer model"):
        compensation.blocks([10], 10)


@pytest.mark.parametrize("weighting", ["none", "norm"])
def test_accumulated_sums_give_the_least_squares_solution_of_the_gathered_activations(weighting):
    dense, windows = tiny_model("llama", layers=6), _windows()
    m, y = _m_and_y(dense, windows, 2, 3)
    if weighting == "norm":  # the weighted regression: each token's rows over its target's norm
        w = _outputs(dense, windows, [3])[3].norm(dim=-1, keepdim=True)
        assert w.max() > 1.5 * w.min()  # the weights differ between tokens, so the two fits do too
        m, y = m / w, y / w
    stats, = compensation.accumulate(dense=dense, windows=windows, drop=[2, 3], weighting=weighting)
    assert stats.tokens == m.shape[0] == 4 * 4 * 32
    t = compensation.solve(stats.mtm, stats.mty, ridge=0.0)
    expected = torch.linalg.lstsq(m, y).solution
    assert torch.allclose(t, expected, rtol=1e-6, atol=1e-8)
    assert stats.residual(t) == pytest.approx(((m @ t - y) ** 2).sum().item(), rel=1e-6)


def test_the_ridge_shrinks_the_map_towards_the_identity_not_towards_zero():
    """A large ridge leaves the model uncompensated (T -> I); between, the fit trades residual for
    distance from I: each ridge's T minimises ||M T - Y||^2 + r ||T - I||^2 over its neighbours."""
    dense, windows = tiny_model("llama", layers=6), _windows()
    stats, = compensation.accumulate(dense=dense, windows=windows, drop=[2, 3])
    eye = torch.eye(stats.mtm.shape[0], dtype=torch.float64)
    far = compensation.solve(stats.mtm, stats.mty, ridge=1e6)
    assert (far - eye).abs().max() < 1e-4
    r = 1e-2 * stats.mtm.diagonal().mean().item()
    t = compensation.solve(stats.mtm, stats.mty, ridge=1e-2)
    objective = lambda x: stats.residual(x) + r * ((x - eye) ** 2).sum().item()
    for scale in (0.99, 1.01):
        assert objective(t) < objective(eye + scale * (t - eye))
    assert objective(t) < objective(compensation.solve(stats.mtm, stats.mty, ridge=0.0))
    assert stats.residual(eye) > stats.residual(t) > stats.residual(compensation.solve(stats.mtm, stats.mty, ridge=0.0))


@pytest.mark.parametrize("family", FOLDABLE)  # biases (OPT, GPT-NeoX), a parallel residual (GPT-NeoX)
@pytest.mark.parametrize("weighting", ["none", "norm"])
@pytest.mark.parametrize("ridge", [0.0, 1e-4])
def test_the_fold_reproduces_the_solve_residual_in_the_compensated_model(ridge, weighting, family):
    dense, windows, drop = with_random_biases(tiny_model(family, layers=6)), _windows(), [2, 3]
    model = _pruned(dense, drop)
    before = _outputs(model, windows, [1])[1]
    info = compensation.compensate(model=model, dense=dense, drop=drop, windows=windows, ridge=ridge,
                                   weighting=weighting)
    target = _outputs(dense, windows, [3])[3]
    after = _outputs(model, windows, [1])[1]  # pruned index 1 is original layer 1 = a - 1
    measured = _error(after, target, weighting)
    assert measured == pytest.approx(info["residual"][0], rel=1e-4)
    assert info["residual_identity"][0] == pytest.approx(_error(before, target, weighting), rel=1e-4)
    assert measured < 0.8 * info["residual_identity"][0]


@pytest.mark.parametrize("weighting", ["none", "norm"])
@pytest.mark.parametrize("activations", ["dense", "sequential"])
def test_a_non_contiguous_drop_set_is_repaired_block_by_block(activations, weighting):
    dense, windows, drop = tiny_model("llama", layers=7), _windows(), [4, 1, 2]
    model = _pruned(dense, drop)  # kept: 0 3 5 6
    plain = _pruned(dense, drop)
    info = compensation.compensate(model=model, dense=dense, drop=drop, windows=windows, activations=activations,
                                   weighting=weighting)
    assert info["blocks"] == [(1, 2), (4, 4)]
    layers, untouched = families.decoder_layers(model), families.decoder_layers(plain)
    changed = [not torch.equal(layers[i].mlp.down_proj.weight, untouched[i].mlp.down_proj.weight) for i in range(4)]
    assert changed == [True, True, False, False]  # kept layers 0 and 3 precede the two blocks
    targets = _outputs(dense, windows, [2, 4])
    outs = _outputs(model, windows, [0, 1])
    first = _error(outs[0], targets[2], weighting)
    assert first == pytest.approx(info["residual"][0], rel=1e-4)
    second = _error(outs[1], targets[4], weighting)
    if activations == "sequential":  # fitted on the stream that reaches the second boundary
        assert second == pytest.approx(info["residual"][1], rel=1e-4)
        assert second < info["residual_identity"][1]
    else:  # fitted on the dense stream: the residual is the dense boundary's under the map solved
        # from activations gathered here (the pruned stream reaching it differs, so it is not `second`)
        m, y = _m_and_y(dense, windows, 4, 4)
        w = targets[4].norm(dim=-1, keepdim=True) if weighting == "norm" else torch.ones(1, dtype=torch.float64)
        t = compensation.solve((m / w).T @ (m / w), (m / w).T @ (y / w), ridge=1e-2)  # compensate's default ridge
        assert info["residual"][1] == pytest.approx((((m @ t - y) / w) ** 2).sum().item(), rel=1e-6)
        assert info["residual_identity"][1] == pytest.approx((((m - y) / w) ** 2).sum().item(), rel=1e-6)


@pytest.mark.parametrize("method", ["lstsq", "scalar"])
@pytest.mark.parametrize("family", sorted(families.FAMILIES))
def test_compensated_model_exports_and_reloads_with_plain_transformers(family, method, tmp_path):
    from transformers import AutoModelForCausalLM

    from trsp_ray.config.run_config import load_config
    from trsp_ray.run.export import export_model, pruned_manifest

    dense, windows, drop = tiny_model(family, layers=6), _windows(), [2, 3]
    model = _pruned(dense, drop)
    if family not in FOLDABLE and method == "scalar":
        with pytest.raises(TrspError, match="post_feedforward_layernorm") as err:
            compensation.compensate(model=model, dense=dense, drop=drop, windows=windows, method=method)
        assert "\n" not in str(err.value)
        return
    # lstsq folds into layer 1 (before the block; Gemma: its MLP norm), the scalar fold into layer 2 (original 4)
    proj = families.map_output(families.decoder_layers(model)[1 if method == "lstsq" else 2], model)[0]
    weight = proj.weight.clone()
    compensation.compensate(model=model, dense=dense, drop=drop, windows=windows, method=method)
    assert not torch.equal(weight, proj.weight)
    cfg = load_config(overrides=[f"compensation.method={method}", "tracking.enabled=false"])
    manifest = pruned_manifest(method="random", drop=drop, num_layers_original=6, config=cfg.to_dict())
    path = export_model(model, None, str(tmp_path / "out"), manifest=manifest)
    reloaded = AutoModelForCausalLM.from_pretrained(path).eval()
    ids = _windows(count=1, batch=2, seqlen=16, seed=7)[0]
    with torch.no_grad():
        expected = model(input_ids=ids, use_cache=False).logits
        got = reloaded(input_ids=ids, use_cache=False).logits
    assert torch.allclose(got, expected, atol=1e-5)
    assert sum(type(m).__name__ == "Linear" for m in reloaded.modules()) == sum(
        type(m).__name__ == "Linear" for m in model.modules())  # no new modules
    import json
    written = json.loads((path / "trsp_ray.json").read_text())
    assert written["config"]["compensation"]["method"] == method


def test_post_ln_opt_is_refused_in_one_line():
    dense = tiny_model("opt", layers=6)
    dense.config.do_layer_norm_before = False
    with pytest.raises(TrspError, match="do_layer_norm_before=False") as err:
        compensation.check_request(model=dense, method="lstsq", tokens=10_000)
    assert "\n" not in str(err.value)


def test_bad_requests_fail_in_one_line_before_any_forward():
    from trsp_ray.config.run_config import load_config

    dense = tiny_model("llama", layers=6)
    calls = []
    dense.register_forward_hook(lambda *_: calls.append(1))
    weight = dense.model.layers[1].mlp.down_proj.weight.clone()
    cases = [(dict(windows=_windows(count=1, batch=1, seqlen=32)), "0.5 per column of the 64 x 64 map"),
             (dict(drop=[0, 1]), "removes layer 0"),
             (dict(method="foo"), "compensation.method='foo' is not valid"),
             (dict(method="scalar", activations="sequential"), "not used by the scalar fold"),
             (dict(activations="both"), "compensation.activations='both' is not valid")]
    for change, message in cases:
        kwargs = {"model": _pruned(dense, change.get("drop", [2, 3])), "dense": dense, "drop": [2, 3],
                  "windows": _windows(), **change}
        with pytest.raises(TrspError, match=message) as err:
            compensation.compensate(**kwargs)
        assert "\n" not in str(err.value)
    assert not calls and torch.equal(weight, dense.model.layers[1].mlp.down_proj.weight)
    for override, message in (("compensation.activations=sequential compensation.method=scalar", "scalar fold"),
                              ("compensation.method=full", "choose one of auto, none, lstsq, scalar"),
                              ("compensation.windows=-1", "must be >= 0"),
                              ("compensation.ridge=-1", "must be >= 0")):
        with pytest.raises(TrspError, match=message):
            load_config(overrides=override.split())


def test_two_shards_summed_give_the_one_process_solve():
    dense, windows, drop = tiny_model("llama", layers=6), _windows(count=6), [1, 2, 4]
    whole = compensation.accumulate(dense=dense, windows=windows, drop=drop)
    halves = [compensation.accumulate(dense=dense, windows=windows[r::2], drop=drop) for r in range(2)]
    for one, rank0, rank1 in zip(whole, *halves):
        sent: list = []
        rank1.reduced(lambda t, sent=sent: sent.append(t) or t)  # what rank 1 contributes, in call order
        peer = iter(sent)
        summed = rank0.reduced(lambda t, peer=peer: t + next(peer))  # an all-reduce sum, seen from rank 0
        assert summed.tokens == one.tokens == 6 * 4 * 32
        t_one = compensation.solve(one.mtm, one.mty)
        t_sum = compensation.solve(summed.mtm, summed.mty)
        assert ((t_sum - t_one).norm() / t_one.norm()).item() < 1e-8
        assert summed.residual(t_sum) == pytest.approx(one.residual(t_one), rel=1e-8)


def _gloo_worker(rank, world, init, out_dir):
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        dense, drop = tiny_model("llama", layers=6), [2, 3]
        model = _pruned(dense, drop)

        def reduce(t):
            t = t.clone()
            dist.all_reduce(t)
            return t

        info = compensation.compensate(model=model, dense=dense, drop=drop, windows=_windows(count=6)[rank::world],
                                       reduce=reduce)
        torch.save({"weight": model.model.layers[1].mlp.down_proj.weight, "tokens": info["tokens"]},
                   Path(out_dir) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.mark.slow  # two spawned interpreters import torch + transformers: ~40 s on a loaded 2-core machine
def test_two_gloo_workers_fold_the_one_process_map(tmp_path):
    import torch.multiprocessing as mp

    init = f"file://{tmp_path / 'rendezvous'}"
    mp.spawn(_gloo_worker, args=(2, init, str(tmp_path)), nprocs=2, join=True)
    dense, drop = tiny_model("llama", layers=6), [2, 3]
    model = _pruned(dense, drop)
    info = compensation.compensate(model=model, dense=dense, drop=drop, windows=_windows(count=6))
    one = model.model.layers[1].mlp.down_proj.weight
    for rank in range(2):
        got = torch.load(tmp_path / f"rank{rank}.pt")
        assert got["tokens"] == info["tokens"] == 6 * 4 * 32
        assert torch.allclose(got["weight"], one, rtol=1e-5, atol=1e-6)


def _reload(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def _eval_windows(root, *, count: int, seqlen: int) -> torch.Tensor:
    """The held-out windows `prune` scores of a tiny workspace's eval.txt (data.heldout's reader),
    [count, seqlen] (its SmolLM2 tokenizer adds no BOS)."""
    from transformers import AutoTokenizer

    from trsp_ray.data.domains import load_texts
    from trsp_ray.data.heldout import text_windows

    tokenizer = AutoTokenizer.from_pretrained(root / "model")
    return text_windows(tokenizer, load_texts(str(root / "eval.txt")), seqlen=seqlen, max_windows=count).windows


@torch.no_grad()
def _ppl(model, ids: torch.Tensor) -> float:
    """exp of the mean next-token cross entropy over every window of `ids` [n, seqlen]."""
    import math

    logits = model(input_ids=ids, use_cache=False).logits.float()
    return math.exp(torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten()).item())


def test_a_run_with_compensation_records_it_in_the_manifest(tmp_path, capsys):
    import json

    from trsp_ray import driver
    from trsp_ray.config.run_config import load_config
    from trsp_ray.models.tiny import tiny_workspace

    root = tiny_workspace(tmp_path / "ws", layers=6, calib_chars=20000, eval_chars=8000)
    overrides = [f"model={root / 'model'}", f"data.calib_text={root / 'calib.txt'}",
                 f"data.eval_text={root / 'eval.txt'}", "data.seqlen=32", "data.eval_seqlen=64",
                 "data.eval_max_windows=2", "method=random", "ratio=0.34", "threads=1", "tracking.enabled=false"]
    plain = driver.run(load_config(overrides=overrides))
    assert "random (" not in capsys.readouterr().out  # the summary table names no compensation
    cfg = load_config(overrides=[*overrides, "compensation.method=lstsq", "compensation.windows=4",
                                 "compensation.min_tokens_per_column=1", f"output={tmp_path / 'out'}"])
    with pytest.raises(TrspError, match="per column of the 64 x 64 map"):
        driver.run(load_config(overrides=[*overrides, "compensation.method=lstsq", "compensation.windows=1"]))
    capsys.readouterr()
    results = driver.run(cfg)
    assert "random (lstsq compensation)" in capsys.readouterr().out  # the summary table says what ran
    assert results["dropped_layers"] == plain["dropped_layers"]
    assert results["compensation"] == "lstsq" and results["compensation_tokens"] == 4 * 32
    spans = compensation.blocks(results["dropped_layers"], 6)
    assert results["compensation_cost"] == pytest.approx(4 * 32 * (spans[-1][1] + 1) / 6)
    # both reported PPLs recomputed here from the files: the plain run's is the dense model without its drop
    # set, the compensated run's is its export, which differs from that model in the folded weights only
    plain_model, exported = _reload(root / "model"), _reload(tmp_path / "out")
    kept = remove_layers(plain_model, results["dropped_layers"])
    ids = _eval_windows(root, count=2, seqlen=64)
    assert plain["heldout_ppl"] == pytest.approx(_ppl(plain_model, ids), rel=1e-5)
    assert results["heldout_ppl"] == pytest.approx(_ppl(exported, ids), rel=1e-5)
    a, b = plain_model.state_dict(), exported.state_dict()
    assert sorted(k for k in a if not torch.equal(a[k], b[k])) == sorted(
        f"model.layers.{kept.index(first - 1)}.mlp.down_proj.weight" for first, _ in spans)
    manifest = json.loads((tmp_path / "out" / "trsp_ray.json").read_text())
    assert manifest["config"]["compensation"] == {"method": "lstsq", "ridge": 1e-2, "windows": 4,
                                                  "activations": "dense", "form": "full", "rank": 64,
                                                  "weighting": "norm", "tokens_per_column": 28.0,
                                                  "min_tokens_per_column": 1.0, "objective": "mse"}
    assert [manifest["metrics"][f"compensation_{k}"] for k in ("form", "ridge", "weighting", "objective")] == [
        "full", 1e-2, "norm", "mse"]
    assert manifest["metrics"]["compensation_tokens"] == 4 * 32
    assert manifest["export_check"]["max_abs_logit_diff"] <= manifest["export_check"]["atol"]


def _cuda():
    return torch.device("cuda", torch.cuda.current_device())


@pytest.mark.parametrize("run, host", [
    ("cpu", "meta"),  # a stand-in original: only the swap's bookkeeping differs from a GPU run
    pytest.param("cuda", "cpu", marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(),
                                                                        reason="needs a CUDA device")])])
def test_a_bf16_fit_beside_a_host_original_folds_within_bf16_rounding_and_returns_the_copy_as_it_was(
        run, host, monkeypatch):
    """A GPU run (methods._dense_beside): the bf16 original waits in host memory, the pruned bf16 copy
    steps out to host memory while a transient dense copy on the device gives the fit its passes, the
    fold lands in the host copy (a float64 solve and T^T W, cast back to bf16) and the copy returns.
    Checked: each folded weight is T^T W of the captured map within bf16's rounding (2^-8 relative,
    elementwise); every other tensor is untouched; every parameter is back on its device in bf16; the
    copy was in host memory while the transient copy existed, and that copy is freed, after an error
    too; the bf16 fold repairs the boundary as the float64 solve says (its measured error within 0.2%)."""
    import gc
    import weakref
    from types import SimpleNamespace

    from trsp_ray.run.methods import _dense_beside

    run = _cuda() if run == "cuda" else torch.device(run)
    dense, drop = tiny_model("llama", layers=6).to(torch.bfloat16), [2, 3]
    windows = [w.to(run) for w in _windows()]
    swapped = _pruned(dense, drop).to(run)
    handed, waited, moves, maps = [], [], [], []

    def scoring_model():  # what Workbench.scoring_model hands out: a transient copy on the run's device
        waited.append({p.device.type for p in swapped.parameters()})
        handed.append(copy_model(dense, run))
        return handed[-1]

    real_to, real_fold = swapped.to, compensation.fold
    swapped.to = lambda *a, **k: moves.append(torch.device(a[0] if a else k["device"]).type) or real_to(*a, **k)
    monkeypatch.setattr(compensation, "fold", lambda *, model, layer, t: (
        maps.append((layer, layer.mlp.down_proj.weight.detach().clone(), t)), real_fold(model=model, layer=layer, t=t)))
    original = dense if host == "cpu" else copy_model(dense, torch.device(host))
    bench = SimpleNamespace(model=original, scoring_model=scoring_model)
    before = {k: v.clone() for k, v in swapped.state_dict().items()}
    allocated = torch.cuda.memory_allocated(run) if run.type == "cuda" else 0
    with _dense_beside(bench, swapped, activations="dense") as used:
        assert used is handed[0] and used is not original
        assert {p.dtype for p in used.parameters()} == {torch.bfloat16} and next(used.parameters()).device == run
        info = compensation.compensate(model=swapped, dense=used, drop=drop, windows=windows)
    gone = weakref.ref(handed.pop())
    del used
    gc.collect()
    assert gone() is None  # nothing keeps the transient copy alive after the fit
    if run.type == "cuda":
        assert torch.cuda.memory_allocated(run) == allocated  # no second model left on the device
    assert waited == [{"cpu"}] and moves == ["cpu", run.type]  # out to host memory for the fit, then back

    (layer, w, t), = maps  # one block, folded into original layer 1's down_proj (pruned index 1)
    assert layer is families.decoder_layers(swapped)[1] and t.dtype == torch.float64
    want = t.cpu().T @ w.cpu().double()
    got = layer.mlp.down_proj.weight
    assert ((got.cpu().double() - want).abs() <= 2.0 ** -8 * want.abs()).all()  # one bf16 rounding of T^T W
    assert not torch.equal(got, w)
    after = swapped.state_dict()
    changed = [k for k in before if not torch.equal(before[k], after[k])]
    assert changed == ["model.layers.1.mlp.down_proj.weight"]
    assert all(after[k].dtype == before[k].dtype and after[k].device == before[k].device for k in before)
    assert {(p.dtype, p.device) for p in swapped.parameters()} == {(torch.bfloat16, run)}

    target = _outputs(dense, [w.cpu() for w in windows], [3])[3]
    measured = _error(_outputs(swapped, windows, [1])[1].cpu(), target, "norm")
    assert measured == pytest.approx(info["residual"][0], rel=2e-3)
    assert measured < 0.8 * info["residual_identity"][0]

    moves.clear()
    with pytest.raises(RuntimeError, match="the fit failed"), _dense_beside(bench, swapped, activations="dense"):
        raise RuntimeError("the fit failed")
    gone = weakref.ref(handed.pop())
    gc.collect()
    assert gone() is None and moves == ["cpu", run.type]  # an error in the fit still returns the copy
    with _dense_beside(bench, swapped, activations="sequential") as used:  # needs both models in each pass
        assert used is original and not handed


def test_the_default_folds_a_diagonal_map_into_the_mlp_norm_on_gemma(tmp_path):
    """Gemma 2 normalises the MLP output after the projection, so only a diagonal map folds, into that
    norm's weight (issue 32 item 2, compensation.map_form): the default method compensates there with
    the diagonal form and records it; the scalar fold (whose scaled projections the norms would undo)
    asked for by name is refused in one line."""
    from trsp_ray import driver
    from trsp_ray.config import registry
    from trsp_ray.config.run_config import load_config
    from trsp_ray.models.tiny import tiny_workspace

    root = tiny_workspace(tmp_path / "ws", layers=6, calib_chars=20000, eval_chars=8000, family="gemma2")
    overrides = [f"model={root / 'model'}", f"data.calib_text={root / 'calib.txt'}",
                 f"data.eval_text={root / 'eval.txt'}", "data.seqlen=32", "data.eval_seqlen=64",
                 "data.eval_max_windows=2", "ratio=0.34", "threads=1", "tracking.enabled=false",
                 "baselines.calib_windows=2", "stage2.steps=1", "compensation.windows=16"]  # 8 per column
    assert registry.method(load_config(overrides=overrides).method).compensate  # the default
    results = driver.run(load_config(overrides=overrides))
    assert results["method"] == load_config(overrides=overrides).method and results["compensation_tokens"] == 16 * 32
    assert (results["compensation"], results["compensation_form"], results["heal_steps"]) == ("lstsq", "diagonal", 1)
    with pytest.raises(TrspError, match="post_feedforward_layernorm.*--method shortgpt[+]heal instead") as err:
        driver.run(load_config(overrides=[*overrides, "compensation.method=scalar"]))
    assert "\n" not in str(err.value)


SCALAR_FAMILIES = FOLDABLE  # RMSNorm and LayerNorm, biases, parallel residual


@torch.no_grad()
def _stream_scaled_logits(model, kept, drop, scales, ids):
    """Logits of the plain pruned `model` with the stream entering the first kept layer after each
    block multiplied by that block's scale (forward pre-hooks of the test's own): what the scalar
    fold claims to compute without any hook."""
    layers, handles = families.decoder_layers(model), []
    for (_a, b), s in zip(compensation.blocks(drop, len(kept) + len(drop)), scales):
        after = [k for k, original in enumerate(kept) if original > b]
        if not after:
            continue

        def scale(_module, args, kwargs, s=s):
            if args:
                return (args[0] * s, *args[1:]), kwargs
            return args, {**kwargs, "hidden_states": kwargs["hidden_states"] * s}
        handles.append(layers[after[0]].register_forward_pre_hook(scale, with_kwargs=True))
    try:
        return model(input_ids=ids, use_cache=False).logits
    finally:
        for h in handles:
            h.remove()


@pytest.mark.parametrize("family", SCALAR_FAMILIES)
def test_the_scalar_fold_scales_the_stream_at_each_cut_by_the_dense_norm_ratio(family):
    dense, windows, drop = tiny_model(family, layers=7), _windows(), [1, 2, 4]
    for module in dense.modules():  # the norms' eps is the only term that sees a scale: made negligible
        for name in ("eps", "variance_epsilon"):
            if isinstance(getattr(module, name, None), float):
                setattr(module, name, 1e-12)
    kept = [0, 3, 5, 6]
    model, plain = _pruned(dense, drop), _pruned(dense, drop)
    info = compensation.compensate(model=model, dense=dense, drop=drop, windows=windows, method="scalar")
    # the scales from hidden states transformers reports: entering layer a, leaving layer b
    with torch.no_grad():
        states = [dense(input_ids=w, output_hidden_states=True, use_cache=False).hidden_states for w in windows]
    for (a, b), s in zip(info["blocks"], info["scales"]):
        h = torch.cat([st[a].flatten(0, -2) for st in states]).double()
        y = torch.cat([st[b + 1].flatten(0, -2) for st in states]).double()
        assert s == pytest.approx((y.norm(dim=1).sum() / h.norm(dim=1).sum()).item(), rel=1e-6)
        assert info["residual"][info["blocks"].index((a, b))] == pytest.approx(((s * h - y) ** 2).sum().item(),
                                                                               rel=1e-5)
    assert info["tokens"] == 4 * 4 * 32 and all(abs(s - 1) > 1e-3 for s in info["scales"])
    ids = _windows(count=1, batch=2, seqlen=16, seed=9)[0]
    with torch.no_grad():
        folded = model(input_ids=ids, use_cache=False).logits
        untouched = plain(input_ids=ids, use_cache=False).logits
    expected = _stream_scaled_logits(plain, kept, drop, info["scales"], ids)
    assert torch.allclose(folded, expected, rtol=1e-4, atol=1e-4)
    assert (folded - untouched).abs().max() > 100 * (folded - expected).abs().max()


def test_a_block_at_either_end_gets_the_right_scalar():
    dense, windows = tiny_model("llama", layers=6), _windows()
    # a block ending at the last layer feeds only the final norm: scale 1, nothing folded
    model = _pruned(dense, [4, 5])
    weights = [p.clone() for p in model.parameters()]
    info = compensation.compensate(model=model, dense=dense, drop=[4, 5], windows=windows, method="scalar")
    assert info["scales"] == [1.0] and all(torch.equal(a, b) for a, b in zip(weights, model.parameters()))
    # a block at layer 0 (which lstsq refuses): the stream at the cut is the embeddings
    model = _pruned(dense, [0, 1])
    info = compensation.compensate(model=model, dense=dense, drop=[0, 1], windows=windows, method="scalar")
    assert info["blocks"] == [(0, 1)] and abs(info["scales"][0] - 1) > 1e-3


def test_two_shards_summed_give_the_one_process_scales():
    dense, windows, drop = tiny_model("llama", layers=6), _windows(count=6), [1, 2, 4]
    whole = compensation_scalar.scalar_sums(dense=dense, windows=windows, drop=drop)
    halves = [compensation_scalar.scalar_sums(dense=dense, windows=windows[r::2], drop=drop) for r in range(2)]
    for one, rank0, rank1 in zip(whole, *halves):
        summed = rank0.sums + rank1.sums
        assert torch.allclose(summed, one.sums, rtol=1e-10)
        assert int(summed[5]) == 6 * 4 * 32


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    """config.json and two texts: what a dry run and the checks before any work read (no weights)."""
    from trsp_ray.models.tiny import tiny_config

    root = tmp_path_factory.mktemp("ws")
    tiny_config("llama", layers=6).save_pretrained(root / "model")
    for name in ("calib.txt", "eval.txt"):
        (root / name).write_text("The quick brown fox jumps over the lazy dog.\n" * 200)
    return root


def _prune(root, *extra):
    """`trsp-ray prune --dry-run` on the tiny workspace: (exit status, stdout, stderr)."""
    import contextlib
    import io

    from trsp_ray import cli

    out, err = io.StringIO(), io.StringIO()
    argv = ["prune", "--dry-run", "--model", str(root / "model"), "--calib-text", str(root / "calib.txt"),
            "--eval-text", str(root / "eval.txt"), "--set", "tracking.enabled=false", *extra]
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = cli.main(argv)
    return code, out.getvalue(), err.getvalue()


def test_compensation_none_with_the_default_is_refused_wherever_a_run_starts(workspace):
    """Issue 33 item 7: `--set compensation.method=none` under shortgpt+comp+heal used to fit least
    squares anyway. Left at auto the default fits least squares and says so in the dry run; none is
    one line naming the method without the fold, before any work, on every path."""
    from trsp_ray.config.run_config import for_method, load_config
    from trsp_ray.distributed.train import run_distributed

    assert for_method(load_config()).compensation.method == "lstsq"
    assert for_method(load_config(overrides=["method=shortgpt+heal"])).compensation.method == "none"
    assert for_method(load_config(overrides=["method=shortgpt+heal", "compensation.method=none"])) \
        .compensation.method == "none"
    none = load_config(overrides=[f"model={workspace / 'model'}", "compensation.method=none",
                                  "distributed.workers=2"])
    for start in (for_method, run_distributed):  # run_distributed: the Ray Train path, before Ray starts
        with pytest.raises(TrspError, match="compensation.method='none' is not valid with --method "
                                            "shortgpt[+]comp[+]heal.*use --method shortgpt[+]heal") as err:
            start(none)
        assert "\n" not in str(err.value)
    code, out, err = _prune(workspace, "--set", "compensation.method=none")
    assert code == 2 and not out and err.count("\n") == 1 and "use --method shortgpt+heal" in err
    code, out, _ = _prune(workspace)
    # compensation.windows 0: sized to the tiny model's hidden size, 28 x 64 / 128 = 14 windows
    assert code == 0 and "compensation: lstsq (form full, ridge 0.01, weighting norm, objective mse), fitted " \
                         "after the selection on 14 windows x 128 tokens (1,792;" in out
    code, out, _ = _prune(workspace, "--method", "shortgpt+heal")
    assert code == 0 and "compensation: none (shortgpt+heal fits nothing)" in out


def test_a_compensation_after_stage2_is_refused_before_any_work(workspace):
    """Issue 33 item 5: the fit reads the dense model's activations; after TRSP's stage 2 it would fold
    into weights stage 2 trained. Refused in one line naming the methods that can be compensated, on
    the one-process path (apply_method, before the model is copied), the dry run and the workers."""
    from types import SimpleNamespace

    from trsp_ray.config.run_config import for_method, load_config
    from trsp_ray.distributed.train import run_distributed
    from trsp_ray.run.methods import apply_method

    trained = load_config(overrides=[f"model={workspace / 'model'}", "method=trsp", "compensation.method=lstsq",
                                     "distributed.workers=2"])
    message = "compensation.method='lstsq' is not available with --method trsp: its stage 2 trains.*trsp[+]heal"
    untouched = SimpleNamespace(cfg=trained)  # no model: a refusal after any work would fail differently
    for start in (for_method, run_distributed, lambda cfg: apply_method(untouched, registry.method("trsp"))):
        with pytest.raises(TrspError, match=message) as err:
            start(trained)
        assert "\n" not in str(err.value)
    code, out, err = _prune(workspace, "--method", "trsp", "--set", "compensation.method=scalar")
    assert code == 2 and err.count("\n") == 1 and "compensation.method='scalar' is not available" in err
    # without stage 2 the fit runs as asked
    assert for_method(trained, stage2=False).compensation.method == "lstsq"
    assert for_method(load_config(overrides=["method=trsp", "compensation.method=lstsq", "stage2.enabled=false"])) \
        .compensation.method == "lstsq"
    assert for_method(load_config(overrides=["method=trsp-no-stage2", "compensation.method=lstsq"])) \
        .compensation.method == "lstsq"
    assert for_method(load_config(overrides=["method=trsp"])).compensation.method == "none"  # auto: no fit
