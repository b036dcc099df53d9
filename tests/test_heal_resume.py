"""A heal in one process resumes from its last checkpoint (run/heal_store.py): interrupted, a rerun computes
only the steps after the checkpoint and ends with the uninterrupted heal's weights; another model before
the heal or other heal settings start afresh; a finished heal leaves nothing stored; the checkpoint's size
is the plan's figure."""

import pytest
import torch

from trsp_ray.config import registry
from trsp_ray.config.run_config import load_config, replace

SMALL = ["data.seqlen=32", "data.batch_size=2", "data.eval_seqlen=64", "data.eval_max_windows=4",
         "baselines.calib_windows=2", "stage2.steps=6", "threads=1", "tracking.enabled=false",
         "heal.checkpoint_minutes=0"]
METHOD = "shortgpt+comp+heal"


@pytest.fixture
def steps(monkeypatch):
    """Counts TorchStepper.step calls in `steps.calls`; while `steps.interrupt`, the 4th raises KeyboardInterrupt
    (in heal step 4: the checkpoint after step 3 is stored)."""
    from types import SimpleNamespace

    from trsp_ray.method import training

    state, step = SimpleNamespace(calls=0, interrupt=False), training.TorchStepper.step

    def counted(self):
        state.calls += 1
        if state.calls == 4 and state.interrupt:
            raise KeyboardInterrupt
        step(self)

    monkeypatch.setattr(training.TorchStepper, "step", counted)
    return state


def _config(root, store, *extra):
    data = {"calib_text": str(root / "calib.txt"), "eval_text": str(root / "eval.txt")}
    return load_config(None, [f"model={root / 'model'}", f"method={METHOD}", "ratio=0.25",
                              f"checkpoint_dir={store}", *SMALL, *extra], base={"data": data})


def _logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids, use_cache=False).logits.float()


@pytest.mark.parametrize("family,dtype", [("llama", "fp32"), ("gpt_neox", "bf16")])
def test_an_interrupted_heal_resumes_from_its_last_checkpoint(family, dtype, workspaces, tmp_path, steps, capsys):
    from trsp_ray.plan.shape import read_shape
    from trsp_ray.run.heal_store import planned_gb
    from trsp_ray.run.methods import apply_method
    from trsp_ray.run.workbench import prepare

    root, store = workspaces(family), tmp_path / "checkpoints"
    cfg = _config(root, store, f"dtype={dtype}")
    spec = registry.method(METHOD)
    whole = apply_method(prepare(cfg), spec)
    assert whole.info["heal_steps"] == 6 and whole.info["heal_resumed_after"] == 0
    assert not (store / "heal").exists()  # a finished heal leaves nothing

    steps.interrupt, steps.calls = True, 0
    with pytest.raises(KeyboardInterrupt):
        apply_method(prepare(cfg), spec)
    stored = list((store / "heal").glob("*/heal.pt"))
    assert len(stored) == 1
    assert torch.load(stored[0], weights_only=True)["step"] == 3
    # the plan's figure (`prune --dry-run`): 12 bytes a trained parameter
    shape = read_shape(cfg.model)
    planned = planned_gb(shape.recipe_params("all", kept_layers=shape.layers - len(whole.drop))) * 1024**3
    assert planned <= stored[0].stat().st_size <= 1.1 * planned, (stored[0].stat().st_size, planned)

    steps.interrupt, steps.calls = False, 0
    capsys.readouterr()
    again = apply_method(prepare(cfg), spec)
    assert steps.calls == 3  # steps 4-6; 1-3 came from the checkpoint
    assert "heal: resuming after step 3" in capsys.readouterr().out
    assert again.info["heal_resumed_after"] == 3 and again.drop == whole.drop
    ids = torch.randint(3, 1000, (2, 24), generator=torch.Generator().manual_seed(2))
    torch.testing.assert_close(_logits(again.model, ids), _logits(whole.model, ids), atol=1e-6, rtol=0)
    assert not (store / "heal").exists()


