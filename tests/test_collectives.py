"""Every collective goes through distributed/collectives.py, which puts the tensor on the backend's
device: NCCL takes only tensors on the rank's GPU, gloo only host tensors. CPU tests run gloo, which
forgives a host tensor anywhere, so these tests stand in for the GPU: a stub backend records where
each tensor reaches it, and fake CUDA tensors (torch's FakeTensorMode, no GPU needed) play the
activations of a GPU run."""

from __future__ import annotations

import ast
import pathlib

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


def collective_calls(source: str) -> list[str]:
    """The torch.distributed collectives `source` calls (by alias or by imported name), as 'line: name'."""
    tree = ast.parse(source)
    aliases, names = set(), {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name == "torch.distributed":
                    aliases.add(a.asname or "torch.distributed")
        elif isinstance(node, ast.ImportFrom) and node.module == "torch.distributed":
            for a in node.names:
                if a.name in COLLECTIVES:
                    names[a.asname or a.name] = a.name
        elif isinstance(node, ast.ImportFrom) and node.module == "torch":
            for a in node.names:
                if a.name == "distributed":
                    aliases.add(a.asname or "distributed")
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        f = node.func
        if isinstance(f, ast.Attribute) and f.attr in COLLECTIVES:
            owner = ast.unparse(f.value)
            if owner in aliases or owner == "torch.distributed":
                found.append(f"{node.lineno}: {f.attr}")
        elif isinstance(f, ast.Name) and f.id in names:
            found.append(f"{node.lineno}: {names[f.id]}")
    return found


def test_the_check_sees_a_collective_called_by_any_spelling():
    snippets = {
        "import torch.distributed as dist\ndist.all_reduce(t)\n": ["2: all_reduce"],
        "import torch\ntorch.distributed.broadcast(t, src=0)\n": ["2: broadcast"],
        "from torch.distributed import all_gather_object as ago\nago(out, x)\n": ["2: all_gather_object"],
        "from torch import distributed as d\nd.barrier()\n": ["2: barrier"],
        "import torch.distributed as dist\ndist.get_rank()\nx.all_reduce()\n": [],
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
        self.gates, self.mode = gates, mode
        self.weight = torch.nn.Parameter(torch.zeros(1))  # the input ids stay on the host

    def base_model(self, input_ids, use_cache=False):
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
