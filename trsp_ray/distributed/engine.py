"""DeepSpeed plumbing run inside each worker: sharded model load, the stepper the stage loops use,
gathered gate access, and a full state dict gathered from the shards for export.

Everything here assumes torch.distributed is already initialised (Ray Train's TorchTrainer does it).
"""

from __future__ import annotations

import contextlib
import logging

import torch
from torch import nn


def quiet_deepspeed() -> None:
    """DeepSpeed logs every engine build at INFO; keep the job log readable."""
    from deepspeed.utils import logger

    logger.setLevel(logging.WARNING)


def init_deepspeed(*, backend: str) -> None:
    """Attach DeepSpeed's comm layer to the process group Ray Train created."""
    import deepspeed
    import torch._dynamo  # noqa: F401  (zero.Init patches module classes; dynamo must be imported first)

    quiet_deepspeed()
    deepspeed.init_distributed(dist_backend=backend, auto_mpi_discovery=False)


def load_sharded(path: str, *, ds_config: dict, dtype: torch.dtype):
    """A *ForCausalLM built partitioned from the start: with ZeRO-3 in `ds_config`, transformers
    constructs it inside `deepspeed.zero.Init` and loads each checkpoint shard into the partitions,
    so no rank ever holds the whole model."""
    from transformers import AutoModelForCausalLM
    from transformers.integrations.deepspeed import HfDeepSpeedConfig, unset_hf_deepspeed_config

    marker = HfDeepSpeedConfig(ds_config)  # read by from_pretrained through a weak reference
    try:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    finally:
        del marker
        unset_hf_deepspeed_config()  # later plain models (export, tests) must not be partitioned
    return model


def zero_ready_gates(gates) -> None:
    """Give each gate shape [1] instead of []: DeepSpeed cannot partition a 0-dim parameter (it
    views it as bytes to broadcast). The gate math broadcasts identically and values are kept."""
    for w in gates.wrappers:
        if w.gate.dim() == 0:
            w.gate = nn.Parameter(w.gate.detach().reshape(1).clone(), requires_grad=w.gate.requires_grad)
    gates.gather = gather_gates


def is_partitioned(model) -> bool:
    return any(hasattr(p, "ds_id") for p in model.parameters())


def gather_context(params: list[nn.Parameter]):
    """Full values of ZeRO-3 parameters inside the block; rank 0's edits are kept on exit."""
    if not any(hasattr(p, "ds_id") for p in params):
        return contextlib.nullcontext()
    import deepspeed

    return deepspeed.zero.GatheredParameters(params, modifier_rank=0)


@contextlib.contextmanager
def gather_gates(params: list[nn.Parameter]):
    """`gather_context` for the gates, whose edits (the projection onto s >= 0, a reset, a restore)
    must also reach the optimizer's fp32 master copy: ZeRO-3 keeps one per trained parameter (on
    the host under optimizer offload, and a separate copy even in fp32) and writes it back over
    the parameter at the next step, which would undo the edit. After the gathered block, each rank
    copies its re-partitioned slice into its master slice (safe_set_local_fp32_param)."""
    if not any(hasattr(p, "ds_id") for p in params):
        yield
        return
    from deepspeed.utils import safe_set_local_fp32_param

    from trsp_ray.distributed.collectives import max_over_ranks

    with gather_context(params):
        before = [p.detach().clone() for p in params]
        yield
        changed = [float(not torch.equal(p.detach(), b)) for p, b in zip(params, before)]
    changed = max_over_ranks(changed)  # rank 0 is the modifier; every rank must agree
    for p, c in zip(params, changed):
        if c and p.requires_grad and getattr(p, "_z3_optimizer", None) is not None:
            safe_set_local_fp32_param(p, p.ds_tensor.detach())


def master_values(params: list[nn.Parameter]) -> list[float | None]:
    """The optimizer's fp32 master value of each 1-element parameter (None: not trained now).
    Collective under ZeRO-3 (each trained parameter's master is all-gathered)."""
    from deepspeed.utils import safe_get_full_fp32_param

    out = []
    for p in params:
        trained = p.requires_grad and getattr(p, "_z3_optimizer", None) is not None
        out.append(float(safe_get_full_fp32_param(p).reshape(-1)[0]) if trained else None)
    return out


