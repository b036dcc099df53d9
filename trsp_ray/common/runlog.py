"""The run log: one JSON object per line, appended by a driver and by the processes it starts.

The one writer of JSON-lines logs (STYLE.md rule 13): the reproduction's `run_log.jsonl` and the
search's `events.jsonl`. Tests and benchmarks count work from these logs, so every line must be
whole: each is one write() on an O_APPEND file, which concurrent writers on one filesystem never
interleave, and `read` skips a last line cut off by a crash.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path


def append(path: str | os.PathLike, event: str, /, **fields) -> None:
    """Append {"event": event, "time": <unix seconds>, **fields}; values JSON does not know are str()."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    line = json.dumps({"event": event, "time": time.time(), **fields}, default=str) + "\n"
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line.encode())
    finally:
        os.close(fd)


def read(path: str | os.PathLike) -> list[dict]:
    """Every event, oldest first; [] when there is no log yet. A last line without its newline is
    one being written or cut by a crash: kept only if it parses."""
    path = Path(path)
    if not path.is_file():
        return []
    *lines, tail = path.read_text(encoding="utf-8").split("\n")
    events = [json.loads(line) for line in lines if line.strip()]
    if tail.strip():
        try:
            events.append(json.loads(tail))
        except json.JSONDecodeError:
            pass
    return events
