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
    from trsp_ray.distributed import train
    from trsp_ray.evaluation import pool
    from trsp_ray.run import workbench

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


VERSION = re.compile(r"^(?P<prog>\S+) \d+\.\d+\.\d+\S* \(git [0-9a-f]{4,}\)$")


def test_version_on_trsp_ray_and_every_job(capsys):
    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0
    line = capsys.readouterr().out.strip()
    assert VERSION.match(line) and line.startswith("trsp-ray "), line  # this checkout is a git repository
    for name, parse in (("prune_70b", "parse_args"), ("search", "parse_args"), ("reproduce", "job_config")):
        with pytest.raises(SystemExit) as done:
            getattr(_job(name), parse)(["--version"])
        assert done.value.code == 0
        line = capsys.readouterr().out.strip()
        assert VERSION.match(line) and line.startswith(f"{name}.py "), line


def test_verbose_on_trsp_ray_or_its_subcommand():
    from trsp_ray.cli import build_parser

    parser = build_parser()
    assert parser.parse_args(["prune"]).verbose is False
    assert parser.parse_args(["--verbose", "prune"]).verbose is True
    assert parser.parse_args(["prune", "--verbose"]).verbose is True


EXPORT = """
import sys
from trsp_ray.common.logs import quiet_libraries
quiet_libraries(verbose=sys.argv[2] == "verbose")
from trsp_ray.run.export import export_model, pruned_manifest
from trsp_ray.models.tiny import tiny_model
model = tiny_model("llama", layers=2)
export_model(model, None, sys.argv[1], manifest=pruned_manifest(method=None, drop=[], num_layers_original=2))
print("deepspeed imported:", "deepspeed" in sys.modules)
"""
THIRD_PARTY = re.compile(r"Loading weights|Writing model shards|Setting accelerator|it/s\]")


@pytest.mark.parametrize("mode", ["quiet", "verbose"])
def test_an_export_prints_no_third_party_bars_and_imports_no_deepspeed(tmp_path, mode):
    """A single-process export (save, then the reload check) in a fresh interpreter, as a run does
    it: quiet, none of transformers' bars; --verbose brings them back (so the test sees them)."""
    import os
    import subprocess

    env = {k: v for k, v in os.environ.items()
           if k not in ("HF_HUB_DISABLE_PROGRESS_BARS", "MLFLOW_LOGGING_LEVEL", "TQDM_DISABLE")}
    proc = subprocess.run([sys.executable, "-c", EXPORT, str(tmp_path / "out"), mode], capture_output=True,
                          text=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "deepspeed imported: False" in proc.stdout
    found = THIRD_PARTY.findall(proc.stdout + proc.stderr)
    assert (found == []) if mode == "quiet" else ("Writing model shards" in found), found


def test_deepspeed_banner_is_dropped_but_its_warnings_are_kept(monkeypatch):
    import logging

    from trsp_ray.common.logs import quiet_libraries

    for var in ("HF_HUB_DISABLE_PROGRESS_BARS", "MLFLOW_LOGGING_LEVEL", "RAY_DEDUP_LOGS", "TQDM_DISABLE"):
        monkeypatch.delenv(var, raising=False)  # restored after the test: quiet_libraries sets them
    quiet_libraries()
    import io

    from tqdm import tqdm

    out = io.StringIO()
    list(tqdm(range(3), desc="Running loglikelihood requests", file=out))  # lm-eval's bars are plain tqdm
    assert out.getvalue() == ""
    ds = logging.getLogger("DeepSpeed")
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    ds.addHandler(handler)
    try:
        ds.warning("Setting accelerator to CPU. If you have GPU or other accelerator, we were unable to detect it.")
        ds.warning("zero_optimization.stage3_max_live_parameters is large")
    finally:
        ds.removeHandler(handler)
    assert [r.getMessage() for r in records] == ["zero_optimization.stage3_max_live_parameters is large"]


@pytest.mark.parametrize("command,flag", [(["search", "--space", "stage1.lambda1=0.01,0.02"], "--search-dir"),
                                          (["reproduce", "--preset", "local"], "--out")])
def test_search_and_reproduce_dirs_under_a_file_or_unwritable_are_refused(tmp_path, capsys, no_work, command, flag):
    """Their folders are resumable (an existing one with results is fine), but a path under a file
    or in a folder that cannot be written is refused in one line before any model or Ray starts."""
    import ray

    afile = tmp_path / "afile"
    afile.write_text("not a directory")
    started = []
    original = ray.init
    ray.init = lambda *a, **k: started.append(1)
    try:
        for bad, words in ((afile / "sub", "not a directory"), (afile, "is a file"),
                           (Path("/proc/trsp-ray-test/dir"), "not writable")):
            assert main([*command, flag, str(bad), "--no-mlflow"] if command[0] == "search"
                        else [*command, flag, str(bad)]) == 2
            line = _one_error_line(capsys, "trsp-ray")
            assert flag in line and words in line, line
    finally:
        ray.init = original
    assert not started
