"""Bad input: a one-line error naming the value and what is valid, exit 2, nothing written."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from trsp_ray.cli import main
from trsp_ray.common.errors import TrspError
from trsp_ray.config.run_config import RunConfig, load_config


def test_yaml_and_overrides(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("ratio: 0.3\nstage1:\n  lambda1: 0.01\n")
    cfg = load_config(str(path), ["stage2.lambda2=0.5", "--stage1.selection=oneshot"])
    assert cfg.ratio == 0.3 and cfg.stage1.lambda1 == 0.01
    assert cfg.stage2.lambda2 == 0.5 and cfg.stage1.selection == "oneshot"
    assert load_config(None).to_dict() == RunConfig().to_dict()


@pytest.mark.parametrize("override, needle", [
    ("ratio=1.5", "ratio=1.5"), ("ratio=0", "ratio=0"), ("stage1.lambda1=-0.1", "stage1.lambda1=-0.1"),
    ("stage2.lambda2=-1", "stage2.lambda2=-1"), ("stage1.bogus=1", "stage1.bogus"),
    ("method=magic", "'magic'"), ("gates.gate=sigmoid", "'sigmoid'"), ("stage2.steps=2.5", "stage2.steps"),
])
def test_bad_config_values(override, needle):
    with pytest.raises(TrspError) as err:
        load_config(None, [override])
    assert needle in str(err.value) and "\n" not in str(err.value)


def _cli(tmp_path, *args):
    return subprocess.run([sys.executable, "-m", "trsp_ray.cli", *args], capture_output=True, text=True,
                          cwd=tmp_path, timeout=300,
                          env={**__import__("os").environ, "TRSP_RAY_MLFLOW_DIR": str(tmp_path / "ml")})


@pytest.mark.parametrize("args, needle", [
    (["--ratio", "1.2"], "ratio=1.2"),
    (["--ratio", "0.97"], "only 25 are candidates (layers 4..28)"),
    (["--set", "stage1.lambda1=-1"], "stage1.lambda1=-1"),
    (["--model", "/nonexistent/model"], "/nonexistent/model"),
    (["--calib-text", "/nonexistent/calib.txt"], "/nonexistent/calib.txt"),
    (["--set", "nope=1"], "'nope'"),
])
def test_prune_bad_input_exits_2_and_writes_nothing(tmp_path, args, needle):
    proc = _cli(tmp_path, "prune", "--output", str(tmp_path / "out"), "--no-mlflow", *args)
    assert proc.returncode == 2, proc.stderr[-1500:]
    lines = [line for line in proc.stderr.strip().splitlines() if line.startswith("trsp-ray: error")]
    assert len(lines) == 1 and needle in lines[0], proc.stderr[-1500:]
    assert not (tmp_path / "out").exists()


def test_unknown_method_is_rejected(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["prune", "--method", "magic"])
    assert exc.value.code == 2
    assert "magic" in capsys.readouterr().err


JOBS = Path(__file__).resolve().parents[1] / "jobs"


@pytest.mark.parametrize("cmd, prog, needle", [
    ([str(JOBS / "prune_70b.py"), "--no-tracking", "--set", "ratio=1.5"], "prune_70b.py", "ratio=1.5"),
    ([str(JOBS / "reproduce.py"), "--set", "ratio=1.5"], "reproduce.py", "ratio=1.5"),
    ([str(JOBS / "search.py"), "--space", "stage1.lambda1=-1"], "search.py", "stage1.lambda1"),
    (["-m", "trsp_ray.cli", "eval", "--models", ".", "--tasks", "magic", "--no-mlflow"], "trsp-ray", "'magic'"),
    ([str(JOBS / "prune_70b.py"), "--bogus"], "prune_70b.py", "--bogus"),  # argparse's own error: same shape
])
def test_every_entry_point_reports_bad_input_on_one_line_named_after_itself(tmp_path, cmd, prog, needle):
    proc = subprocess.run([sys.executable, *cmd], capture_output=True, text=True, cwd=tmp_path, timeout=300,
                          env={**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"})
    lines = [line for line in proc.stderr.splitlines() if ": error:" in line]
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr[-1500:]
    assert lines[0].startswith(f"{prog}: error: ") and needle in lines[0], lines
    assert not any(p.name != "ml" for p in tmp_path.iterdir())  # refused before anything was written


def test_interrupt_exits_130_and_says_finished_work_is_intact(capsys):
    from trsp_ray.common.errors import run_main

    def interrupted():
        raise KeyboardInterrupt

    assert run_main("trsp-ray", interrupted) == 130
    assert capsys.readouterr().err.strip() == "trsp-ray: interrupted; finished exports and checkpoints are intact"
