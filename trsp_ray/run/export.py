"""Export a pruned model as a plain Hugging Face directory, atomically, with a `trsp_ray.json` manifest.

The directory is written under a temp name beside the target and renamed into place only after it
has been reloaded with plain `from_pretrained` and its logits compared with the in-memory model:
an interrupted or failed export leaves no model directory behind.
"""

from __future__ import annotations

import contextlib
import os
import platform
import shutil
import sys
from pathlib import Path

import torch

from trsp_ray.common import atomic
from trsp_ray.common.errors import TrspError

MANIFEST = "trsp_ray.json"


def versions() -> dict[str, str]:
    import importlib.metadata as md

    out = {"python": platform.python_version()}
    for pkg in ("trsp_ray", "torch", "transformers", "deepspeed", "ray", "lm_eval", "mlflow", "peft"):
        try:
            out[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            pass
    return out


def check_output_dir(output: str, *, overwrite: bool, need_bytes: float = 0) -> Path:
    """Validate an export target before any work starts: not an existing non-empty directory (unless
    `overwrite`), under a directory (not a file) this process can write, on a disk with `need_bytes`
    free. Returns the resolved target; a one-line TrspError names what is wrong."""
    target = Path(output).expanduser().resolve()
    if target.exists() and not overwrite and (not target.is_dir() or any(target.iterdir())):
        raise TrspError(f"output {output!r} already exists and is not empty; choose a new path or pass --overwrite")
    base = target.parent  # the nearest existing folder above the target: what the export creates it in
    while not base.exists():
        base = base.parent
    if not base.is_dir():
        raise TrspError(f"output {output!r} is under {str(base)!r}, a file, not a directory; "
                        f"choose a path under a directory")
    if not _can_create_in(base):
        raise TrspError(f"output {output!r} cannot be written: {str(base)!r} is not writable; "
                        f"choose a directory you can write to")
    free = shutil.disk_usage(base).free
    if free < need_bytes:
        raise TrspError(f"output {output!r}: the export needs ~{need_bytes / 1e9:.2f} GB but {str(base)!r} has "
                        f"{free / 1e9:.2f} GB free; free some space or choose another disk")
    return target


def check_work_dir(path: str, *, flag: str) -> Path:
    """A resumable working folder (a search's --search-dir, a reproduction's --out): it may exist
    with earlier results in it, but it or the nearest folder above it must be a writable directory.
    Returns the resolved path; a one-line TrspError naming the flag and the value otherwise."""
    target = Path(path).expanduser().resolve()
    if target.exists() and not target.is_dir():
        raise TrspError(f"{flag} {path!r} is a file, not a directory; choose a directory path")
    base = target
    while not base.exists():
        base = base.parent
    if not base.is_dir():
        raise TrspError(f"{flag} {path!r} is under {str(base)!r}, a file, not a directory; "
                        "choose a path under a directory")
    if not _can_create_in(base):
        raise TrspError(f"{flag} {path!r} cannot be written: {str(base)!r} is not writable; "
                        "choose a directory you can write to")
    return target


def _can_create_in(directory: Path) -> bool:
    """Whether an entry can be created in `directory`: os.access says yes to root on any folder and
    knows nothing of read-only mounts, so create (and remove) one."""
    probe = directory / f".trsp-ray-write-check-{os.getpid()}"
    try:
        probe.mkdir()
    except FileExistsError:
        return True
    except OSError:
        return False
    probe.rmdir()
    return True


# Tokenizer files, config and manifest beside the weights: a few MB; this leaves room for them.
EXPORT_EXTRA_BYTES = 64 * 2**20


def planned_export_bytes(plan, *, ratio: float) -> float:
    """Bytes the export of a run will write, from its memory plan (planner `Plan` or `SinglePlan`):
    the pruned model's parameters (stage1.n_drop_for decoder layers fewer) in the plan's dtype."""
    from trsp_ray.method.stage1 import n_drop_for

    s = plan.shape
    return (s.params - n_drop_for(ratio, s.layers) * s.layer_params) * plan.setup.dtype_bytes + EXPORT_EXTRA_BYTES


def check_export_target(output: str | None, *, overwrite: bool, plan, ratio: float) -> Path | None:
    """The check every job that writes an export runs at its start (trsp-ray prune, jobs/prune_70b.py):
    `check_output_dir` with the free disk the export needs as planned. None when nothing is exported."""
    if not output:
        return None
    return check_output_dir(output, overwrite=overwrite, need_bytes=planned_export_bytes(plan, ratio=ratio))


# What every `trsp_ray.json` holds, whichever path wrote the weights (single process, Ray Train,
# search trial, reproduction cell, benchmark row): the reproduction table and the evaluator read them.
MANIFEST_KEYS = ("method", "dropped_layers", "drop_order", "num_layers_original", "num_layers_kept", "kept_layers",
                 "config", "metrics")


def pruned_manifest(*, method: str | None, drop: list[int], num_layers_original: int, config: dict | None = None,
                    metrics: dict | None = None, **extra) -> dict:
    """The one builder of export manifests: the layer fields follow from `drop` (in drop order) and
    the original layer count, so no path can write a kept count that disagrees with its drop set;
    `extra` adds path-specific keys (export checks, the search trial, ...)."""
    dropped = [int(i) for i in drop]
    bad = [i for i in dropped if not 0 <= i < num_layers_original]
    if bad or len(set(dropped)) != len(dropped):
        raise TrspError(f"drop set {dropped} is not distinct layers of a {num_layers_original}-layer model")
    kept = [i for i in range(num_layers_original) if i not in set(dropped)]
    clash = set(extra) & set(MANIFEST_KEYS)
    if clash:
        raise TrspError(f"manifest extras {sorted(clash)} would overwrite the builder's own fields")
    return {"method": method, "dropped_layers": dropped, "drop_order": dropped,
            "num_layers_original": num_layers_original, "num_layers_kept": len(kept), "kept_layers": kept,
            "config": config or {}, "metrics": metrics or {}, **extra}


def write_manifest(manifest: dict, directory: Path) -> None:
    atomic.write_json(Path(directory) / MANIFEST, {**manifest, "versions": versions()})


@torch.no_grad()
def probe_logits(model, vocab: int, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """(probe ids [1, 24], fp32 logits on CPU [1, 24, vocab]) of `model` on a fixed random batch,
    computed on `device` (default: where the parameters are)."""
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (1, 24), generator=gen)
    device = device if device is not None else next(model.parameters()).device
    return ids, model(input_ids=ids.to(device), use_cache=False).logits.float().cpu()


def logit_tolerance(dtype: torch.dtype, expected: torch.Tensor, *, atol: float) -> float:
    """How far the reloaded model's logits may be from the in-memory ones on the same device.

    The weights are bit-identical and the kernels the same, so fp32 gets `atol`. A 16-bit model
    can still meet a kernel that rounds differently for a different memory layout: two units in
    the last place of the dtype at the logits' scale."""
    if dtype == torch.float32:
        return atol
    return max(atol, 2 * torch.finfo(dtype).eps * expected.abs().max().item())


def verify_export(model, directory: Path, *, atol: float = 1e-5) -> dict:
    """Reload `directory` with plain from_pretrained on `model`'s device and dtype and compare probe
    logits computed there (a CUDA model against a CPU reload would measure the devices, not the
    export). When the device lacks room for the reload beside the model, the model waits in host
    memory meanwhile, so the device never holds two copies."""
    from transformers import AutoModelForCausalLM

    device = next(model.parameters()).device
    vocab = model.get_input_embeddings().weight.shape[0]
    ids, expected = probe_logits(model, vocab)
    parked = device.type == "cuda" and not _room_for(model, device)
    if parked:
        model.to("cpu")
    try:
        reloaded = AutoModelForCausalLM.from_pretrained(directory, dtype=model.dtype).to(device).eval()
        _, got = probe_logits(reloaded, vocab)
        del reloaded
    finally:
        if parked:
            model.to(device)
    return {"max_abs_logit_diff": (got - expected).abs().max().item(),
            "atol": logit_tolerance(model.dtype, expected, atol=atol), "device": str(device),
            "dtype": str(model.dtype).removeprefix("torch.")}


def _room_for(model, device: torch.device) -> bool:
    need = sum(p.numel() * p.element_size() for p in model.parameters())
    free, _ = torch.cuda.mem_get_info(device)
    return free > 1.2 * need + 2**30


@contextlib.contextmanager
def _no_deepspeed_import():
    """save_pretrained unwraps the model through accelerate, which imports deepspeed whenever it is
    installed (~5 s, and its accelerator banner on CPU) only to test isinstance(model, DeepSpeedEngine).
    A process that never imported deepspeed holds no such engine, so the test is skipped there."""
    other = None
    if "deepspeed" not in sys.modules:
        try:
            import accelerate.utils.other as other
        except ImportError:
            pass
    if other is None or not hasattr(other, "is_deepspeed_available"):
        yield
        return
    saved = other.is_deepspeed_available
    other.is_deepspeed_available = lambda: False
    try:
        yield
    finally:
        other.is_deepspeed_available = saved


def export_model(model, tokenizer, output: str, *, manifest: dict, overwrite: bool = False,
                 verify: bool = True, atol: float = 1e-5) -> Path:
    """Save `model` (+ tokenizer) to `output` through a temp dir + rename; returns the final path.

    With `verify`, the temp copy is reloaded with AutoModelForCausalLM on the model's device in
    the model's dtype and must give logits within `logit_tolerance` of the in-memory model on a
    probe batch, else nothing is renamed into place; the manifest records the check.
    """
    target = check_output_dir(output, overwrite=overwrite)
    with atomic.directory(target) as tmp:
        with _no_deepspeed_import():
            model.save_pretrained(tmp)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        if verify:
            check = verify_export(model, tmp, atol=atol)
            manifest = {**manifest, "export_check": check}
            if check["max_abs_logit_diff"] > check["atol"]:
                raise RuntimeError(f"exported model differs from the in-memory model (max |dlogit| "
                                   f"{check['max_abs_logit_diff']:.3g} > {check['atol']:.3g} on {check['device']})")
        write_manifest(manifest, tmp)
    return target
