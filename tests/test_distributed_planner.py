"""Memory planner and `trsp-ray plan`: parameter counts and per-worker figures checked by hand."""

import argparse
import json
import tempfile
from pathlib import Path

import pytest

from trsp_ray.common.errors import TrspError
from trsp_ray.plan import memory, shape, zero3_plan, zero3_setup
from trsp_ray.plan_cli import register

LLAMA2_70B = {"vocab_size": 32000, "hidden_size": 8192, "intermediate_size": 28672, "num_hidden_layers": 80,
              "num_attention_heads": 64, "num_key_value_heads": 8, "tie_word_embeddings": False}
SMOLLM2 = {"vocab_size": 49152, "hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30,
           "num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 64, "tie_word_embeddings": True}


def _write(tmp_path, config: dict):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    return path


def test_parameter_counts_match_the_published_sizes(tmp_path):
    assert shape.read_shape(str(_write(tmp_path, LLAMA2_70B))).params == 68_976_648_192  # "70B"
    # SmolLM2-135M: 134,515,008 parameters (tied embedding counted once); a directory works too.
    _write(tmp_path, SMOLLM2)
    assert shape.read_shape(str(tmp_path)).params == 134_515_008


def test_stage_figures_by_hand():
    s = shape.Shape(vocab=100, hidden=10, intermediate=20, layers=2, heads=2, kv_heads=1, head_dim=5, tied=True)
    assert s.layer_params == 2 * 10 * 10 + 2 * 10 * 5 + 3 * 10 * 20 + 20  # 920
    assert s.params == 2 * 920 + 100 * 10 + 10  # 2850
    st = zero3_setup.Setup(workers=2, dtype_bytes=4, micro_batch=1, seqlen=1, device="cpu")
    stage1, stage2 = zero3_plan.estimate(s, st)
    gb = memory.GB
    assert stage1.parts["weights (partition)"] == pytest.approx(2850 * 4 / 2 / gb)
    assert "optimizer fp32 + Adam (partition)" not in stage1.parts  # frozen base: gates only
    assert stage2.parts["optimizer fp32 + Adam (partition)"] == pytest.approx(2850 * 12 / 2 / gb)
    assert stage2.parts["gradients (partition)"] == pytest.approx(2850 * 4 / 2 / gb)
    # activations per token and layer (plan/activations.py): norms 8h + 8, attention e(2q + 2kv) + 4
    # heads, SwiGLU 3eI = 376; ZeRO-3's Linear inputs in stage 1 e(2h + I) = 160 and the gate's eh = 40;
    # stage 2's Linear and norm-weight inputs e(4h + I) = 240; logits 12V = 1200
    assert stage1.parts["activations"] == pytest.approx((2 * (456 + 160 + 40) + 1200) / gb)
    assert stage2.parts["activations"] == pytest.approx((2 * (456 + 240) + 1200) / gb)
    # grads + optim + bucket, and stage 2's 2 x 40 more activation bytes
    assert stage2.total - stage1.total == pytest.approx((2850 * 16 / 2 + 2850 * 4 + 80) / gb)


def test_offload_moves_optimizer_state_to_host():
    s = shape.Shape(32000, 8192, 28672, 80, 64, 8, 128, False)
    on = zero3_plan.estimate(s, zero3_setup.Setup(workers=8, offload_optimizer=True))[1]
    off = zero3_plan.estimate(s, zero3_setup.Setup(workers=8))[1]
    assert "optimizer fp32 + Adam (partition)" not in on.parts
    assert on.host == pytest.approx(s.params * 16 / 8 / memory.GB)
    assert off.total - on.total > 100  # ~112 GB of gradients + Adam state per GPU leave the device


def test_llama2_70b_on_8x80():
    s = shape.Shape(32000, 8192, 28672, 80, 64, 8, 128, False)
    ckpt = zero3_setup.Setup(workers=8, gpu_memory_gb=80, activation_checkpointing=True)
    stage1, stage2 = zero3_plan.estimate(s, ckpt)
    assert stage1.total < 80 < stage2.total  # frozen-weight stage 1 fits; full stage 2 does not
    assert zero3_plan.plan(s, zero3_setup.Setup(workers=8, activation_checkpointing=True, offload_optimizer=True)).fits
    assert zero3_plan.min_workers(s, ckpt) == 16
    lora = zero3_plan.estimate(s, zero3_setup.Setup(workers=8, activation_checkpointing=True, trainable="lora"))[1]
    assert lora.total < 80
    text = zero3_plan.plan(s, zero3_setup.Setup(workers=8)).suggestion()
    assert "--activation-checkpointing" in text and "--workers" in text


def _cli(argv):
    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    args = parser.parse_args(argv)
    return args.func(args)


def test_plan_command_exit_status(tmp_path, capsys):
    path = str(_write(tmp_path, LLAMA2_70B))
    assert _cli(["plan", "--model-config", path, "--workers", "8", "--activation-checkpointing"]) == 1
    assert "what would fit" in capsys.readouterr().out
    assert _cli(["plan", "--model-config", path, "--workers", "16", "--activation-checkpointing"]) == 0
    with pytest.raises(TrspError, match="--workers=0"):
        _cli(["plan", "--model-config", path, "--workers", "0"])
    with pytest.raises(TrspError, match="not found"):
        _cli(["plan", "--model-config", str(tmp_path / "nope.json"), "--workers", "8"])


def test_gathered_parameters_follow_zero3_live_cache():
    """Under DeepSpeed's 1e9 live-parameter cap a small model stays gathered whole during a step;
    a lower cap leaves two decoder layers (current + prefetched); a 70B model is over the cap."""
    s = shape.Shape(vocab=100, hidden=10, intermediate=20, layers=2, heads=2, kv_heads=1, head_dim=5, tied=True)
    whole = zero3_plan.estimate(s, zero3_setup.Setup(workers=2, dtype_bytes=4, device="cpu"))[0]
    assert whole.parts["gathered parameters"] == pytest.approx(2850 * 4 / memory.GB)
    setup = zero3_setup.Setup(workers=2, dtype_bytes=4, device="cpu", max_live_parameters=10)
    capped = zero3_plan.estimate(s, setup)[0]
    assert capped.parts["gathered parameters"] == pytest.approx(2 * 920 * 4 / memory.GB)
    big = shape.read_shape(str(_write(Path(tempfile.mkdtemp()), LLAMA2_70B)))
    layers2 = 2 * big.layer_params * 2 / memory.GB  # 2 x 856M bf16 parameters > the 1e9 cap
    gathered = zero3_plan.estimate(big, zero3_setup.Setup(workers=8))[0].parts["gathered parameters"]
    assert gathered == pytest.approx(layers2)
    # The cap a run passes to DeepSpeed reaches the planner.
    from trsp_ray.config.run_config import load_config

    cfg = load_config(overrides=["distributed.workers=2"])
    ds = {"zero_optimization": {"stage3_max_live_parameters": 1e6}}
    assert zero3_setup.setup_for_run(cfg, ds).max_live_parameters == 1e6
    assert zero3_setup.setup_for_run(cfg).max_live_parameters == 1e9


def test_checkpoint_disk_and_host_figures_by_hand():
    s = shape.Shape(32000, 8192, 28672, 80, 64, 8, 128, False)
    st = zero3_setup.Setup(workers=16, activation_checkpointing=True, keep_checkpoints=2, export_shard_gb=5.0)
    h = zero3_plan.plan(s, st).host()
    # Stage 2 trains all weights: fp32 master + Adam m, v = 12 bytes per parameter, plus gate state.
    assert h.checkpoint_gb == pytest.approx((s.params * 12 + 64 * 1024 * 16) / memory.GB)
    assert h.storage_gb == pytest.approx(3 * h.checkpoint_gb)  # 2 kept + 1 being written
    # 8 of 16 ranks stage their share of two saves: one uploading in the background, the next
    assert h.disk_per_node_gb == pytest.approx(2 * h.checkpoint_gb * 8 / 16)
    sync = zero3_plan.plan(s, zero3_setup.Setup(workers=16, activation_checkpointing=True, async_upload=False)).host()
    assert sync.disk_per_node_gb == pytest.approx(h.checkpoint_gb * 8 / 16)  # every rank waits for its upload
    assert h.export_host_gb == pytest.approx(10.0)  # 2 x the 5 GB shard (> the largest tensor, 0.47 GB)
    assert h.host_per_node_gb == pytest.approx(8 * memory.HOST_BASE_GB["gpu"] + 10.0)
    assert h.threads_per_worker == 1
    off = zero3_plan.plan(s, zero3_setup.Setup(workers=8, activation_checkpointing=True, offload_optimizer=True,
                                        cpus_per_node=96)).host()
    assert off.threads_per_worker == 12  # 96 cores / 8 GPU workers, for CPU Adam
    assert off.host_per_worker_gb == pytest.approx(s.params * 16 / 8 / memory.GB + memory.HOST_BASE_GB["gpu"])
    shared = zero3_plan.plan(s, zero3_setup.Setup(workers=16, remote_storage=False)).host()
    assert shared.disk_per_node_gb == 0.0  # written in place on the shared path
    gates_only = zero3_plan.plan(s, st)
    gates_only.stages = gates_only.stages[:1]  # a run without stage 2 saves gate state only
    assert gates_only.host().checkpoint_gb < 0.01


def test_disk_budget_refuses_on_one_line(tmp_path):
    path = str(_write(tmp_path, LLAMA2_70B))
    with pytest.raises(TrspError) as err:
        _cli(["plan", "--model-config", path, "--workers", "16", "--activation-checkpointing",
              "--disk-budget-gb", "2000", "--method", "trsp"])  # stage 2 trains (and saves) every layer
    assert "\n" not in str(err.value)
    assert str(err.value).startswith("checkpoints need 2312.6 GB of storage (keep_checkpoints=2")
    assert "use keep_checkpoints=1 (1541.8 GB)" in str(err.value)
    assert _cli(["plan", "--model-config", path, "--workers", "16", "--activation-checkpointing",
                 "--disk-budget-gb", "2000", "--keep-checkpoints", "1", "--method", "trsp"]) == 0
    # The driver refuses the same before any worker starts (CPU run: only the disk budget is checked).
    from trsp_ray.config.run_config import load_config
    from trsp_ray.distributed.train import prepare_run

    cfg = load_config(overrides=[f"model={tmp_path}", "distributed.workers=2", "distributed.disk_budget_gb=0.001",
                                 f"distributed.storage_path={tmp_path / 'st'}"])
    (tmp_path / "config.json").write_text(json.dumps(SMOLLM2))
    with pytest.raises(TrspError, match=r"^checkpoints need .* but distributed.disk_budget_gb=0.001; use"):
        prepare_run(cfg)


# --- Parameter counts from the model's own structure (meta device), one tiny config per family.
_SIZES = {"vocab_size": 96, "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 3,
          "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8, "max_position_embeddings": 64}
TINY = {name: {"model_type": name, **_SIZES} for name in
        ("llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3_text", "phi3")}
TINY["phi3"].update(pad_token_id=0, eos_token_id=0)  # its defaults (32000) lie outside a 96-token vocabulary
TINY["gpt_neox"] = {"model_type": "gpt_neox", "vocab_size": 96, "hidden_size": 32, "intermediate_size": 128,
                    "num_hidden_layers": 3, "num_attention_heads": 4, "max_position_embeddings": 64}
# OPT with a word-embedding projection narrower than hidden (as OPT-350m): project_in / project_out exist.
TINY["opt"] = {"model_type": "opt", "vocab_size": 96, "hidden_size": 32, "ffn_dim": 48, "num_hidden_layers": 3,
               "num_attention_heads": 4, "word_embed_proj_dim": 16, "max_position_embeddings": 64}


def test_every_family_has_a_tiny_config():
    from trsp_ray.models.families import FAMILIES

    assert sorted(TINY) == sorted(FAMILIES)


@pytest.mark.parametrize("family", sorted(TINY))
def test_counts_equal_the_real_model(family):
    """The planner's counts (total, each decoder layer, LoRA adapters) equal those of the model
    instantiated on CPU from the same config, for every family families.py supports."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from trsp_ray.method import training
    from trsp_ray.models import families

    fields = dict(TINY[family])
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(fields.pop("model_type"), **fields))
    s = shape.shape_from_config(TINY[family], source=family)
    assert s.params == sum(p.numel() for p in model.parameters())  # parameters() yields a tied weight once
    layers = families.decoder_layers(model)
    assert len(layers) == s.layers == 3
    for layer in layers:
        assert s.layer_params == sum(p.numel() for p in layer.parameters())
    assert s.tied == (model.get_output_embeddings().weight is model.get_input_embeddings().weight)
    assert s.counts.largest_tensor == max(p.numel() for p in model.parameters())
    lora = training.add_lora(model, rank=4)
    assert s.lora_params(4) == sum(p.numel() for p in lora.parameters() if p.requires_grad)


def test_opt_and_gpt_neox_are_planned_with_their_own_sizes(tmp_path):
    """OPT (no intermediate_size) is planned, not refused; activation sizes come from the family's own
    fields (ffn_dim; GPT-NeoX's heads without key/value heads)."""
    (tmp_path / "config.json").write_text(json.dumps(TINY["opt"]))
    opt = shape.read_shape(str(tmp_path))
    assert (opt.intermediate, opt.hidden, opt.kv_heads, opt.head_dim, opt.vocab) == (48, 32, 4, 8, 96)
    p = zero3_plan.plan(opt, zero3_setup.Setup(workers=2, dtype_bytes=4, device="cpu", seqlen=16))
    assert p.fits and p.stages[0].parts["weights (partition)"] == pytest.approx(opt.params * 4 / 2 / memory.GB)
    neox = shape.shape_from_config(TINY["gpt_neox"])
    assert (neox.intermediate, neox.kv_heads, neox.head_dim) == (128, 4, 8)
    # A GPT-NeoX layer: fused qkv + dense + two MLP Linears with biases, two LayerNorms; no gate projection.
    h, i = 32, 128
    assert neox.layer_params == (3 * h * h + 3 * h) + (h * h + h) + (h * i + i) + (i * h + h) + 4 * h


def test_llama3_70b_counts_without_allocating():
    c = {"model_type": "llama", "vocab_size": 128256, "hidden_size": 8192, "intermediate_size": 28672,
         "num_hidden_layers": 80, "num_attention_heads": 64, "num_key_value_heads": 8, "tie_word_embeddings": False}
    h, i, v, kv = 8192, 28672, 128256, 8 * 128
    layer = 2 * h * h + 2 * h * kv + 3 * h * i + 2 * h  # q, o; k, v; gate, up, down; two RMSNorms
    assert shape.shape_from_config(c).layer_params == layer == 855_654_400
    assert shape.shape_from_config(c).params == 80 * layer + 2 * v * h + h == 70_553_706_496

    def rss() -> int:
        return int(Path("/proc/self/statm").read_text().split()[1]) * 4096

    before = rss()
    model = shape.meta_model(c)
    assert all(p.is_meta for p in model.parameters())
    assert rss() - before < 256 * 2**20  # bf16 weights would be 141 GB


def test_hand_built_shape_formula_equals_a_meta_llama():
    """A Shape built from fields alone is counted by the Llama formula; it agrees with a meta Llama."""
    fields = shape.Shape(vocab=96, hidden=32, intermediate=48, layers=3, heads=4, kv_heads=2, head_dim=8, tied=False)
    meta = shape.shape_from_config(TINY["llama"])
    assert fields.counts == meta.counts
    assert fields.params == 3 * (2 * 32 * 32 + 2 * 32 * 16 + 3 * 32 * 48 + 64) + 2 * 96 * 32 + 32


def test_bad_configs_refused_on_one_line():
    with pytest.raises(TrspError, match=r"model_type 'bert'.*supported: .*gpt_neox.*opt"):
        shape.shape_from_config({"model_type": "bert", **_SIZES})
    with pytest.raises(TrspError, match="lacks 'intermediate_size'"):  # no model_type: read as a Llama
        shape.shape_from_config({k: v for k, v in _SIZES.items() if k != "intermediate_size"})
    with pytest.raises(TrspError, match="^model config 'x' does not build a llama model: ") as err:
        shape.shape_from_config({**TINY["llama"], "head_dim": 5}, source="x")  # odd RoPE dimension
    assert "\n" not in str(err.value)
