import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import pytest  # noqa: E402


@pytest.fixture(autouse=True)
def _mlflow_in_tmp(tmp_path, monkeypatch):
    """Keep every test's MLflow store (and runs/ dir) out of the repository."""
    monkeypatch.setenv("TRSP_RAY_MLFLOW_DIR", str(tmp_path / "mlruns"))


def pytest_configure(config):
    import torch

    # Tiny models gain nothing from intra-op threads, and on a busy 2-core machine spinning
    # threads slow everything down.
    torch.set_num_threads(1)
