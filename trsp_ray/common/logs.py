"""Progress output: every module logs through the one `trsp_ray` logger.

A line reads `[trsp_ray HH:MM:SS] message` on stdout, as the README shows it. On a multi-process
run (Ray Train workers, torch.distributed) only rank 0 prints progress; the other ranks still print
warnings and errors, so a failure on any rank is seen. `TRSP_RAY_LOG_LEVEL` (e.g. WARNING, DEBUG)
changes how much is printed; an application that configures `logging` itself can attach its own
handlers to the `trsp_ray` logger.
"""

from __future__ import annotations

import logging
import os
import sys

LOGGER_NAME = "trsp_ray"
_FORMAT = "[trsp_ray %(asctime)s] %(message)s"


def rank() -> int:
    """This process's rank: torch.distributed's when a process group is up, else the launcher's
    RANK variable (Ray Train and torchrun set it), else 0."""
    torch = sys.modules.get("torch")  # never import torch just to log
    if torch is not None:
        dist = torch.distributed
        if dist.is_available() and dist.is_initialized():
            return dist.get_rank()
    try:
        return int(os.environ.get("RANK", "0"))
    except ValueError:
        return 0


class _RankZeroProgress(logging.Filter):
    """Drop records below WARNING on every rank but 0 (evaluated per record: the rank is known only
    once a worker has joined its process group)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= logging.WARNING or rank() == 0


class _StdoutHandler(logging.StreamHandler):
    """Writes to whatever sys.stdout is at the time of the record (pytest and Ray swap it)."""

    def __init__(self):
        super().__init__(sys.stdout)

    def emit(self, record: logging.LogRecord) -> None:
        self.stream = sys.stdout
        super().emit(record)


def logger() -> logging.Logger:
    """The `trsp_ray` logger, set up on first use (one stdout handler, INFO, rank-0 progress)."""
    log_ = logging.getLogger(LOGGER_NAME)
    if not getattr(log_, "_trsp_ray_ready", False):
        handler = _StdoutHandler()
        handler.setFormatter(logging.Formatter(_FORMAT, datefmt="%H:%M:%S"))
        handler.addFilter(_RankZeroProgress())
        log_.addHandler(handler)
        level = os.environ.get("TRSP_RAY_LOG_LEVEL", "INFO").upper()
        log_.setLevel(level if isinstance(logging.getLevelName(level), int) else "INFO")
        log_.propagate = False  # one line per message, whatever the root logger does
        log_._trsp_ray_ready = True
    return log_


def log(msg: str) -> None:
    """One progress line."""
    logger().info(msg)


def warn(msg: str) -> None:
    """A warning every rank prints."""
    logger().warning(msg)


class _DropLine(logging.Filter):
    """Drop records whose message starts with `prefix` (a library's banner, not its warnings)."""

    def __init__(self, prefix: str):
        super().__init__()
        self.prefix = prefix

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(self.prefix)


def quiet_libraries(*, verbose: bool = False) -> None:
    """Third-party progress bars and banners off in trsp_ray's own runs (`--verbose` keeps them):
    transformers' and the hub's bars ("Loading weights", "Writing model shards"), MLflow's INFO lines,
    DeepSpeed's "Setting accelerator to CPU" banner; Ray prints each worker's lines as they are, without
    its dedup hints. Library warnings and trsp_ray's own progress lines stay. Set through environment
    variables where a library reads one (so processes started from this one inherit them) and on the
    libraries already imported; a variable the user set wins."""
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")  # rank 0 alone prints progress: nothing to deduplicate
    if verbose:
        return
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")  # transformers' bars follow the hub's switch
    os.environ.setdefault("TQDM_DISABLE", "1")  # every other tqdm bar (lm-eval's requests, datasets' maps)
    os.environ.setdefault("MLFLOW_LOGGING_LEVEL", "WARNING")
    if "transformers" in sys.modules:
        sys.modules["transformers"].utils.logging.disable_progress_bar()
    if "tqdm" in sys.modules:  # imported already: tqdm read TQDM_DISABLE when it was imported
        _default_tqdm_off(sys.modules["tqdm"].std.tqdm)
    if "mlflow" in sys.modules:
        logging.getLogger("mlflow").setLevel(logging.WARNING)
    ds = logging.getLogger("DeepSpeed")  # deepspeed resets its level on import, but keeps filters
    if not any(isinstance(f, _DropLine) for f in ds.filters):
        ds.addFilter(_DropLine("Setting accelerator to CPU"))
    # lm-eval's notes on how trsp_ray calls it on purpose (an in-memory model, zero-shot), three
    # lines per evaluated model; its other warnings stay
    for name, prefixes in LM_EVAL_NOTES.items():
        target = logging.getLogger(name)
        if not any(isinstance(f, _DropLine) for f in target.filters):
            for prefix in prefixes:
                target.addFilter(_DropLine(prefix))


LM_EVAL_NOTES = {
    "lm_eval.models.huggingface": ("`pretrained` model kwarg is not of type `str`",
                                   "Passed an already-initialized model through `pretrained`"),
    "lm_eval.evaluator": ("Overwriting default num_fewshot of",),
}


def _default_tqdm_off(cls) -> None:
    """Make `disable=True` the default of an already imported tqdm class (lm-eval and datasets build
    plain tqdm bars and expose no switch); a caller that passes `disable` still decides."""
    if getattr(cls.__init__, "_trsp_quiet", False):
        return
    original = cls.__init__

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("disable", True)
        original(self, *args, **kwargs)

    __init__._trsp_quiet = True
    cls.__init__ = __init__
