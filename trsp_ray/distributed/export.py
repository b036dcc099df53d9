"""Streaming export of a ZeRO-3 run: one unit gathered at a time, written straight to safetensors.

At 70B a whole-model gather would put ~140 GB on rank 0's host. Here every rank gathers one unit
at a time with `GatheredParameters` on that unit's parameters only: one kept decoder layer, or one
module outside the layers (embeddings, final norm, an untied lm_head). Dropped layers are never
gathered. Rank 0 appends each tensor to a pre-planned shard (shards.py) under the pruned model's
name (layer indices renumbered), taking its sha256 on the way. Then rank 0 writes config.json
(`surgery.shorten_config`), the generation config, the tokenizer and the manifest
(`export.pruned_manifest`), re-reads every tensor to check the checksums and, only when the
pruned model fits the host (`reload_max_gb`), reloads it with plain transformers and compares its
logits with those the ZeRO-3 model gave before the export, on the same device and dtype. It all
happens in a temp dir renamed into place at the end (`export.publish`): a failed export leaves
no output, and a failure on rank 0 never leaves the other ranks hanging in a gather.

Rank 0's extra host memory: on GPU the gather is in device memory and the host holds the one
tensor on its way to disk; on CPU runs it is the gathered unit, briefly twice over (torch's gloo
all_gather stages its output in a temporary): about one layer or the embedding, never the model.
`benchmarks/export_memory.py` measures it.

Timeouts. The per-unit gathers run on the training process group (Ray Train's default timeout is
30 min); the longest wait there is one unit's write on rank 0 (a 70B layer is 1.7 GB: about 35 s
even at 50 MB/s). The long waits, the other ranks idling while rank 0 re-reads the checksums and
reloads the model, happen on a separate gloo group whose timeout is sized from the bytes
(`timeout_for`): the default would kill a healthy 70B export on slow storage, and no timeout
would leave a dead rank 0 undetected.
"""

from __future__ import annotations

import contextlib
import copy
from dataclasses import dataclass, field

import torch

from trsp_ray.common.errors import TrspError
from trsp_ray.distributed.collectives import broadcast_object, close_group, host_group, rank_and_world

SLOW_STORAGE_BYTES_PER_S = 50e6  # a slow network filesystem; local NVMe is 20-100x faster


def plain_name(key: str, layers_path: str) -> str | None:
    """A gated model's parameter name as the plain model's (`<layers>.<i>.layer.x` -> `<layers>.<i>.x`);
    None for a gate scalar (gates are discarded at export, as `detach_gates` does)."""
    prefix = layers_path + "."
    if not key.startswith(prefix):
        return key
    index, _, rest = key[len(prefix):].partition(".")
    if rest == "gate":
        return None
    if rest.startswith("layer."):
        rest = rest[len("layer."):]
    return f"{prefix}{index}.{rest}"


def plain_state_dict(state: dict[str, torch.Tensor], layers_path: str) -> dict[str, torch.Tensor]:
    """`state` with every key mapped by `plain_name` (gate scalars dropped)."""
    return {name: value for key, value in state.items() if (name := plain_name(key, layers_path)) is not None}


@dataclass
class Unit:
    """What one gather brings in: (export name, parameter or buffer) pairs of one module."""

    label: str
    entries: list[tuple[str, torch.Tensor]] = field(default_factory=list)

    def params(self) -> list[torch.nn.Parameter]:
        return [t for _, t in self.entries if isinstance(t, torch.nn.Parameter)]


def _own_tensors(module, recurse: bool):
    yield from module.named_parameters(recurse=recurse, remove_duplicate=False)
    for prefix, sub in (module.named_modules() if recurse else [("", module)]):
        for name, buf in sub.named_buffers(recurse=False):
            if name not in sub._non_persistent_buffers_set:  # non-persistent ones are rebuilt from the config
                yield (f"{prefix}.{name}" if prefix else name), buf


