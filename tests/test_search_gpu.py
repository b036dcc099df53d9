"""Search trials on GPUs: the route from the memory planner (GPU fractions for small models, Ray Train
workers for large ones), the trial's device, and a Ray cluster with a (fake) GPU resource on which a
trial is scheduled holding a GPU while its work runs on the CPU of this GPU-less machine."""

import json

import pytest

from trsp_ray.common.errors import TrspError
from trsp_ray.config.run_config import load_config
from trsp_ray.search.route import trial_device, trial_route
from trsp_ray.search.space import parse_space

SMALL = ["method=trsp", "data.seqlen=32", "data.batch_size=2", "data.eval_seqlen=64", "data.eval_max_windows=4",
         "stage1.first_round_steps=2", "stage1.steps_per_round=1", "stage2.steps=2", "threads=1",
         "tracking.enabled=false"]


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    from trsp_ray.models.tiny import tiny_workspace

    return tiny_workspace(tmp_path_factory.mktemp("gpu_search"), layers=8, calib_chars=30000, eval_chars=8000)


def _base(assets, *extra):
    return load_config(overrides=[f"model={assets / 'model'}", f"data.calib_text={assets / 'calib.txt'}",
                                  f"data.eval_text={assets / 'eval.txt'}", *SMALL, *extra])


def _llama2_7b(tmp_path):
    from trsp_ray.reproduce.presets import PAPER

    path = tmp_path / "llama2-7b"
    path.mkdir()
    (path / "config.json").write_text(json.dumps({**PAPER.model("llama2-7b").shape, "model_type": "llama"}))
    return str(path)


def test_route_gives_small_models_a_gpu_fraction_and_large_ones_ray_train(assets, tmp_path):
    tiny = str(assets / "model")
    small = trial_route(_base(assets, "device=auto"), model_path=tiny, cluster={"CPU": 16, "GPU": 8})
    assert ((small.use_gpu, small.gpus, small.workers) == (True, 0.25, 0)
            and small.resources(2) == {"cpu": 2, "gpu": 0.25})
    assert small.eval_gpus == 0.25 and small.gpus_per_trial() == 0.25
    cpu = trial_route(_base(assets, "device=auto"), model_path=tiny, cluster={"CPU": 2})
    assert (cpu.use_gpu, cpu.gpus, cpu.workers) == (False, 0.0, 0) and cpu.resources(1) == {"cpu": 1}
    big_cfg = load_config(overrides=["device=cuda", "data.seqlen=2048", "data.batch_size=8",
                                     "distributed.activation_checkpointing=true"])
    big = trial_route(big_cfg, model_path=_llama2_7b(tmp_path), cluster={"CPU": 64, "GPU": 8})
    # 7B stage 2 (all weights + Adam, ~108 GB of model state) cannot fit one 80 GB GPU; stage 1 can
    assert big.gpus == 0.0 and 1 < big.workers <= 8 and big.peak_gb <= 80 and big.stage1_on_one_device
    assert big.resources(1) == {"cpu": 1} and big.gpus_per_trial() == big.workers


def test_bad_routes_fail_on_one_line_before_any_trial(assets):
    tiny = str(assets / "model")
    for kwargs, msg in (({"cluster": {"CPU": 2}}, "device=cuda but the Ray cluster has no GPUs"),
                        ({"cluster": {"GPU": 1}, "gpus_per_trial": 1.5}, "gpus per trial=1.5"),
                        ({"cluster": {"GPU": 1}, "workers": 0}, "trial workers=0"),
                        ({"cluster": {"GPU": 1}, "workers": 2}, "needs 2 GPUs, the Ray cluster has 1")):
        with pytest.raises(TrspError, match=msg) as err:
            trial_route(_base(assets, "device=cuda"), model_path=tiny, **kwargs)
        assert "\n" not in str(err.value)


