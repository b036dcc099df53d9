"""Selection reuse across trials, and the search's machine-readable run log.

Trials that share the model, data, precision, gates and stage-1 settings share one stage-1 result
from the content-keyed store (trsp_ray/run/stage1_store.py, the same store the reproduction uses),
computed once for the largest ratio any of them needs; a trial that finds another computing it
waits for that result instead of computing it again. A baseline selection (Block Influence, the
angular block, SLEB, tail, random) is kept in the same store, under the same lock, as the drop set
and what it cost, keyed by search/pipeline.selection_key: trials of shortgpt+heal and
shortgpt+comp+heal with any heal settings compute Block Influence once. A least-squares fit is
kept there too (fit_for_trial), as the weights its fold wrote, keyed by the selection and every
fit setting: trials that differ only in their heal (recipe, steps, lr) fit once.

Every stage-1 and selection computation, reuse and stage-2 / heal run is appended to `events.jsonl` as one JSON object
per line, so tests and benchmarks count work from the log rather than from timing.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

from trsp_ray.common import runlog
from trsp_ray.method.stage1 import Stage1Result
from trsp_ray.run.stage1_store import Stage1Store

EVENTS = "events.jsonl"


class RunLog:
    """Append-only JSON-lines log shared by the driver and every trial process."""

    def __init__(self, root: str | Path, *, invocation: str = ""):
        self.path = Path(root) / EVENTS
        self.invocation = invocation

    def write(self, event: str, **fields) -> None:
        runlog.append(self.path, event, **{"invocation": self.invocation, **fields})  # a summary carries its own

    def read(self, *, invocation: str | None = None) -> list[dict]:
        return [r for r in runlog.read(self.path) if invocation is None or r.get("invocation") == invocation]

    def count(self, event: str, *, invocation: str | None = None) -> int:
        return sum(1 for r in self.read(invocation=invocation) if r["event"] == event)


def stage1_for_trial(*, need: int, compute: Callable[[int], Stage1Result], content: dict,
                     store: Stage1Store | None, key: str, plan_n_drop: int, log: RunLog, trial: str) -> Stage1Result:
    """The stage-1 result a trial needs (`need` layers): from the store, or `compute(n)` once for
    the `plan_n_drop` layers every trial sharing the key will need; without a store (reuse off) it
    is computed for this trial's own ratio, as a plain run would."""
    def timed(n_drop: int) -> Stage1Result:
        start = time.perf_counter()
        result = compute(n_drop)
        log.write("stage1_computed", key=key, trial=trial, n_drop=n_drop, steps=result.steps,
                  seconds=time.perf_counter() - start)
        return result

    if store is None:
        return timed(need)
    result, computed = store.obtain(key, need=need, plan=plan_n_drop, content=content, compute=timed)
    if not computed:
        log.write("stage1_reused", key=key, trial=trial, n_drop=need, cached_n_drop=len(result.drop_order))
    return result


def selection_for_trial(*, need: int, compute: Callable[[], tuple[list[int], dict]], content: dict,
                        store: Stage1Store | None, key: str, log: RunLog, trial: str) -> tuple[list[int], dict]:
    """(drop set of `need` layers, its cost info) of a baseline selection: from the store, or
    `compute()` once under the key's lock and stored as the record for exactly `need` layers
    (a baseline's windows can depend on the drop count, so no prefix is served)."""
    from trsp_ray.common import atomic

    def timed() -> tuple[list[int], dict]:
        start = time.perf_counter()
        drop, info = compute()
        log.write("selection_computed", key=key, trial=trial, n_drop=need, selector=content.get("selector"),
                  select_cost=info.get("select_cost"), seconds=time.perf_counter() - start)
        return list(drop), info

    if store is None:
        return timed()
    with store.locked(key):
        record = store.record(key, need)
        if record is not None:
            log.write("selection_reused", key=key, trial=trial, n_drop=need, selector=content.get("selector"))
            return list(record["drop"]), dict(record["info"])
        drop, info = timed()
        atomic.write_json(store.path(key, need), {"drop": drop, "info": info, "key": key, "content": content})
        return drop, info


def fit_for_trial(*, store: Stage1Store | None, key: str, log: RunLog, trial: str):
    """methods.apply_method's `fit_store` for a trial: the fit of content key `key` (search/pipeline.fit_key)
    from the store, its folded weights written into the trial's model; or computed once under the
    key's lock and stored (a torch file of the fit's info and its folded weights). None without a store."""
    if store is None:
        return None

    def obtain(compute, apply):
        import torch

        from trsp_ray.common import atomic

        path = store.root / f"{key}.fit.pt"
        with store.locked(key):
            if path.is_file():
                stored = torch.load(path, weights_only=True)
                apply(stored["weights"])
                log.write("fit_reused", key=key, trial=trial)
                return stored["info"], stored["weights"]
            start = time.perf_counter()
            info, weights = compute()
            atomic.save_torch(path, {"info": info, "weights": weights})
            log.write("fit_computed", key=key, trial=trial, tokens=info.get("tokens"),
                      seconds=time.perf_counter() - start)
            return info, weights

    return obtain
