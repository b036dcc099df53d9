"""Every collective goes through distributed/collectives.py, which puts the tensor on the backend's
device: NCCL takes only tensors on the rank's GPU, gloo only host tensors. CPU tests run gloo, which
forgives a host tensor anywhere, so these tests stand in for the GPU: a stub backend records where
each tensor reaches it, and fake CUDA tensors (torch's FakeTensorMode, no GPU needed) play the
activations of a GPU run."""

from __future__ import annotations

import ast
import pathlib
from types import SimpleNamespace

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from trsp_ray.distributed import collectives

ROOT = pathlib.Path(__file__).resolve().parent.parent
HELPER = ROOT / "trsp_ray" / "distributed" / "collectives.py"
# torch.distributed's calls that move tensors (or pickled objects as tensors) between ranks
COLLECTIVES = {"all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_object", "broadcast",
               "broadcast_object_list", "reduce", "reduce_scatter", "reduce_scatter_tensor", "gather",
               "gather_object", "scatter", "scatter_object_list", "all_to_all", "all_to_all_single",
               "barrier", "send", "recv", "isend", "irecv", "monitored_barrier"}


# the modules whose collectives reach the backend: torch.distributed (and its c10d module, where the
# functions live) and DeepSpeed's comm, which wraps them
COMMS = {"torch.distributed", "torch.distributed.distributed_c10d", "deepspeed.comm", "deepspeed.comm.comm"}


def _paths(expr: ast.AST, bound: dict[str, set[str]]) -> set[str]:
    """The dotted names `expr` can stand for ('dist.all_reduce' -> {'torch.distributed.all_reduce'})."""
    if isinstance(expr, ast.Name):
        return bound.get(expr.id, set())
    if isinstance(expr, ast.Attribute):
        return {f"{base}.{expr.attr}" for base in _paths(expr.value, bound)}
    return set()


def _bindings(tree: ast.AST) -> dict[str, set[str]]:
    """{local name: the dotted names it is bound to}: every import (lazy ones too, under any alias) and
    every plain assignment of a bound name (`dist = torch.distributed`, `ar = comm.all_reduce`)."""
    bound: dict[str, set[str]] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                name = a.asname or a.name.split(".")[0]
                bound.setdefault(name, set()).add(a.name if a.asname else name)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            for a in node.names:
                bound.setdefault(a.asname or a.name, set()).add(f"{node.module}.{a.name}")
    grew = True
    while grew:  # an alias of an alias: until nothing new is bound
        grew = False
        for node in ast.walk(tree):
            targets = node.targets if isinstance(node, ast.Assign) else (
                [node.target] if isinstance(node, (ast.AnnAssign, ast.NamedExpr)) and node.value else [])
            for target in (t for t in targets if isinstance(t, ast.Name)):
                new = _paths(node.value, bound) - bound.get(target.id, set())
                if new:
                    bound.setdefault(target.id, set()).update(new)
                    grew = True
    return bound


def collective_calls(source: str) -> list[str]:
    """The collectives `source` calls through torch.distributed or deepspeed.comm, by any alias, imported
    name or assigned name, as 'line: name'."""
    tree = ast.parse(source)
    bound = _bindings(tree)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            for path in sorted(_paths(node.func, bound)):
                owner, _, name = path.rpartition(".")
                if owner in COMMS and name in COLLECTIVES:
                    found.append(f"{node.lineno}: {name}")
                    break
    return sorted(found, key=lambda f: int(f.split(":")[0]))


