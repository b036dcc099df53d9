"""The per-worker train loop of a distributed run: stage 1 -> stage 2 -> export, resumable.

Each Ray Train worker runs `train_loop(config)`. The stage loops are the single-process ones
(`run_stage1`, `run_stage2`, `run_heal`); only the stepper (a DeepSpeed engine), gate gathering and
checkpointing differ. Checkpoints: after every stage-1 round and every `checkpoint_every` stage-2
steps, each rank writes its own files into one Ray checkpoint, once: straight into the run's
checkpoint folder on a local/shared path, or into a local staging folder that Ray uploads to a
remote storage and then deletes. A resumed rank reads only its own files. Progress goes to the
run's records on the same storage (storage.RunRecords), never to a side file on a local disk.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from trsp_ray.distributed.checkpoints import discard_download, restore_point, save
from trsp_ray.distributed.collectives import gather_objects, sum_over_ranks
from trsp_ray.distributed.events import EventLog, FaultInjector
from trsp_ray.distributed.ranks import block_influence_on_ranks, forward_engine
from trsp_ray.method.training import FIT_STREAM, HEAL_STREAM, SELECTION_STREAM, STAGE1_STREAM, STAGE2_STREAM


def reset_peak_memory() -> None:
    """Start a new peak-memory window (device memory on GPU, resident set size on CPU)."""
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    elif Path("/proc/self/clear_refs").exists():
        Path("/proc/self/clear_refs").write_text("5")  # Linux: reset VmHWM to the current RSS


def peak_memory_gb() -> float | None:
    """Peak of this worker since the last reset, in GiB (what the planner estimates)."""
    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated() / 2**30
    status = Path("/proc/self/status")
    if not status.exists():
        return None
    for line in status.read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 2**20  # kB -> GiB
    return None


def train_loop(config: dict) -> None:
    """Entry point of every Ray Train worker; `config` is the plain dict built by the driver."""
    import ray.train

    from trsp_ray.config import registry
    from trsp_ray.config.run_config import from_dict
    from trsp_ray.distributed import compensate
    from trsp_ray.distributed import engine as eng
    from trsp_ray.run.pipeline import named

    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    cfg = from_dict(config["run"])
    # the driver resolved the pipeline (run_distributed): read once here, its spec handed down
    pipe = named(cfg)
    spec = pipe.spec
    # Threads: the run's setting, else the CPUs Ray gave this worker (more when the optimizer is
    # offloaded: CPU Adam steps this rank's whole partition every step).
    torch.set_num_threads(cfg.threads or config.get("cpus_per_worker") or 1)
    torch.manual_seed(cfg.seed)
    eng.init_deepspeed(backend="nccl" if cfg.distributed.use_gpu else "gloo")
    events = EventLog(config.get("records"), rank)
    meta, engine_dir = restore_point(rank)
    events.write("start", world=world, resumed_from=None if meta is None else meta["label"], nodes=_nodes(),
                 threads=torch.get_num_threads(), downloaded=None if meta is None else meta.get("downloaded"))
    bench = _load(config, cfg, rank=rank, world=world)
    fault = FaultInjector(config.get("fault"), rank, config.get("records"))
    from trsp_ray.distributed.recovery import teacher_on_workers

    # a distilling heal's teacher: the dense model's records, stored before anything changes a weight
    bench.teacher = teacher_on_workers(pipe, bench, teacher=config.get("teacher"), rank=rank, world=world)
    if config.get("stage1") is not None:  # a stage 1 computed elsewhere (distributed/handoff.py)
        from trsp_ray.method.stage1 import n_drop_for
        from trsp_ray.run.stage1_store import handed_over_drop

        drop = handed_over_drop(config["stage1"], ranking=spec.ranking, n_drop=n_drop_for(cfg.ratio, bench.num_layers))
        s1_state = {"handed_over": True}
        events.write("stage1_done", drop_order=drop, handed_over=True, rounds_computed=0)
    elif config.get("drop") is not None:  # a heal method's drop set chosen in one process (SLEB's)
        drop, s1_state = list(config["drop"]), {"handed_over": True}
        events.write("stage1_done", drop_order=drop, handed_over=True, rounds_computed=0,
                     selector=spec.selector)
    elif spec.selector == registry.SHORTGPT_SELECTOR:
        drop, s1_state = _shortgpt(cfg, bench, events=events, rank=rank), {}
    elif spec.merges:
        drop, s1_state = _merge_select(cfg, bench, events=events, rank=rank), {}
    elif spec.selector == registry.TAIL_SELECTOR:  # no forward: every rank alike
        from trsp_ray.method.selectors import tail_drop
        from trsp_ray.method.stage1 import candidate_layers, n_drop_for

        g = cfg.gates
        candidates = candidate_layers(bench.num_layers, protect_head=g.protect_head, protect_tail=g.protect_tail)
        drop, s1_state = tail_drop(n_drop=n_drop_for(cfg.ratio, bench.num_layers), candidates=candidates), {}
        events.write("stage1_done", drop_order=drop, selector=registry.TAIL_SELECTOR, rounds_computed=0,
                     select_cost=0.0)
    else:
        drop, s1_state = _stage1(config, cfg, bench, ranking=spec.ranking, events=events, meta=meta, rank=rank,
                                 fault=fault)
    merged, pairs = _merge(cfg, bench, drop=drop, events=events, rank=rank) if spec.merges else ({}, None)
    comp = _fit_compensation(cfg, bench, drop=drop, events=events, rank=rank)
    # where one process folds (methods.apply_method): after stage 2, before a heal. A resumed heal
    # folds again and then loads its checkpoint's (folded, healed) weights over the result.
    heal = comp is not None and spec.heal
    if heal:
        compensate.apply(model=bench.model, drop=drop, info=comp)
    model = _stage2(config, pipe, bench, drop=drop, s1_state=s1_state, events=events, meta=meta,
                    engine_dir=engine_dir, rank=rank, fault=fault, comp=comp)
    if pairs is not None:  # kept through the heal: a heal resumed from its checkpoint reads them back
        pairs.clear()
    if comp is not None and not heal:
        compensate.apply(model=model, drop=drop, info=comp)
    _export(config, cfg, bench, model=model, drop=drop, events=events, rank=rank,
            metrics=compensate.manifest_metrics(cfg.compensation, comp) | merged)
    events.write("done", drop_order=drop)
    ray.train.report({"done": 1, "drop_order": json.dumps(drop)})


def _nodes() -> list[str]:
    """The Ray node id of every rank, in rank order (collective)."""
    import ray

    return gather_objects(ray.get_runtime_context().get_node_id())


def _load(config: dict, cfg, *, rank: int, world: int):
    """Tokenizer, calibration ids and the gated model, partitioned from the start under ZeRO-3."""
    from types import SimpleNamespace

    from transformers import AutoTokenizer

    from trsp_ray.data.perplexity import bos_token
    from trsp_ray.distributed import engine as eng
    from trsp_ray.method.gates import attach_gates
    from trsp_ray.models import families
    from trsp_ray.run.workbench import calibration_of

    path = config["model_path"]
    tokenizer = AutoTokenizer.from_pretrained(path)
    # The same training windows as the single-process path (workbench.calibration_of).
    cal = calibration_of(cfg, tokenizer, bos=bos_token(tokenizer))
    calib_ids = cal.ids
    from trsp_ray.distributed.deepspeed_config import worker_dtype

    dtype = getattr(torch, worker_dtype(cfg))
    model = eng.load_sharded(path, ds_config=config["ds_config"], dtype=dtype)
    gates = attach_gates(model, gate_mode=cfg.gates.gate)
    eng.zero_ready_gates(gates)
    factory = eng.StepperFactory(ds_config=config["ds_config"], rank=rank, world=world,
                                 activation_checkpointing=cfg.distributed.activation_checkpointing)
    return SimpleNamespace(path=path, tokenizer=tokenizer, calib_ids=calib_ids, calib_strata=cal.strata,
                           calibration=cal, model=model, gates=gates, factory=factory,
                           num_layers=families.num_layers(model), world=world)


def _batches(cfg, bench, seed_offset: int):
    from trsp_ray.data.perplexity import bos_token
    from trsp_ray.method.training import Batches

    d = cfg.data
    # the single process's convention (Workbench.batches): BOS first when the tokenizer adds one
    return Batches(bench.calib_ids, seqlen=d.seqlen, batch_size=d.batch_size, seed=cfg.seed + seed_offset,
                   bos=bos_token(bench.tokenizer), strata=bench.calib_strata)


def _stage1(config: dict, cfg, bench, *, ranking: str, events: EventLog, meta: dict | None, rank: int,
            fault: FaultInjector):
    """Run (or finish) stage 1; returns (drop order, final stage-1 state for later checkpoints).
    `ranking`: which of stage 1's rankings the pipeline drops by (its spec's, Stage1Result.drop_for)."""
    from trsp_ray.data.perplexity import bos_token
    from trsp_ray.distributed import engine as eng
    from trsp_ray.method.probes import RemovalScorer, common_tokens
    from trsp_ray.method.stage1 import candidate_layers, check_drop_count, n_drop_for, run_stage1
    from trsp_ray.run.methods import probe_windows, probes_removal, stage1_settings

    s1, g = cfg.stage1, cfg.gates
    candidates = candidate_layers(bench.num_layers, protect_head=g.protect_head, protect_tail=g.protect_tail)
    n_drop = n_drop_for(cfg.ratio, bench.num_layers)
    check_drop_count(n_drop, candidates, cfg.ratio, bench.num_layers)
    reset_peak_memory()
    last = {"state": meta["stage1"] if meta else None}

    def report(metrics: dict, step: int) -> None:
        fault.check(metrics)
        if "stage1/rounds_done" in metrics:
            # The optimizer's fp32 copy of the gates (collective): what the next step starts from;
            # after the projection onto s >= 0 it must equal the gates themselves.
            master = eng.master_values(bench.gates.gate_params())
            events.write("round", round=metrics["stage1/rounds_done"], dropped=metrics["stage1/dropped"], step=step,
                         gate_master=master)

    def on_round(state: dict) -> None:
        last["state"] = state
        rounds = len(state["round_ends"])
        save({"label": f"stage1-round{rounds}", "stage": 1, "rounds_done": rounds,
               "drop_order": state["drop_order"]}, state, rank=rank, upload=cfg.distributed.checkpoint_upload)

    scorer, influence, spent = None, None, 0
    if probes_removal(s1):
        # every rank scores its share of the windows (k % world == rank); the summed scores are
        # the same number on every rank, so every rank drops the same layer
        windows = probe_windows(bench.calib_ids, s1=s1, data=cfg.data, seed=cfg.seed,
                                bos=bos_token(bench.tokenizer), strata=bench.calib_strata)
        common = common_tokens(bench.calib_ids) if s1.probe_criterion == "recall" else None
        scorer = RemovalScorer(model=bench.model, gates=bench.gates, windows=windows, criterion=s1.probe_criterion,
                               rank=rank, world=bench.world, all_reduce=sum_over_ranks, common=common)
        if s1.shortlist_bi:  # data-parallel, the same influences on every rank
            influence, spent = block_influence_on_ranks(cfg, bench, windows, rank=rank)
    result = run_stage1(model=bench.model, gates=bench.gates, batches=_batches(cfg, bench, STAGE1_STREAM),
                        n_drop=n_drop, candidates=candidates, make_stepper=bench.factory, report=report,
                        resume=last["state"], on_round=on_round, scorer=scorer, influence=influence,
                        **stage1_settings(s1))
    result.probe_cost += spent
    drop = result.drop_for(ranking, n_drop)
    events.write("stage1_done", drop_order=drop, rounds_computed=result.rounds_computed, peak_gb=peak_memory_gb(),
                 gates=bench.gates.gate_values(), gate_history=result.gate_history, probe_cost=result.probe_cost,
                 refine_calls=result.refine_calls, refine_budget=s1.refine_budget, refine_cost=result.refine_cost)
    return drop, last["state"]


def _shortgpt(cfg, bench, *, events: EventLog, rank: int) -> list[int]:
    """ShortGPT's drop set on the single process's windows (methods.select), Block Influence scored
    data-parallel (block_influence_on_ranks). Forward-only and cheap: a resumed run recomputes it
    rather than checkpointing it."""
    from trsp_ray.config import registry
    from trsp_ray.method.selectors import lowest_influence
    from trsp_ray.method.stage1 import candidate_layers, check_drop_count, n_drop_for
    from trsp_ray.run.methods import fixed_windows, shortgpt_windows

    g = cfg.gates
    candidates = candidate_layers(bench.num_layers, protect_head=g.protect_head, protect_tail=g.protect_tail)
    n_drop = n_drop_for(cfg.ratio, bench.num_layers)
    check_drop_count(n_drop, candidates, cfg.ratio, bench.num_layers)
    windows = fixed_windows(_batches(cfg, bench, SELECTION_STREAM), shortgpt_windows(cfg, n_drop))
    reset_peak_memory()
    bi, tokens = block_influence_on_ranks(cfg, bench, windows, rank=rank)
    drop = lowest_influence(bi, n_drop=n_drop, candidates=candidates)
    events.write("stage1_done", drop_order=drop, selector=registry.SHORTGPT_SELECTOR, block_influence=bi,
                 rounds_computed=0, select_cost=tokens, peak_gb=peak_memory_gb())
    return drop


def _merge_select(cfg, bench, *, events: EventLog, rank: int) -> list[int]:
    """A merge's drop set (each pair's second layer) on ShortGPT's windows, the pairs' distances scored
    data-parallel (distributed/merging.py); forward-only, recomputed by a resumed run."""
    from trsp_ray.config import registry
    from trsp_ray.distributed.merging import pairs_on_ranks
    from trsp_ray.method.stage1 import candidate_layers, n_drop_for
    from trsp_ray.run.methods import fixed_windows, shortgpt_windows

    g = cfg.gates
    candidates = candidate_layers(bench.num_layers, protect_head=g.protect_head, protect_tail=g.protect_tail)
    n_pairs = n_drop_for(cfg.ratio, bench.num_layers)
    windows = fixed_windows(_batches(cfg, bench, SELECTION_STREAM), shortgpt_windows(cfg, n_pairs))
    forward_engine(bench)
    reset_peak_memory()
    firsts, tokens = pairs_on_ranks(bench.model, bench.gates, windows, n_pairs=n_pairs, candidates=candidates,
                                    rank=rank, world=bench.world)
    drop = [a + 1 for a in firsts]
    events.write("stage1_done", drop_order=drop, selector=registry.MERGE_SELECTOR, rounds_computed=0,
                 select_cost=tokens, peak_gb=peak_memory_gb())
    return drop


def _merge(cfg, bench, *, drop: list[int], events: EventLog, rank: int):
    """Merge each pair (d - 1, d) of `drop` on the ranks (distributed/merging.py), on the one process's merge
    windows (FIT_STREAM); returns the manifest's merge fields and rank 0's store of the pairs (merge_on_ranks)."""
    from trsp_ray.distributed.merging import merge_on_ranks
    from trsp_ray.plan.merge_plan import merge_windows
    from trsp_ray.run.methods import fixed_windows

    windows = fixed_windows(_batches(cfg, bench, FIT_STREAM), merge_windows(cfg))
    reset_peak_memory()
    merged, store = merge_on_ranks(cfg, bench, drop=drop, windows=windows, rank=rank, world=bench.world)
    # merged_here: the pairs this attempt merged (0 where a restart read them all back from rank 0's store)
    events.write("merged", peak_gb=peak_memory_gb(), merged_here=store.saved if store is not None else None, **merged)
    return merged, store


def _stage2(config: dict, pipe, bench, *, drop: list[int], s1_state: dict, events: EventLog, meta: dict | None,
            engine_dir: str | None, rank: int, fault: FaultInjector, comp: dict | None = None):
    """Stage 2, or a heal method's heal (recovery.heal_on_workers: heal.run_heal, the single
    process's loop), with checkpoints every `checkpoint_every` steps; a resumed run fast-forwards.
    A heal trains its recipe's set (`comp`: the fit's info, whose blocks name the map recipe's layers).
    `pipe`: the run's pipeline (train_loop's), whose spec says whether it heals."""
    from trsp_ray.distributed.recovery import heal_on_workers, recovery_settings
    from trsp_ray.method.stage2 import run_stage2

    cfg = pipe.cfg
    settings = recovery_settings(pipe)
    if settings is None:
        return bench.model
    heal = pipe.spec.heal
    done = meta.get("stage2_step", 0) if meta and meta["stage"] == 2 else 0
    every, steps = cfg.distributed.checkpoint_every, settings["steps"]

    first = len(bench.factory.built)  # engines before this one: stage 1's (none after ShortGPT)

    def on_build(stepper, index: int) -> None:
        if index == first and done:  # the stage-2 (or heal) engine
            stepper.engine.load_checkpoint(engine_dir, tag="stage2", load_optimizer_states=True,
                                           load_lr_scheduler_states=False)
            discard_download(meta)
            stepper.skip = done  # the loop replays the batch stream and schedule without compute

    def report(metrics: dict, step: int) -> None:
        if step > done and step % every == 0 and step < steps:
            state = save({"label": f"stage2-step{step}", "stage": 2, "stage2_step": step, "drop_order": drop},
                         s1_state, rank=rank, engine=bench.factory.built[-1].engine,
                         upload=cfg.distributed.checkpoint_upload)
            # "uploading": a failure before the upload commits resumes from the previous checkpoint
            events.write("checkpoint", stage=2, step=step, upload=state)
        if step > done:
            fault.check_stage2(step)

    bench.factory.on_build = on_build
    reset_peak_memory()
    if heal:  # the batch stream the single-process heal reads
        from trsp_ray.data.perplexity import bos_token
        from trsp_ray.method.distill import StoredDistillLoss
        from trsp_ray.run.workbench import heal_stream

        if bench.teacher is not None:  # each rank reads its rows' records of the stream's batches
            stream, r = bench.teacher.stream, cfg.recovery
            bench.factory.objective = StoredDistillLoss(bench.teacher.lookup, temperature=r.kd_temperature,
                                                        ce_weight=r.kd_ce_weight)
        else:
            stream = heal_stream(cfg, bench.calibration, bos=bos_token(bench.tokenizer), seed_offset=HEAL_STREAM,
                                 steps=settings["steps"])
        result = heal_on_workers(pipe, model=bench.model, gates=bench.gates, drop=drop, comp=comp,
                                 batches=stream, make_stepper=bench.factory, report=report)
        updates = {}  # the drop set is bypassed from the first step: no update of it to measure
    else:
        result = run_stage2(model=bench.model, gates=bench.gates, batches=_batches(cfg, bench, STAGE2_STREAM),
                            drop=drop, make_stepper=bench.factory, report=report, **settings)
        updates = {str(i): [v[done], v[-1]] for i, v in result.relative_update.items() if len(v) > done}
    events.write("stage2_done", steps_computed=result.steps - done, peak_gb=peak_memory_gb(), relative_update=updates)
    return result.model


def _fit_compensation(cfg, bench, *, drop: list[int], events: EventLog, rank: int) -> dict | None:
    """The compensation's maps (distributed/compensate.py) from the dense model, on the single
    process's windows (FIT_STREAM, methods.apply_method); None for compensation.method none."""
    from trsp_ray.config.run_config import sized
    from trsp_ray.distributed import compensate
    from trsp_ray.models import families
    from trsp_ray.run.methods import fixed_windows

    c = sized(cfg, hidden=families.text_config(bench.model).hidden_size).compensation  # windows 0: auto
    if c.method == "none":
        return None
    if c.windows < bench.world:  # every rank raises alike (a rank without a window would hang the rest)
        from trsp_ray.common.errors import TrspError

        raise TrspError(f"compensation.windows={c.windows} is fewer than the {bench.world} workers; use "
                        f"compensation.windows >= {bench.world}")
    windows = fixed_windows(_batches(cfg, bench, FIT_STREAM), c.windows)
    forward_engine(bench)  # a handed-over drop set: no selection built one
    reset_peak_memory()  # the fit's own peak, to set beside the plan's compensation stage
    if c.method == "scalar":
        info = compensate.fit_scalar(model=bench.model, gates=bench.gates, drop=drop, windows=windows, rank=rank,
                                     world=bench.world)
    else:
        info = compensate.fit(model=bench.model, gates=bench.gates, drop=drop, windows=windows, rank=rank,
                              world=bench.world, ridge=c.ridge, form=c.form, map_rank=c.rank,
                              weighting=c.weighting, objective=c.objective, minimum=c.min_tokens_per_column)
    events.write("compensation", method=c.method, peak_gb=peak_memory_gb(),
                 **{k: v for k, v in info.items() if k != "maps"})
    return info


def _export(config: dict, cfg, bench, *, model, drop: list[int], events: EventLog, rank: int,
            metrics: dict | None = None) -> None:
    """Every rank streams the kept layers, one gathered at a time, into rank 0's shards (export.py)."""
    from trsp_ray.distributed.export import export_streaming

    if cfg.output:
        d = cfg.distributed
        manifest = dict(config.get("manifest", {}))
        if metrics:
            manifest["metrics"] = {**manifest.get("metrics", {}), **metrics}
        done = export_streaming(model, tokenizer=bench.tokenizer, drop=drop, output=cfg.output,
                                manifest=manifest, max_shard_mb=d.export_shard_mb,
                                reload_max_gb=d.export_reload_max_gb, timeout_s=d.export_timeout_s)
        events.write("exported", **done)
