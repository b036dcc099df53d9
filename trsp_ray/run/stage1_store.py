"""Stage-1 results stored under the content of what produced them: the one stage-1 store that the
search and the reproduction both use.

Stage 1 depends on the model (its files), the calibration text (a file's bytes, or the mixture:
data.calib_mix by name and its sources' text through the fingerprint), the windows it is cut into
(data.seqlen, data.batch_size), the seed, the precision (device, dtype), the gates and the stage1
settings - and on nothing else. Not on the ratio, as long as the drop order for a smaller
ratio is a prefix of the order for a larger one (SPEC section 1): then a stored result serves every
ratio up to its length, and a longer one replaces it. Swap refinement (`stage1.refine` with probes)
breaks that rule: it can change any position of the order, and a smaller ratio refines its own
set. So when refinement can run, one result is kept per n_drop and served to that n_drop only.
Changing any of those settings changes the key, so a changed setting recomputes instead of
silently reusing a stale result. A hub model is keyed by its id and its revision (the snapshot
the Hugging Face cache resolves it to), so a new revision recomputes.

`<root>/<key>.json` holds a prefix-serving result and the content it was keyed by (to read why two
keys differ), `<root>/<key>.n<layers>.json` a result for exactly that many layers;
`<root>/<key>.n<layers>.rounds.pt` holds the rounds finished so far of a computation in
progress (`checkpoints`), so an interrupted one restarts after its last finished round; writes
are atomic, and `obtain` holds a per-key file lock while it computes, so parallel processes
(search trials, reproduction tasks) wait for one computation instead of repeating it.
The root must be on storage every node sees (a shared filesystem on a multi-node cluster).
No Ray, DeepSpeed or MLflow here: the single-process path could use it too.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import json
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Iterator

from trsp_ray.common import atomic
from trsp_ray.run.content import calibration_content, store_key

if TYPE_CHECKING:
    from trsp_ray.method.stage1 import Stage1Result

# Config fields stage 1 reads (data: content.calibration_content, what names the calibration text and
# shapes its windows; the text's bytes enter through the fingerprint, which the caller computes from
# the same config).
STAGE1_TOP = ("model", "seed", "device", "dtype")
STAGE1_SECTIONS = ("gates", "stage1")


def stage1_content(cfg: dict) -> dict:
    """The part of a run-config dict stage 1 depends on."""
    return {**{k: cfg.get(k) for k in STAGE1_TOP}, "data": calibration_content(cfg["data"]),
            **{k: cfg[k] for k in STAGE1_SECTIONS}}


def stage1_key(cfg: dict, fingerprint: str) -> str:
    """Content key of a stage-1 result (content.store_key): `stage1_content(cfg)`, the data
    fingerprint (content.data_fingerprint), the library versions and the resolved precision."""
    return store_key({"config": stage1_content(cfg)}, cfg=cfg, data=fingerprint)


def prefix_serves(content: dict) -> bool:
    """Whether a result stored for n layers serves every smaller n (the prefix rule): not when swap
    refinement can reorder the drop order (iterative selection with removal probes, refine > 0).
    `content` is what the result is keyed by (`stage1_content`, or a dict holding it as "config")."""
    from types import SimpleNamespace

    from trsp_ray.run.methods import probes_removal

    s1 = (content.get("stage1") or content.get("config", {}).get("stage1") or {})
    if not s1.get("refine", 0):
        return True
    return not probes_removal(SimpleNamespace(probe=s1.get("probe", 0), selection=s1.get("selection", "iterative")))


def result_dict(result: Stage1Result) -> dict:
    """A Stage1Result as plain data (what crosses Ray boundaries and lands in the store)."""
    return dataclasses.asdict(result)


def result_from(data: dict) -> Stage1Result:
    from trsp_ray.method.stage1 import Stage1Result  # torch: only when a result is read

    return Stage1Result(**{f.name: data[f.name] for f in dataclasses.fields(Stage1Result) if f.name in data})


def handed_over_drop(data: dict, *, ranking: str, n_drop: int) -> list[int]:
    """The drop set a TRSP pipeline takes from a stage-1 result handed over as plain data
    (`result_dict`): the first `n_drop` of the `ranking` its resolved spec reads (Pipeline.spec: the
    round-1 ranking for `trsp-oneshot`, the greedy order otherwise). Ray Train workers prune by it,
    and the hand-over (distributed/handoff.py) checks their export against it."""
    return result_from(data).drop_for(ranking, n_drop)


class Stage1Store:
    """Stage-1 results by content key under `root`."""

    def __init__(self, root: str | Path):
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)

    def path(self, key: str, n_drop: int | None = None) -> Path:
        """The prefix-serving record of `key`, or (n_drop given) the record for exactly n_drop layers."""
        return self.root / (f"{key}.json" if n_drop is None else f"{key}.n{n_drop}.json")

    @contextlib.contextmanager
    def locked(self, key: str) -> Iterator[None]:
        with open(self.root / f"{key}.lock", "w") as fh:
            fcntl.flock(fh, fcntl.LOCK_EX)  # released when the file closes, also if the process dies
            try:
                yield
            finally:
                fcntl.flock(fh, fcntl.LOCK_UN)

    def record(self, key: str, n_drop: int | None = None) -> dict | None:
        f = self.path(key, n_drop)
        return json.loads(f.read_text(encoding="utf-8")) if f.is_file() else None

    def get(self, key: str, n_drop: int) -> Stage1Result | None:
        """The result stored for exactly `n_drop` layers, else a prefix-serving one whose drop order
        covers them, else None."""
        exact = self.record(key, n_drop)
        if exact is not None:
            return result_from(exact)
        data = self.record(key)
        if data is None or len(data["drop_order"]) < n_drop or not prefix_serves(data.get("content", {})):
            return None
        return result_from(data)

    def put(self, key: str, result: Stage1Result, *, content: dict, **extra) -> None:
        """Store `result`: as the key's prefix-serving record, or, when refinement can reorder its
        drop order, as the record for exactly its length."""
        where = self.path(key, None if prefix_serves(content) else len(result.drop_order))
        atomic.write_json(where, {**result_dict(result), "key": key, "content": content, **extra})

    def rounds_path(self, key: str, n_drop: int) -> Path:
        return self.root / f"{key}.n{n_drop}.rounds.pt"

    def checkpoints(self, key: str, n_drop: int) -> tuple[dict | None, Callable[[dict], None]]:
        """(state to resume from or None, on_round callback) of a computation of `key` for `n_drop`
        layers: each finished round's state is saved atomically, and `obtain` removes it once the
        whole result is stored."""
        import torch

        from trsp_ray.common import atomic

        path = self.rounds_path(key, n_drop)
        resume = torch.load(path, weights_only=True) if path.exists() else None  # tensors, numbers, lists: no pickle
        return resume, lambda state: atomic.save_torch(path, state)

    def obtain(self, key: str, *, need: int, compute: Callable[[int], Stage1Result], content: dict,
               plan: int = 0) -> tuple[Stage1Result, bool]:
        """(result covering `need` layers, whether it was computed now). Under the key's lock: the
        stored result when it serves `need`, else `compute(max(need, plan))` (`compute(need)` when
        refinement can reorder: a longer result would not serve `need`), stored before return."""
        with self.locked(key):
            hit = self.get(key, need)
            if hit is not None:
                return hit, False
            n_drop = max(need, plan) if prefix_serves(content) else need
            result = compute(n_drop)
            self.put(key, result, content=content, n_drop=n_drop)
            self.rounds_path(key, n_drop).unlink(missing_ok=True)  # the finished result holds every round
            return result, True
