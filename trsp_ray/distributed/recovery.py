"""What Ray Train workers train after stage 1, and with which parameters: the rules the worker
loop (worker._stage2) applies, kept apart so they can be tested without a cluster."""

from __future__ import annotations


def recovery_settings(cfg) -> dict | None:
    """run_stage2's keyword arguments for what the workers train after stage 1, None for nothing.
    A heal method heals with stage 2's budget (stage2.steps at stage2.lr, stage2.trainable) as one
    process does (methods.method_heal), whatever stage2.enabled says: as stage 2 with schedule skip
    (P bypassed from step 1) in joint mode (sequential would keep later P layers in the network
    until their segment: not a heal)."""
    from trsp_ray import registry
    from trsp_ray.distributed.zero3_plan import recovers_on_workers
    from trsp_ray.methods import stage2_settings

    if not recovers_on_workers(cfg):
        return None
    if registry.method(cfg.method).heal:
        return {**stage2_settings(cfg.stage2, schedule="skip"), "mode": "joint"}
    return stage2_settings(cfg.stage2)


def heal_stepper(make_stepper, *, gates, drop: list[int]):
    """`make_stepper` for a heal: the dropped layers are frozen and left out of the optimizer (no
    fp32 master, Adam moments, gradients or checkpoint bytes for ~a quarter of a 70B model)."""
    dropped = [p for w in gates.wrappers if w.index in drop for p in w.layer.parameters()]
    ids = {id(p) for p in dropped}

    def make(model, groups: list[dict]):
        for p in dropped:
            p.requires_grad_(False)
        kept = [{**g, "params": [p for p in g["params"] if id(p) not in ids]} for g in groups]
        return make_stepper(model, [g for g in kept if g["params"]])

    return make
