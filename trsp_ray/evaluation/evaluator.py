"""Evaluate one candidate (an exported model directory): held-out perplexity, zero-shot tasks, speed.

`Evaluator` is plain Python; the pool runs it inside Ray actors, tests run it directly. Settings
cross the Ray boundary as a plain dict (`EvalSettings.to_dict` / `from_dict`).
"""

from __future__ import annotations

import json
import os
import socket
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from trsp_ray.common.errors import TrspError
from trsp_ray.common.logs import log
from trsp_ray.config.sections import DataConfig
from trsp_ray.evaluation.harness import check_limit
from trsp_ray.evaluation.speed import SpeedSettings
from trsp_ray.evaluation.tasks import DEFAULT_TASKS, STOCK_PREFIX, check_task_names

MANIFEST = "trsp_ray.json"
_WEIGHTS = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
            "pytorch_model.bin.index.json")


@dataclass(frozen=True)
class EvalSettings:
    """What to measure for every candidate. `tasks=()` skips zero-shot; `dense` enables speed-ups."""

    tasks: tuple[str, ...] = DEFAULT_TASKS
    limit: int | None = None  # items per task (None = the whole split)
    batch_size: int = 8  # lm-eval batch
    ppl: bool = True
    eval_text: str | None = None  # any text file; default: the Wikipedia held-out articles
    # `prune`'s held-out windows (data.eval_seqlen, data.eval_max_windows): `eval` of an export scores
    # what `prune` printed for it
    ppl_seqlen: int = DataConfig.eval_seqlen
    ppl_windows: int | None = DataConfig.eval_max_windows
    speed: SpeedSettings | None = field(default_factory=SpeedSettings)
    dense: str | None = None  # dense model dir timed beside each candidate (speed-up vs L / L_kept)
    dtype: str = "float32"
    items: bool = False  # keep per-item results (paired comparisons read them)

    def __post_init__(self):
        object.__setattr__(self, "tasks", tuple(check_task_names(list(self.tasks))))
        check_limit(self.limit)
        for name in ("batch_size", "ppl_seqlen", "ppl_windows"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value <= 0):
                raise TrspError(f"{name}={value!r} is invalid; pass a positive integer")
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise TrspError(f"dtype={self.dtype!r} is invalid; use float32, bfloat16 or float16")
        if self.dense is not None:
            check_candidate(self.dense)
        if self.eval_text is not None and not Path(self.eval_text).expanduser().is_file():
            raise TrspError(f"eval_text {self.eval_text!r} is not a file; pass a UTF-8 text file for PPL")

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "EvalSettings":
        speed = d.get("speed")
        return cls(**{**d, "tasks": tuple(d["tasks"]), "speed": SpeedSettings(**speed) if speed else None})


def check_candidate(path: str) -> Path:
    """A candidate directory that looks loadable, else a one-line TrspError naming what is missing."""
    p = Path(path).expanduser()
    if not p.is_dir():
        raise TrspError(f"candidate {path!r} is not a directory; pass an exported model directory")
    if not (p / "config.json").is_file():
        raise TrspError(f"candidate {path!r} has no config.json; pass an exported Hugging Face model directory")
    if not any((p / w).is_file() for w in _WEIGHTS):
        raise TrspError(f"candidate {path!r} has no weights ({' or '.join(_WEIGHTS[::2])})")
    return p.resolve()


