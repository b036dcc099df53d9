"""A heal's and TRSP stage 2's checkpoints in one process, so an interrupted heal or stage 2 (Ctrl-C, a lost
machine) restarts from its last checkpoint instead of its first step (SmolLM2-135M healed at a 3M budget:
240 steps, 100 minutes on 2 CPU cores). The Ray Train workers checkpoint both their own way
(distributed/worker.py). Stage 2's checkpoint is the heal's with stage 2's record added (each dropped layer's
relative update so far), under `<checkpoint_dir>/stage2/<key>/` on the same `heal.checkpoint_minutes`, keyed
by the gated model it starts from, stage 2's settings and the drop set.

`<checkpoint_dir>/heal/<key>/heal.pt` holds what the heal changed and what its next step reads: the trained
parameters (the optimizer's: an fp32 master where the weight is bf16/fp16), the optimizer's state, the fp16
loss scale, the random state and the step: 12 bytes a trained parameter. It is written atomically every
`heal.checkpoint_minutes` of the heal's wall time, or less often where writes are slow: never more than
MAX_SHARE of the heal's time goes to them (a 3B model's all-weight heal on one GPU writes 36 GB a checkpoint).
Each replaces the last; the checkpoint is removed once the heal is done. A rerun reads it back and replays the
batch stream up to the stored step without compute (as the workers' resumed heal does), so the resumed heal
ends with the uninterrupted heal's weights.

The key covers the model the heal starts from (a digest of its weights: whatever selection, stage 2, fit
or merge made it), the heal's settings and recipe, the recovery objective, the seed, the calibration text
and windows, the library versions and the precision; a change of any starts afresh.
"""

from __future__ import annotations

import hashlib
import time
from pathlib import Path

from trsp_ray.common import atomic
from trsp_ray.common.logs import log
from trsp_ray.run.content import (
    calibration_content,
    checkpoint_root,
    data_fingerprint,
    new_folders,
    remove_store,
    store_key,
)

STATE_BYTES = 12  # per trained parameter: its fp32 value (or master) and Adam's two fp32 moments
SAMPLE = 256  # values of each parameter the weights digest reads beside its sum
MAX_SHARE = 0.05  # of a heal's wall time its checkpoint writes may take (heal.checkpoint_minutes > 0)