def test_trial_device_uses_cuda_only_when_torch_sees_the_assigned_gpu(monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert trial_device("auto", gpu_ids=["0"]) == "cpu"  # a GPU resource without CUDA: run on the CPU
    assert trial_device("cpu", gpu_ids=["0"]) == "cpu" and trial_device("auto", gpu_ids=[]) == "cpu"
    with pytest.raises(TrspError, match="device=cuda but this trial holds GPUs"):
        trial_device("cuda", gpu_ids=["0"])
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert trial_device("auto", gpu_ids=["0"]) == "cuda" and trial_device("auto", gpu_ids=[]) == "cpu"


@pytest.fixture
def fake_gpu_ray(private_ray):
    private_ray(num_cpus=2, num_gpus=1)  # a GPU resource Ray schedules by; this machine has no CUDA


@pytest.mark.ray
def test_trials_are_scheduled_on_a_gpu_resource_and_run_on_cpu(assets, tmp_path, fake_gpu_ray):
    import ray

    from trsp_ray.search.cache import RunLog
    from trsp_ray.search.run import SearchOptions, run_search

    assert ray.cluster_resources()["GPU"] == 1.0
    space = parse_space({"params": {"ratio": [0.125, 0.25]}})
    opts = SearchOptions(search_dir=str(tmp_path / "search"), name="gpu", asha=False, val_windows=2,
                         register_name=None)
    summary = run_search(_base(assets, "device=auto"), space, opts)
    # two ratios, two n_drop: with swap refinement (the default) each gets its own stage 1
    assert summary["trials_run"] == 2 and summary["failed"] == 0 and summary["stage1_computed"] == 2
    events = RunLog(tmp_path / "search").read()
    route = next(e for e in events if e["event"] == "route")
    assert (route["use_gpu"], route["gpus"], route["workers"], route["eval_gpus"]) == (True, 0.25, 0, 0.25)
    started = [e for e in events if e["event"] == "trial_started"]
    assert len(started) == 2 and all(e["gpu_ids"] == ["0"] and e["device"] == "cpu" for e in started)
    records = [json.loads(p.read_text()) for p in (tmp_path / "search" / "trials").glob("*.json")]
    assert sorted(len(r["drop"]) for r in records) == [1, 2]
    assert all(r["gpu_ids"] == ["0"] and r["device"] == "cpu" and r["route"] == "single" for r in records)
    assert all(r["evaluation"]["status"] == "ok" and r["heldout_ppl"] > 1 for r in records)


@pytest.mark.ray
@pytest.mark.slow
def test_a_trial_runs_stage2_on_ray_train_inside_the_trial(assets, tmp_path, fake_gpu_ray):
    from trsp_ray.run.stage1_store import Stage1Store
    from trsp_ray.search.cache import RunLog
    from trsp_ray.search.run import SearchOptions, run_search

    space = parse_space({"params": {"ratio": [0.25]}})
    opts = SearchOptions(search_dir=str(tmp_path / "search"), name="dist", asha=False, val_windows=2,
                         register_name=None, trial_workers=1)
    # device=cpu on a cluster with a GPU: the forced Ray Train route runs on CPU workers (gloo)
    base = _base(assets, "device=cpu", f"distributed.storage_path={tmp_path / 'ray'}")
    summary = run_search(base, space, opts)
    assert summary["trials_run"] == 1 and summary["failed"] == 0 and summary["stage1_computed"] == 1
    (record,) = [json.loads(p.read_text()) for p in (tmp_path / "search" / "trials").glob("*.json")]
    assert record["route"] == "ray-train" and record["workers"] == 1 and len(record["drop"]) == 2
    # the exported drop set is the stored stage-1 one (its record for 2 layers: refinement may reorder
    # a longer one), handed to the workers (distributed/handoff.py)
    stored = Stage1Store(tmp_path / "search" / "stage1").get(record["stage1_key"], 2)
    assert stored is not None and stored.drop_order[:2] == record["drop"] and record["stage1_shared"] is True
    assert record["kept_parameters"] < record["dense_parameters"] and record["evaluation"]["layers"] == 6
    assert [e["route"] for e in RunLog(tmp_path / "search").read() if e["event"] == "stage2_run"] == ["ray-train x1"]


@pytest.mark.parametrize("dtype, bf16, scored", [("fp32", True, "float32"), ("auto", True, "bfloat16"),
                                                  ("auto", False, "float16")])
def test_a_ray_train_trial_scores_in_the_runs_dtype(assets, monkeypatch, dtype, bf16, scored):
    """Issue 49: a Ray Train trial's validation scored the export in bf16 whenever a GPU was visible,
    where a single-device trial scores in the run's dtype (workbench.run_dtype): the same dtype on the
    same (here faked) GPU, so both kinds of trial rank on the same numbers."""
    import torch

    from trsp_ray.evaluation import evaluator
    from trsp_ray.run.workbench import DTYPES, load_model, run_dtype
    from trsp_ray.search import distributed_trial

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: bf16)
    asked = []

    def load_candidate(path, *, dtype):  # the export loaded on the host, in fp32: what matters is what was asked
        asked.append(dtype)
        return load_model(path, device="cpu", dtype="fp32")

    monkeypatch.setattr(evaluator, "load_candidate", load_candidate)
    base = _base(assets, "device=cuda", f"dtype={dtype}")
    out = distributed_trial._validation_task(str(assets / "model"), base.to_dict())
    assert asked == [scored] == [str(DTYPES[run_dtype(base)]).removeprefix("torch.")]  # a single-device trial's
    assert out["objective"]["windows"] == len(out["val_nlls"]) >= 1
