"""What Ray Train workers train after stage 1, and with which parameters: the rules the worker
loop (worker._stage2) applies, kept apart so they can be tested without a cluster."""

from __future__ import annotations


def recovery_settings(pipe) -> dict | None:
    """The keyword arguments of what the workers train after stage 1 on the resolved pipeline `pipe`
    (run.pipeline.Pipeline), None for nothing. A heal method heals as one process does, whatever
    stage2.enabled says: run_heal's budget and recipe (methods.heal_settings of methods.method_heal:
    stage2.steps at stage2.lr, config.heal_recipe's recipe; heal.steps is refused on the workers,
    train.check_worker_settings). TRSP's stage 2: run_stage2's (methods.stage2_settings)."""
    from trsp_ray.plan.zero3_plan import recovers_on_workers
    from trsp_ray.run.methods import heal_settings, method_heal, stage2_settings

    cfg = pipe.cfg
    if not recovers_on_workers(cfg, spec=pipe.spec):
        return None
    if pipe.spec.heal:
        return heal_settings(method_heal(cfg))
    return stage2_settings(cfg.stage2)


def heal_on_workers(pipe, *, model, gates, drop: list[int], comp: dict | None, batches, make_stepper, report):
    """A heal method's heal on the workers: heal.run_heal, the one heal loop, on the gated ZeRO-3
    model (a partitioned model cannot be cut) with the drop set bypassed and no gate applied, which
    equals the pruned model one process heals (tests/test_gates_surgery.py). run_heal is handed the
    kept layers, so the dropped layers and the gates stay frozen and out of the optimizer (no fp32
    master, Adam moments, gradients or checkpoint bytes for ~a quarter of a 70B model) and a tail or
    map recipe picks its set among the kept layers before the engine is built. `comp`: the fit's
    info, whose blocks name the map recipe's layers (None without a fit); `pipe`: the resolved
    pipeline (a heal method's). Returns run_heal's result."""
    from trsp_ray.method.boundaries import fold_layers
    from trsp_ray.method.heal import run_heal

    settings = recovery_settings(pipe)
    kept = [w for w in gates.wrappers if w.index not in set(drop)]
    order = [w.index for w in kept]
    # the kept layers a least-squares fold wrote its maps into (the map recipe's), as one process finds them
    maps = ([order.index(i) for i in fold_layers(comp["blocks"])]
            if comp is not None and pipe.cfg.compensation.method == "lstsq" else [])
    with gates.state(gated=False, bypass=drop):
        return run_heal(model=model, batches=batches, layers=[w.layer for w in kept], map_layers=maps,
                        mlp_output=gathered_mlp_output, make_stepper=make_stepper, report=report, **settings)


def gathered_mlp_output(layer, model):
    """families.map_module with the layer's partitions gathered: a ZeRO-3 weight shows no shape
    until gathered (the fit resolves its targets the same way)."""
    from trsp_ray.distributed.engine import gather_context
    from trsp_ray.models import families

    with gather_context(list(layer.parameters())):
        return families.map_module(layer, model)