def export_units(model, drop: list[int]) -> tuple[list[Unit], list[int], int]:
    """(units in model order, kept original indices, original layer count) of the pruned export.

    A tensor shared by two modules (lm_head tied to the embedding) is exported once, under its
    first name, as transformers' save_pretrained does.
    """
    from trsp_ray.models import families

    layers_path = families.family_of(model).layers_path
    layers = families.decoder_layers(model)
    total = len(layers)
    if any(not 0 <= i < total for i in drop) or len(set(drop)) != len(drop) or len(drop) >= total:
        raise TrspError(f"drop set {drop} is not valid for {total} layers; indices must be distinct, "
                        f"in [0, {total}), and at least one layer must remain")
    kept = [i for i in range(total) if i not in set(drop)]
    units, seen = [], set()

    def add(unit: Unit, items, rename) -> None:
        for key, tensor in items:
            name = rename(key)
            if name is not None and id(tensor) not in seen:
                seen.add(id(tensor))
                unit.entries.append((name, tensor))
        if unit.entries:
            units.append(unit)

    for prefix, module in model.named_modules():
        if prefix == layers_path:
            for new, old in enumerate(kept):
                add(Unit(f"layer {old} -> {new}"), _own_tensors(layers[old], recurse=True),
                    lambda key, old=old, new=new: _renumbered(key, layers_path=layers_path, old=old, new=new))
        elif not prefix.startswith(layers_path + "."):
            add(Unit(prefix or "root"), _own_tensors(module, recurse=False),
                lambda key, prefix=prefix: f"{prefix}.{key}" if prefix else key)
    return units, kept, total


def _renumbered(key: str, *, layers_path: str, old: int, new: int) -> str | None:
    """Export name of a tensor `key` (relative to decoder layer `old`) as part of layer `new`."""
    name = plain_name(f"{layers_path}.{old}.{key}", layers_path)
    return None if name is None else f"{layers_path}.{new}.{name[len(f'{layers_path}.{old}.'):]}"


def _shape(t: torch.Tensor) -> tuple[int, ...]:
    return tuple(t.ds_shape) if hasattr(t, "ds_shape") else tuple(t.shape)  # ZeRO-3 keeps the full shape aside


