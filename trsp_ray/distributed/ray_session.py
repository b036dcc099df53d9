"""The one place trsp_ray starts or joins Ray (STYLE.md rule 13).

Every driver (evaluation pool, reproduction grid, search, Ray benchmark, Ray Train run) calls
`connect`; the one that started Ray is the one that shuts it down (`session` does both).
"""

from __future__ import annotations

import contextlib
import os
from typing import Iterator


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
    ray.init(address=address, include_dashboard=include_dashboard, log_to_driver=log_to_driver, **init_kwargs)
    return True


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
