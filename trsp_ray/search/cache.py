"""Stage-1 reuse across trials, and the search's machine-readable run log.

Stage 1 depends on the model, the data, the gates and the stage-1 settings, not on the ratio: its
drop order for a smaller ratio is a prefix of the order for a larger one (SPEC §1). So trials that
share those settings share one stage-1 result, stored under a content key and computed once, for
the largest ratio any of them needs. Trials run in parallel processes; a per-key file lock makes
the second trial wait for the first one's result instead of computing it again. The directory must
be on storage every node sees (a shared filesystem on a multi-node cluster).

Every stage-1 computation, reuse and stage-2 run is appended to `events.jsonl` as one JSON object
per line, so tests and benchmarks count work from the log rather than from timing.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import hashlib
import json
import os
import time
from pathlib import Path
from typing import Iterator

from trsp_ray.stage1 import Stage1Result
from trsp_ray.tracking import write_json_atomic

EVENTS = "events.jsonl"


class RunLog:
    """Append-only JSON-lines log shared by the driver and every trial process."""

    def __init__(self, root: str | Path, *, invocation: str = ""):
        self.path = Path(root) / EVENTS
        self.invocation = invocation

    def write(self, event: str, **fields) -> None:
        record = {"event": event, "time": time.time(), "invocation": self.invocation, **fields}
        self.path.parent.mkdir(parents=True, exist_ok=True)
        line = json.dumps(record, default=str) + "\n"
        # One write() on an O_APPEND file: lines from concurrent trials never interleave.
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, line.encode())
        finally:
            os.close(fd)

    def read(self, *, invocation: str | None = None) -> list[dict]:
        if not self.path.is_file():
            return []
        rows = [json.loads(line) for line in self.path.read_text().splitlines() if line.strip()]
        return [r for r in rows if invocation is None or r.get("invocation") == invocation]

    def count(self, event: str, *, invocation: str | None = None) -> int:
        return sum(1 for r in self.read(invocation=invocation) if r["event"] == event)


def data_fingerprint(*, model: str, calib_text: str | None) -> str:
    """What the stage-1 key must change with beyond the config: the model files and calibration text."""
    from trsp_ray import assets

    h = hashlib.sha256()
    path = Path(assets.resolve_model(model))
    for name in ("config.json", "model.safetensors", "model.safetensors.index.json"):
        f = path / name
        if f.is_file():  # size + mtime: cheap, and changes whenever the weights are rewritten
            st = f.stat()
            h.update(f"{name}:{st.st_size}:{int(st.st_mtime)}".encode())
    if calib_text:
        h.update(Path(calib_text).expanduser().read_bytes())
    else:
        h.update(assets.WIKI_SOURCE.encode())
    return h.hexdigest()[:16]


class Stage1Cache:
    """Stage-1 results by content key: `<root>/<key>.json`, written atomically."""

    def __init__(self, root: str | Path):
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)

    def _file(self, key: str) -> Path:
        return self.root / f"{key}.json"

    @contextlib.contextmanager
    def locked(self, key: str) -> Iterator[None]:
        with open(self.root / f"{key}.lock", "w") as fh:
            fcntl.flock(fh, fcntl.LOCK_EX)  # released when the file closes, also if the trial dies
            try:
                yield
            finally:
                fcntl.flock(fh, fcntl.LOCK_UN)

    def get(self, key: str, n_drop: int) -> Stage1Result | None:
        """A cached result whose drop order covers `n_drop` layers, else None."""
        f = self._file(key)
        if not f.is_file():
            return None
        data = json.loads(f.read_text())
        if len(data["drop_order"]) < n_drop:
            return None
        return Stage1Result(**{k: data[k] for k in _FIELDS})

    def put(self, key: str, result: Stage1Result, *, settings: dict) -> None:
        record = {k: getattr(result, k) for k in _FIELDS}
        write_json_atomic({**record, "settings": settings}, self._file(key))


_FIELDS = [f.name for f in dataclasses.fields(Stage1Result)]


def stage1_for_trial(bench, *, cache: Stage1Cache | None, key: str, plan_n_drop: int, log: RunLog,
                     trial: str) -> Stage1Result:
    """The stage-1 result a trial needs: from the cache, or computed once for `plan_n_drop` layers.

    Without a cache (reuse off) stage 1 runs for this trial's own ratio, as a plain run would.
    """
    import dataclasses as dc

    from trsp_ray.config import replace
    from trsp_ray.methods import run_stage1_for

    need = bench.n_drop()
    if cache is None:
        return _compute(bench, log=log, key=key, trial=trial, n_drop=need)
    with cache.locked(key):
        hit = cache.get(key, need)
        if hit is not None:
            log.write("stage1_reused", key=key, trial=trial, n_drop=need, cached_n_drop=len(hit.drop_order))
            return hit
        n_drop = max(need, plan_n_drop)
        # Stage 1 reads n_drop from the config's ratio; the planned ratio is the largest of the search.
        ratio = n_drop / bench.num_layers
        wide = dc.replace(bench, cfg=replace(bench.cfg, ratio=ratio))
        assert wide.n_drop() == n_drop, (wide.n_drop(), n_drop)
        result = _compute(wide, log=log, key=key, trial=trial, n_drop=n_drop, run=run_stage1_for)
        cache.put(key, result, settings={k: bench.cfg.to_dict()[k] for k in ("gates", "stage1", "seed")})
        return result


def _compute(bench, *, log: RunLog, key: str, trial: str, n_drop: int, run=None) -> Stage1Result:
    from trsp_ray.methods import run_stage1_for

    start = time.perf_counter()
    result = (run or run_stage1_for)(bench)
    log.write("stage1_computed", key=key, trial=trial, n_drop=n_drop, steps=result.steps,
              seconds=time.perf_counter() - start)
    return result
