"""Where stored files live: a local path or a URI Ray Train supports (s3://, gs://, ...), reached
through one pyarrow filesystem, the same one Ray Train writes its checkpoints with. The run's
records (distributed/storage.py) and the teacher store (run/teacher_store.py) open their roots here.

    fs, root = filesystem("s3://bucket/runs?endpoint_override=127.0.0.1:9000&scheme=http")
"""

from __future__ import annotations

from pathlib import Path


def is_remote(storage_path: str) -> bool:
    return "://" in storage_path and not storage_path.startswith("file://")


def filesystem(storage_path: str):
    """(pyarrow filesystem, path on it) of a storage path or URI (query options such as
    endpoint_override=host:port&scheme=http go to pyarrow)."""
    import pyarrow.fs

    if not is_remote(storage_path):
        return pyarrow.fs.LocalFileSystem(), str(Path(storage_path.removeprefix("file://")).expanduser().resolve())
    fs, path = pyarrow.fs.FileSystem.from_uri(storage_path)
    return fs, path.rstrip("/")
