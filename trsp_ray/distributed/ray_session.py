"""The one place trsp_ray starts or joins Ray (STYLE.md rule 13).

Every driver (evaluation pool, reproduction grid, search, Ray benchmark, Ray Train run) calls
`connect`; the one that started Ray is the one that shuts it down (`session` does both).
"""

from __future__ import annotations

import contextlib
import json
import os
from typing import Iterator

# What `logs.quiet_libraries` sets in the driver and every task and actor must see too: a worker on a
# node started by `ray start` has that node's environment, not the driver's, so these travel in the
# job's runtime_env (Ray merges it with a `ray job submit --runtime-env` one per variable).
FORWARDED_ENV = ("HF_HUB_DISABLE_PROGRESS_BARS", "TQDM_DISABLE", "MLFLOW_LOGGING_LEVEL")


def connect(address: str | None = None, *, local_cpus: int | None = None, include_dashboard: bool | None = False,
            log_to_driver: bool = True, **init_kwargs) -> bool:
    """Join the cluster at `address` (default: RAY_ADDRESS), else start a local Ray instance; a
    no-op when this process has Ray initialised already. Returns whether this call initialised Ray.

    Without an address Ray first joins a cluster that `ray start` left on this machine; `local_cpus`
    instead always starts a fresh local instance of that many CPUs (a benchmark sized by its own
    worker count). `include_dashboard=None` is Ray's default (started when installed).
    """
    import ray

    if ray.is_initialized():
        return False
    address = address or os.environ.get("RAY_ADDRESS") or None
    if address is None and local_cpus is not None:
        address, init_kwargs = "local", {**init_kwargs, "num_cpus": local_cpus}
    forwarded = forwarded_env()
    if forwarded:
        runtime_env = dict(init_kwargs.pop("runtime_env", None) or {})
        runtime_env["env_vars"] = {**forwarded, **runtime_env.get("env_vars", {})}
        init_kwargs["runtime_env"] = runtime_env
    ray.init(address=address, include_dashboard=include_dashboard, log_to_driver=log_to_driver, **init_kwargs)
    return True


def forwarded_env() -> dict[str, str]:
    """The FORWARDED_ENV variables this process has, less those a submitted job's runtime_env sets
    already (Ray refuses a variable named by both)."""
    job = json.loads(os.environ.get("RAY_JOB_CONFIG_JSON_ENV_VAR") or "{}")
    taken = (job.get("runtime_env") or {}).get("env_vars") or {}
    return {k: os.environ[k] for k in FORWARDED_ENV if k in os.environ and k not in taken}


@contextlib.contextmanager
def session(address: str | None = None, **kwargs) -> Iterator[bool]:
    """`connect(address, **kwargs)` for the block; shuts Ray down after it only if this call started
    it (a cluster joined or a Ray initialised by the caller stays up). Yields whether it started."""
    started = connect(address, **kwargs)
    try:
        yield started
    finally:
        if started:
            import ray

            if ray.is_initialized():
                ray.shutdown()
