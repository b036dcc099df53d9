"""Asynchronous checkpoint upload (issue 19): a save to remote storage uploads in the background
while the workers train on; a new save first waits for the previous upload, so a node's local disk
holds at most two saves, and the plan counts both."""

import threading
import time

import pytest

from trsp_ray.config import load_config
from trsp_ray.distributed.checkpoints import wait_for_upload
from trsp_ray.distributed.zero3_setup import setup_for_run
from trsp_ray.errors import TrspError


def test_a_new_save_waits_until_the_previous_upload_removed_its_staging_folder(tmp_path):
    staged = tmp_path / "trsp-ckpt-1"
    staged.mkdir()
    (staged / "state-rank0.pt").write_bytes(b"x" * 1024)
    remover = threading.Timer(0.4, lambda: __import__("shutil").rmtree(staged))
    remover.start()
    t0 = time.time()
    waited = wait_for_upload(str(staged), poll_s=0.05)
    assert not staged.exists() and waited >= 0.35 and time.time() - t0 < 5
    assert wait_for_upload(None) < 0.01 and wait_for_upload(str(tmp_path / "gone")) < 0.01


def test_upload_mode_reaches_the_plan_and_a_bad_one_is_refused():
    base = ["distributed.workers=2", "distributed.storage_path=s3://bucket/runs"]
    plain = setup_for_run(load_config(overrides=base))
    sync = setup_for_run(load_config(overrides=base + ["distributed.checkpoint_upload=sync"]))
    assert plain.remote_storage and plain.async_upload and not sync.async_upload
    with pytest.raises(TrspError) as err:
        load_config(overrides=["distributed.checkpoint_upload=later"])
    assert "distributed.checkpoint_upload" in str(err.value) and "'later'" in str(err.value)
    assert "async" in str(err.value) and "\n" not in str(err.value)