def test_the_check_sees_a_collective_called_by_any_spelling():
    snippets = {
        "import torch.distributed as dist\ndist.all_reduce(t)\n": ["2: all_reduce"],
        "import torch\ntorch.distributed.broadcast(t, src=0)\n": ["2: broadcast"],
        "from torch.distributed import all_gather_object as ago\nago(out, x)\n": ["2: all_gather_object"],
        "from torch import distributed as d\nd.barrier()\n": ["2: barrier"],
        "import torch.distributed as dist\ndist.get_rank()\nx.all_reduce()\n": [],
        # DeepSpeed's comm reaches the same backend (issue 49: the scan did not see it)
        "import deepspeed.comm as dist\ndist.all_reduce(t)\n": ["2: all_reduce"],
        "from deepspeed import comm\ncomm.all_gather(out, t)\n": ["2: all_gather"],
        "import deepspeed\ndeepspeed.comm.broadcast(t, 0)\n": ["2: broadcast"],
        "from deepspeed.comm import reduce_scatter_tensor as rs\nrs(out, t)\n": ["2: reduce_scatter_tensor"],
        # any alias of torch.distributed, however it is bound
        "import torch\nd = torch.distributed\nd.all_reduce(t)\n": ["3: all_reduce"],
        "import torch as th\nth.distributed.all_reduce(t)\n": ["2: all_reduce"],
        "import torch.distributed as dist\nfn = dist.all_reduce\nfn(t)\n": ["3: all_reduce"],
        "import torch.distributed as dist\na = dist\nb = a\nb.barrier()\n": ["4: barrier"],
        "def f():\n    from torch.distributed import distributed_c10d as c\n    c.all_reduce(t)\n": ["3: all_reduce"],
        "import deepspeed\nimport torch\ndeepspeed.init_distributed()\ntorch.cuda.synchronize()\n": [],
    }
    for source, expected in snippets.items():
        assert collective_calls(source) == expected, source