# DeepSpeed's optimizer checkpoints hold two plain-data objects besides tensors and containers;
# allowing exactly these lets every checkpoint load with torch.load(weights_only=True).
def _deepspeed_safe_globals() -> list:
    from deepspeed.runtime.fp16.loss_scaler import LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum

    return [LossScaler, ZeroStageEnum]


def load_safely(path, map_location="cpu"):
    """torch.load without arbitrary unpickling (weights_only=True) for this package's checkpoints."""
    with torch.serialization.safe_globals(_deepspeed_safe_globals()):
        return torch.load(path, map_location=map_location, weights_only=True)


def _safe_checkpoint_engine(engine) -> None:
    """Make DeepSpeed's own checkpoint loads (model + optimizer partitions) weights_only too."""
    ce = engine.checkpoint_engine
    ce.load = lambda path, map_location=None: load_safely(path, map_location=map_location)


class DeepSpeedStepper:
    """The `Stepper` of training.py over a DeepSpeed engine.

    Each worker computes the loss of its own slice of the stage loop's batch (rows
    rank*m .. rank*m+m-1, m = B / world); the engine averages gradients over workers, so one step
    equals the single-process step on the whole batch. `skip` > 0 fast-forwards that many steps
    (no compute, no update) to resume a stage-2 loop that has no resume argument of its own.
    `objective(engine, rows, rows=slice)`: the loss of this rank's rows (distill.StoredDistillLoss,
    which reads those rows' teacher records); next-token CE without one.
    """

    def __init__(self, model, param_groups: list[dict], *, ds_config: dict, rank: int, world: int,
                 objective=None):
        import deepspeed

        from trsp_ray.method.gates import GatedLayer

        self.engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=param_groups, config=ds_config)
        _safe_checkpoint_engine(self.engine)
        self.rank, self.world, self.objective = rank, world, objective
        self.skip = 0
        self.gated_layers = [m for m in model.modules() if isinstance(m, GatedLayer)]

    def _rows(self, batch: torch.Tensor) -> slice:
        if batch.shape[0] % self.world:
            raise ValueError(f"batch of {batch.shape[0]} rows does not split over {self.world} workers")
        m = batch.shape[0] // self.world
        return slice(self.rank * m, (self.rank + 1) * m)

    def forward(self, batch: torch.Tensor) -> torch.Tensor:
        if self.skip > 0:
            return torch.zeros((), requires_grad=True)
        rows = self._rows(batch)
        local = batch[rows].to(self.engine.device)
        if self.objective is not None:
            return self.objective(self.engine, local, rows=rows)
        return self.engine(input_ids=local, labels=local, use_cache=False).loss

    def backward(self, loss: torch.Tensor) -> None:
        if self.skip == 0:
            self.engine.backward(loss)

    def step(self) -> None:
        if self.skip > 0:
            self.skip -= 1
            return
        boundary = self.engine.is_gradient_accumulation_boundary()
        self.engine.step()
        if boundary:
            self._clear_grad_partitions()
            self._average_gate_grad_ema()

    def _average_gate_grad_ema(self) -> None:
        """Each rank's gates record dLoss/ds of its own slice of the batch (GatedLayer.grad_ema); the
        ranking breaks ties between gates pinned at 0 with it, so every rank must hold the same
        value, or ranks drop different layers and their collectives stop matching. The mean over
        ranks is the single-process value (the EMA is linear; the batch splits evenly)."""
        if self.world < 2 or not self.gated_layers:
            return
        from trsp_ray.distributed.collectives import sum_over_ranks

        values = sum_over_ranks([float(m.grad_ema) for m in self.gated_layers])
        for m, v in zip(self.gated_layers, (v / self.world for v in values)):
            m.grad_ema = v

    def _clear_grad_partitions(self) -> None:
        """Zero ZeRO-3's gradient partitions after an optimizer step.

        ZeRO-3 writes each reduced gradient into a persistent flat buffer and hands the optimizer
        that buffer for every trainable parameter, whether or not it got a gradient this step; a
        parameter without one (a stage-2 layer annealed to exact identity is skipped in forward)
        would be stepped again with its last gradient, which also inflates the clipping norm of
        every other layer. torch's optimizers skip such a parameter; zeroing the buffer makes the
        distributed step match, and makes a run resumed from a checkpoint (fresh, zeroed buffers)
        bit-identical to an uninterrupted one.
        """
        opt = self.engine.optimizer
        buffer = getattr(opt, "grad_partitions_flat_buffer", None)
        if isinstance(buffer, torch.Tensor):
            buffer.zero_()
        for flat in getattr(opt, "fp32_partitioned_groups_flat", []) or []:
            if getattr(flat, "grad", None) is not None:  # optimizer offload keeps fp32 grads here
                flat.grad.zero_()

    def _zero3(self) -> bool:
        return hasattr(self.engine.optimizer, "fp32_partitioned_groups_flat")

    def state_dict(self) -> dict:
        """This rank's optimizer state (under ZeRO-3: its partition, fp32 master weights included)."""
        return self.engine.optimizer.state_dict()

    def load_state_dict(self, state: dict) -> None:
        if self._zero3():
            # ZeRO-3 takes the list of every rank's state and picks its own entry.
            self.engine.optimizer.load_state_dict([state] * self.world, load_optimizer_states=True)
        else:
            self.engine.optimizer.load_state_dict(state)

    def close(self) -> None:
        """Remove the engine's hooks so the next stage can build a new engine on the same model."""
        self.engine.destroy()


