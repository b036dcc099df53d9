"""Stage 2 + export on Ray Train workers from a stage-1 result computed elsewhere (the shared,
content-keyed store of trsp_ray/run/stage1_store.py), so every TRSP variant of a model - single-device
or distributed, in a search or a reproduction - prunes from one stage-1 run: `run_distributed`
takes the result as `stage1=` (a plain dict, `stage1_store.result_dict`) and the workers skip their
own stage 1. The returned `shared` flag says whether the exported drop set is the shared one.
"""

from __future__ import annotations


def run_stage2_distributed(cfg, *, stage1: dict | None, n_drop: int, name: str, overwrite: bool = True):
    """(DistributedResult, shared): `cfg` on `cfg.distributed.workers` Ray Train workers, exported
    to `cfg.output`; `shared` is True when the exported drop set is `stage1`'s for `cfg.method`.
    `stage1=None`: the workers learn stage 1 (a model whose stage 1 needs them too)."""
    from trsp_ray.distributed.train import run_distributed
    from trsp_ray.run.pipeline import named
    from trsp_ray.run.stage1_store import handed_over_drop

    if stage1 is None:
        return run_distributed(cfg, name=name, overwrite=overwrite), False
    # the ranking the workers drop by (worker.train_loop reads the same spec of the same name)
    expected = handed_over_drop(stage1, ranking=named(cfg).spec.ranking, n_drop=n_drop)
    result = run_distributed(cfg, stage1=stage1, name=name, overwrite=overwrite)
    return result, list(result.drop_order) == list(expected)