def test_no_module_but_the_helper_calls_a_collective():
    offenders = {}
    for folder in ("trsp_ray", "jobs", "benchmarks", "cluster"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            if path == HELPER:
                continue
            calls = collective_calls(path.read_text())
            if calls:
                offenders[str(path.relative_to(ROOT))] = calls
    assert offenders == {}, f"call distributed/collectives.py instead: {offenders}"
    assert collective_calls(HELPER.read_text()), "the helper itself must hold the collectives"


class StubBackend:
    """A torch.distributed stand-in with a group of two ranks: records the device of every tensor a
    collective receives and doubles it (the other rank holds the same value)."""

    def __init__(self, backend: str):
        self.backend, self.seen = backend, []
        self.ReduceOp = torch.distributed.ReduceOp

    def is_available(self):
        return True

    def is_initialized(self):
        return True

    def get_world_size(self, group=None):
        return 2

    def get_rank(self, group=None):
        return 0

    def get_backend(self, group=None):
        return self.backend

    def all_reduce(self, t, op=None):
        self.seen.append(t.device)
        t.mul_(2)

    def broadcast_object_list(self, box, src=0, group=None, device=None):
        self.seen.append(device)


@pytest.fixture
def stub(monkeypatch):
    def install(backend: str) -> StubBackend:
        fake = StubBackend(backend)
        monkeypatch.setattr(collectives, "_dist", lambda: fake)
        monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
        return fake
    return install


def test_nccl_gets_a_host_tensor_on_the_rank_gpu_and_the_caller_gets_it_back_on_the_host(stub):
    backend = stub("nccl")
    with FakeTensorMode(allow_non_fake_inputs=True):
        host = torch.ones(3)
        out = collectives.all_reduce(host)
        assert backend.seen == [torch.device("cuda", 0)]
        assert out.device == torch.device("cpu") and out.dtype == torch.float32
        summed = collectives.all_reduce_sum(host)
        assert backend.seen[-1] == torch.device("cuda", 0) and summed.device.type == "cpu"
        assert summed.dtype == torch.float64
    collectives.broadcast_object({"a": 1})
    assert backend.seen[-1] == torch.device("cuda", 0)


def test_gloo_gets_gpu_activation_sums_on_the_host_and_they_come_back_on_the_gpu(stub):
    backend = stub("gloo")
    with FakeTensorMode(allow_non_fake_inputs=True):
        on_gpu = torch.ones(3, device="cuda")
        out = collectives.all_reduce(on_gpu, op="max")
        assert backend.seen == [torch.device("cpu")]
        assert out.device == torch.device("cuda", 0)
        moved = collectives.all_reduce(on_gpu, to="cpu")
        assert moved.device == torch.device("cpu")


def test_the_helper_reduces_a_copy_and_names_a_bad_op(stub):
    stub("gloo")
    t = torch.tensor([1.0, 2.0])
    assert collectives.all_reduce(t).tolist() == [2.0, 4.0]
    assert t.tolist() == [1.0, 2.0]  # never in place
    assert collectives.max_over_ranks([1.0, 0.0]) == [2.0, 0.0]
    with pytest.raises(ValueError, match="'prod' is not one of"):
        collectives.all_reduce(t, op="prod")


def test_without_a_group_every_collective_is_the_identity():
    t = torch.tensor([1.5, 2.5])
    assert collectives.all_reduce_sum(t).tolist() == [1.5, 2.5]
    assert collectives.sum_over_ranks([1.0, 2.0]) == [1.0, 2.0]
    assert collectives.broadcast_object("x") == "x"
    assert collectives.gather_objects(7) == [7]
    assert collectives.rank_and_world() == (0, 1)
    collectives.barrier()


class _Probed(torch.nn.Module):
    """A stand-in decoder whose layers hand the gates' probes fake CUDA activations (a GPU run)."""

    def __init__(self, gates, mode):
        super().__init__()
        self.gates, self.mode, self.entries = gates, mode, []
        self.weight = torch.nn.Parameter(torch.zeros(1))  # the input ids stay on the host

    def base_model(self, input_ids, use_cache=False):
        self.entries.append("decoder")
        self._layers(input_ids)

    def forward(self, input_ids, labels=None, use_cache=False):
        """The whole model, LM head and loss included (what `head=True` runs: ZeRO-3's hooks)."""
        self.entries.append("model")
        self._layers(input_ids)
        with self.mode:
            return SimpleNamespace(loss=torch.zeros((), device="cuda"))

    def _layers(self, input_ids):
        rows, seq = input_ids.shape
        with self.mode:  # the forward runs "on the GPU"; the caller's bookkeeping on the host
            for w in self.gates.wrappers:
                x = torch.ones(rows, seq, 8, device="cuda")
                w.probe(w.index, x, 2 * x)


class _Wrapper:
    def __init__(self, index):
        self.index, self.probe = index, None


class _Gates:
    def __init__(self, n):
        self.wrappers = [_Wrapper(i) for i in range(n)]


def test_block_influence_masks_gpu_activations_with_a_host_padding_mask():
    """The first GPU run's crash: Block Influence on a ZeRO-3 worker multiplied the activations'
    cosine (cuda:0) by the padding mask (host). The mask now follows the activations."""
    from trsp_ray.method.selectors import influence_tensors

    gates = _Gates(3)
    batches = [torch.zeros(2, 4, dtype=torch.long), torch.zeros(1, 4, dtype=torch.long)]
    masks = [torch.ones(2), torch.zeros(1)]  # host tensors, as distributed/ranks.py makes them
    model = _Probed(gates, FakeTensorMode(allow_non_fake_inputs=True))
    sums, count = influence_tensors(model, gates, batches, masks=masks)
    assert {v.device for v in sums.values()} == {torch.device("cuda", 0)}
    assert all(v.dtype == torch.float64 for v in sums.values())
    assert count == 2 * 4  # the padding window counts nowhere


def test_the_workers_block_influence_path_runs_on_gpu_activations(monkeypatch):
    """What the Ray Train workers run (ranks.block_influence_on_ranks: their share of the windows, a
    padding row with a host mask, the whole model with its head, head=True), on fake CUDA
    activations. The test above runs head=False, the one-process path; the workers' path differs."""
    from trsp_ray.distributed import ranks
    from trsp_ray.method import selectors

    calls = []

    def on_gpu(model, gates, batches, **kwargs):  # the workers' call, run on the fake GPU
        sums, count = selectors.influence_tensors(model, gates, batches, **kwargs)
        calls.append({"kwargs": kwargs, "devices": {v.device for v in sums.values()}, "count": count})
        return {i: 0.0 for i in sums}, count

    monkeypatch.setattr(selectors, "influence_sums", on_gpu)
    monkeypatch.setattr(ranks, "forward_engine", lambda bench, fresh=False: None)
    gates = _Gates(3)
    model = _Probed(gates, FakeTensorMode(allow_non_fake_inputs=True))
    bench = SimpleNamespace(model=model, gates=gates, world=2)
    cfg = SimpleNamespace(data=SimpleNamespace(batch_size=2))
    windows = [torch.zeros(1, 4, dtype=torch.long) for _ in range(3)]  # rank 1 holds one, then pads
    ranks.block_influence_on_ranks(cfg, bench, windows, rank=1)
    (call,) = calls
    assert call["kwargs"]["head"] is True and set(model.entries) == {"model"}  # the whole model, as on workers
    assert [m.tolist() for m in call["kwargs"]["masks"]] == [[1.0], [0.0]]  # host masks, one padding row
    assert call["devices"] == {torch.device("cuda", 0)} and call["count"] == 4  # the padding row counts nowhere
