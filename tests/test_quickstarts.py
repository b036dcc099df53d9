"""The README's GPU and cluster quickstarts run as shown: the one-GPU command's `--dry-run` (refused in
one line without a GPU, and its plan printed with device=cpu) and the cluster's `trsp-ray plan`, each
checked against the output the README prints under it, figures included. CPU only, a few seconds."""

import re
import shlex
from pathlib import Path

import pytest
import torch

from trsp_ray.cli import main

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
FENCE = re.compile(r"```(\w+)\n(.*?)\n```", flags=re.S)


@pytest.fixture(autouse=True)
def _offline(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("TRSP_RAY_MLFLOW_DIR", str(tmp_path / "mlruns"))
    # the default checkpoint folder a user gets (./runs/checkpoints), which the plans print: these
    # commands plan and write nothing there (conftest's guard fails a test that does)
    monkeypatch.delenv("TRSP_RAY_CHECKPOINT_DIR", raising=False)


def shown(marker: str) -> tuple[list[str], list[str]]:
    """(argv after `trsp-ray` of the README's bash line holding `marker`, the lines of the first `text`
    block after that bash block: what the README says the command prints)."""
    blocks = [(m.group(1), m.group(2), m.end()) for m in FENCE.finditer(README)]
    for i, (lang, body, _) in enumerate(blocks):
        line = next((x for x in body.splitlines() if lang == "bash" and marker in x), None)
        if line is not None:
            text = next(b for lang2, b, _ in blocks[i + 1:] if lang2 == "text")
            return shlex.split(line.split("trsp-ray", 1)[1]), text.splitlines()
    raise AssertionError(f"no README bash line holds {marker!r}")


def assert_printed(expected: list[str], out: str) -> None:
    """Every line the README shows is a whole line of the output; `...` stands for any text."""
    lines = out.splitlines()
    for want in expected:
        pattern = re.compile(".*".join(map(re.escape, want.split("..."))) + r"\Z")
        assert any(pattern.match(got) for got in lines), f"README shows {want!r}; the command printed:\n{out}"


def _swap(argv: list[str], flag: str, value: str) -> list[str]:
    out = list(argv)
    out[out.index(flag) + 1] = value
    return out


def test_the_gpu_quickstart_dry_run_prints_the_plan_the_readme_shows(tmp_path, capsys):
    argv, expected = shown("--dry-run")
    assert argv[0] == "prune" and "device=cuda" in argv and "--dry-run" in argv
    # the README's model is a hub id this offline machine does not hold: SmolLM2 stands in for it
    argv = _swap(_swap(argv, "--model", "smollm2-135m"), "--output", str(tmp_path / "pruned"))
    if not torch.cuda.is_available():
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert err == "trsp-ray: error: device='cuda' but no CUDA device is visible; use device=cpu or auto\n"
        assert f"`{err.strip()}`" in " ".join(README.split())  # the README quotes the refusal as printed
        argv[argv.index("device=cuda")] = "device=cpu"
    assert main(argv) == 0
    out = capsys.readouterr().out
    if "device=cpu" in argv:
        assert_printed(expected, out)
    # the figures are a plan: every stage fits the device's memory and the heal is the peak
    route = re.search(r"^route: single process on one \w+: peak ([\d.]+) of ([\d.]+) GB \((\w+)\)$", out, re.M)
    assert route and float(route[1]) < float(route[2]), out
    stages = {m[1]: float(m[2]) for m in re.finditer(r"^  (\S[^:]*): ([\d.]+) GB$", out, re.M)}
    assert {"shortgpt", "compensation", "heal"} <= set(stages), stages
    assert max(stages, key=stages.get) == route[3] and abs(stages[route[3]] - float(route[1])) < 0.05
    assert not (tmp_path / "pruned").exists()  # a dry run writes nothing


def test_the_cluster_quickstart_plan_prints_the_figures_the_readme_shows(capsys):
    argv, expected = shown("trsp-ray plan")
    assert argv[0] == "plan" and argv[argv.index("--workers") + 1] == "16"
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert_printed(expected, out)
    gpu_gb = float(argv[argv.index("--gpu-memory-gb") + 1])
    per_worker = {m[1]: float(m[2]) for m in re.finditer(r"^  (.+?): ([\d.]+) GB per worker", out, re.M)}
    assert per_worker["stage 2 (all weights)"] == 60.7 and per_worker["stage 1"] == 19.9, per_worker
    assert all(gb < gpu_gb for gb in per_worker.values()), per_worker
    assert out.rstrip().endswith("plan fits")
    # the README's sentence after the plan says what it means: 16 x 80 GB, 2 nodes of 8
    assert "16 x 80 GB GPUs (2 nodes of 8)" in README


def test_the_cluster_quickstart_submits_the_job_it_planned():
    job = next(line for m in FENCE.finditer(README) if m.group(1) == "bash"
               for line in m.group(2).replace("\\\n", " ").splitlines() if "jobs/prune_70b.py" in line)
    plan, _ = shown("trsp-ray plan")
    args = shlex.split(job.split("jobs/prune_70b.py", 1)[1])
    assert args[args.index("--workers") + 1] == plan[plan.index("--workers") + 1]
