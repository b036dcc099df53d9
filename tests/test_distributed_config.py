"""DeepSpeed config builder and the driver's pre-flight checks (no Ray, no workers)."""

import pytest
import torch

from trsp_ray.common.errors import TrspError
from trsp_ray.config.run_config import load_config
from trsp_ray.config.sections import DistributedConfig
from trsp_ray.distributed.deepspeed_config import build_ds_config, merge, parse_options, validate_ds_config
from trsp_ray.distributed.export import plain_state_dict
from trsp_ray.distributed.storage import check_storage
from trsp_ray.distributed.train import check_resources, prepare_run


def test_cpu_config_is_fp32_zero3_with_torch_adam():
    c = build_ds_config(DistributedConfig(workers=2, grad_accum=2), batch_size=4, lr=0.01)
    assert c["bf16"] == {"enabled": False}
    assert c["zero_optimization"]["stage"] == 3
    assert (c["train_micro_batch_size_per_gpu"], c["gradient_accumulation_steps"], c["train_batch_size"]) == (2, 2, 8)
    assert c["optimizer"]["params"]["torch_adam"] is True and c["zero_allow_untested_optimizer"]
    assert "offload_optimizer" not in c["zero_optimization"]


def test_gpu_offload_config():
    c = build_ds_config(DistributedConfig(workers=8, use_gpu=True, offload_params=True, offload_optimizer=True),
                        batch_size=8, lr=1e-4)
    assert c["bf16"] == {"enabled": True}
    assert c["zero_optimization"]["offload_param"]["device"] == "cpu"
    assert c["zero_optimization"]["offload_optimizer"] == {"device": "cpu", "pin_memory": True}
    assert c["optimizer"]["params"]["torch_adam"] is False  # DeepSpeed's CPU Adam for offloaded state
    with pytest.raises(TrspError, match="needs distributed.strategy=zero3"):
        build_ds_config(DistributedConfig(workers=2, strategy="ddp", offload_params=True), batch_size=2, lr=1)


def test_batch_must_split_over_workers():
    with pytest.raises(TrspError, match="does not split evenly"):
        build_ds_config(DistributedConfig(workers=3), batch_size=4, lr=0.01)


def test_options_merge_and_deepspeed_rejects_bad_ones():
    base = build_ds_config(DistributedConfig(workers=2), batch_size=4, lr=0.01)
    extra = parse_options(["zero_optimization.stage=4", "gradient_clipping=0.5"])
    merged = merge(base, extra)
    assert merged["gradient_clipping"] == 0.5 and merged["zero_optimization"]["contiguous_gradients"] is True
    validate_ds_config(base)
    with pytest.raises(TrspError, match=r"^DeepSpeed rejected the config: .*stage") as err:
        validate_ds_config(merged)
    assert "\n" not in str(err.value)


def test_storage_resources_and_run_checks(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(TrspError, match="storage_path.*not writable"):
        check_storage(str(blocker / "sub"))
    assert check_storage(str(tmp_path / "ok")).endswith("ok")
    with pytest.raises(TrspError, match="needs 8 CPUs but the Ray cluster has 2; use workers <= 1"):
        check_resources(DistributedConfig(workers=4, cpus_per_worker=2), {"CPU": 2.0})
    with pytest.raises(TrspError, match="needs 2 GPUs"):
        check_resources(DistributedConfig(workers=2, use_gpu=True), {"CPU": 64.0, "GPU": 1.0})
    cfg = load_config(overrides=["distributed.workers=2", "distributed.grad_accum=3"])
    with pytest.raises(TrspError, match="not a multiple of distributed.grad_accum=3"):
        prepare_run(cfg)


def test_gated_keys_map_to_plain_keys():
    state = {"model.layers.0.gate": torch.ones(1), "model.layers.0.layer.mlp.up_proj.weight": torch.zeros(2),
             "model.layers.12.layer.input_layernorm.weight": torch.zeros(2), "lm_head.weight": torch.zeros(2)}
    assert sorted(plain_state_dict(state, "model.layers")) == [
        "lm_head.weight", "model.layers.0.mlp.up_proj.weight", "model.layers.12.input_layernorm.weight"]


def test_mlflow_store_of_a_distributed_run(tmp_path, monkeypatch):
    from trsp_ray.distributed.train import tracking_uri_for

    given = load_config(overrides=["tracking.tracking_uri=http://mlflow:5000"])
    assert tracking_uri_for(given, str(tmp_path)) == "http://mlflow:5000"
    plain = load_config()
    monkeypatch.setenv("TRSP_RAY_MLFLOW_DIR", str(tmp_path / "shared"))  # cluster/runtime_env.yaml sets it
    assert tracking_uri_for(plain, str(tmp_path / "st")) == f"sqlite:///{(tmp_path / 'shared').resolve() / 'mlflow.db'}"
    monkeypatch.delenv("TRSP_RAY_MLFLOW_DIR")
    assert tracking_uri_for(plain, str(tmp_path / "st")) == f"sqlite:///{tmp_path / 'st' / 'mlflow.db'}"
    assert tracking_uri_for(plain, None) is None  # remote storage and no URI: skipped, said so


def test_worker_threads_follow_the_nodes_cores_under_offload():
    from trsp_ray.distributed.train import worker_cpus

    gpu_nodes = ([{"Alive": True, "Resources": {"CPU": 96.0, "GPU": 8.0}}] * 2
                 + [{"Alive": True, "Resources": {"CPU": 8.0}}])
    offload = DistributedConfig(workers=16, use_gpu=True, offload_optimizer=True)
    assert worker_cpus(offload, gpu_nodes) == 12  # 96 cores / 8 GPUs; the CPU-only head does not count
    assert worker_cpus(DistributedConfig(workers=16, use_gpu=True), gpu_nodes) == 1  # no CPU Adam to feed
    assert worker_cpus(DistributedConfig(workers=16, use_gpu=True, offload_optimizer=True, cpus_per_worker=4),
                       gpu_nodes) == 4  # an explicit value wins
    cpu_nodes = [{"Alive": True, "Resources": {"CPU": 8.0}}, {"Alive": False, "Resources": {"CPU": 64.0}}]
    assert worker_cpus(DistributedConfig(workers=2, offload_optimizer=True), cpu_nodes) == 4  # dead node ignored
    with pytest.raises(TrspError, match="x cpus_per_worker=12 needs 192 CPUs but the Ray cluster has 100"):
        check_resources(offload, {"CPU": 100.0, "GPU": 16.0}, 12)
