"""A pool of Ray evaluation actors: candidates spread over actors, results streamed back as they finish.

Each actor is an `Evaluator` holding `num_cpus` CPUs (its torch thread count), optionally a GPU
fraction or whole GPUs, optionally inside its own placement group (for a candidate split over
several GPUs). The driver hands a candidate to whichever actor is free, prints a progress line per
finished candidate, logs one MLflow run per candidate, and retries a failed candidate once (on a
fresh actor if the old one died); a candidate that still fails is reported and the rest finish.
"""

from __future__ import annotations

import collections
import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass

from trsp_ray.common.errors import TrspError
from trsp_ray.common.logs import log as progress_log
from trsp_ray.distributed import ray_session
from trsp_ray.evaluation.evaluator import EvalSettings, Evaluator, check_candidate


@dataclass(frozen=True)
class ActorResources:
    """Resources reserved per evaluation actor."""

    num_cpus: float = 1.0  # also the actor's torch thread count (at least 1)
    num_gpus: float = 0.0  # a fraction (0.5: two actors share a GPU) or whole GPUs
    placement_group: bool = False  # reserve CPUs+GPUs as one STRICT_PACK bundle (multi-GPU candidates)

    def __post_init__(self):
        if not self.num_cpus > 0:
            raise TrspError(f"cpus per actor={self.num_cpus!r} is invalid; pass a positive number")
        if self.num_gpus < 0 or (self.num_gpus > 1 and self.num_gpus != int(self.num_gpus)):
            raise TrspError(f"gpus per actor={self.num_gpus!r} is invalid; pass 0, a fraction below 1, "
                            "or a whole number of GPUs")

    @property
    def threads(self) -> int:
        return max(1, int(self.num_cpus))


def failure(path: str, error: str, attempts: int) -> dict:
    """The result record of a candidate that could not be evaluated."""
    from pathlib import Path

    return {"model": path, "name": Path(path).name, "status": "failed", "error": error,
            "attempts": attempts, "tasks": {}, "ppl": None, "speed": None}


def error_line(exc: BaseException) -> str:
    """One line for a failure inside an actor: the original exception, not Ray's traceback dump."""
    cause = getattr(exc, "cause", None) or exc
    if isinstance(cause, TrspError):
        return str(cause)
    text = (str(cause).strip().splitlines() or [""])[0][:300]
    return f"{type(cause).__name__}: {text}"


def _check_cluster(actors: int, res: ActorResources) -> None:
    import ray

    total = ray.cluster_resources()
    for key, need in (("CPU", res.num_cpus), ("GPU", res.num_gpus)):
        have = total.get(key, 0.0)
        if need and actors * need > have + 1e-9:
            raise TrspError(f"{actors} actors x {need:g} {key}s each need {actors * need:g} {key}s, the Ray "
                            f"cluster has {have:g}; lower --actors or the per-actor {key}s")


def _start_actor(res: ActorResources, settings: dict):
    import ray

    options = {"num_cpus": res.num_cpus, "num_gpus": res.num_gpus, "max_restarts": 0}
    pg = None
    if res.placement_group:
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        bundle = {"CPU": res.num_cpus, **({"GPU": res.num_gpus} if res.num_gpus else {})}
        pg = placement_group([bundle], strategy="STRICT_PACK")
        try:
            ray.get(pg.ready(), timeout=120)
        except ray.exceptions.GetTimeoutError:
            ray.util.remove_placement_group(pg)
            raise TrspError(f"no node can hold a placement group of {bundle} within 120 s; "
                            "lower the per-actor resources") from None
        options["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
            placement_group=pg, placement_group_bundle_index=0)
    actor = ray.remote(Evaluator).options(**options).remote(settings, threads=res.threads)
    return actor, pg


def _stop_actor(actor, pg) -> None:
    import ray

    ray.kill(actor)
    if pg is not None:
        ray.util.remove_placement_group(pg)


def _log_candidate(tracker, result: dict, settings: EvalSettings) -> None:
    from trsp_ray.evaluation.report import flat_metrics

    tags = {"candidate": result["model"], "status": result["status"]}
    with tracker.run(result["name"], nested=True, tags=tags):
        tracker.log_params({"candidate": result["model"], "settings": settings.to_dict(),
                            "lm_eval_version": result.get("lm_eval_version"),
                            "manifest": result.get("manifest") or {}})
        metrics = flat_metrics(result)
        if metrics:
            tracker.log_metrics(metrics)
        tracker.log_dict(result, "result.json")


