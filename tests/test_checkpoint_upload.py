"""Asynchronous checkpoint upload (issue 19): a save to remote storage uploads in the background
while the workers train on; a new save first waits for the previous upload to commit, so a node's
local disk holds at most two saves, and the plan counts both. The S3 job test
(test_distributed_storage.py) runs its saves, fault and resume through the asynchronous path."""

import pytest

from trsp_ray.common.errors import TrspError
from trsp_ray.config.run_config import load_config
from trsp_ray.plan.zero3_setup import setup_for_run


def test_upload_mode_reaches_the_plan_and_a_bad_one_is_refused():
    base = ["distributed.workers=2", "distributed.storage_path=s3://bucket/runs"]
    plain = setup_for_run(load_config(overrides=base))
    sync = setup_for_run(load_config(overrides=base + ["distributed.checkpoint_upload=sync"]))
    assert plain.remote_storage and plain.async_upload and not sync.async_upload
    with pytest.raises(TrspError) as err:
        load_config(overrides=["distributed.checkpoint_upload=later"])
    assert "distributed.checkpoint_upload" in str(err.value) and "'later'" in str(err.value)
    assert "async" in str(err.value) and "\n" not in str(err.value)