def weights_digest(model) -> str:
    """A digest of `model`'s parameters: each one's name, shape, dtype, float64 sum and an evenly strided
    sample of its values (read on their device, one transfer), so any other model it would start from
    (another drop set, fit or merge; a stage changed by new code) gives another digest."""
    import torch

    h = hashlib.sha256()
    sums, samples = [], []
    for name, p in model.named_parameters():
        flat = p.detach().reshape(-1)
        h.update(f"{name}:{tuple(p.shape)}:{p.dtype};".encode())
        sums.append(flat.sum(dtype=torch.float64))
        samples.append(flat[:: max(1, flat.numel() // SAMPLE)].to(torch.float64))
    h.update(torch.stack(sums).cpu().numpy().tobytes())
    h.update(torch.cat(samples).cpu().numpy().tobytes())
    return h.hexdigest()[:16]


def heal_key(cfg: dict, *, model, heal: dict, map_layers, shape: tuple[int, int], stage2: dict | None = None) -> str:
    """The key of a heal by the run `cfg` (a RunConfig dict) of `model` with the settings `heal` (a HealConfig
    as a dict), the map recipe's `map_layers` and its windows' `shape` (seqlen, batch); of stage 2 where
    `stage2` holds its settings and drop set (then `heal` is {} and `map_layers` empty)."""
    data = cfg["data"]
    what = {"weights": weights_digest(model), "heal": heal, "map_layers": list(map_layers), "shape": list(shape),
            "recovery": cfg["recovery"], "seed": cfg["seed"], "data": calibration_content(data),
            **({"stage2": stage2} if stage2 is not None else {})}
    return store_key(what, cfg=cfg, data=data_fingerprint(model=cfg["model"], calib_text=data.get("calib_text"),
                                                          calib_mix=data.get("calib_mix")))


def planned_gb(trained_params: int) -> float:
    """GB of disk one heal checkpoint takes for `trained_params` trained parameters (STATE_BYTES each)."""
    return STATE_BYTES * trained_params / 1024**3


class HealCheckpoints:
    """The checkpoint of one heal (`key`) under `<root>/<stage>/<key>/` (stage: heal or stage2): `restore`
    before its first step, `after` every step (it writes once `wait` seconds have passed since the last write:
    `minutes`, or where the last write took longer than MAX_SHARE of that, the wait that keeps it to that
    share; 0: every step), `clear` once done. run_heal (method/heal.py) and run_stage2 call the three; stage 2
    hands `after` its `record` (the relative updates so far), which `restore` puts in `self.record`."""

    def __init__(self, root: str | Path, key: str, *, minutes: float, stage: str = "heal"):
        self.stage = stage
        self.dir = Path(root).expanduser() / stage / key
        self.path = self.dir / f"{stage}.pt"
        self.record: dict = {}
        self.minutes = minutes
        self.wait = 60.0 * minutes
        self.last = time.monotonic()
        self.made: list[Path] = []  # the folders the first save made, deepest first: clear removes them

    def restore(self, stepper) -> tuple[int, float | None]:
        """(steps done, the heal's first loss) of the stored checkpoint, put back into `stepper`'s parameters,
        optimizer and random state; (0, None) where none is stored."""
        import torch

        if not self.path.is_file():
            return 0, None
        # tensors, numbers, lists and dicts (no pickle), mapped from the file, not read whole: on a GPU run
        # the state reaches the device a tensor at a time, never all of it in host memory or beside the live state
        stored = torch.load(self.path, weights_only=True, map_location="cpu", mmap=True)
        with torch.no_grad():
            for p, value in zip(stepper.params, stored["params"], strict=True):
                p.copy_(value)
            for p, master in stepper.masters:
                p.copy_(master)
        stepper.optimizer.load_state_dict(stored["optimizer"])
        stepper.loss_scale, stepper.skipped_steps = stored["loss_scale"], stored["skipped_steps"]
        torch.set_rng_state(stored["rng"])
        if stored.get("cuda_rng") is not None and torch.cuda.is_available():
            torch.cuda.set_rng_state(stored["cuda_rng"])
        self.record = stored.get("record", {})
        log(f"  {self.label()}: resuming after step {stored['step']} from {self.path}")
        self.last = time.monotonic()
        return stored["step"], stored["first"]

    def label(self) -> str:
        return "stage 2" if self.stage == "stage2" else self.stage

    def after(self, step: int, steps: int, stepper, *, first: float | None, record: dict | None = None) -> None:
        """Store the heal after `step` of `steps` where `minutes` have passed since the last write (never after
        the last step: the heal's result follows at once). torch.save copies a device tensor to the host as it
        writes it, one at a time."""
        import torch

        if step >= steps or time.monotonic() - self.last < self.wait:
            return
        start = time.monotonic()
        if not self.made:
            self.made = new_folders(self.dir)
        state = {"step": step, "first": first, "params": [p.detach() for p in stepper.params],
                 "optimizer": stepper.optimizer.state_dict(), "loss_scale": stepper.loss_scale,
                 "skipped_steps": stepper.skipped_steps, "rng": torch.get_rng_state(),
                 "cuda_rng": torch.cuda.get_rng_state() if torch.cuda.is_available() else None,
                 "record": record or {}}
        atomic.save_torch(self.path, state)
        self.last = time.monotonic()
        took = self.last - start
        if self.minutes > 0:
            self.wait = max(60.0 * self.minutes, took * (1.0 - MAX_SHARE) / MAX_SHARE)
        size = self.path.stat().st_size / 1024**3
        log(f"  {self.label()}: checkpoint after step {step}/{steps} ({size:.2f} GB in {took:.0f} s"
            + (f"; the next in {self.wait / 60:.0f} min or more)" if self.minutes > 0 else ")"))

    def clear(self) -> None:
        """Remove the checkpoint, its folder and the folders above it that this heal's first save made, where
        empty."""
        remove_store(self.dir, self.made)


def heal_checkpoints(cfg, model, heal, map_layers, stream) -> HealCheckpoints | None:
    """The checkpoints of the heal `heal` (a HealConfig) of `model` on the batch `stream` by the run `cfg`; None
    where heal.checkpoint_minutes is off."""
    import dataclasses

    if heal.checkpoint_minutes is None:
        return None
    settings = {k: v for k, v in dataclasses.asdict(heal).items() if k != "checkpoint_minutes"}
    key = heal_key(cfg.to_dict(), model=model, heal=settings, map_layers=map_layers,
                   shape=(stream.seqlen, stream.batch_size))
    return HealCheckpoints(checkpoint_root(cfg.checkpoint_dir), key, minutes=heal.checkpoint_minutes)


def stage2_checkpoints(cfg, s2, model, *, drop: list[int]) -> HealCheckpoints | None:
    """The checkpoints of TRSP's stage 2 with the settings `s2` (a Stage2Config: the run's or a row's) of the
    gated `model` dropping `drop` by the run `cfg`, on its calibration windows (data.seqlen x data.batch_size);
    None where heal.checkpoint_minutes (every training's in one process) is off."""
    import dataclasses

    minutes = cfg.heal.checkpoint_minutes
    if minutes is None:
        return None
    key = heal_key(cfg.to_dict(), model=model, heal={}, map_layers=(), shape=(cfg.data.seqlen, cfg.data.batch_size),
                   stage2={"settings": dataclasses.asdict(s2), "drop": list(drop)})
    return HealCheckpoints(checkpoint_root(cfg.checkpoint_dir), key, minutes=minutes, stage="stage2")


def planned_line(cfg, spec, shape, *, steps: int) -> str | None:
    """`prune --dry-run`'s line of the disk a heal's checkpoint (or TRSP stage 2's, where it runs) takes in one
    process (planned_gb), where and how often; None where nothing trains or its checkpoint_minutes is off.
    `spec`: the run's registry.Method; `shape`: its model's plan.shape.Shape; `steps`: the steps it trains
    (pipeline.training_steps)."""
    from trsp_ray.config.run_config import heal_recipe
    from trsp_ray.method.stage1 import n_drop_for

    n_drop, minutes = n_drop_for(cfg.ratio, shape.layers), cfg.heal.checkpoint_minutes
    if spec.stage2 and cfg.stage2.enabled:  # every layer trains, the dropped ones toward identity
        stage, s2 = "stage2", cfg.stage2
        trained = shape.recipe_params(s2.trainable, kept_layers=shape.layers, lora_rank=s2.lora_rank)
    else:
        stage = "heal"
        trainable, rank = heal_recipe(cfg, heal_method=spec.heal)
        trained = shape.recipe_params(trainable, kept_layers=shape.layers - n_drop, lora_rank=rank,
                                      tail_layers=cfg.heal.tail_layers, maps=n_drop)
    if minutes is None or not steps:
        return None
    the, name = ("", "stage 2") if stage == "stage2" else ("the ", "heal")
    every = "after every step" if minutes == 0 else f"every {minutes:g} min of {the}{name}"
    return (f"{stage} checkpoint: {planned_gb(trained):.2f} GB of disk under {checkpoint_root(cfg.checkpoint_dir)}/"
            f"{stage}, written {every} (heal.checkpoint_minutes) so an interrupted {name} resumes; removed when "
            f"{the}{name} is done")
