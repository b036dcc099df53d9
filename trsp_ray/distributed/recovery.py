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


def teacher_on_workers(pipe, bench, *, teacher: dict | None, rank: int, world: int):
    """The teacher store of the workers' heal (run/teacher_store.py), its missing shards computed now:
    None when the run does not distil from a stored teacher (`teacher`: the driver's {"root", "model"}
    for a stored-teacher heal, else None). Called before stage 1, the fit or any step changes a weight,
    so the sharded model with no gate applied and nothing bypassed is the dense teacher: no second
    model in any rank's memory. The windows split over the ranks as every data-parallel forward does
    (training.split_over_ranks, padding forwards keep the ZeRO-3 collectives in step); rank 0 gathers
    each shard's rows and writes it, and every rank reads its own rows of each batch back from the
    store (which must be on storage every node sees). A resumed run finds its shards stored."""
    from trsp_ray.data.perplexity import bos_token
    from trsp_ray.method.training import HEAL_STREAM
    from trsp_ray.models import families
    from trsp_ray.run.teacher_store import TeacherStore, check_topk
    from trsp_ray.run.workbench import heal_stream

    settings = recovery_settings(pipe)
    if teacher is None or settings is None or not pipe.spec.heal:
        return None
    cfg, r = pipe.cfg, pipe.cfg.recovery
    stream = heal_stream(cfg, bench.calibration, bos=bos_token(bench.tokenizer), seed_offset=HEAL_STREAM,
                         steps=settings["steps"])
    store = TeacherStore(teacher["root"], stream, k=r.kd_topk, temperature=r.kd_temperature, cfg=cfg.to_dict(),
                         model=teacher["model"])
    check_topk(r.kd_topk, families.text_config(bench.model).vocab_size)
    fill_on_ranks(bench, store, windows=settings["steps"] * stream.batch_size, rank=rank, world=world)
    return store


def fill_on_ranks(bench, store, *, windows: int, rank: int, world: int) -> int:
    """Store the missing shards of `store`'s first `windows` windows from the dense ZeRO-3 model (no
    gate applied, nothing bypassed), computed data-parallel (ranks_compute) and written by rank 0;
    returns the shards computed. Collective: every rank calls it."""
    from trsp_ray.distributed.collectives import broadcast_object, sum_over_ranks
    from trsp_ray.distributed.ranks import forward_engine

    todo = broadcast_object(store.missing(windows) if rank == 0 else None)  # every rank computes the same shards
    if not todo:
        return 0
    forward_engine(bench, fresh=True)  # an engine's hooks gather each layer's partitions in the forward
    with bench.gates.state(gated=False, bypass=[]):
        done = store.fill(ranks_compute(bench, k=store.k, temperature=store.temperature,
                                        batch_size=max(1, store.stream.batch_size // world), rank=rank, world=world),
                          windows=windows, shards=todo, write=rank == 0)
    sum_over_ranks([0.0])  # the writer has stored every shard before any rank reads one
    return done


def ranks_compute(bench, *, k: int, temperature: float, batch_size: int, rank: int, world: int):
    """teacher_store's compute(windows) on the ranks: each rank runs the top-k records of its rows
    (rows k % world == rank, in batches of `batch_size`) on the ZeRO-3 model, and the shard's
    records are gathered on every rank in the windows' order."""
    import torch

    from trsp_ray.distributed.collectives import gather_objects
    from trsp_ray.method.training import join_over_ranks, split_over_ranks
    from trsp_ray.run.teacher_store import dense_compute

    def forward(batch: torch.Tensor) -> torch.Tensor:
        return bench.model(input_ids=batch.to(bench.factory.built[-1].engine.device), use_cache=False).logits

    def compute(windows: torch.Tensor):
        mine, padding = split_over_ranks(list(windows.split(batch_size)), rank=rank, world=world)
        training = bench.model.training
        bench.model.eval()
        run = dense_compute(bench.model, k=k, temperature=temperature, batch_size=batch_size, forward=forward)
        records = run(torch.cat(mine)) if mine else None
        with torch.no_grad():
            for _ in range(padding):  # ZeRO-3: a rank short of a batch still runs its forwards
                forward(windows[:1])
        bench.model.train(training)
        parts = gather_objects(records)
        return tuple(join_over_ranks([None if p is None else p[i] for p in parts], rows=windows.shape[0])
                     for i in range(3))

    return compute
