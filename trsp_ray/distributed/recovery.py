"""What Ray Train workers train after stage 1, and with which parameters: the rules the worker
loop (worker._stage2) applies, kept apart so they can be tested without a cluster."""

from __future__ import annotations

from trsp_ray.config_sections import PARTIAL_RECIPES, TAIL_RECIPE


def recovery_settings(cfg) -> dict | None:
    """run_stage2's keyword arguments for what the workers train after stage 1, None for nothing.
    A heal method heals with stage 2's budget (stage2.steps at stage2.lr, the heal's recipe:
    config.heal_recipe) as one process does (methods.method_heal), whatever stage2.enabled says: as
    stage 2 with schedule skip (P bypassed from step 1) in joint mode (sequential would keep later P
    layers in the network until their segment: not a heal). A tail or map recipe runs as `all`
    there, narrowed to its set by `heal_stepper`."""
    from trsp_ray import registry
    from trsp_ray.config import heal_recipe
    from trsp_ray.distributed.zero3_plan import recovers_on_workers
    from trsp_ray.methods import stage2_settings

    if not recovers_on_workers(cfg):
        return None
    if registry.method(cfg.method).heal:
        trainable, rank = heal_recipe(cfg, heal_method=True)
        return {**stage2_settings(cfg.stage2, schedule="skip"), "mode": "joint", "lora_rank": rank,
                "trainable": "all" if trainable in PARTIAL_RECIPES else trainable}
    return stage2_settings(cfg.stage2)


def heal_recipe_of(cfg, *, comp: dict | None) -> dict:
    """heal_stepper's `recipe` for a heal method's heal on the workers: the recipe, the tail's k and
    the original indices of the layers a least-squares fold wrote its maps into (`comp`: the fit's
    info, its "blocks"; None without a fit)."""
    from trsp_ray.boundaries import fold_layers
    from trsp_ray.config import heal_recipe

    trainable, _ = heal_recipe(cfg, heal_method=True)
    maps = fold_layers(comp["blocks"]) if comp is not None and cfg.compensation.method == "lstsq" else []
    return {"trainable": trainable, "tail_layers": cfg.heal.tail_layers, "map_layers": maps}


def heal_stepper(make_stepper, *, gates, drop: list[int], recipe: dict | None = None):
    """`make_stepper` for a heal: the dropped layers are frozen and left out of the optimizer (no
    fp32 master, Adam moments, gradients or checkpoint bytes for ~a quarter of a 70B model). With a
    tail or map `recipe` (heal_recipe_of), everything outside its set (heal.recipe_params of the kept
    layers) is too, before the engine is built: DeepSpeed gets only the recipe's parameters.
    `make.hooks` holds what the recipe attached (a tied head's detach, heal.output_side_only)."""
    dropped = [p for w in gates.wrappers if w.index in drop for p in w.layer.parameters()]
    ids = {id(p) for p in dropped}
    trainable = (recipe or {}).get("trainable", "all")

    def make(model, groups: list[dict]):
        for p in dropped:
            p.requires_grad_(False)
        kept = [{**g, "params": [p for p in g["params"] if id(p) not in ids]} for g in groups]
        if trainable in PARTIAL_RECIPES:
            from trsp_ray import families
            from trsp_ray.distributed.engine import gather_context
            from trsp_ray.heal import output_side_only, recipe_params

            def mlp_output(layer, model):  # a partitioned weight shows no shape until gathered
                with gather_context(list(layer.parameters())):
                    return families.map_module(layer, model)

            wrappers = [w for w in gates.wrappers if w.index not in set(drop)]
            order = [w.index for w in wrappers]
            wanted = recipe_params(model, trainable=trainable, layers=[w.layer for w in wrappers],
                                   tail_layers=recipe["tail_layers"], mlp_output=mlp_output,
                                   map_layers=[order.index(i) for i in recipe["map_layers"]])
            keep = {id(p) for p in wanted}
            for p in model.parameters():
                if id(p) not in keep:
                    p.requires_grad_(False)
            kept = [{**g, "params": [p for p in g["params"] if id(p) in keep]} for g in kept]
            hook = output_side_only(model) if trainable == TAIL_RECIPE else None
            make.hooks += [hook] if hook is not None else []
        return make_stepper(model, [g for g in kept if g["params"]])

    make.hooks = []
    return make
