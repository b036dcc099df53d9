"""Stage 1's removal probes and refinement in the plan (issue 19): memory per GPU and compute, for
Llama-2-70B (V = 32,000) and Llama-3-70B (V = 128,256) on 16 x 80 GB, printed by `trsp-ray plan`."""

import subprocess
import sys
from pathlib import Path

import pytest
from test_distributed_hub import cached_70b  # noqa: F401  (fixture)

from trsp_ray.config import registry
from trsp_ray.config.run_config import load_config
from trsp_ray.plan import shape, zero3_plan, zero3_setup
from trsp_ray.plan.probe_plan import ProbeSetup, probe_plan, refine_calls

MODELS = Path(__file__).resolve().parents[1] / "cluster" / "models"
GiB = 2**30


def _plan(name: str, **setup):
    st = zero3_setup.Setup(workers=16, gpu_memory_gb=80, activation_checkpointing=True, **setup)
    probes = ProbeSetup.from_config(load_config(None, ["method=trsp+heal"]), spec=registry.method("trsp+heal"))
    return probe_plan(shape.read_shape(str(MODELS / name)), st, probes)


@pytest.mark.parametrize("name, vocab", [("llama-2-70b.json", 32_000), ("llama-3-70b.json", 128_256)])
def test_probe_memory_per_gpu_is_the_chunk_logprobs_and_the_teacher(name, vocab):
    pp = _plan(name)
    tokens = 2048  # 8 probe windows over 16 GPUs: one 2048-token window each
    assert pp.windows_per_gpu == 1 and pp.teacher_cached
    parts = pp.memory.parts
    # bf16: while the student's log-probs are made, the teacher chunk (2) + the logits (2) + their fp32
    # upcast (4) + the fp32 log-probs (4); the KL phase needs less (2 + 4 + 4): 12 bytes (kl_div took 22)
    assert parts["probe chunk (student log-probs + teacher)"] == pytest.approx(tokens * vocab * 12 / GiB)
    assert parts["probe teacher cache"] == pytest.approx(tokens * vocab * 2 / GiB)
    assert "activations" not in parts  # a no-grad forward keeps no training activations
    figures = {32_000: (0.73, 0.12, 14.5), 128_256: (2.94, 0.49, 17.3)}[vocab]
    got = (parts["probe chunk (student log-probs + teacher)"], parts["probe teacher cache"], pp.memory.total)
    assert [round(x, 2 if i < 2 else 1) for i, x in enumerate(got)] == list(figures)


def test_probe_and_refinement_compute_of_llama2_70b():
    pp = _plan("llama-2-70b.json")
    # 80 layers, 25%: 20 rounds of 4 probes; 80 - 10 (auto: one layer in eight) - 1 = 69 candidates;
    # refinement: 2 passes x 20 x a pool of min(69 - 20, 20 x 3) = 1,960 calls unbounded, capped at the default
    # budget of 320
    assert (pp.n_drop, pp.probe_calls, pp.refine_unbounded, pp.refine_calls) == (20, 80, 1960, 320)
    assert pp.window_tokens == 8 * 2048
    assert pp.compute == (80 + 320 + 1) * 8 * 2048  # + the cached teacher's one pass
    assert pp.compute_per_gpu(2048) == (80 + 320 + 1) * 2048
    assert refine_calls(candidates=28, n_drop=8, probe=4, refine=2) == 320  # SmolLM2: the default's formula


def test_a_teacher_over_the_budget_is_recomputed_every_call():
    st = zero3_setup.Setup(workers=1, gpu_memory_gb=80, activation_checkpointing=True)
    s = shape.read_shape(str(MODELS / "llama-3-70b.json"))
    pp = probe_plan(s, st, ProbeSetup.from_config(load_config(None, ["method=trsp+heal"]),
                                                  spec=registry.method("trsp+heal")))
    assert not pp.teacher_cached and pp.memory.parts["probe teacher cache"] == 0  # 8 x 2048 x 128k x 2 > 2 GiB
    assert pp.compute == 2 * pp.calls * 8 * 2048


def test_plan_command_prints_the_probes(cached_70b):  # noqa: F811
    import os

    done = subprocess.run([sys.executable, "-m", "trsp_ray.cli", "plan", "--model-config", "meta-llama/Llama-2-70b-hf",
                           "--workers", "16", "--gpu-memory-gb", "80", "--activation-checkpointing",
                           "--method", "trsp+heal"], capture_output=True, text=True, env={**os.environ}, timeout=300)
    out = done.stdout
    assert done.returncode == 0, done.stderr
    for figure in ("stage 1 probes: 14.5 GB per worker (fits)",
                   "probe chunk (student log-probs + teacher): 0.73 GB",
                   "probe teacher cache: 0.12 GB", "80 scorer calls in 20 rounds + at most 320 refinement calls",
                   "the passes alone allow 1960", "= 6.6M dense-forward tokens (all GPUs; 0.8M per GPU)"):
        assert figure in out, figure
    assert out.index("stage 1 probes") < out.index("checkpoint:")