def test_another_model_or_other_heal_settings_start_the_heal_afresh(workspaces, tmp_path, steps):
    from trsp_ray.run.methods import apply_method
    from trsp_ray.run.workbench import prepare

    cfg = _config(workspaces("llama"), tmp_path / "checkpoints")
    spec = registry.method(METHOD)
    for changed in ({"compensation.ridge": 0.05}, {"stage2.lr": 2e-4}):  # the fit's output; the heal's rate
        steps.interrupt, steps.calls = True, 0
        with pytest.raises(KeyboardInterrupt):
            apply_method(prepare(cfg), spec)
        steps.interrupt, steps.calls = False, 0
        out = apply_method(prepare(replace(cfg, **changed)), spec)
        assert steps.calls == 6 and out.info["heal_resumed_after"] == 0, changed
        # the interrupted heal's checkpoint is still there for its own rerun, which resumes
        steps.calls = 0
        assert apply_method(prepare(cfg), spec).info["heal_resumed_after"] == 3 and steps.calls == 3


def test_the_weights_digest_sees_one_value_changed():
    """heal_store.weights_digest reads every value's sum beside a sample: a model with one weight changed
    outside the sample gives another digest, an equal copy the same one."""
    import copy

    from transformers import LlamaConfig, LlamaForCausalLM

    from trsp_ray.run.heal_store import weights_digest

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2))
    same, other = copy.deepcopy(model), copy.deepcopy(model)
    with torch.no_grad():
        other.model.layers[1].mlp.down_proj.weight.view(-1)[1] += 1e-3  # index 1: between the strided samples
    assert weights_digest(same) == weights_digest(model)
    assert weights_digest(other) != weights_digest(model)


def test_slow_checkpoint_writes_are_spaced_to_a_twentieth_of_the_heal(tmp_path, monkeypatch):
    """A write that takes longer than MAX_SHARE of heal.checkpoint_minutes pushes the next one out, so the
    writes never take more than that share of the heal (a large model on a slow disk); 0 minutes writes
    after every step whatever it costs."""
    import time
    from types import SimpleNamespace

    from trsp_ray.common import atomic
    from trsp_ray.run import heal_store

    save = atomic.save_torch

    def slow(path, obj):  # a disk that takes 0.2 s a checkpoint
        time.sleep(0.2)
        save(path, obj)

    monkeypatch.setattr(atomic, "save_torch", slow)
    weight = torch.nn.Parameter(torch.ones(4))
    stepper = SimpleNamespace(params=[weight], masters=[], optimizer=torch.optim.AdamW([weight]), loss_scale=1.0,
                              skipped_steps=0)
    for minutes, writes in ((0.001, 1), (0, 3)):  # 0.06 s between writes asked for; every step
        store = heal_store.HealCheckpoints(tmp_path / str(minutes), "k", minutes=minutes)
        store.last -= 1.0  # the first write is due
        written = []
        for step in range(1, 4):
            time.sleep(0.1)  # each step outlasts the 0.06 s asked for, not the 3.8 s the slow write calls for
            before = store.path.stat().st_mtime_ns if store.path.exists() else None
            store.after(step, 10, stepper, first=1.0)
            written += [step] if store.path.exists() and store.path.stat().st_mtime_ns != before else []
        assert len(written) == writes, (minutes, written)
        if minutes:
            assert store.wait >= 0.2 * (1 - heal_store.MAX_SHARE) / heal_store.MAX_SHARE, store.wait


