"""Issue 32 item 2: ReplaceMe's cosine objective for the compensation map (compensation.objective=
cosine, trsp_ray/method/compensation_cosine.py). The cosine map folds exactly like the least-squares one,
lowers the mean 1 - cos of the repaired stream below the least-squares map's on the same calibration
rows (and pays for it in squared error: the two objectives differ), keeps its form, is what the ZeRO-3
workers' sharded fit computes, is counted in the plan, and bad settings are one-line errors."""

import json
import os
import subprocess
import sys

import pytest
import torch

from trsp_ray.common.errors import TrspError
from trsp_ray.method import compensation, compensation_cosine
from trsp_ray.method.surgery import remove_layers
from trsp_ray.models import families
from trsp_ray.models.tiny import VOCAB, tiny_model, with_random_biases
from trsp_ray.run.workbench import copy_model

DROP = [2, 3]  # one block: the map folds into layer 1


def _windows(count=4, batch=4, seqlen=32, seed=1):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (batch, seqlen), generator=gen) for _ in range(count)]


def _pruned(dense, drop=DROP):
    model = copy_model(dense, torch.device("cpu"))
    remove_layers(model, drop)
    return model


@torch.no_grad()
def _rows(dense, windows, a, b):
    """(x, r, y) of block [a..b] over `windows`, [n, d] float64, by the test's own hooks: the MLP
    output of layer a-1, the stream it is added to, and the dense output of layer b."""
    layers = families.decoder_layers(dense)
    got = {"x": [], "out": [], "y": []}
    first = lambda out: out[0] if isinstance(out, tuple) else out
    handles = [families.map_output(layers[a - 1], dense)[0].register_forward_hook(
                   lambda _m, _i, out: got["x"].append(out.flatten(0, -2))),
               layers[a - 1].register_forward_hook(lambda _m, _i, out: got["out"].append(first(out).flatten(0, -2))),
               layers[b].register_forward_hook(lambda _m, _i, out: got["y"].append(first(out).flatten(0, -2)))]
    for batch in windows:
        dense(input_ids=batch, use_cache=False)
    for h in handles:
        h.remove()
    x, out, y = (torch.cat(got[k]).double() for k in ("x", "out", "y"))
    return x, out - x, y


def _cosine_loss(t, x, r, y):
    return (1 - torch.nn.functional.cosine_similarity(x @ t + r, y, dim=-1)).mean()


def _squared(t, x, r, y):
    return ((x @ t + r - y) ** 2).sum().item()


def _samples(x, r, y, block=(2, 3)):
    return compensation_cosine.Samples(block, [(x.float(), r.float(), y.float())])


@torch.no_grad()
def _logits_with_map(model, layer: int, t: torch.Tensor, ids):
    """Logits of the plain pruned `model` with the MLP output of decoder `layer` (Gemma: after its norm)
    right-multiplied by `t` in a forward hook of the test's own: what the fold claims to compute without one."""
    proj = families.map_output(families.decoder_layers(model)[layer], model)[0]
    handle = proj.register_forward_hook(lambda _m, _i, out: (out.double() @ t).to(out.dtype))
    try:
        return model(input_ids=ids, use_cache=False).logits
    finally:
        handle.remove()


