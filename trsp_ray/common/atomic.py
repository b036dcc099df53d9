"""Atomic writes: a file or a directory appears complete under its final name, or not at all.

The one module in trsp_ray that makes temp files for that purpose (STYLE.md rule 13). Everything is
written under a temp name beside the target (same filesystem, so the final step is a rename) and the
temp is removed if the write fails, so a reader never sees half a file and a crash leaves no
partial target behind. Concurrent writers of identical content are fine: the last rename wins.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Iterator

TEMP_PREFIX = ".tmp-"  # hidden, and what tests look for when they check that nothing was left behind


@functools.cache
def _file_mode() -> int:
    """What open() would give a new file (0o666 less the umask); mkstemp's own 0o600 would make a
    report or checkpoint unreadable to the group that shares a cluster's storage."""
    umask = os.umask(0)
    os.umask(umask)
    return 0o666 & ~umask


@contextlib.contextmanager
def temp_path(path: str | os.PathLike, *, suffix: str = "") -> Iterator[Path]:
    """Yield a fresh temp file path beside `path`; on a clean exit it is renamed onto `path`.

    For writers that want a path rather than a file object (matplotlib infers the format from
    `suffix`). On an exception the temp is removed and `path` is left as it was.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=TEMP_PREFIX, suffix=suffix)
    os.fchmod(fd, _file_mode())
    os.close(fd)
    try:
        yield Path(tmp)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


@contextlib.contextmanager
def open_file(path: str | os.PathLike, mode: str = "w", *, suffix: str = "") -> Iterator[Any]:
    """`open` for writing (`mode` "w" text, utf-8, or "wb"), renamed onto `path` on a clean exit."""
    if mode not in ("w", "wb"):
        raise ValueError(f"mode={mode!r} is not valid; use 'w' or 'wb'")
    with temp_path(path, suffix=suffix) as tmp:
        with open(tmp, mode, **({} if "b" in mode else {"encoding": "utf-8"})) as fh:
            yield fh


def write_bytes(path: str | os.PathLike, data: bytes) -> None:
    with open_file(path, "wb") as fh:
        fh.write(data)


def write_text(path: str | os.PathLike, text: str) -> None:
    with open_file(path, "w") as fh:
        fh.write(text)


def write_json(path: str | os.PathLike, obj: Any) -> None:
    """Indented JSON; values JSON does not know (paths, dtypes) are written as their str()."""
    with open_file(path, "w") as fh:
        json.dump(obj, fh, indent=2, default=str)


def save_torch(path: str | os.PathLike, obj: Any) -> None:
    """torch.save(obj) to `path` atomically (checkpoints a resumed run reads back)."""
    import torch

    with open_file(path, "wb", suffix=".pt") as fh:
        torch.save(obj, fh)


def staging_dir(target: str | os.PathLike) -> Path:
    """A fresh temp dir beside `target` (same filesystem, so `publish` is a rename). For writers
    whose steps span several calls; otherwise use `directory`."""
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix=f".{target.name}{TEMP_PREFIX}", dir=target.parent))


def publish(tmp: str | os.PathLike, target: str | os.PathLike) -> None:
    """Rename the finished `tmp` into place; an old `target` is moved aside first and removed after
    (a directory cannot be renamed onto a non-empty one)."""
    target = Path(target)
    if target.exists():
        old = target.with_name(f".{target.name}.old-{os.getpid()}")
        os.replace(target, old)
        os.replace(tmp, target)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, target)


@contextlib.contextmanager
def directory(target: str | os.PathLike, *, replace: bool = True) -> Iterator[Path]:
    """Yield a temp dir beside `target` to fill; on a clean exit it is renamed into place.

    `replace`: an existing `target` is swapped out (see `publish`); without it the rename is a plain
    os.replace, which raises OSError when `target` is a non-empty directory (e.g. another process
    finished the same directory first). The temp dir is removed on every path out.
    """
    target = Path(target)
    tmp = staging_dir(target)
    try:
        yield tmp
        if replace:
            publish(tmp, target)
        else:
            os.replace(tmp, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