def test_a_merge_heal_interrupted_in_its_heal_resumes_without_merging_again(workspaces, tmp_path, steps,
                                                                            monkeypatch):
    """merge+heal keeps its merged pairs stored until the heal is done: interrupted in the heal, a rerun puts
    the pairs back (no pair cut again), resumes the heal from its checkpoint, and ends with the uninterrupted
    run's model; a finished run leaves neither store."""
    from trsp_ray.method import merge
    from trsp_ray.run.methods import apply_method
    from trsp_ray.run.workbench import prepare

    store = tmp_path / "checkpoints"
    cfg = replace(_config(workspaces("llama"), store), method="merge+heal")
    spec = registry.method("merge+heal")
    whole = apply_method(prepare(cfg), spec)
    assert len(whole.info["merge_pairs"]) == 2 and whole.info["heal_steps"] == 6
    assert not (store / "merged_pairs").exists() and not (store / "heal").exists()

    steps.interrupt, steps.calls = True, 0
    with pytest.raises(KeyboardInterrupt):
        apply_method(prepare(cfg), spec)
    assert len(list((store / "merged_pairs").glob("*/pair-*.pt"))) == 2
    cut, cuts = merge._cut_pair, []
    monkeypatch.setattr(merge, "_cut_pair", lambda *a, **k: cuts.append(a[1].index) or cut(*a, **k))
    steps.interrupt, steps.calls = False, 0
    again = apply_method(prepare(cfg), spec)
    assert cuts == [] and steps.calls == 3 and again.info["heal_resumed_after"] == 3
    for key in ("merge_pairs", "merge_cost", "merge_mlp_error"):
        assert again.info[key] == whole.info[key], key
    ids = torch.randint(3, 1000, (2, 24), generator=torch.Generator().manual_seed(2))
    torch.testing.assert_close(_logits(again.model, ids), _logits(whole.model, ids), atol=1e-6, rtol=0)
    assert not (store / "merged_pairs").exists() and not (store / "heal").exists()


@pytest.mark.parametrize("mode", ["joint", "sequential"])
def test_an_interrupted_stage_2_resumes_from_its_last_checkpoint(mode, workspaces, tmp_path, steps, capsys):
    """TRSP's stage 2 in one process checkpoints as a heal does: interrupted in step 4 of 6, a rerun computes steps
    4-6 only and ends with the uninterrupted stage 2's weights and relative updates (sequential: the second
    layer's segment starts in the resumed part); the dry run's disk figure is the checkpoint's size; a finished
    stage 2 leaves nothing stored."""
    from trsp_ray.plan.shape import read_shape
    from trsp_ray.run.heal_store import planned_line
    from trsp_ray.run.methods import apply_method
    from trsp_ray.run.workbench import prepare

    store = tmp_path / "checkpoints"
    cfg = replace(_config(workspaces("llama"), store), method="trsp", **{"stage2.mode": mode})
    spec, drop = registry.method("trsp"), [2, 5]
    whole = apply_method(prepare(cfg), spec, drop=drop)
    assert whole.info["stage2_steps"] == 6 and not (store / "stage2").exists()

    steps.interrupt, steps.calls = True, 0
    with pytest.raises(KeyboardInterrupt):
        apply_method(prepare(cfg), spec, drop=drop)
    stored = list((store / "stage2").glob("*/stage2.pt"))
    assert len(stored) == 1 and torch.load(stored[0], weights_only=True)["step"] == 3
    line = planned_line(cfg, spec, read_shape(cfg.model), steps=6)
    planned = float(line.split("stage2 checkpoint: ")[1].split(" GB")[0]) * 1024**3
    assert 0.99 * planned <= stored[0].stat().st_size <= 1.1 * planned, (stored[0].stat().st_size, planned)

    steps.interrupt, steps.calls = False, 0
    capsys.readouterr()
    again = apply_method(prepare(cfg), spec, drop=drop)
    assert steps.calls == 3 and "stage 2: resuming after step 3" in capsys.readouterr().out
    assert again.info["stage2_steps"] == 6 and again.info["relative_update"] == whole.info["relative_update"]
    ids = torch.randint(3, 1000, (2, 24), generator=torch.Generator().manual_seed(2))
    torch.testing.assert_close(_logits(again.model, ids), _logits(whole.model, ids), atol=1e-6, rtol=0)
    assert not (store / "stage2").exists()
