"""An export path `trsp-ray prune` cannot write is refused in one line, exit 2, before any work: no
log line (the pipeline's, the route's) comes first, and `--dry-run` refuses it too instead of
printing a plan for a run that would fail."""

import os
import subprocess
import sys

import pytest


def _prune(tmp_path, *args):
    return subprocess.run([sys.executable, "-m", "trsp_ray.cli", "prune", "--no-mlflow", *args], capture_output=True,
                          text=True, cwd=tmp_path, timeout=300,
                          env={**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
                               "TRSP_RAY_MLFLOW_DIR": str(tmp_path / "ml")})


@pytest.mark.parametrize("dry_run", [False, True], ids=["prune", "dry-run"])
@pytest.mark.parametrize("output, needle", [
    ("a_file/sub", "is under '{}', a file, not a directory"),
    ("a_file", "already exists and is not empty"),
])
def test_an_unwritable_output_is_one_line_and_exit_2_before_any_work(tmp_path, dry_run, output, needle):
    a_file = tmp_path / "a_file"
    a_file.write_text("not a directory\n")
    proc = _prune(tmp_path, "--output", str(tmp_path / output), *(["--dry-run"] if dry_run else []))
    assert proc.returncode == 2, (proc.stdout[-1500:], proc.stderr[-1500:])
    assert proc.stdout == ""  # nothing before the refusal: the log goes to stdout, a plan too
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr[-1500:]
    assert lines[0].startswith("trsp-ray: error: output ") and needle.format(a_file) in lines[0], lines
    assert a_file.read_text() == "not a directory\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a_file"]  # nothing else was written
