"""The teacher store: the dense model's top-k next-token records (method/distill.py) of every window
of a heal stream, computed once and read by every later row, seed and trial that heals on it.

A distillation heal of a million tokens ran the dense teacher beside the student at every step: a
second model in the device's memory, one more forward per trained token per row, and no way onto
the ZeRO-3 workers. The teacher depends only on the model, the windows and (k, temperature), and
the heal stream's first n windows are the same whatever n a row asks for (data/stream.py), so the
records are stored per shard of SHARD_WINDOWS windows under a key of (model fingerprint, the
stream's content key, k, sequence length, temperature, shard index) through content.store_key (so
the library versions and the resolved precision are in it too): another text, k or length misses.

`<root>/<key>.pt` holds one shard: logp [W, L, k] fp16, index [W, L, k] int32, tail [W, L] fp16
and the content it was keyed by; 6k + 2 bytes a token. A local root is written atomically (temp +
rename, common/atomic.py) under a per-key lock, so parallel rows compute a shard once; an s3:// root
(common/filesystems.py) takes each shard as one object, which a reader sees whole or not at all.
The root must be on storage every node sees when Ray Train workers read it.
"""

from __future__ import annotations

import contextlib
import io
import math
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

from trsp_ray.common import atomic
from trsp_ray.common.filesystems import filesystem, is_remote
from trsp_ray.common.logs import log
from trsp_ray.plan.teacher_plan import SHARD_WINDOWS, bytes_per_token
from trsp_ray.run.content import checkpoint_root, store_key

Records = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # (logp, index, tail), method/distill.py
# compute(windows [n, L]) -> the records of those windows; run once per missing shard
Compute = Callable[[torch.Tensor], Records]


def store_root(checkpoint_dir: str | None) -> str:
    """Where the teacher store lives: `<checkpoint_dir>/teacher` (an s3:// checkpoint_dir too), by
    default under ./runs/checkpoints beside the stage-1 store, as an absolute path a worker can use."""
    base = checkpoint_root(checkpoint_dir)
    if not is_remote(base):
        return str(Path(base).expanduser().resolve() / "teacher")
    where, _, options = base.partition("?")  # s3://bucket/dir?endpoint_override=...: the options stay last
    return where.rstrip("/") + "/teacher" + (f"?{options}" if options else "")


class TeacherStore:
    """The records of `stream` (data/stream.HealStream) at top-`k` and `temperature`, by shard.
    `cfg`: the run-config dict (content.store_key reads its precision); `model`: the model's
    fingerprint (content.model_fingerprint)."""

    def __init__(self, root: str, stream, *, k: int, temperature: float, cfg: dict, model: str,
                 shard_windows: int = SHARD_WINDOWS):
        self.root, self.stream, self.k, self.temperature = root, stream, k, temperature
        self.shard_windows = shard_windows
        self.fs, self.path_root = filesystem(root)
        self.remote = is_remote(root)
        self.content = {"model": model, "stream": stream.key(), "k": k, "seqlen": stream.seqlen,
                        "temperature": temperature, "shard_windows": shard_windows}
        self._cfg, self._model = cfg, model
        self._cache: dict[int, Records] = {}
        self.forwards = 0  # teacher batches computed by this store (what a reused shard saves)

    # -- keys and files ---------------------------------------------------------------------------
    def key(self, shard: int) -> str:
        return store_key({"teacher": {**self.content, "shard": shard}}, cfg=self._cfg, data=self._model, length=24)

    def path(self, shard: int) -> str:
        return f"{self.path_root}/{self.key(shard)}.pt"

    def shards(self, windows: int) -> range:
        """The shards that hold the first `windows` windows."""
        return range(math.ceil(windows / self.shard_windows))

    def has(self, shard: int) -> bool:
        import pyarrow.fs

        return self.fs.get_file_info(self.path(shard)).type == pyarrow.fs.FileType.File

    def missing(self, windows: int) -> list[int]:
        return [s for s in self.shards(windows) if not self.has(s)]

    def rows(self, shard: int) -> range:
        """Global window indices of `shard` (the last shard of a stream ends at its capacity)."""
        first = shard * self.shard_windows
        return range(first, min(first + self.shard_windows, self.stream.capacity))

    @contextlib.contextmanager
    def _locked(self, shard: int) -> Iterator[None]:
        if self.remote:  # no lock on object storage: two writers put the same bytes, the last one stays
            yield
            return
        import fcntl

        Path(self.path_root).mkdir(parents=True, exist_ok=True)
        with open(f"{self.path_root}/{self.key(shard)}.lock", "w") as fh:
            fcntl.flock(fh, fcntl.LOCK_EX)  # released when the file closes, also if the process dies
            try:
                yield
            finally:
                fcntl.flock(fh, fcntl.LOCK_UN)

    def _write(self, shard: int, records: Records) -> None:
        logp, index, tail = records
        buf = io.BytesIO()
        torch.save({"logp": logp.cpu(), "index": index.cpu(), "tail_mass": tail.cpu(),
                    "content": {**self.content, "shard": shard}}, buf)
        if self.remote:
            self.fs.create_dir(self.path_root, recursive=True)
            with self.fs.open_output_stream(self.path(shard)) as out:
                out.write(buf.getvalue())
        else:
            atomic.write_bytes(self.path(shard), buf.getvalue())

    def _read(self, shard: int) -> Records:
        if shard not in self._cache:
            with self.fs.open_input_stream(self.path(shard)) as fh:
                data = torch.load(io.BytesIO(fh.read()), weights_only=True)  # tensors, numbers, strings
            self._cache = {shard: (data["logp"], data["index"], data["tail_mass"])}  # a heal reads shards in order
        return self._cache[shard]

    # -- computing and reading -------------------------------------------------------------------
    def fill(self, compute: Compute, *, windows: int, shards: list[int] | None = None, write: bool = True) -> int:
        """Compute and store each shard of the first `windows` windows that is not stored yet (or
        `shards`, a list every data-parallel rank agreed on); `write` False: compute only (a rank
        other than the writer). Returns the shards computed."""
        todo = self.missing(windows) if shards is None else shards
        done = 0
        for shard in todo:
            with self._locked(shard) if write else contextlib.nullcontext():
                if shards is None and self.has(shard):  # another row computed it while this one waited
                    continue
                rows = torch.stack([self.stream.window(i) for i in self.rows(shard)])
                records = compute(rows)
                if write:
                    self._write(shard, records)
                done += 1
                if write and len(todo) > 1:  # the pass precedes the heal's first step: show it moving
                    log(f"  teacher pass: shard {done}/{len(todo)} ({len(rows)} windows)")
        if todo:
            log(f"  teacher store: {done} shard(s) of {self.shard_windows} windows computed, "
                f"{len(self.shards(windows)) - len(todo)} read; {bytes_per_token(self.k)} bytes a token "
                f"(top-{self.k} at T={self.temperature:g}) under {self.root}")
        return done

    def records(self, windows: list[int]) -> Records:
        """(logp [n, L, k], index [n, L, k], tail [n, L]) of global windows `windows`, read from the store."""
        parts = [[], [], []]
        for w in windows:
            shard, at = divmod(w, self.shard_windows)
            for part, tensor in zip(parts, self._read(shard)):
                part.append(tensor[at])
        return tuple(torch.stack(p) for p in parts)

    def lookup(self, rows: slice | None = None) -> Records:
        """The records of the stream's last batch (rows `rows` of it): distill.StoredDistillLoss's lookup."""
        last = self.stream.last
        return self.records(last if rows is None else last[rows])


