"""Issue 20: what a newcomer meets in the first hour. Each bad input gets one `<prog>: error: ...`
line naming the value, exit 2, before any model is loaded or any worker starts; `--version` on
every entry point; quiet third-party libraries; timings that measure what they name."""

import importlib.util
import re
import sys
from pathlib import Path

import pytest

from trsp_ray.cli import main

JOBS = Path(__file__).resolve().parents[1] / "jobs"


def _job(name: str):
    """A job script (jobs/<name>.py) as a module, so its main() runs in this process."""
    spec = importlib.util.spec_from_file_location(f"job_{name}", JOBS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def no_work(monkeypatch):
    """Fail the test if a model is loaded, a distributed run starts or the evaluation pool starts:
    the bad input must be refused before any of them."""
    from trsp_ray import workbench
    from trsp_ray.distributed import train
    from trsp_ray.evaluation import pool

    def refuse(what):
        def _raise(*a, **k):
            raise AssertionError(f"{what} started before the bad input was refused")
        return _raise

    monkeypatch.setattr(workbench, "prepare", refuse("the model load"))
    monkeypatch.setattr(train, "run_distributed", refuse("the Ray Train run"))
    monkeypatch.setattr(pool, "evaluate_pool", refuse("the actor pool"))


def _one_error_line(capsys, prog: str) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"{prog}: error: "), err
    return err[0]


def test_malformed_yaml_is_one_line_naming_file_line_and_column(tmp_path, capsys, no_work):
    bad = tmp_path / "bad.yaml"
    bad.write_text("ratio: 0.25\nstage1:\n  lambda1: [1, 2\n")
    assert main(["prune", "--config", str(bad), "--no-mlflow"]) == 2
    line = _one_error_line(capsys, "trsp-ray")
    assert str(bad) in line and re.search(r"line \d+, column \d+", line), line


def _prune_argv(output: str) -> list[str]:
    return ["prune", "--output", output, "--no-mlflow", "--ratio", "0.25"]


def test_output_under_a_regular_file_is_refused_before_the_model_loads(tmp_path, capsys, no_work):
    afile = tmp_path / "afile"
    afile.write_text("not a directory")
    assert main(_prune_argv(str(afile / "sub"))) == 2
    line = _one_error_line(capsys, "trsp-ray")
    assert str(afile) in line and "not a directory" in line


def test_unwritable_output_parent_is_refused(capsys, no_work):
    # /proc refuses new entries even to root (chmod does not stop root, so a mode-0500 folder would not do)
    assert main(_prune_argv("/proc/trsp-ray-test/out")) == 2
    line = _one_error_line(capsys, "trsp-ray")
    assert "/proc" in line and "writ" in line


def test_too_little_free_disk_for_the_planned_export_is_refused(tmp_path, capsys, no_work, monkeypatch):
    import collections
    import shutil

    usage = collections.namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(10**12, 10**12 - 1000, 1000))
    assert main(_prune_argv(str(tmp_path / "out"))) == 2
    line = _one_error_line(capsys, "trsp-ray")
    assert str(tmp_path / "out") in line and "free" in line and "GB" in line


def test_prune_70b_refuses_an_output_under_a_file_before_any_worker(tmp_path, capsys, no_work):
    afile = tmp_path / "afile"
    afile.write_text("")
    job = _job("prune_70b")
    code = job.main(["--model", "smollm2-135m", "--device", "cpu", "--workers", "1", "--no-tracking",
                     "--ratio", "0.1", "--output", str(afile / "sub"), "--storage-path", str(tmp_path / "st")])
    assert code == 2
    assert str(afile) in _one_error_line(capsys, "prune_70b.py")


def test_eval_of_a_missing_model_directory_is_refused_before_the_pool(tmp_path, capsys, no_work):
    assert main(["eval", "--models", "/nonexistent/model", "--no-mlflow", "--tasks", "none",
                 "--out", str(tmp_path / "res")]) == 2
    line = _one_error_line(capsys, "trsp-ray")
    assert "/nonexistent/model" in line
    assert not (tmp_path / "res").exists()
