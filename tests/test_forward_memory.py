"""Issue 40 item 4: the plans of Block Influence and of the least-squares fit count what those passes
hold. Each pass runs on a CPU Llama of Llama proportions (d 256, I 768, 6 layers) in fp32 and bf16
while a dispatch mode counts the bytes of every tensor it creates that is still alive (an analog of
torch.cuda.max_memory_allocated above the weights); the plan's figure for the same shape, tokens and
dtype must land within 15% of that count. On one H200 the plans had put Block Influence 59-80% over
(they counted logits its decoder-only pass never makes) and the fit 36-38% under (the run held the
dense copy and the removed layers beside the pruned model: tests below)."""

import copy
import gc
import weakref

import pytest
import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from trsp_ray.config import registry
from trsp_ray.method import compensation, selectors
from trsp_ray.method.boundaries import blocks
from trsp_ray.method.gates import attach_gates
from trsp_ray.method.surgery import remove_layers
from trsp_ray.plan.compensation_plan import fit_phases
from trsp_ray.plan.memory import GB
from trsp_ray.plan.shape import read_shape
from trsp_ray.plan.single_plan import SingleSetup, single_forward
from trsp_ray.plan.zero3_plan import influence_stage
from trsp_ray.plan.zero3_setup import Setup

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
ROWS, SEQLEN = 4, 128


class LiveBytes(TorchDispatchMode):
    """The peak, over every op run under it, of the bytes of the storages its ops created that are still
    referenced (views and in-place results of an op's inputs are not new)."""

    def __init__(self):
        super().__init__()
        self.live: dict[int, tuple[StorageWeakRef, int]] = {}
        self.now = self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for key in [k for k, (ref, _) in self.live.items() if ref.expired()]:
            self.now -= self.live.pop(key)[1]
        inputs = {t.untyped_storage()._cdata for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)}
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                storage = t.untyped_storage()
                key = storage._cdata
                if key not in inputs and key not in self.live:
                    self.live[key] = (StorageWeakRef(storage), storage.nbytes())
                    self.now += storage.nbytes()
        self.peak = max(self.peak, self.now)
        return out


