"""What a distributed run records and the faults its tests inject: rank 0's event records on the
run's storage (storage.RunRecords) and test-only worker faults, each fired once per run."""

from __future__ import annotations

import json
import os
import signal
import time

from trsp_ray.common.logs import log


class EventLog:
    """The run's records: rank 0 writes one per event (and echoes it to stdout) to the run's
    storage (storage.RunRecords), so they survive a lost node and work on s3:// as on a local path."""

    def __init__(self, records: dict | None, rank: int):
        from trsp_ray.distributed.storage import RunRecords

        self.store = RunRecords(records["storage"], records["run"]) if records and rank == 0 else None
        self.rank = rank
        # 1 + the starts recorded so far (read once, by the only writer)
        self.attempt = 1 + sum(r["event"] == "start" for r in self.store.read()) if self.store else 0

    def write(self, event: str, **fields) -> None:
        if self.rank != 0:
            return
        record = {"event": event, "attempt": self.attempt, "time": round(time.time(), 3), **fields}
        log(f"worker: {json.dumps(record)}")
        if self.store is not None:
            self.store.write(record)


class FaultInjector:
    """Test-only faults, each once per run (a marker in the run's storage records that it fired).

    A spec fires on rank `rank` (default 1) after `after_steps` steps of stage-1 round `round`
    (1-based), or right after stage-2 step `stage2_step` (after that step's checkpoint, if it takes
    one). `action` "kill" SIGKILLs the worker (a lost process); "wait" writes the marker with this
    worker's node id and waits, so that a test can remove that whole node (a lost node).
    `upload` "flushed" (default) lets a save still uploading in the background commit first;
    "in_flight" fires at once, the last save's upload still running (its marker lists the staged
    folders not yet uploaded): the resume must then take the last committed checkpoint.
    """

    def __init__(self, specs: list[dict] | None, rank: int, records: dict | None):
        from trsp_ray.distributed.storage import RunRecords

        self.store = RunRecords(records["storage"], records["run"]) if specs and records else None
        self.armed = [s for s in specs or [] if rank == s.get("rank", 1) and self.store.marker(s["marker"]) is None]
        self.seen: dict[str, int] = {}

    def check(self, metrics: dict) -> None:
        """Stage-1 hook (every step's metrics)."""
        for spec in self.armed:
            if "round" in spec and metrics.get("stage1/round") == spec["round"] - 1:
                self.seen[spec["marker"]] = self.seen.get(spec["marker"], 0) + 1
                if self.seen[spec["marker"]] >= spec.get("after_steps", 1):
                    self._fire(spec)

    def check_stage2(self, step: int) -> None:
        for spec in self.armed:
            if step == spec.get("stage2_step"):
                self._fire(spec)

    def _fire(self, spec: dict) -> None:
        import ray

        from trsp_ray.distributed.checkpoints import flush_uploads, pending_uploads

        upload = spec.get("upload", "flushed")
        if upload not in ("flushed", "in_flight"):
            raise ValueError(f"fault {spec['marker']}: upload={upload!r}; choose flushed or in_flight")
        if upload == "flushed":
            flush_uploads()  # a save still uploading in the background commits first: a known resume point
            # Ray Train V2 takes a reported checkpoint from the worker's queue at its next poll
            # (health-check interval, 2 s by default); dying sooner would lose the last checkpoint
            # too, and the test would measure Ray's poll timing, not our resume.
            time.sleep(2.5 * float(os.environ.get("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "2")))
        node = ray.get_runtime_context().get_node_id()
        self.store.set_marker(spec["marker"], json.dumps({"pid": os.getpid(), "node": node, "time": time.time(),
                                                          "pending": pending_uploads()}))
        if spec.get("action", "kill") == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        deadline = time.time() + spec.get("wait_s", 600)
        while time.time() < deadline:  # the test removes this node; nothing after this line should run
            time.sleep(1)
        raise RuntimeError(f"fault {spec['marker']}: node {node} was not removed within {spec.get('wait_s', 600)} s")