def _saved(model, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`tensors` under the names save_pretrained would write (transformers reverts the renamings it
    applies on load, e.g. GPT-NeoX's lm_head <-> embed_out); works on meta tensors too."""
    from transformers.core_model_loading import revert_weight_conversion

    return revert_weight_conversion(model, dict(tensors))


def plan_shards(model, units: list[Unit], *, max_shard_bytes: int):
    """The shards every rank agrees on, from shapes and dtypes alone (nothing gathered)."""
    from trsp_ray.distributed.shards import TensorSpec, plan_shards

    specs = []
    for unit in units:
        meta = {name: torch.empty(_shape(t), dtype=t.dtype, device="meta") for name, t in unit.entries}
        specs += [TensorSpec(name, tuple(t.shape), t.dtype) for name, t in _saved(model, meta).items()]
    return plan_shards(specs, max_shard_bytes=max_shard_bytes)


def gathered(params: list[torch.nn.Parameter]):
    """Full values of `params` inside the block on every rank, read-only (nothing is broadcast back)."""
    if not any(hasattr(p, "ds_id") for p in params):
        return contextlib.nullcontext()
    import deepspeed

    return deepspeed.zero.GatheredParameters(params, modifier_rank=None)


def timeout_for(nbytes: int, *, reload: bool) -> int:
    """Seconds the other ranks may wait for rank 0: write + checksum re-read (+ reload) of `nbytes`
    at SLOW_STORAGE_BYTES_PER_S, plus 10 minutes for the tokenizer, config and rename."""
    return int(600 + (3 if reload else 2) * nbytes / SLOW_STORAGE_BYTES_PER_S)


def _host_available_bytes() -> int:
    import psutil

    return psutil.virtual_memory().available


def reload_fits(nbytes: int, *, max_gb: float, device: torch.device) -> tuple[bool, str]:
    """Whether rank 0 may load the whole pruned model once more for the logit check: at most
    `max_gb` GiB and half of what the host (and the device) has free right now."""
    if nbytes > max_gb * 2**30:
        return False, f"skipped: {nbytes / 2**30:.1f} GiB > distributed.export_reload_max_gb={max_gb}"
    if nbytes > _host_available_bytes() / 2:
        return False, f"skipped: {nbytes / 2**30:.1f} GiB > half the host's available memory"
    if device.type == "cuda" and nbytes > torch.cuda.mem_get_info(device)[0] / 2:
        return False, f"skipped: {nbytes / 2**30:.1f} GiB > half the free memory of {device}"
    return True, "ran"


def _compute_device(model) -> torch.device:
    """Where forward runs: the accelerator when there is one (ZeRO-3 partitions may sit on the CPU
    under parameter offload), else where the parameters are."""
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return next(model.parameters()).device


@torch.no_grad()
def reference_logits(model, drop: list[int], *, vocab: int, device: torch.device) -> torch.Tensor:
    """Logits [1, 24, vocab] (fp32, CPU) of the pruned model computed by `model` itself: dropped
    layers bypassed, which equals removing them (tests/test_gates_surgery.py). Collective under
    ZeRO-3 (every rank runs the forward; the engine's hooks must still be installed). Leaves the
    dropped layers bypassed: the export is the model's last use."""
    from trsp_ray.method.gates import GatedLayer, attach_gates, detach_gates
    from trsp_ray.models import families
    from trsp_ray.run.export import probe_logits

    wrapped = all(isinstance(layer, GatedLayer) for layer in families.decoder_layers(model))
    gates = attach_gates(model)  # existing wrappers kept; gating, stage-2 scales and bypass cleared
    gates.set_bypass(drop)
    training = model.training
    model.eval()
    try:
        return probe_logits(model, vocab, device)[1]
    finally:
        model.train(training)
        if not wrapped:
            detach_gates(model)


def logit_atol(dtype: torch.dtype, reference: torch.Tensor) -> float:
    """fp32: the same forward on the same weights agrees to ~1e-6; 16-bit kernels may differ by a
    few units in the last place of the largest logit."""
    return 1e-5 if dtype == torch.float32 else 2e-2 * max(1.0, reference.abs().max().item())


def _broadcast(value, group):
    """Rank 0's `value` on every rank of the export's host group (None: one rank, nothing to send)."""
    return value if group is None else broadcast_object(value, group=group)


def export_streaming(model, *, tokenizer, drop: list[int], output: str, manifest: dict, max_shard_mb: float = 5000,
                     reload_max_gb: float = 16.0, timeout_s: int = 0, overwrite: bool = True) -> dict:
    """Every rank: export `model` (gated or plain, ZeRO-3 partitioned or not) without layers `drop`.

    `manifest` holds the run's fields (method, config, ...); the layer fields, checks and versions
    are added. Returns {"path", "export_check"} on every rank; if anything failed on rank 0, every
    rank raises and nothing exists at `output` (an old directory there is kept).
    """
    from trsp_ray.models import families

    rank, world = rank_and_world()
    units, kept, total = export_units(model, list(drop))
    shards = plan_shards(model, units, max_shard_bytes=int(max_shard_mb * 10**6))
    nbytes = sum(s.nbytes for s in shards)
    dtype = next(t.dtype for s in shards for t in s.tensors if t.dtype.is_floating_point)
    device = _compute_device(model)
    timeout = timeout_s or timeout_for(nbytes, reload=True)
    group = host_group(timeout) if world > 1 else None
    try:
        fits, note = _broadcast(reload_fits(nbytes, max_gb=reload_max_gb, device=device) if rank == 0 else None, group)
        vocab = families.text_config(model).vocab_size
        reference = reference_logits(model, drop, vocab=vocab, device=device) if fits else None
        job = _Rank0Export(model, shards=shards, output=output, overwrite=overwrite) if rank == 0 else None
        for unit in units:
            with gathered(unit.params()):
                if job is not None:
                    job.write(unit)
        if job is not None:
            job.finish(tokenizer=tokenizer, reference=reference, device=device, dtype=dtype, vocab=vocab,
                       kept=kept, total=total, drop=list(drop), manifest=manifest, reload_note=note,
                       timeout_s=timeout)
        # Every rank learns rank 0's outcome here, waiting at most `timeout` (see the module doc).
        outcome = _broadcast(job.outcome() if job is not None else None, group)
    finally:
        close_group(group)
    if job is not None and job.error is not None:
        raise job.error
    if "error" in outcome:
        raise RuntimeError(f"the export on rank 0 failed: {outcome['error']}")
    return outcome


class _Rank0Export:
    """Rank 0's side of the export. An error is kept, not raised, until every rank has finished
    the gathers (raising mid-stream would leave the others blocked in the next gather)."""

    def __init__(self, model, *, shards, output: str, overwrite: bool):
        from trsp_ray.common.atomic import staging_dir
        from trsp_ray.distributed.shards import ShardWriter
        from trsp_ray.run.export import check_output_dir

        self.model, self.shards, self.error, self.result, self.tmp, self.writer = model, shards, None, None, None, None
        try:
            self.target = check_output_dir(output, overwrite=overwrite)
            self.tmp = staging_dir(self.target)
            self.writer = ShardWriter(self.tmp, shards)
        except Exception as exc:
            self._fail(exc)

    def _fail(self, exc: BaseException) -> None:
        import shutil

        self.error = self.error or exc
        if self.writer is not None:
            self.writer.abort()
        if self.tmp is not None:
            shutil.rmtree(self.tmp, ignore_errors=True)

    def write(self, unit: Unit) -> None:
        if self.error is not None:
            return
        try:
            for name, tensor in _saved(self.model, {n: t.detach() for n, t in unit.entries}).items():
                self.writer.write(name, tensor)
        except BaseException as exc:
            self._fail(exc)
            if not isinstance(exc, Exception):
                raise

    def finish(self, *, tokenizer, reference, device, dtype, vocab: int, kept: list[int], total: int,
               drop: list[int], manifest: dict, reload_note: str, timeout_s: int) -> None:
        from trsp_ray.common.atomic import publish
        from trsp_ray.distributed.shards import verify_shards
        from trsp_ray.run.export import pruned_manifest, write_manifest

        if self.error is not None:
            return
        try:
            self.writer.close()
            check = {"tensors": verify_shards(self.tmp, self.shards, self.writer.digests), "checksum": "sha256",
                     "bytes": sum(s.nbytes for s in self.shards), "shards": len(self.shards),
                     "largest_shard_bytes": max(s.nbytes for s in self.shards), "reload_check": reload_note,
                     "timeout_s": timeout_s}
            self._write_config(kept=kept, total=total, dtype=dtype)
            if tokenizer is not None:
                tokenizer.save_pretrained(self.tmp)
            if reference is not None:
                check.update(self._reload_check(reference, device=device, dtype=dtype, vocab=vocab))
            run = dict(manifest)
            fields = pruned_manifest(method=run.pop("method", None), drop=drop, num_layers_original=total,
                                     config=run.pop("config", {}), metrics=run.pop("metrics", {}), **run,
                                     export_check=check, exported_from="deepspeed zero3, streamed unit by unit")
            write_manifest(fields, self.tmp)
            publish(self.tmp, self.target)
            self.result = {"path": str(self.target), "export_check": check}
        except Exception as exc:
            self._fail(exc)

    def _write_config(self, *, kept: list[int], total: int, dtype: torch.dtype) -> None:
        """config.json of the pruned model (what save_pretrained would write after remove_layers)."""
        from trsp_ray.method.surgery import shorten_config

        config = copy.deepcopy(self.model.config)
        shorten_config(config, kept=kept, total=total)
        config.dtype = str(dtype).split(".")[1]
        config.architectures = [type(self.model).__name__]
        config.save_pretrained(self.tmp)
        if self.model.can_generate():
            self.model.generation_config.save_pretrained(self.tmp)

    def _reload_check(self, reference: torch.Tensor, *, device, dtype, vocab: int) -> dict:
        from transformers import AutoModelForCausalLM

        from trsp_ray.run.export import probe_logits

        reloaded = AutoModelForCausalLM.from_pretrained(self.tmp, dtype=dtype).to(device).eval()
        got = probe_logits(reloaded, vocab, device)[1]
        del reloaded
        diff, atol = (got - reference).abs().max().item(), logit_atol(dtype, reference)
        if not diff <= atol:
            raise RuntimeError(f"the exported model's logits differ from the ZeRO-3 model's by {diff:.3g} "
                               f"(tolerance {atol:.3g} for {dtype})")
        return {"max_abs_logit_diff": diff, "atol": atol}

    def outcome(self) -> dict:
        return self.result if self.error is None else {"error": f"{type(self.error).__name__}: {self.error}"}
