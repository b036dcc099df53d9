"""The run's storage: whatever Ray Train supports (a shared local path, s3://, gs://, ...), reached
through one pyarrow filesystem (common/filesystems.py), the same one Ray Train writes its checkpoints with.

    records = RunRecords(storage_path, run_name)    # the run's own records, one object per event

No path here assumes a POSIX filesystem shared by the nodes: S3 has no append, so every record is
its own small object (`<run>/records/<ns>-<seq>.json`), read back sorted by name.
"""

from __future__ import annotations

import json
import os
import time
import uuid
from pathlib import Path

from trsp_ray.common.errors import TrspError
from trsp_ray.common.filesystems import filesystem, is_remote


def _short(exc: Exception) -> str:
    return " ".join(str(exc).split())[:160]


def check_storage(storage_path: str) -> str:
    """The storage must answer and take a write now, in the driver: a missing bucket, a wrong endpoint
    or a read-only path is a one-line error before any worker starts. Returns the normalized path."""
    import pyarrow.fs

    remote = is_remote(storage_path)
    hint = "pass a reachable URI (check the endpoint, bucket and credentials)" if remote else \
        "pass a directory you can write to"
    try:
        fs, path = filesystem(storage_path)
        if remote:
            bucket = path.split("/", 1)[0]
            if fs.get_file_info(bucket).type == pyarrow.fs.FileType.NotFound:
                raise TrspError(f"distributed.storage_path={storage_path!r}: bucket {bucket!r} does not exist; "
                                f"create it or pass an existing bucket")
        fs.create_dir(path, recursive=True)
        probe = f"{path}/.trsp-write-test-{uuid.uuid4().hex[:8]}"
        with fs.open_output_stream(probe) as out:
            out.write(b"ok")
        fs.delete_file(probe)
    except TrspError:
        raise
    except Exception as exc:  # pyarrow raises OSError, ArrowInvalid, ... with multi-line AWS details
        what = "is not reachable" if remote else "is not writable"
        raise TrspError(f"distributed.storage_path={storage_path!r} {what} ({_short(exc)}); {hint}") from None
    return storage_path if remote else path


def location(storage_path: str, run: str) -> str:
    """Where a run lives, for people: `<storage>/<run>` (a URI's query options left out)."""
    base = storage_path.split("?", 1)[0] if is_remote(storage_path) else storage_path
    return join(base, run)


def join(*parts: str) -> str:
    return "/".join(p.strip("/") if i else p.rstrip("/") for i, p in enumerate(parts))


class RunRecords:
    """The run's records (start, round, checkpoint, stage1_done, stage2_done, exported, done) and
    once-only markers, under `<storage>/<run>/` on the run's filesystem; readable by the driver
    after the run and by a resumed attempt."""

    def __init__(self, storage_path: str, run: str):
        self.storage_path, self.run = storage_path, run
        self.fs, root = filesystem(storage_path)
        self.dir = join(root, run)
        self._seq = 0

    def write(self, record: dict) -> None:
        self._seq += 1
        name = join(self.dir, "records", f"{time.time_ns():020d}-{os.getpid()}-{self._seq:05d}.json")
        self.fs.create_dir(join(self.dir, "records"), recursive=True)
        with self.fs.open_output_stream(name) as out:
            out.write(json.dumps(record).encode())

    def read(self) -> list[dict]:
        import pyarrow.fs

        selector = pyarrow.fs.FileSelector(join(self.dir, "records"), allow_not_found=True)
        infos = sorted((i for i in self.fs.get_file_info(selector) if i.path.endswith(".json")),
                       key=lambda i: i.base_name)
        out = []
        for info in infos:
            with self.fs.open_input_stream(info.path) as fh:
                out.append(json.loads(fh.read().decode()))
        return out

    def marker(self, name: str) -> str | None:
        """Text of marker `name`, None when absent."""
        import pyarrow.fs

        path = join(self.dir, name)
        if self.fs.get_file_info(path).type == pyarrow.fs.FileType.NotFound:
            return None
        with self.fs.open_input_stream(path) as fh:
            return fh.read().decode()

    def set_marker(self, name: str, text: str) -> None:
        self.fs.create_dir(self.dir, recursive=True)
        with self.fs.open_output_stream(join(self.dir, name)) as out:
            out.write(text.encode())


def download(fs, src_dir: str, dest: str, keep) -> None:
    """Copy the files under `src_dir` whose relative path passes `keep(rel)` into local `dest`."""
    import pyarrow.fs

    for info in fs.get_file_info(pyarrow.fs.FileSelector(src_dir, recursive=True)):
        if info.type != pyarrow.fs.FileType.File:
            continue
        rel = info.path[len(src_dir):].lstrip("/")
        if not keep(rel):
            continue
        target = Path(dest) / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        with fs.open_input_stream(info.path) as src, open(target, "wb") as out:
            while chunk := src.read(1 << 24):
                out.write(chunk)