def _progress_line(done: int, total: int, result: dict) -> str:
    from trsp_ray.evaluation.report import summary_line

    return f"[{done}/{total}] {summary_line(result)}"


def evaluate_pool(models: list[str], *, settings: EvalSettings, actors: int = 1,
                  resources: ActorResources = ActorResources(), tracker=None, retries: int = 1,
                  address: str | None = None, on_result: Callable[[dict], None] | None = None,
                  log: Callable[[str], None] = progress_log) -> list[dict]:
    """Evaluate every candidate directory in `models` on a pool of `actors` Ray actors.

    Returns one result dict per candidate, in the order given; failed ones have status "failed" and a
    one-line "error". Bad paths fail before any actor starts; the others are still evaluated.
    Starts a local Ray instance (and shuts it down) unless Ray is already initialised or `address`
    names a cluster.
    """
    if not isinstance(actors, int) or actors < 1:
        raise TrspError(f"actors={actors!r} is invalid; pass a positive integer")
    if not models:
        raise TrspError("no candidates given; pass one or more exported model directories")
    bad = {}
    for i, path in enumerate(models):
        try:
            check_candidate(path)
        except TrspError as e:
            bad[i] = failure(path, str(e), attempts=0)
    report = _reporter(len(models), tracker, settings, on_result, log)
    for i in sorted(bad):
        report(bad[i])
    good = [m for i, m in enumerate(models) if i not in bad]
    if not good:
        return [bad[i] for i in range(len(models))]

    with ray_session.session(address):
        with actor_pool(settings=settings, actors=min(actors, len(good)), resources=resources, retries=retries,
                        log=log) as run:
            scored = iter(run(good, report=report))
    return [bad[i] if i in bad else next(scored) for i in range(len(models))]


@contextlib.contextmanager
def actor_pool(*, settings: EvalSettings, actors: int, resources: ActorResources = ActorResources(),
               retries: int = 1, log: Callable[[str], None] = progress_log):
    """`actors` started evaluation actors (each constructed, so start-up is over when this yields);
    yields `run(models, report=None) -> results`, which keeps every actor busy until the candidates
    (checked directories) are scored, and can be called again on the same warm actors. Needs Ray
    initialised; stops the actors on exit."""
    _check_cluster(actors, resources)
    pool: list[tuple] = []
    try:
        pool = [_start_actor(resources, settings.to_dict()) for _ in range(actors)]
        import ray

        ray.get([actor.where.remote() for actor, _ in pool])

        def run(models: list[str], *, report: Callable[[dict], None] | None = None) -> list[dict]:
            results: dict[int, dict] = {}
            queue = collections.deque((i, 1) for i in range(len(models)))
            _drain(pool, queue, models, results, report or (lambda r: None), resources, settings, retries, log)
            return [results[i] for i in range(len(models))]

        yield run
    finally:
        for actor, pg in pool:
            _stop_actor(actor, pg)


def _reporter(total, tracker, settings, on_result, log):
    done = [0]

    def report(result: dict) -> None:
        done[0] += 1
        log(_progress_line(done[0], total, result))
        if tracker is not None:
            _log_candidate(tracker, result, settings)
        if on_result is not None:
            on_result(result)

    return report


def _drain(pool, queue, models, results, report, resources, settings, retries, log) -> None:
    """Keep every actor busy until the queue is empty; collect results as they finish."""
    import ray

    idle = list(range(len(pool)))
    inflight: dict = {}  # object ref -> (candidate index, attempt, actor slot, start time)
    while queue or inflight:
        while queue and idle:
            i, attempt = queue.popleft()
            slot = idle.pop()
            ref = pool[slot][0].evaluate.remote(models[i])
            inflight[ref] = (i, attempt, slot, time.perf_counter())
        ready, _ = ray.wait(list(inflight), num_returns=1)
        ref = ready[0]
        i, attempt, slot, start = inflight.pop(ref)
        try:
            result = ray.get(ref)
            result["attempts"] = attempt
        except ray.exceptions.RayError as e:  # task raised, actor died, worker OOM-killed, ...
            if isinstance(e, ray.exceptions.RayActorError):  # the actor died: replace it
                _stop_actor(*pool[slot])
                pool[slot] = _start_actor(resources, settings.to_dict())
            message = error_line(e)
            if attempt <= retries:
                log(f"candidate {models[i]} failed (attempt {attempt}): {message}; retrying")
                queue.append((i, attempt + 1))
                idle.append(slot)
                continue
            result = failure(models[i], message, attempts=attempt)
        result["wall_seconds"] = time.perf_counter() - start
        results[i] = result
        idle.append(slot)
        report(result)
