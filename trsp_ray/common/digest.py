"""Content hashes: of a JSON-able object (`content_key`) and of a file's bytes (`file_digest`).

Every store of trsp_ray (the stage-1 store, the teacher store, the benchmark's row cache and dense
reference, the text caches) names what it holds by these, so that a changed input gives another
name instead of a stale result."""

from __future__ import annotations

import functools
import hashlib
import json
from pathlib import Path
from typing import Any


def content_key(obj: Any, length: int = 16) -> str:
    """A short stable hash of a JSON-able object (sorted keys; what JSON cannot say, by its str)."""
    blob = json.dumps(obj, sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:length]


def file_digest(path: str | Path) -> str:
    """sha256 of a file's bytes (first 24 hex digits). Read once per path, size and modification
    time: a row cache asks for the same data files once per row."""
    p = Path(path).expanduser().resolve()
    st = p.stat()
    return _digest(str(p), st.st_size, st.st_mtime_ns)


@functools.lru_cache(maxsize=256)
def _digest(path: str, size: int, mtime_ns: int) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()[:24]