class StepperFactory:
    """`make_stepper` for the stage loops: one engine per call, the previous one closed first.

    `on_build(stepper, index)` runs after each build (index 0 = stage 1, 1 = stage 2), e.g. to load
    a stage-2 checkpoint into the fresh engine.
    """

    def __init__(self, *, ds_config: dict, rank: int, world: int, activation_checkpointing: bool = False,
                 on_build=None):
        self.ds_config, self.rank, self.world = ds_config, rank, world
        self.objective = None  # the steppers' objective from the next build on (DeepSpeedStepper)
        self.activation_checkpointing = activation_checkpointing
        self.on_build = on_build
        self.built: list[DeepSpeedStepper] = []

    def __call__(self, model, param_groups: list[dict]) -> DeepSpeedStepper:
        if self.built:
            self.built[-1].close()
        if self.activation_checkpointing:
            # Recompute each decoder layer in backward: activations drop from O(layers) to O(1)
            # layers. The single process's rule (training.set_checkpointing): unlike HF's
            # gradient_checkpointing_enable it needs no training mode, which would switch on
            # dropout (OPT's 0.1) that the one-process run does not have.
            from trsp_ray.method.training import set_checkpointing

            set_checkpointing(model, True)
        stepper = DeepSpeedStepper(model, param_groups, ds_config=self.ds_config, rank=self.rank, world=self.world,
                                   objective=self.objective)
        if self.on_build is not None:
            self.on_build(stepper, len(self.built))
        self.built.append(stepper)
        return stepper


def gather_state_dict(model, *, rank: int) -> dict[str, torch.Tensor] | None:
    """The full state dict of a (possibly ZeRO-3 partitioned) model on rank 0, None elsewhere.

    One module at a time is gathered, so peak extra memory per rank is the largest module, and
    rank 0 ends up holding one CPU copy (what DeepSpeed's 16-bit gather on save also does).
    """
    out: dict[str, torch.Tensor] | None = {} if rank == 0 else None
    for prefix, module in model.named_modules():
        params = list(module.named_parameters(recurse=False))
        if not params:
            continue
        with gather_context([p for _, p in params]):
            if out is not None:
                for name, p in params:
                    out[f"{prefix}.{name}" if prefix else name] = p.detach().to("cpu", copy=True)
    if out is not None:  # persistent buffers only: the others are rebuilt from the config
        for prefix, module in model.named_modules():
            for name, buf in module.named_buffers(recurse=False):
                if name not in module._non_persistent_buffers_set:
                    out.setdefault(f"{prefix}.{name}" if prefix else name, buf.detach().to("cpu", copy=True))
    return out
