"""A 7B default prune on one 80 GB GPU (issue 33 item 10): its full-weight heal of the ~5.5B kept
weights needs ~87 GB, so the route refuses in one line before any work and says what would run
instead (a LoRA heal, with its peak, or Ray Train workers); the plan sizes a heal method's heal with
the setting the heal reads (stage2.trainable), not heal.trainable."""

import json

import pytest

from trsp_ray.common.errors import TrspError
from trsp_ray.config import registry
from trsp_ray.config.run_config import load_config, replace

LLAMA2_7B = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096,
             "intermediate_size": 11008, "num_hidden_layers": 32, "num_attention_heads": 32,
             "num_key_value_heads": 32, "vocab_size": 32000, "max_position_embeddings": 4096,
             "rms_norm_eps": 1e-5, "tie_word_embeddings": False, "torch_dtype": "float16"}


@pytest.fixture
def llama7b(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(LLAMA2_7B))
    return tmp_path


def test_the_heal_is_planned_with_the_weights_a_heal_method_trains(llama7b):
    from trsp_ray.plan.single_plan import single_plan_for_run
    from trsp_ray.run.pipeline import resolve

    cfg = resolve(load_config(overrides=[f"model={llama7b}"])).cfg  # the default heals
    full = single_plan_for_run(cfg, device="gpu", memory_gb=80)
    lora = single_plan_for_run(replace(cfg, **{"stage2.trainable": "lora"}), device="gpu", memory_gb=80)
    assert full.worst().name == "heal" and full.peak > 80 and not full.fits
    assert lora.fits and lora.peak < 20  # the heal method's LoRA heal: adapters and bf16 weights
    # heal.trainable sizes only an extra heal after a method that does not heal by itself
    extra = single_plan_for_run(replace(cfg, **{"method": "shortgpt", "heal.steps": 4, "heal.trainable": "lora"}),
                                device="gpu", memory_gb=80)
    assert extra.fits


def test_a_7b_default_prune_on_one_80gb_gpu_is_refused_naming_what_would_run(llama7b):
    from trsp_ray.plan import route
    from trsp_ray.run.pipeline import resolve

    cfg = resolve(load_config(overrides=[f"model={llama7b}"])).cfg
    with pytest.raises(TrspError) as err:
        route.route(cfg, spec=registry.method(cfg.method), device="gpu", memory_gb=80)
    message = str(err.value)
    assert "\n" not in message and "heal needs 87.3 GB in one process" in message
    # the LoRA route's peak is its least-squares fit (a dense bf16 copy on the GPU + the sums), not the heal
    assert "set stage2.trainable=lora" in message and "peak 16.6 GB" in message
    assert "distributed.workers=N" in message
    chosen = route.route(replace(cfg, **{"distributed.workers": 8}), spec=registry.method(cfg.method), device="gpu",
                         memory_gb=80)
    assert chosen.workers == 2  # allowed workers: the fewest whose ZeRO-3 plan fits
