"""Models by name: a local directory, a config.json file, or a Hugging Face hub id (owner/name).

    path = config_file("meta-llama/Llama-2-70b-hf")   # the cached (or downloaded) config.json

A hub id is read through `huggingface_hub`, which looks in the local cache first
($HF_HUB_CACHE, else $HF_HOME/hub) and reaches the hub only when HF_HUB_OFFLINE is unset. Only
config.json is fetched here: the planner needs nothing else, and the workers load the weights
themselves with `from_pretrained`, from the same cache (cluster/ puts HF_HOME on shared storage).
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

from trsp_ray.common.errors import TrspError

_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def is_hub_id(name: str) -> bool:
    """owner/name, not an existing path and not path-like (./x, /x, ~/x, a/b/c)."""
    return bool(_HUB_ID.match(name)) and not Path(name).expanduser().exists()


def hub_cache_dir() -> str:
    """The cache huggingface_hub reads, resolved now (its constants are fixed at import)."""
    if os.environ.get("HF_HUB_CACHE"):
        return os.environ["HF_HUB_CACHE"]
    home = os.environ.get("HF_HOME") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "huggingface")
    return os.path.join(home, "hub")


def offline() -> bool:
    value = os.environ.get("HF_HUB_OFFLINE") or os.environ.get("TRANSFORMERS_OFFLINE") or ""
    return value.strip().lower() in ("1", "true", "yes", "on")


def config_file(name: str) -> Path:
    """config.json of a model directory, of a config file path, or of a hub id (cache, then hub)."""
    path = Path(name).expanduser()
    if path.is_file():
        return path
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise TrspError(f"model directory {name!r} has no config.json; pass a Hugging Face model directory")
        return path / "config.json"
    if not is_hub_id(name):
        raise TrspError(f"model config {name!r} not found: not a file, not a directory, not a hub id (owner/name)")
    return _hub_config(name)


def _hub_config(repo_id: str) -> Path:
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import (
        EntryNotFoundError,
        GatedRepoError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
    )

    cache = hub_cache_dir()
    try:
        return Path(hf_hub_download(repo_id, "config.json", cache_dir=cache, local_files_only=offline()))
    except LocalEntryNotFoundError as exc:  # not cached, and offline or the hub unreachable (before its parent class)
        why = "HF_HUB_OFFLINE=1" if offline() else f"the hub is not reachable ({type(exc).__name__})"
        raise TrspError(f"model {repo_id!r} is not in the Hugging Face cache {cache} and {why}; run "
                        f"`hf download {repo_id}` with HF_HOME on storage every node sees, or pass a local "
                        f"model directory") from None
    except GatedRepoError:
        raise TrspError(f"model {repo_id!r} is gated on the hub; set HF_TOKEN to an account with access, "
                        f"or pass a local model directory") from None
    except RepositoryNotFoundError:
        raise TrspError(f"model {repo_id!r} is not on the hub (or needs HF_TOKEN); check the id or pass a local "
                        f"model directory") from None
    except EntryNotFoundError:
        raise TrspError(f"model {repo_id!r} has no config.json on the hub; pass a Hugging Face causal-LM") from None
    except (OSError, ValueError) as exc:
        raise TrspError(f"model {repo_id!r}: config.json could not be read from the Hugging Face cache {cache} or "
                        f"the hub ({type(exc).__name__}); pass a local model directory") from None


def read_config(name: str) -> dict:
    """The parsed config.json of `name` (see config_file)."""
    path = config_file(name)
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise TrspError(f"model config {str(path)!r} is not readable JSON ({exc}); pass a config.json") from None
