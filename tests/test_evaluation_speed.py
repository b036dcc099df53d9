"""Speed settings per device, and the statistic: a disturbed round cannot move a speed-up."""

import pytest

from trsp_ray.common.errors import TrspError
from trsp_ray.evaluation import speed
from trsp_ray.evaluation.speed import DEFAULTS, SpeedSettings


def test_defaults_are_per_device_and_flags_win():
    cpu = SpeedSettings().resolve("cpu")
    gpu = SpeedSettings(rounds=3).resolve("cuda")
    assert (cpu.prompt_len, cpu.new_tokens, cpu.rounds) == (512, 32, 16)
    assert gpu.rounds == 3 and gpu.gen_batch * gpu.new_tokens >= 32 * 256  # not 4 x 16 launch-bound tokens
    assert all(getattr(SpeedSettings().resolve(d), k) == v for d in DEFAULTS for k, v in DEFAULTS[d].items())
    for bad, msg in (({"rounds": 0}, "speed.rounds=0"), ({"clock": "tsc"}, "speed.clock='tsc'")):
        with pytest.raises(TrspError, match=msg):
            SpeedSettings(**bad)


def test_clock_is_cpu_time_only_for_one_cpu_thread(monkeypatch):
    monkeypatch.setattr(speed.torch, "get_num_threads", lambda: 1)
    assert SpeedSettings().clock_for("cpu") == "cpu" and SpeedSettings().clock_for("cuda") == "wall"
    monkeypatch.setattr(speed.torch, "get_num_threads", lambda: 4)
    assert SpeedSettings().clock_for("cpu") == "wall" and SpeedSettings(clock="cpu").clock_for("cpu") == "cpu"


def test_speedup_is_the_median_paired_ratio_and_ignores_a_disturbed_round(monkeypatch):
    from types import SimpleNamespace

    import torch

    # Dense costs 3 s, pruned 2 s (CPU time); round 2 of dense is disturbed (10 s), and wall time
    # carries load noise. Calls arrive in ABBA order, one (prefill, generate) pair per model.
    calls = {"dense": 0, "pruned": 0}

    def fake(model, *args):
        n = calls[model.name]
        calls[model.name] += 1
        cpu = {"dense": 3.0, "pruned": 2.0}[model.name] * (1 if (model.name, n // 2) != ("dense", 2) else 10 / 3)
        return cpu * 1.5, cpu

    def model(name, layers):
        return SimpleNamespace(name=name, device=torch.device("cpu"), config=SimpleNamespace(num_hidden_layers=layers),
                               get_input_embeddings=lambda: SimpleNamespace(num_embeddings=10))

    monkeypatch.setattr(speed, "prefill_seconds", fake)
    monkeypatch.setattr(speed, "generate_seconds", fake)
    out = speed.compare_speed(model("dense", 30), model("pruned", 20),
                              SpeedSettings(warmup=1, rounds=5, clock="cpu"))
    assert calls == {"dense": 12, "pruned": 12}  # (1 + 5) rounds x (prefill + generate)
    assert out["prefill_speedup"] == pytest.approx(1.5) and out["throughput_speedup"] == pytest.approx(1.5)
    assert out["prefill_speedup_max"] == pytest.approx(5.0)  # the disturbed round is visible, not used
    assert out["dense_prefill_ms"] == pytest.approx(3000.0) and out["ideal_speedup"] == pytest.approx(1.5)
    assert out["settings"]["clock"] == "cpu" and out["settings"]["rounds"] == 5