def read_manifest(path: Path) -> dict | None:
    """The export manifest if present (it is optional: any HF directory can be evaluated)."""
    f = path / MANIFEST
    if not f.is_file():
        return None
    try:
        return json.loads(f.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise TrspError(f"candidate {str(path)!r} has a broken {MANIFEST} ({e.msg} at line {e.lineno})") from None


def load_candidate(path: str, *, dtype: str = "float32"):
    """(model in eval mode on the actor's device, tokenizer) from an exported directory."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    p = check_candidate(path)
    kwargs = {"dtype": getattr(torch, dtype)}
    if torch.cuda.device_count() > 1:  # a candidate given several GPUs is split across them
        kwargs["device_map"] = "auto"
    try:
        model = AutoModelForCausalLM.from_pretrained(p, **kwargs).eval()
        tokenizer = AutoTokenizer.from_pretrained(p)
    except Exception as e:  # noqa: BLE001 - any load failure is this candidate's, reported on one line
        first = (str(e).strip().splitlines() or [""])[0][:200]
        raise TrspError(f"candidate {path!r} does not load: {type(e).__name__}: {first}") from None
    if "device_map" not in kwargs and torch.cuda.is_available():
        model.to("cuda")
    return model, tokenizer


def other_windows(manifest: dict | None, coverage: dict) -> str:
    """A note when the export's manifest says `prune` scored other held-out windows than these (another
    text, length or count): its PPL and this one are then not the same figure."""
    theirs = ((manifest or {}).get("metrics") or {}).get("heldout_windows") or {}
    keys = ("source", "seqlen", "windows", "bos")
    if not theirs or all(theirs.get(k) == coverage[k] for k in keys if k in theirs):
        return ""
    what = ", ".join(f"{k} {theirs.get(k)!r}" for k in keys if theirs.get(k) != coverage[k])
    return f"; prune scored other held-out windows ({what}): its PPL is not comparable with this one"


class Evaluator:
    """Scores candidates one at a time; keeps the dense reference and tokenized text between them."""

    def __init__(self, settings: dict, *, threads: int | None = None):
        import torch

        if threads:
            torch.set_num_threads(threads)
        self.threads = torch.get_num_threads()
        self.settings = EvalSettings.from_dict(settings)
        self._dense = None
        self._text_ids: dict[tuple, object] = {}
        self._task_dir = None
        offline = [t for t in self.settings.tasks if not t.startswith(STOCK_PREFIX)]
        if offline:  # written on the actor's own node: absolute paths must exist where lm-eval runs
            from trsp_ray.evaluation.tasks import write_task_dir

            self._task_dir = write_task_dir(offline)

    def where(self) -> str:
        return f"{socket.gethostname()}:{os.getpid()} ({self.threads} threads)"

    def _heldout_windows(self, tokenizer):
        """The held-out windows: `prune`'s reader (data.heldout), spread over the held-out documents,
        BOS first where the tokenizer adds one."""
        from trsp_ray.data.domains import load_texts
        from trsp_ray.data.heldout import text_windows

        key = (len(tokenizer), tuple(tokenizer("Held-out text, 2024.").input_ids))
        if key not in self._text_ids:
            s = self.settings
            self._text_ids[key] = text_windows(tokenizer, load_texts(eval_text=s.eval_text), seqlen=s.ppl_seqlen,
                                               max_windows=s.ppl_windows)
        return self._text_ids[key]

    def _speed(self, model) -> dict:
        from trsp_ray.evaluation.speed import compare_speed, measure_speed

        s = self.settings
        if s.dense is None:
            return measure_speed(model, s.speed)
        if self._dense is None:
            self._dense, _ = load_candidate(s.dense, dtype=s.dtype)
        return compare_speed(self._dense, model, s.speed)

    def evaluate(self, path: str) -> dict:
        """Everything measured for one candidate, as a plain dict (see report.py for the columns)."""
        from trsp_ray.data.perplexity import nlls_of, ppl_of
        from trsp_ray.evaluation.harness import lm_eval_version, run_tasks

        s, start = self.settings, time.perf_counter()
        name = Path(path).name
        model, tokenizer = load_candidate(path, dtype=s.dtype)
        manifest = read_manifest(Path(path).expanduser())
        out = {"model": str(Path(path).expanduser().resolve()), "name": name, "status": "ok",
               "layers": model.config.num_hidden_layers, "manifest": manifest, "where": self.where(),
               "lm_eval_version": lm_eval_version(), "tasks": {}, "ppl": None, "speed": None}
        if manifest and manifest.get("num_layers_original"):
            out["layers_original"] = int(manifest["num_layers_original"])
        if s.ppl:
            held = self._heldout_windows(tokenizer)
            out["ppl"], out["heldout_windows"] = ppl_of(nlls_of(model, held.windows)), held.coverage()
            log(f"{name}: held-out PPL {out['ppl']:.2f} ({time.perf_counter() - start:.1f} s)"
                + other_windows(manifest, held.coverage()))
        if s.tasks:
            scored = run_tasks(model, tokenizer, tasks=list(s.tasks), limit=s.limit,
                               batch_size=s.batch_size, task_dir=self._task_dir, items=s.items)
            out["tasks"] = scored["tasks"]
            log(f"{name}: {len(s.tasks)} tasks scored ({time.perf_counter() - start:.1f} s)")
        if s.speed is not None:
            out["speed"] = self._speed(model)
        out["seconds"] = time.perf_counter() - start
        return out
