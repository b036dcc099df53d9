"""Bad hardware requests are one line and exit 2 before any work (issue 40): `device=cuda` on a
machine without a GPU (prune and --dry-run), and Ray Train workers that the cluster has no GPUs for."""

import os
import subprocess
import sys

import pytest
import torch

from trsp_ray.common.errors import TrspError


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without a GPU")
@pytest.mark.parametrize("dry_run", [False, True], ids=["prune", "dry-run"])
def test_device_cuda_without_a_gpu_is_one_line_before_any_log(tmp_path, dry_run):
    proc = subprocess.run([sys.executable, "-m", "trsp_ray.cli", "prune", "--no-mlflow", "--set", "device=cuda",
                           *(["--dry-run"] if dry_run else [])], capture_output=True, text=True, cwd=tmp_path,
                          timeout=300, env={**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
                                            "TRSP_RAY_MLFLOW_DIR": str(tmp_path / "ml")})
    assert proc.returncode == 2, (proc.stdout[-1500:], proc.stderr[-1500:])
    assert proc.stdout == ""  # not even the pipeline's line comes first
    assert proc.stderr.strip().splitlines() == [
        "trsp-ray: error: device='cuda' but no CUDA device is visible; use device=cpu or auto"]
    assert sorted(p.name for p in tmp_path.iterdir()) == []


@pytest.mark.parametrize("workers, gpus, ok", [(2, 1, False), (4, 0, False), (2, 2, True)])
def test_workers_beyond_the_clusters_gpus_are_refused_naming_both_counts(workers, gpus, ok):
    from trsp_ray.config.sections import DistributedConfig
    from trsp_ray.distributed.train import check_resources

    dist = DistributedConfig(workers=workers, use_gpu=True)
    resources = {"CPU": 64.0, "GPU": float(gpus)}
    if ok:
        check_resources(dist, resources)
        return
    with pytest.raises(TrspError) as err:
        check_resources(dist, resources)
    message = str(err.value)
    assert f"distributed.workers={workers}" in message and f"has {gpus}" in message and "\n" not in message
