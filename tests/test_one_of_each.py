"""Issue 13: progress goes through the one `trsp_ray` logger, quiet on non-zero ranks; the lint
configuration holds; Ray's deprecation warnings are not hidden with everyone else's."""

import re
import shutil
import subprocess
import warnings
from pathlib import Path

import pytest

from trsp_ray.common import logs

ROOT = Path(__file__).resolve().parents[1]


def test_progress_lines_on_rank_0_only_warnings_everywhere(capsys, monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    logs.log("round 1 done")
    out = capsys.readouterr().out
    assert out.startswith("[trsp_ray ") and out.rstrip().endswith("] round 1 done") and out.count("\n") == 1
    monkeypatch.setenv("RANK", "3")
    logs.log("round 2 done")
    logs.warn("node lost")
    out = capsys.readouterr().out
    assert "round 2 done" not in out and out.rstrip().endswith("] node lost")


def test_library_code_logs_through_the_logger_not_print():
    # print() is for results a command shows (tables, paths, JSON, one-line errors); progress is logged.
    allowed = {"cli.py", "common/errors.py", "evaluation/cli.py", "reproduce/cli.py", "plan_cli.py", "driver.py",
               "benchmark/comparison.py", "reproduce/run.py"}
    offenders = []
    for path in (ROOT / "trsp_ray").rglob("*.py"):
        rel = path.relative_to(ROOT / "trsp_ray").as_posix()
        code = path.read_text().replace('print(dry_run("paper"))', "")  # a usage line in a docstring
        if rel not in allowed and re.search(r"(?<![\w.])print\(", code):
            offenders.append(rel)
    assert not offenders, f"print() outside the commands: {offenders}"


def test_ray_deprecations_pass_the_warning_filter():
    with warnings.catch_warnings(record=True) as seen:  # keeps pytest's configured filters
        warnings.warn_explicit("ray api moved", DeprecationWarning, "ray/train/x.py", 1, module="ray.train.x")
        warnings.warn_explicit("other api moved", DeprecationWarning, "pkg/x.py", 1, module="transformers.x")
    assert [str(w.message) for w in seen] == ["ray api moved"]


def test_the_code_passes_its_lint_configuration():
    ruff = shutil.which("ruff")
    if ruff is None:
        pytest.fail("ruff is not installed; pip install -e '.[dev]' installs the pinned version")
    done = subprocess.run([ruff, "check", str(ROOT)], capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 0, done.stdout[-3000:]


def _calls(name: str) -> set[str]:
    """Modules of trsp_ray/ and jobs/ whose code calls `name` (e.g. "os.replace", "ray.init")."""
    import ast

    owner, _, attr = name.rpartition(".")
    found = set()
    for path in list((ROOT / "trsp_ray").rglob("*.py")) + list((ROOT / "jobs").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == attr
                    and isinstance(node.func.value, ast.Name) and node.func.value.id == owner):
                found.add(path.relative_to(ROOT).as_posix())
    return found


def test_one_module_renames_temp_files_into_place_and_one_starts_ray():
    assert _calls("os.replace") == {"trsp_ray/common/atomic.py"}
    assert _calls("tempfile.mkstemp") == {"trsp_ray/common/atomic.py"}
    assert _calls("ray.init") == {"trsp_ray/distributed/ray_session.py"}
    # mkdtemp elsewhere makes scratch directories, never a file that is renamed into place
    assert _calls("tempfile.mkdtemp") - {"trsp_ray/common/atomic.py"} <= {"trsp_ray/benchmark/comparison.py",
                                                                    "trsp_ray/distributed/checkpoints.py"}


def test_one_function_splits_rows_over_the_data_parallel_ranks():
    """Rows k % world == rank, batched and padded so the ranks stay in step, come from
    training.split_over_ranks only (the probes', the fit's and Block Influence's forwards): a
    second `rows[rank::world]` is a split that can disagree (the probes' once ran a forward of no
    rows on a rank without a window)."""
    import ast

    def world(node) -> bool:
        return (isinstance(node, ast.Name) and node.id == "world") or (
            isinstance(node, ast.Attribute) and node.attr == "world")

    found = set()
    for path in list((ROOT / "trsp_ray").rglob("*.py")) + list((ROOT / "jobs").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Slice) and node.step is not None and world(node.step):
                found.add(path.relative_to(ROOT).as_posix())
    assert found == {"trsp_ray/method/training.py"}
