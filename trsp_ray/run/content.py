"""What a stored result was computed from, and the one key every store names it by.

A stored result (a stage-1 drop order, a teacher's top-k logits, a benchmark row, the dense
model's reference scores) may be read back only by a run that would compute the same result. It
depends on the settings that produce it (`what`, each store says which), on the bytes it read
(the model's files, every text: calibration, held-out domains, a user's files, task data) and on
the code beneath it: the library versions (torch, transformers, lm-eval, deepspeed) and the device
and dtype the run resolves to (`auto` is bf16 on a GPU and fp32 on a CPU: one config, two
results). `store_key` joins the three; a change of any gives another key, never a stale result.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

from trsp_ray.common.digest import content_key, file_digest

# the libraries whose versions change what a forward, a training step or a task score computes
LIBRARIES = ("torch", "transformers", "lm-eval", "deepspeed")


def checkpoint_root(checkpoint_dir: str | None) -> str:
    """Where a run's stores and checkpoints live (stage 1, the teacher, a merge's pairs, the audition's
    trials): the config's `checkpoint_dir`, else $TRSP_RAY_CHECKPOINT_DIR, by default ./runs/checkpoints
    of the working directory."""
    return checkpoint_dir or os.environ.get("TRSP_RAY_CHECKPOINT_DIR") or str(Path.cwd() / "runs" / "checkpoints")


def new_folders(path: Path) -> list[Path]:
    """The folders of `path` and above it that do not exist yet, deepest first: what a store's first write
    makes, and `remove_store` removes again."""
    return [p for p in (path, *path.parents) if not p.exists()]


def remove_store(path: Path, made: list[Path]) -> None:
    """Remove a finished store's folder `path`, the folder holding it where no other store is in it, and
    the folders above that its first write made (`made`: new_folders before that write), where empty."""
    import contextlib
    import shutil

    shutil.rmtree(path, ignore_errors=True)
    for folder in dict.fromkeys([path.parent, *made[2:]]):
        with contextlib.suppress(OSError):
            folder.rmdir()


def model_fingerprint(model: str) -> str:
    """What identifies a model's weights beyond its name: size + mtime of config and weight files
    (cheap, and changes whenever the weights are rewritten); a hub id with its revision."""
    from trsp_ray.data import assets

    path = Path(assets.resolve_model(model))
    if not path.is_dir():
        return f"hub:{model}@{hub_revision(model)}"
    h = hashlib.sha256()
    for f in sorted(path.glob("*.json")) + sorted(path.glob("*.safetensors")) + sorted(path.glob("*.bin")):
        st = f.stat()
        h.update(f"{f.name}:{st.st_size}:{int(st.st_mtime)}".encode())
    return h.hexdigest()[:16]


def hub_revision(repo_id: str) -> str:
    """The commit a hub id resolves to now: the name of the snapshot directory its config.json is
    read from (`hf download` and from_pretrained name it by the commit hash, transformers'
    `config._commit_hash`)."""
    from trsp_ray.data import hub

    return hub.config_file(repo_id).parent.name


def text_fingerprint(path: str | None, calib_mix: str | None = None) -> str:
    """The bytes of a calibration text file, or the mixture's sources and weights (a file source by
    its bytes, a domain by its text: domains.text_key, a hash of its source files and split rule)."""
    from trsp_ray.data import domains

    if path:
        return file_digest(path)[:16]
    mix = domains.parse_mix(calib_mix or domains.DEFAULT_MIX)
    return content_key({(f"{s}:{domains.text_key(s)}" if s in domains.DOMAINS else text_fingerprint(s)): w
                        for s, w in mix.items()})


# The data settings that make the calibration windows: what names the text and shapes its windows
CALIBRATION_DATA = ("calib_text", "calib_mix", "seqlen", "batch_size")


def calibration_content(data: dict) -> dict:
    """The data settings (a RunConfig dict's "data") that make the calibration windows (CALIBRATION_DATA),
    what a stage-1 result, a selection or a merge is keyed by beside the text's bytes: a calibration file
    replaces the mixture, so the mixture is left out beside one."""
    out = {k: data[k] for k in CALIBRATION_DATA}
    if data.get("calib_text"):
        out["calib_mix"] = None
    return out


def data_fingerprint(*, model: str, calib_text: str | None, calib_mix: str | None = None) -> str:
    """Fingerprint of the model files and the calibration data: what a selection's key needs beyond
    the config."""
    return content_key({"model": model_fingerprint(model), "calib": text_fingerprint(calib_text, calib_mix)})


def eval_fingerprint(data: dict) -> dict:
    """The bytes of every held-out text a run's `data` settings score: the evaluation text (a user's
    file, else the held-out Wikipedia articles) and each scored domain's text."""
    from trsp_ray.data import domains

    held = file_digest(data["eval_text"]) if data.get("eval_text") else domains.text_key("wiki")
    return {"eval_text": held,
            "domains": {n: domains.text_key(n) for n in domains.eval_domain_names(data.get("eval_domains", "all"))}}


def run_inputs(cfg: dict, *, evaluation: bool = True, files: tuple = ()) -> str:
    """Fingerprint of everything a run of `cfg` (a RunConfig dict) reads: the model's files, the
    calibration text, with `evaluation` the held-out texts, and the bytes of `files` (task data)."""
    d = cfg["data"]
    out = {"model": model_fingerprint(cfg["model"]), "calib": text_fingerprint(d.get("calib_text"), d.get("calib_mix")),
           "files": sorted(file_digest(f) for f in files)}
    if evaluation:
        out["eval"] = eval_fingerprint(d)
    return content_key(out, length=24)


def library_versions() -> dict[str, str | None]:
    """{library: installed version or None} of LIBRARIES."""
    from importlib import metadata

    out = {}
    for name in LIBRARIES:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    return out


def precision(cfg: dict) -> dict[str, str]:
    """{device type, dtype} that `cfg`'s device and dtype resolve to on this machine (workbench's
    rules: auto is cuda when one is visible; dtype auto is bf16 or fp16 on a GPU, fp32 on a CPU)."""
    import torch

    from trsp_ray.run.workbench import DTYPES, resolve_dtype

    device = cfg.get("device", "auto")
    kind = ("cuda" if torch.cuda.is_available() else "cpu") if device == "auto" else torch.device(device).type
    if kind == "cuda" and not torch.cuda.is_available():
        return {"device": kind, "dtype": str(cfg.get("dtype", "auto"))}  # refused where the run starts
    dtype = resolve_dtype(cfg.get("dtype", "auto"), torch.device(kind))
    return {"device": kind, "dtype": next(name for name, dt in DTYPES.items() if dt == dtype)}


def store_key(what: dict, *, cfg: dict, data: str, length: int = 16) -> str:
    """The key of a stored result: `what` (the settings it depends on), `data` (a fingerprint of the
    bytes it read: data_fingerprint, run_inputs), the library versions and the precision `cfg`
    resolves to here. The one key function of every store."""
    return content_key({"what": what, "data": data, "libraries": library_versions(), "precision": precision(cfg)},
                       length=length)
