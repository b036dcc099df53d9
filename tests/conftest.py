import os
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import pytest  # noqa: E402

from trsp_ray.common.process_exit import skip_teardown_at_exit  # noqa: E402

REPO_RUNS = Path(__file__).resolve().parents[1] / "runs"
GIB_PER_WORKER = 6


@pytest.fixture(scope="module")
def workspaces(tmp_path_factory):
    """family -> a tiny model of it (8 layers) with SmolLM2's tokenizer and short texts, made on demand."""
    from trsp_ray.models.tiny import tiny_workspace

    made: dict = {}

    def get(family):
        if family not in made:
            made[family] = tiny_workspace(tmp_path_factory.mktemp(family), layers=8, calib_chars=30000,
                                          eval_chars=8000, family=family)
        return made[family]

    return get


def pytest_xdist_auto_num_workers(config):
    """How many processes pyproject's `-n auto` starts: one per core this process may use, no more
    than one per GIB_PER_WORKER of memory (two test processes with the Ray heads and workers they start
    used at most 8.4 GiB on 2 cores), and none when the command names single tests (`file.py::test`),
    which then run in this process."""
    if config.args and all("::" in arg for arg in config.args):
        return 0
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return max(1, min(len(os.sched_getaffinity(0)), int(memory // GIB_PER_WORKER)))


def _repo_runs() -> set[Path]:
    return set(REPO_RUNS.rglob("*")) if REPO_RUNS.is_dir() else set()


@pytest.fixture(autouse=True)
def _outputs_in_tmp(tmp_path, monkeypatch):
    """Keep every test's MLflow store and default checkpoint folder (stores of stage 1, the teacher, a
    merge's pairs) out of the repository, where tests in parallel processes would share them, and fail a
    test that writes into the repository's runs/ (a default output directory): a stage-1 store left
    there is reused by a later run, so it must not come from a test."""
    monkeypatch.setenv("TRSP_RAY_MLFLOW_DIR", str(tmp_path / "mlruns"))
    monkeypatch.setenv("TRSP_RAY_CHECKPOINT_DIR", str(tmp_path / "checkpoints"))
    before = _repo_runs()
    yield
    new = sorted(str(p.relative_to(REPO_RUNS)) for p in _repo_runs() - before)
    assert not new, f"the test wrote into the repository's runs/: {new[:5]}"


_SESSION: list = []


def pytest_sessionstart(session):
    _SESSION.append(session)


# The test run ends like every trsp-ray command (trsp_ray/common/process_exit.py): its status once the
# atexit handlers ran, without the interpreter's module teardown of torch, Ray and transformers, which
# segfaulted once after every test had passed and turned the run into exit 139. Registered here,
# before any of those libraries is imported, so their atexit handlers still run first.
skip_teardown_at_exit(lambda: int(_SESSION[0].exitstatus) if _SESSION else None)


def pytest_configure(config):
    import torch

    # Tiny models gain nothing from intra-op threads, and on a busy 2-core machine spinning
    # threads slow everything down.
    torch.set_num_threads(1)


@pytest.fixture
def private_ray():
    """`start(**ray_init_kwargs)`: a Ray instance of this test's own (its own short temp dir, so
    ray.init neither joins another engineer's cluster on this machine nor leaves one running)."""
    import shutil
    import tempfile

    started = []

    def start(**kwargs):
        import ray

        temp = tempfile.mkdtemp(prefix="ray-", dir="/tmp")  # short: Ray's socket paths have a length limit
        started.append(temp)
        ray.init(include_dashboard=False, _temp_dir=temp, **kwargs)

    yield start
    if started:
        import ray

        ray.shutdown()
        for temp in started:
            shutil.rmtree(temp, ignore_errors=True)


@pytest.fixture
def own_ray_tmpdir(monkeypatch):
    """For code that starts Ray itself (ray.init(address=None)): a short RAY_TMPDIR of this test's
    own, so Ray starts a fresh local instance instead of joining the latest cluster on the machine."""
    import shutil
    import tempfile

    temp = tempfile.mkdtemp(prefix="ray-", dir="/tmp")
    monkeypatch.setenv("RAY_TMPDIR", temp)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    yield temp
    shutil.rmtree(temp, ignore_errors=True)