def test_a_run_whose_probes_do_not_fit_is_refused_before_any_worker(tmp_path):
    """A 7B-like Llama with a vocabulary of 400k on 2 x 40 GB, 4 windows of 2048 tokens a batch:
    stage 1's training fits (33.3 GB per worker), its probes do not (four of the 8 probe windows per
    GPU in one chunk: 4 x 2048 tokens x V x 12 bytes of log-probs and teacher = 36.6 GiB, 50.3 GB in
    all), and check_plan says so in one line."""
    import json

    from trsp_ray.common.errors import TrspError
    from trsp_ray.distributed.train import check_plan

    path = tmp_path / "config.json"
    path.write_text(json.dumps({"model_type": "llama", "vocab_size": 400_000, "hidden_size": 4096,
                                "intermediate_size": 11008, "num_hidden_layers": 32, "num_attention_heads": 32,
                                "num_key_value_heads": 32}))
    common = ["distributed.workers=2", "distributed.use_gpu=true", "distributed.gpu_memory_gb=40",
              "data.batch_size=4", "data.seqlen=2048", "method=trsp-no-stage2",
              "distributed.activation_checkpointing=true"]
    cfg = load_config(None, common)
    assert zero3_plan.plan_for_run(cfg, str(path), spec=registry.method(cfg.method)).fits
    with pytest.raises(TrspError, match=r"stage 1's removal probes need 50\.3 GB per worker"):
        check_plan(cfg, str(path))
    check_plan(load_config(None, [*common, "stage1.probe=0"]), str(path))  # no probes: nothing to refuse


def test_plan_of_the_default_method_has_no_probes_and_freezes_the_drop_set():
    """`trsp-ray plan` plans what the workers run: the default shortgpt+heal scores Block Influence
    (forward-only: no probe figures, its window count and tokens instead) and its heal leaves the 20
    dropped layers of Llama-2-70B out of the optimizer and the checkpoints (the paper's stage 2 does
    not: 770.9 GB per save)."""
    args = [sys.executable, "-m", "trsp_ray.cli", "plan", "--model-config", str(MODELS / "llama-2-70b.json"),
            "--workers", "16", "--gpu-memory-gb", "80", "--activation-checkpointing"]
    default = subprocess.run(args, capture_output=True, text=True, timeout=300)
    assert default.returncode == 0, default.stderr
    out = default.stdout
    assert "stage 1 probes" not in out and "probe compute" not in out
    # as many tokens as stage 1 would see at the config's defaults (methods.shortgpt_windows)
    from trsp_ray.config.run_config import replace
    from trsp_ray.run.methods import shortgpt_windows

    windows = shortgpt_windows(replace(load_config(None, []), **{"data.seqlen": 2048}), 20)
    assert ("Block Influence, forward-only: 13.9 GB per worker (stage 1's model state and one micro batch's logits), "
            f"within the stage-1 figure; {windows} windows x 2048 tokens") in out
    assert "checkpoint: 579.6 GB per save" in out
    paper = subprocess.run([*args, "--method", "trsp"], capture_output=True, text=True, timeout=300)
    assert "checkpoint: 770.9 GB per save" in paper.stdout and "stage 1 probes: 14.5 GB" in paper.stdout


def test_the_route_takes_as_many_workers_as_the_probes_need(tmp_path):
    """A 7B-like Llama with a vocabulary of 400k, 4 windows of 2048 tokens a batch, 40 GB GPUs: one
    process does not fit (60.3 GB), stage 1's training fits 2 workers (33.3 GB) but its probes there
    do not (50.3 GB: four probe windows' logits per GPU), so the route takes 4 workers (18.6 GB); when
    the probes fit no worker count allowed it refuses in one line naming them."""
    import json

    from trsp_ray.common.errors import TrspError
    from trsp_ray.plan.route import route
    from trsp_ray.plan.shape import read_shape

    def shape(vocab):
        (tmp_path / "config.json").write_text(json.dumps({
            "model_type": "llama", "vocab_size": vocab, "hidden_size": 4096, "intermediate_size": 11008,
            "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 32}))
        return read_shape(str(tmp_path))

    common = ["distributed.workers=16", "distributed.use_gpu=true", "data.batch_size=4", "data.seqlen=2048",
              "method=trsp-no-stage2", "device=cuda", "distributed.activation_checkpointing=true"]
    spec = registry.method("trsp-no-stage2")
    r = route(load_config(None, common), spec=spec, shape=shape(400_000), memory_gb=40)
    assert r.workers == 4 and r.plan.peak < 40
    no_probes = route(load_config(None, [*common, "stage1.probe=0"]), spec=spec, shape=shape(400_000), memory_gb=40)
    assert no_probes.workers == 2  # the training plan alone decides
    with pytest.raises(TrspError, match=r"on 2 workers stage 1's removal probes need 50\.3 GB per worker") as err:
        route(load_config(None, common), spec=spec, shape=shape(400_000), memory_gb=40, max_workers=2)
    assert "\n" not in str(err.value)
