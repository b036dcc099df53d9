"""Issue 33 item 6: one exit (trsp_ray/common/process_exit.py) for the console script and every job, that
neither hangs on an idle thread pool nor turns a finished run into a failure in the teardown."""

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
ENTRY_POINTS = ["jobs/prune_70b.py", "jobs/reproduce.py", "jobs/search.py", "trsp_ray/reproduce/cli.py"]
# an object whose destruction aborts the process: the interpreter's teardown destroys it (as it once
# segfaulted in torch's), os._exit never does
CRASH_AT_TEARDOWN = ("import os\n"
                     "class Crash:\n"
                     "    def __del__(self):\n"
                     "        os.abort()\n"
                     "CRASH = Crash()\n")


def _run(script: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", script, *args], capture_output=True, text=True, timeout=60,
                          cwd=ROOT)


def test_the_command_exits_past_an_idle_thread_pool():
    """MLflow's artifact repositories keep a module-level ThreadPoolExecutor whose idle workers wait
    for work until concurrent.futures' threading-atexit hook wakes them; `trsp-ray` must still exit."""
    script = ("import concurrent.futures\n"
              "from trsp_ray import cli\n"
              "POOL = concurrent.futures.ThreadPoolExecutor(max_workers=2)\n"
              "def main():\n"
              "    POOL.submit(lambda: None).result()  # a finished task; its worker now idles\n"
              "    print('done')\n"
              "    return 3\n"
              "cli.main = main\n"
              "cli.entry()\n")
    try:
        done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=30)
    except subprocess.TimeoutExpired:
        pytest.fail("cli.entry() hung on an idle ThreadPoolExecutor for 30 s")
    assert (done.returncode, done.stdout) == (3, "done\n"), done.stderr[-2000:]


def test_a_finished_job_is_not_failed_by_a_crash_in_the_teardown():
    script = CRASH_AT_TEARDOWN + ("import sys\n"
                                  "from trsp_ray.common.process_exit import exit_after\n"
                                  "exit_after(lambda: print('finished'))\n")
    done = _run(script)
    assert (done.returncode, done.stdout) == (0, "finished\n"), done.stderr[-2000:]


def test_a_failure_keeps_its_status_and_its_traceback():
    script = ("from trsp_ray.common.process_exit import exit_after\n"
              "def main():\n"
              "    raise RuntimeError('boom')\n"
              "exit_after(main)\n")
    done = _run(script)
    assert done.returncode == 1 and done.stderr.rstrip().endswith("RuntimeError: boom")
    bad_flag = _run("import argparse\nfrom trsp_ray.common.process_exit import exit_after\n"
                    "exit_after(lambda: argparse.ArgumentParser(prog='job').parse_args(['--nope']))\n")
    assert bad_flag.returncode == 2 and "unrecognized arguments: --nope" in bad_flag.stderr


@pytest.mark.parametrize("path", ENTRY_POINTS)
def test_every_job_exits_through_the_one_exit(path):
    """Each job's `__main__` block ends in exit_after: `--help` (argparse's SystemExit(0) out of the
    job's main) exits 0 although the teardown would abort the process."""
    script = CRASH_AT_TEARDOWN + ("import runpy, sys\n"
                                  f"sys.argv = [{path!r}, '--help']\n"
                                  f"runpy.run_path({path!r}, run_name='__main__')\n")
    done = _run(script)
    assert done.returncode == 0 and "usage:" in done.stdout, (done.returncode, done.stderr[-2000:])
    main_block = [node for node in ast.parse((ROOT / path).read_text()).body
                  if isinstance(node, ast.If) and "__main__" in ast.unparse(node.test)]
    assert len(main_block) == 1 and "exit_after(" in ast.unparse(main_block[0]), path


def test_only_the_exit_module_leaves_with_os_exit():
    found = set()
    for p in list((ROOT / "trsp_ray").rglob("*.py")) + list((ROOT / "jobs").glob("*.py")):
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, ast.Attribute) and node.attr in ("_exit", "_run_exitfuncs"):
                found.add(p.relative_to(ROOT).as_posix())
    assert found == {"trsp_ray/common/process_exit.py"}


def _pytest_run(tmp_path, body: str, with_conftest: bool) -> subprocess.CompletedProcess:
    """pytest on one test file holding an object whose destruction aborts the process, with or
    without the repository's tests/conftest.py loaded as a plugin."""
    test = tmp_path / "test_teardown_crash.py"
    test.write_text("import atexit, os, sys\n"
                    "class Crash:\n"
                    "    def __del__(self, abort=os.abort):  # bound now: the teardown clears `os`\n"
                    "        abort()\n"
                    "CRASH = Crash()\n"
                    "atexit.register(lambda: print('atexit ran', file=sys.stderr))\n" + body)
    plugin = ["-p", "conftest"] if with_conftest else []
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *plugin, str(test)],
                          capture_output=True, text=True, timeout=120, cwd=tmp_path,
                          env={**os.environ, "PYTHONPATH": str(ROOT / "tests")})


@pytest.mark.parametrize("body, status", [("def test_ok():\n    assert 1 + 1 == 2\n", 0),
                                          ("def test_bad():\n    assert 1 + 1 == 3\n", 1)],
                         ids=["passed", "failed"])
def test_the_test_run_keeps_its_status_past_a_crash_in_the_teardown(tmp_path, body, status):
    """tests/conftest.py ends the test run like a trsp-ray command: pytest's status once the atexit
    handlers ran (the module's own handler still prints), never the teardown's abort. Without the
    conftest the same run aborts (134): the crash this guards against is real."""
    done = _pytest_run(tmp_path, body, with_conftest=True)
    assert done.returncode == status and "atexit ran" in done.stderr, (done.returncode, done.stderr[-2000:])
    assert ("1 passed" if status == 0 else "1 failed") in done.stdout
    assert _pytest_run(tmp_path, body, with_conftest=False).returncode == -6  # SIGABRT