def dense_compute(teacher, *, k: int, temperature: float, batch_size: int, forward=None) -> Compute:
    """compute(windows) of the dense `teacher` in batches of `batch_size`, without gradients, on the
    teacher's device; `forward(batch) -> logits` overrides the call (a ZeRO-3 engine's)."""
    from trsp_ray.method.distill import teacher_topk

    def run(batch: torch.Tensor) -> torch.Tensor:
        if forward is not None:
            return forward(batch)
        device = next(teacher.parameters()).device
        return teacher(input_ids=batch.to(device), use_cache=False).logits

    def compute(windows: torch.Tensor) -> Records:
        parts = []
        with torch.no_grad():
            for batch in windows.split(batch_size):
                parts.append(tuple(t.cpu() for t in teacher_topk(run(batch), k=k, temperature=temperature)))
        return tuple(torch.cat(p) for p in zip(*parts))

    return compute


def check_topk(k: int, vocab: int) -> None:
    from trsp_ray.common.errors import TrspError

    if k > vocab:
        raise TrspError(f"recovery.kd_topk={k} is not valid for a vocabulary of {vocab} tokens; use 1..{vocab} "
                        "(or 0: the full vocabulary, with the teacher live)")


def stored_objective(cfg, stream, *, windows: int, dense, root: str | None = None, model: str | None = None):
    """distill.StoredDistillLoss over the teacher store of `stream` at the run's recovery settings,
    with the shards of its first `windows` windows stored first: a missing one is computed by the
    dense model `dense()` yields (a context manager: methods._dense_beside), in the stream's batches.
    `root`: the store (store_root of checkpoint_dir by default); `model`: the model's fingerprint
    (content.model_fingerprint of cfg.model by default)."""
    from trsp_ray.method.distill import StoredDistillLoss
    from trsp_ray.models import families
    from trsp_ray.run.content import model_fingerprint

    r = cfg.recovery
    store = TeacherStore(root or store_root(cfg.checkpoint_dir), stream, k=r.kd_topk, temperature=r.kd_temperature,
                         cfg=cfg.to_dict(), model=model or model_fingerprint(cfg.model))
    if store.missing(windows):
        with dense() as teacher:
            check_topk(r.kd_topk, families.text_config(teacher).vocab_size)
            store.fill(dense_compute(teacher, k=r.kd_topk, temperature=r.kd_temperature,
                                     batch_size=stream.batch_size), windows=windows)
    else:
        log(f"  teacher store: {len(store.shards(windows))} shard(s) read, none computed; "
            f"{bytes_per_token(r.kd_topk)} bytes a token under {store.root}")
    return StoredDistillLoss(store.lookup, temperature=r.kd_temperature, ce_weight=r.kd_ce_weight)