def _llama(tmp_path, dtype, *, intermediate: int = 768, vocab: int = 512):
    """A random Llama of Llama-3 proportions (d 256, I = 3d, GQA) in `dtype`, and its planner Shape."""
    import transformers as tf

    config = tf.LlamaConfig(vocab_size=vocab, hidden_size=256, intermediate_size=intermediate, num_hidden_layers=6,
                            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    config.save_pretrained(tmp_path)
    torch.manual_seed(0)
    model = tf.AutoModelForCausalLM.from_config(config).to(DTYPES[dtype]).eval()
    return model, read_shape(str(tmp_path))


def _windows(n: int, *, vocab: int = 512):
    return list(torch.randint(0, vocab, (n * ROWS, SEQLEN), generator=torch.Generator().manual_seed(1)).split(ROWS))


def _peak(fn) -> int:
    gc.collect()
    with torch.no_grad(), LiveBytes() as counter:
        fn()
    return counter.peak


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("intermediate", [768, 256])
def test_block_influence_holds_what_its_plan_counts(tmp_path, dtype, intermediate):
    """ShortGPT's pass (selectors.decoder_forward, no LM head) holds one layer's forward or, with a
    narrow MLP (as the 3B's I = 2.7d on the GPU), the fp32 probe: the plan's stage less the weights."""
    model, s = _llama(tmp_path, dtype, intermediate=intermediate)
    gates = attach_gates(model)
    measured = _peak(lambda: selectors.block_influence(model, gates, _windows(2)))
    e = 4 if dtype == "fp32" else 2
    stage = single_forward("shortgpt", s, SingleSetup(dtype_bytes=e, baseline_batch=ROWS, baseline_seqlen=SEQLEN),
                           batch=ROWS, seqlen=SEQLEN, evaluation=False)
    planned = (stage.total - sum(v for k, v in stage.parts.items() if k.startswith(("model", "runtime")))) * GB
    assert 0.85 <= planned / measured <= 1.15, (planned, measured)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_block_influence_on_workers_holds_what_its_plan_counts(tmp_path, dtype):
    """On ZeRO-3 workers the pass runs the LM head and the loss (influence_sums with head=True, as
    ranks.block_influence_on_ranks calls it; the engine's gathers are the plan's other parts): with a
    vocabulary 32 times the width, the logits, their fp32 upcast and the log-softmax are its peak."""
    model, s = _llama(tmp_path, dtype, vocab=8192)
    gates = attach_gates(model)
    measured = _peak(lambda: selectors.influence_sums(model, gates, _windows(2, vocab=8192), head=True))
    e = 4 if dtype == "fp32" else 2
    stage = influence_stage(s, Setup(workers=1, dtype_bytes=e, micro_batch=ROWS, seqlen=SEQLEN))
    planned = stage.parts["one layer | the fp32 probe | the logits"] * GB
    assert 0.85 <= planned / measured <= 1.15, (planned, measured)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("drop", [[2], [2, 3], [2, 4]])
def test_the_fit_holds_what_its_plan_counts(tmp_path, dtype, drop):
    """The fit's pass (the sums and one batch's rows beside one layer's forward) and the whole fit
    (the pass, the solves and, in one memory, the fold into the pruned copy) against fit_phases for
    the blocks of the drop set: one block, a two-layer block, two blocks."""
    dense, s = _llama(tmp_path, dtype)
    pruned = copy.deepcopy(dense)
    remove_layers(pruned, drop)
    windows = _windows(3)
    e = 4 if dtype == "fp32" else 2
    phases = fit_phases(s, dtype_bytes=e, tokens=ROWS * SEQLEN, blocks=len(blocks(drop, s.layers)), sharded=False)
    pass_peak = _peak(lambda: compensation.accumulate(dense=dense, windows=windows, drop=drop))
    assert 0.85 <= phases["pass"] * GB / pass_peak <= 1.15, (phases, pass_peak)
    whole = _peak(lambda: compensation.compensate(model=pruned, dense=dense, drop=drop, windows=windows))
    assert 0.85 <= max(phases.values()) * GB / whole <= 1.15, (phases, whole)


def test_the_fit_leaves_one_model_on_the_device(tmp_path, monkeypatch):
    """On a GPU the fit's dense copy must be gone before the pruned copy returns to the device, and the
    removed layers gone before the fit: the first GPU run held both models and the removed layers
    (1B: 2.00 + 1.55 + 0.45 GiB + cuBLAS's 0.03 = the 4.03 measured; 3B: 5.53 + 4.22 + 1.31 + 0.03 = 11.09).
    methods._dense_beside is replaced by one that hands out a copy (the GPU branch) and checks, as the
    block ends, that nothing else holds it."""
    import contextlib

    from trsp_ray.config.run_config import load_config
    from trsp_ray.models import families
    from trsp_ray.models.tiny import tiny_workspace
    from trsp_ray.run import methods
    from trsp_ray.run.workbench import prepare

    root = tiny_workspace(tmp_path / "ws", layers=6, calib_chars=20000, eval_chars=6000)
    cfg = load_config(overrides=[f"model={root / 'model'}", f"data.calib_text={root / 'calib.txt'}",
                                 f"data.eval_text={root / 'eval.txt'}", "data.seqlen=32", "ratio=0.34", "threads=1",
                                 "tracking.enabled=false", "method=shortgpt+comp", "compensation.windows=16"])
    bench = prepare(cfg)
    removed, seen = [], {}

    def on_model(model):
        removed.extend(weakref.ref(layer) for i, layer in enumerate(families.decoder_layers(model)) if i in (2, 4))

    @contextlib.contextmanager
    def dense_beside(bench, model, *, activations):
        gc.collect()
        seen["removed layers alive at the fit"] = sum(ref() is not None for ref in removed)
        dense = bench.fresh_model()
        ref = weakref.ref(dense)
        yield dense
        del dense
        gc.collect()
        seen["dense copy alive as the pruned copy returns"] = ref() is not None

    monkeypatch.setattr(methods, "_dense_beside", dense_beside)
    out = methods.apply_method(bench, registry.method("shortgpt+comp"), drop=[2, 4], on_model=on_model)
    assert out.info["compensation_tokens"] == 16 * 32
    assert seen == {"removed layers alive at the fit": 0, "dense copy alive as the pruned copy returns": False}


def test_the_dense_copy_leaves_the_device_whoever_still_names_it():
    """methods._dense_beside where the original lives elsewhere than the working copy (a GPU run; here
    the original is on the meta device): the transient dense copy is emptied as the block ends, while
    the caller's `as` target still names it (as a wrapper measuring the stage does, benchmarks/gpu_memory.py),
    before the pruned copy returns."""
    from types import SimpleNamespace

    from trsp_ray.models.tiny import tiny_model
    from trsp_ray.run import methods

    working, copies = tiny_model("llama", layers=2), []

    def scoring_model():
        copies.append(tiny_model("llama", layers=2))
        return copies[-1]

    bench = SimpleNamespace(model=tiny_model("llama", layers=2).to("meta"), scoring_model=scoring_model)
    with methods._dense_beside(bench, working, activations="dense") as dense:
        assert dense is copies[0] and {p.device.type for p in dense.parameters()} == {"cpu"}
    assert {p.device.type for p in dense.parameters()} == {"meta"}  # named here, emptied all the same
    assert {p.device.type for p in working.parameters()} == {"cpu"}


def test_the_pruned_evaluation_holds_the_kept_weights(tmp_path):
    """The default pipeline scores the pruned model too, with its kept layers only: on the first GPU
    run's 1B shape (16 layers, 4 dropped) the plan's weights for that pass are the bytes of a meta
    Llama cut as the run cuts it (one stage with the dense weights put that pass 16-23% over)."""
    import transformers as tf

    from trsp_ray.config.run_config import load_config
    from trsp_ray.plan.single_plan import PRUNED_EVALUATION, single_plan, single_stages

    config = tf.LlamaConfig(vocab_size=49152, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                            num_attention_heads=32, num_key_value_heads=8, tie_word_embeddings=True)
    config.save_pretrained(tmp_path)
    with torch.device("meta"):
        model = tf.AutoModelForCausalLM.from_config(config).to(torch.bfloat16)
    remove_layers(model, [3, 7, 9, 12])
    kept_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    stages = single_stages(load_config(None, []))
    assert stages[-2:] == ("evaluation", PRUNED_EVALUATION)
    plan = single_plan(read_shape(str(tmp_path)), SingleSetup(dtype_bytes=2), stages[-2:], n_drop=4)
    dense, pruned = plan.stages
    assert pruned.parts["model (working copy)"] * GB == kept_bytes
    assert dense.parts["model (working copy)"] * GB > kept_bytes
    assert pruned.total - pruned.parts["model (working copy)"] == dense.total - dense.parts["model (working copy)"]
