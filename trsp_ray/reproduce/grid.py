"""The grid of cells (model x method x ratio) and its on-disk store, which makes a run resumable.

Layout under the output directory:
    cells/<cell id>.json        one finished cell (pruned and scored), written atomically
    models/<cell id>/           the exported pruned model (atomic export)
    models/<cell id>.prune.json what its pruning did (drop set, route, time), with its prune key
    stage1/<key>.json           shared stage-1 results by content key (trsp_ray/run/stage1_store.py)
    run_log.jsonl               one JSON line per event: run start/end, cell skipped/stale/pruned/computed

A cell is done when its record carries the cell's current content key, and pruned when its export
exists and its prune record carries the current prune key (work.py): a rerun skips those, and a
cell whose settings changed since is computed again (logged as "stale"). The log says which cells
each run skipped and computed.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from trsp_ray.common import atomic, runlog
from trsp_ray.common.errors import TrspError
from trsp_ray.reproduce.presets import GRID_METHODS, Preset


@dataclass(frozen=True)
class Cell:
    model: str  # ModelSpec.key
    method: str  # one of GRID_METHODS
    ratio: float  # 0.0 for dense

    @property
    def id(self) -> str:
        return f"{self.model}__{self.method}__r{self.ratio:.3f}"

    def to_dict(self) -> dict:
        return asdict(self)


def _pick(given, valid: tuple, what: str, preset: str) -> tuple:
    if given is None:
        return tuple(valid)
    bad = [g for g in given if g not in valid]
    if bad:
        raise TrspError(f"unknown {what} {bad[0]!r} for preset {preset!r}; valid: {', '.join(map(str, valid))}")
    return tuple(dict.fromkeys(given))


def build_grid(preset: Preset, *, models=None, methods=None, ratios=None) -> list[Cell]:
    """Cells of the preset, optionally narrowed; unknown names fail here, before anything runs.

    Dense has one cell per model (no ratio); every other method one per ratio."""
    keys = _pick(models, tuple(m.key for m in preset.models), "model", preset.name)
    chosen = _pick(methods, GRID_METHODS, "method", preset.name)
    ratios = tuple(preset.ratios if ratios is None else ratios)
    for r in ratios:
        if not isinstance(r, (int, float)) or not 0.0 < r < 1.0:
            raise TrspError(f"ratio {r!r} is not valid; it must be in the open interval (0, 1)")
    cells = []
    for key in keys:
        for method in chosen:
            cells += [Cell(key, "dense", 0.0)] if method == "dense" else [Cell(key, method, float(r)) for r in ratios]
    return cells


class CellStore:
    """Finished cells, exported models and the run log under one output directory."""

    def __init__(self, out: str | Path):
        self.root = Path(out).expanduser().resolve()
        try:
            for sub in ("cells", "models", "stage1"):
                (self.root / sub).mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise TrspError(f"output {str(out)!r} is not writable ({exc.strerror}); "
                            "pass a directory you can write to") from None
        self.log_path = self.root / "run_log.jsonl"
        self.run_id = time.strftime("%Y%m%d-%H%M%S") + f"-{os.getpid()}"

    def cell_path(self, cell: Cell) -> Path:
        return self.root / "cells" / f"{cell.id}.json"

    def model_dir(self, cell: Cell) -> Path:
        return self.root / "models" / cell.id

    @property
    def stage1_root(self) -> Path:
        return self.root / "stage1"

    def prune_path(self, cell: Cell) -> Path:
        return self.root / "models" / f"{cell.id}.prune.json"

    def is_done(self, cell: Cell, key: str | None = None) -> bool:
        """A record of the cell exists (and, given `key`, was made by the same content)."""
        if not self.cell_path(cell).is_file():
            return False
        return key is None or self.load(cell).get("cell_key") == key

    def is_pruned(self, cell: Cell, key: str) -> bool:
        """Its prune record carries `key` and names a usable model directory (an export is renamed
        into place only when complete, so config.json means a usable model; the dense cell's
        directory may be the original model's)."""
        record = self.pruned(cell) or {}
        return record.get("prune_key") == key and (Path(record.get("model_dir", "")) / "config.json").is_file()

    def pruned(self, cell: Cell) -> dict | None:
        path = self.prune_path(cell)
        return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else None

    def save_pruned(self, cell: Cell, record: dict, key: str) -> None:
        atomic.write_json(self.prune_path(cell), {**record, "prune_key": key})

    def load(self, cell: Cell) -> dict:
        return json.loads(self.cell_path(cell).read_text(encoding="utf-8"))

    def save(self, cell: Cell, result: dict) -> None:
        atomic.write_json(self.cell_path(cell),
                          {**result, "cell": cell.to_dict(), "cell_id": cell.id, "run_id": self.run_id})

    def log(self, event: str, **fields) -> None:
        runlog.append(self.log_path, event, **{"run_id": self.run_id, **fields})

    def events(self) -> list[dict]:
        return runlog.read(self.log_path)


def read_events(out: str | Path) -> list[dict]:
    """The run log of an output directory (every run, oldest first)."""
    return runlog.read(Path(out) / "run_log.jsonl")