def test_the_cosine_fit_imports_no_distributed_or_tracking_library():
    import ast
    import importlib.util
    from pathlib import Path

    tree = ast.parse(Path(importlib.util.find_spec("trsp_ray.method.compensation_cosine").origin).read_text())
    names = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    names |= {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    assert names <= {"__future__", "collections", "dataclasses", "torch", "trsp_ray"}


@pytest.mark.parametrize("family", ["llama", "opt"])  # OPT: fc2 with a (random) bias folded too
def test_the_folded_cosine_map_equals_the_model_with_the_map_applied(family):
    dense, windows = with_random_biases(tiny_model(family, layers=6)), _windows()
    folded, lstsq, plain = _pruned(dense), _pruned(dense), _pruned(dense)
    info = compensation.compensate(model=folded, dense=dense, drop=DROP, windows=windows, ridge=1e-4,
                                   objective="cosine")
    compensation.compensate(model=lstsq, dense=dense, drop=DROP, windows=windows, ridge=1e-4)
    assert info["cosine"][0] < info["cosine_lstsq"][0] and info["cosine_steps"][0] >= 1
    # the map, from rows gathered by the test's hooks and the least-squares start of the same sums
    x, r, y = _rows(dense, windows, 2, 3)
    stats, = compensation.accumulate(dense=dense, windows=windows, drop=DROP)
    t0 = compensation.solve(stats.mtm, stats.mty, ridge=1e-4)
    t, got = compensation_cosine.fit(_samples(x, r, y), t0, ridge=1e-4)
    assert got["cosine"] == pytest.approx(info["cosine"][0], rel=1e-6)
    ids = _windows(count=1, batch=2, seqlen=24, seed=7)[0]
    with torch.no_grad():
        want = _logits_with_map(plain, 1, t, ids)
        have = folded(input_ids=ids, use_cache=False).logits
        other = lstsq(input_ids=ids, use_cache=False).logits
    assert torch.allclose(have, want, rtol=1e-4, atol=1e-5), (have - want).abs().max()
    assert (other - want).abs().max() > 100 * (have - want).abs().max()  # the lstsq fold is not it


@pytest.mark.parametrize("form,rank", [("full", None), ("diagonal", None), ("lowrank", 8)])
def test_the_cosine_map_has_the_lower_cosine_loss_and_the_lstsq_map_the_lower_squared_error(form, rank,
                                                                                          monkeypatch):
    dense, windows = tiny_model("llama", layers=6), _windows()
    x, r, y = _rows(dense, windows, 2, 3)
    m, target = x, y - r  # least squares: M T ~ Y on the same rows, unweighted, no ridge
    a, b = m.T @ m, m.T @ target
    t_mse = compensation.solve(a, b, ridge=0.0, form=form, rank=rank)
    t_cos, got = compensation_cosine.fit(_samples(x, r, y), t_mse, form=form, rank=rank, ridge=0.0)
    loss_mse, loss_cos = _cosine_loss(t_mse, x, r, y).item(), _cosine_loss(t_cos, x, r, y).item()
    print(f"{form}: 1 - cos {loss_mse:.5f} (lstsq) -> {loss_cos:.5f} (cosine); squared error "
          f"{_squared(t_mse, x, r, y):.3f} -> {_squared(t_cos, x, r, y):.3f}")
    assert got["cosine_lstsq"] == pytest.approx(loss_mse, rel=1e-5)
    assert got["cosine"] == pytest.approx(loss_cos, rel=1e-5)
    assert loss_cos < loss_mse - (2e-3 if form == "full" else 1e-4)
    assert _squared(t_mse, x, r, y) < _squared(t_cos, x, r, y)
    # near the minimum over the form's maps: run on without the early stop, the fit gains under 3e-4 of L
    # and ends where the gradient is a sliver of the start's
    monkeypatch.setattr(compensation_cosine, "TOLERANCE", 0.0)
    t_end, end = compensation_cosine.fit(_samples(x, r, y), t_mse, form=form, rank=rank, ridge=0.0, steps=100)
    assert end["cosine"] <= loss_cos and loss_cos - end["cosine"] < 3e-4 * loss_cos
    grads = []
    for t in (t_mse, t_end):
        t = t.clone().requires_grad_(True)
        _cosine_loss(t, x, r, y).backward()
        g = t.grad.diagonal() if form == "diagonal" else t.grad
        grads.append(g.norm().item())
    if form != "lowrank":  # lowrank minimises over its subspace only
        assert grads[1] < 1e-3 * grads[0]
    eye = torch.eye(t_cos.shape[0], dtype=t_cos.dtype)
    if form == "diagonal":
        assert torch.equal(t_cos, torch.diag(t_cos.diagonal()))
    if form == "lowrank":
        assert torch.linalg.matrix_rank(t_cos - eye).item() <= rank


def test_sequential_activations_refine_each_block_on_the_stream_that_reaches_it():
    dense, windows, drop = tiny_model("llama", layers=7), _windows(), [4, 1, 2]
    model = _pruned(dense, drop)
    info = compensation.compensate(model=model, dense=dense, drop=drop, windows=windows, activations="sequential",
                                   objective="cosine")
    assert info["blocks"] == [(1, 2), (4, 4)] and len(info["cosine"]) == 2
    assert all(after < before for after, before in zip(info["cosine"], info["cosine_lstsq"]))


def test_bad_objectives_are_one_line_errors_before_any_work():
    from trsp_ray.config.run_config import for_method, load_config
    from trsp_ray.config.sections import CompensationConfig

    cases = [(lambda: CompensationConfig(objective="cos"), "compensation.objective='cos' is not valid; choose one of "
              "mse, cosine"),
             (lambda: CompensationConfig(method="scalar", objective="cosine"), "compensation.method='scalar' fits "
              "per-block scales"),
             (lambda: CompensationConfig(method="none", objective="cosine"), "compensation.method='none' fits no map"),
             # auto resolves to none for a method without a fit
             (lambda: for_method(load_config(overrides=["method=shortgpt+heal", "compensation.objective=cosine"])),
              "compensation.method='none' fits no map"),
             (lambda: compensation.compensate(model=None, dense=tiny_model("llama"), drop=DROP, windows=_windows(),
                                              method="scalar", objective="cosine"), "fits per-block scales"),
             (lambda: compensation.compensate(model=None, dense=tiny_model("llama"), drop=DROP, windows=_windows(),
                                              objective="angle"), "compensation.objective='angle' is not valid")]
    for make, message in cases:
        with pytest.raises(TrspError, match=message.replace("(", r"\(").replace(")", r"\)")) as err:
            make()
        assert "\n" not in str(err.value)
    c = for_method(load_config(overrides=["compensation.objective=cosine"])).compensation  # the default compensates
    assert (c.method, c.objective) == ("lstsq", "cosine")
    assert compensation.describe(c)["compensation_objective"] == "cosine"
    assert compensation.describe(CompensationConfig(method="lstsq"))["compensation_objective"] == "mse"


def test_the_plan_counts_the_cached_rows_and_the_steps():
    """Llama-2-70B on 16 workers, 112 windows x 2048 tokens (28 per column): each worker caches its
    14,336 tokens' x, r, y of each of the 20 blocks in bf16 on the host (13.1 GB) and steps with six
    d x d float64 matrices (3 GB) and a 4,096-token float64 chunk (1.75 GB) on the GPU."""
    from pathlib import Path

    from trsp_ray.plan import shape, zero3_setup
    from trsp_ray.plan.compensation_plan import compensation_plan

    s = shape.read_shape(str(Path(__file__).resolve().parents[1] / "cluster" / "models" / "llama-2-70b.json"))
    st = zero3_setup.Setup(workers=16, gpu_memory_gb=80, activation_checkpointing=True)
    mse = compensation_plan(s, st, ratio=0.25, windows=112, protect_head=1, protect_tail=1)
    cos = compensation_plan(s, st, ratio=0.25, windows=112, protect_head=1, protect_tail=1, objective="cosine")
    assert cos.host_gb - mse.host_gb == pytest.approx(20 * 3 * 14336 * 8192 * 2 / 2**30) == 13.125
    assert set(cos.phases) - set(mse.phases) == {"cosine"}
    assert cos.phases["cosine"] == pytest.approx(20.0 + 3.0 + 1.75)  # beside the 20 blocks' sums
    assert cos.memory.total == pytest.approx(mse.memory.total - max(mse.phases.values()) + cos.phases["cosine"])
    with pytest.raises(ValueError, match="calibration windows"):
        compensation_plan(s, st, ratio=0.25, windows=0, objective="cosine")


@pytest.mark.parametrize("family", ["gemma2", "gemma3_text"])
@pytest.mark.parametrize("objective", ["mse", "cosine"])
def test_gemma_folds_a_diagonal_map_exactly_into_its_mlp_norm(family, objective):
    """Gemma's post_feedforward_layernorm divides the MLP output by its own rms, so a full map folded
    into down_proj would be undone; a diagonal D folds exactly into that norm's scale (1 + w) D. The
    default form (full) fits the diagonal there, with either objective; lowrank is refused."""
    dense, windows = tiny_model(family, layers=6), _windows()
    gen = torch.Generator().manual_seed(4)
    with torch.no_grad():  # a norm scale away from 1 + 0, so that a fold that forgot the offset shows
        for layer in families.decoder_layers(dense):
            layer.post_feedforward_layernorm.weight.copy_(0.3 * torch.randn(64, generator=gen))
    folded, plain = _pruned(dense), _pruned(dense)
    info = compensation.compensate(model=folded, dense=dense, drop=DROP, windows=windows, ridge=1e-4,
                                   objective=objective)
    assert info["form"] == "diagonal" and info["residual"][0] < 0.99 * info["residual_identity"][0]
    x, r, y = _rows(dense, windows, 2, 3)
    stats, = compensation.accumulate(dense=dense, windows=windows, drop=DROP)
    t = compensation.solve(stats.mtm, stats.mty, ridge=1e-4, form="diagonal")
    if objective == "cosine":
        t, got = compensation_cosine.fit(_samples(x, r, y), t, form="diagonal", ridge=1e-4)
        assert got["cosine"] < got["cosine_lstsq"]
    assert (t.diagonal() - 1).abs().max() > 1e-3  # a map, not the identity
    ids = _windows(count=1, batch=2, seqlen=24, seed=7)[0]
    with torch.no_grad():
        want = _logits_with_map(plain, 1, t, ids)
        have = folded(input_ids=ids, use_cache=False).logits
        none = plain(input_ids=ids, use_cache=False).logits
    assert torch.allclose(have, want, rtol=1e-4, atol=1e-5), (have - want).abs().max()
    assert (none - want).abs().max() > 100 * (have - want).abs().max()
    before = families.decoder_layers(plain)[1].mlp.down_proj.weight
    assert torch.equal(families.decoder_layers(folded)[1].mlp.down_proj.weight, before)  # the norm took it
    with pytest.raises(TrspError, match="compensation.form='lowrank' cannot fold into family") as err:
        compensation.compensate(model=_pruned(dense), dense=dense, drop=DROP, windows=windows, form="lowrank", rank=4)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("family", ["llama", "gemma2"])
def test_the_workers_fit_and_fold_give_the_one_process_model(family):
    """distributed/compensate.fit + fold on one rank (the model keeps its layers, the drop set bypassed)
    fold the one-process cosine map: into down_proj, or on Gemma the diagonal into its MLP norm."""
    from trsp_ray.config.sections import CompensationConfig
    from trsp_ray.distributed import compensate
    from trsp_ray.method.gates import attach_gates

    dense, windows = tiny_model(family, layers=6), _windows()
    one = _pruned(dense)
    compensation.compensate(model=one, dense=dense, drop=DROP, windows=windows, ridge=1e-4, objective="cosine")
    whole = copy_model(dense, torch.device("cpu"))
    gates = attach_gates(whole)
    gates.set_bypass(DROP)
    info = compensate.fit(model=whole, gates=gates, drop=DROP, windows=windows, rank=0, world=1, ridge=1e-4,
                          objective="cosine", reduce=lambda t: t.double().clone())
    compensate.fold(model=whole, maps=info["maps"])
    assert info["form"] == ("diagonal" if family == "gemma2" else "full") and info["cosine_steps"][0] >= 1
    metrics = compensate.manifest_metrics(CompensationConfig(method="lstsq", objective="cosine"), info)
    assert (metrics["compensation_objective"], metrics["compensation_form"]) == ("cosine", info["form"])
    want = families.map_output(families.decoder_layers(one)[1], one)[0].weight
    got = families.map_output(families.decoder_layers(whole)[1], whole)[0].weight
    assert not torch.equal(got, families.map_output(families.decoder_layers(dense)[1], dense)[0].weight)
    assert torch.allclose(got, want, rtol=1e-6, atol=1e-7), (got - want).abs().max()


GLOO_WORKER = r"""
import json, os, sys, torch
import torch.distributed as dist
from trsp_ray.distributed import compensate
from trsp_ray.method.gates import attach_gates
from trsp_ray.models.tiny import tiny_model
torch.set_num_threads(1)
windows_file, out = sys.argv[1:3]
rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
dist.init_process_group("gloo", rank=rank, world_size=world)
model = tiny_model("llama", layers=6)
gates = attach_gates(model)
gates.set_bypass([2, 4])  # as stage 1 leaves it: the fit must see the dense model
info = compensate.fit(model=model, gates=gates, drop=[2, 4], windows=torch.load(windows_file), rank=rank,
                      world=world, ridge=1e-4, objective="cosine")
torch.save(info["maps"], f"{out}.{rank}.pt")
print("RESULT " + json.dumps({k: info[k] for k in ("tokens", "cosine", "cosine_lstsq", "cosine_steps")}), flush=True)
dist.destroy_process_group()
"""


def test_two_gloo_ranks_fit_the_one_process_cosine_maps(tmp_path):
    """The workers' path (distributed/compensate.fit, all-reduced curvature, gradients and step losses)
    on 2 gloo ranks gives the one-process cosine maps: rank 0 has windows 0 and 2, rank 1 window 1."""
    from trsp_ray.distributed.ranks import free_port

    gen = torch.Generator().manual_seed(3)
    windows = list(torch.randint(0, VOCAB, (3, 48), generator=gen).split(2))  # 144 tokens > hidden 64
    torch.save(windows, tmp_path / "windows.pt")
    port = free_port()
    args = [sys.executable, "-c", GLOO_WORKER, str(tmp_path / "windows.pt"), str(tmp_path / "maps")]
    env = {**os.environ, "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    procs = [subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env={**env, "RANK": str(r)}) for r in range(2)]
    results = []
    for proc in procs:
        try:
            stdout, stderr = proc.communicate(timeout=300)
        finally:
            if proc.poll() is None:
                proc.kill()
        assert proc.returncode == 0, stderr[-3000:]
        results.append(json.loads(next(line[7:] for line in stdout.splitlines() if line.startswith("RESULT "))))
    dense = tiny_model("llama", layers=6)
    one = {}
    for span in ((2, 2), (4, 4)):  # the one-process fit of each block on all the windows
        collect = compensation_cosine.Collector()
        stats, = compensation.accumulate(dense=dense, windows=windows, drop=[2, 4], block=span, sink=collect)
        t0 = compensation.solve(stats.mtm, stats.mty, ridge=1e-4)
        one[span] = compensation_cosine.fit(collect.pop(span), t0, ridge=1e-4)
    for rank, result in enumerate(results):
        assert result["tokens"] == 144
        maps = torch.load(tmp_path / f"maps.{rank}.pt")
        for (span, t), k in zip(maps, range(2)):
            want, got = one[tuple(span)]
            assert result["cosine"][k] == pytest.approx(got["cosine"], rel=1e-9)
            assert result["cosine_steps"][k] == got["cosine_steps"] >= 1
            assert torch.allclose(t, want, rtol=1e-8, atol=1e-10), (t - want).abs().max()


@pytest.mark.parametrize("tolerance, bound", [(1.0, 10), (0.0, 10), (0.0, 2)])
def test_the_fit_is_charged_the_passes_it_ran(monkeypatch, tolerance, bound):
    """Issue 49: a fit that stopped on its tolerance was charged one Gauss-Newton pass more than it
    ran (steps + 1, as if a last pass had found no gain). Tolerance 1.0 stops after the first step; 0.0
    runs until no step gains (or the bound): then the pass that found none ran and is charged."""
    from trsp_ray.config.run_config import for_method, load_config
    from trsp_ray.plan import compute

    gen = torch.Generator().manual_seed(0)
    x, r, y = (torch.randn(256, 8, generator=gen, dtype=torch.float64) for _ in range(3))
    samples = compensation_cosine.Samples((1, 2), [(x, r, y)])
    calls = []
    gradient = compensation_cosine._gradient
    monkeypatch.setattr(compensation_cosine, "_gradient", lambda s, t: calls.append(1) or gradient(s, t))
    monkeypatch.setattr(compensation_cosine, "TOLERANCE", tolerance)
    t0 = torch.linalg.lstsq(x, y - r).solution
    _, info = compensation_cosine.fit(samples, t0, steps=bound)
    steps, passes = info["cosine_steps"], len(calls)
    assert steps >= 1 and passes == (1 if tolerance else min(steps + 1, bound))
    cfg = for_method(load_config(overrides=["method=shortgpt+cos+heal"]))
    done = {"tokens": 256, "blocks": [(1, 2)], **{k: [v] for k, v in info.items()}}  # as compensate reports it
    assert compute.measured_solve_cost(cfg, cfg.compensation, done) == pytest.approx(
        compute.solve_cost(cfg, cfg.compensation, tokens=256, blocks=1, cosine_steps=[passes]))
