"""A distributed run's checkpoints, per rank: written once into one Ray checkpoint (in place on a
local/shared path, else staged locally and uploaded by Ray, in the background or synchronously),
read back on resume with only this rank's files fetched, and local copies deleted when read."""

from __future__ import annotations

import json
import shutil
import tempfile
import uuid
from pathlib import Path

import torch

from trsp_ray.distributed.collectives import broadcast_object

STATE = "state-rank{rank}.pt"  # stage-1 state (+ this rank's optimizer partition)
ENGINE_DIR = "engine"  # stage-2 DeepSpeed checkpoint (model + optimizer partitions)


def _storage():
    """(Ray Train's storage context of this run, whether its filesystem is local/shared POSIX)."""
    import pyarrow.fs
    import ray.train

    storage = ray.train.get_context().get_storage()
    return storage, isinstance(storage.storage_filesystem, pyarrow.fs.LocalFileSystem)


def _own_file(rank: int):
    """Which files of a checkpoint rank `rank` reads: meta, its state, its DeepSpeed partitions and
    the engine's shared files (`latest`), never another rank's partitions."""
    import re

    def keep(rel: str) -> bool:
        name = rel.rsplit("/", 1)[-1]
        other = re.search(r"(?:state-rank|zero_pp_rank_)(\d+)[_.]", name)
        return other is None or int(other.group(1)) == rank

    return keep


def restore_point(rank: int) -> tuple[dict | None, str | None]:
    """(meta + this rank's stage-1 state, engine dir or None) of the last Ray checkpoint. A local or
    shared checkpoint is read in place; a remote one is fetched, this rank's files only, into a
    local folder (meta["downloaded"]) that is deleted as soon as it has been read: here when no
    engine state is in it, else right after the engine loads it (discard_download)."""
    import ray.train

    from trsp_ray.distributed.engine import load_safely
    from trsp_ray.distributed.storage import download

    checkpoint = ray.train.get_checkpoint()
    if checkpoint is None:
        return None, None
    _, local = _storage()
    if local:
        where = checkpoint.path
    else:
        where = tempfile.mkdtemp(prefix="trsp-restore-")
        download(checkpoint.filesystem, checkpoint.path, where, _own_file(rank))
    meta = json.loads((Path(where) / "meta.json").read_text())
    meta["stage1"] = load_safely(Path(where) / STATE.format(rank=rank))
    engine_dir = str(Path(where) / ENGINE_DIR) if (Path(where) / ENGINE_DIR).exists() else None
    if not local:
        meta["downloaded"] = where
        if engine_dir is None or meta["stage"] != 2:  # nothing left to read from it
            discard_download(meta)
            engine_dir = None
    return meta, engine_dir


def discard_download(meta: dict | None) -> None:
    """Delete a remote checkpoint's local copy (up to a 70B rank's ~48 GB of partitions)."""
    if meta and meta.get("downloaded"):
        shutil.rmtree(meta["downloaded"], ignore_errors=True)


def save(meta: dict, stage1_state: dict, *, rank: int, engine=None, upload: str = "async") -> str:
    """One Ray checkpoint from every rank: meta (rank 0), its own state file, its engine shards.
    Returns "committed" (written in place, or uploaded while the ranks waited) or "uploading" (a
    background upload: a failure before it commits resumes from the previous checkpoint).

    Written once: in place in the run's checkpoint folder when the storage is a local/shared path
    (reported with NO_UPLOAD), else into a local staging folder that Ray uploads and deletes: in
    the background (distributed.checkpoint_upload=async, the next steps train meanwhile; a new
    save first waits for the previous upload to commit, so local disk holds at most two) or while
    every rank waits (sync)."""
    import ray.train
    from ray.train import Checkpoint, CheckpointUploadMode

    storage, local = _storage()
    name = broadcast_object(f"checkpoint-{meta['label']}-{uuid.uuid4().hex[:8]}")
    if not local:
        waited = flush_uploads()  # at most two saves on local disk: the one uploading and this one
        if waited > 30:
            from trsp_ray.common.logs import log

            log(f"  checkpoint: waited {waited:.0f} s for the previous save's upload")
    target = storage.build_checkpoint_path_from_name(name) if local else tempfile.mkdtemp(prefix="trsp-ckpt-")
    Path(target).mkdir(parents=True, exist_ok=True)
    torch.save(stage1_state, Path(target) / STATE.format(rank=rank))
    if engine is not None:  # collective: every rank writes its partitions
        engine.save_checkpoint(str(Path(target) / ENGINE_DIR), tag="stage2")
    if rank == 0:
        (Path(target) / "meta.json").write_text(json.dumps(meta))
    metrics = {k: v for k, v in meta.items() if not isinstance(v, (list, dict))}
    if local:
        ray.train.report(metrics, checkpoint=Checkpoint(target, filesystem=storage.storage_filesystem),
                         checkpoint_dir_name=name, checkpoint_upload_mode=CheckpointUploadMode.NO_UPLOAD)
        return "committed"
    if upload == "async":  # Ray deletes the staged folder once it is uploaded
        _STAGED.append(target)
        ray.train.report(metrics, checkpoint=Checkpoint.from_directory(target), checkpoint_dir_name=name,
                         checkpoint_upload_mode=CheckpointUploadMode.ASYNC, delete_local_checkpoint_after_upload=True)
        return "uploading"
    ray.train.report(metrics, checkpoint=Checkpoint.from_directory(target), checkpoint_dir_name=name,
                     checkpoint_upload_mode=CheckpointUploadMode.SYNC, delete_local_checkpoint_after_upload=True)
    shutil.rmtree(target, ignore_errors=True)
    return "committed"


_STAGED: list[str] = []  # this rank's staged saves reported for a background upload


def flush_uploads() -> float:
    """Block until every save this rank reported for a background upload is uploaded and committed
    (Ray Train's COMMITTED read of the reported checkpoints); returns the seconds waited."""
    import time

    import ray.train

    t0 = time.time()
    if _STAGED:
        ray.train.get_all_reported_checkpoints(consistency_mode=ray.train.CheckpointConsistencyMode.COMMITTED)
        _STAGED.clear()
    return time.time() - t0


def pending_uploads() -> list[str]:
    """This rank's staged saves whose background upload has not finished (Ray deletes a staged
    folder once its upload is done): what a failure now would leave half-uploaded."""
    return [d for d in _STAGED if Path(d).exists()]
