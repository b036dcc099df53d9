"""Where a search keeps its things under its directory, shared by the single-process trial
(search/trial.py), the Ray Train trial (search/distributed_trial.py) and the driver (search/run.py):
finished-trial records, exported models, the stage-1 store with its plan and the final ranking."""

from __future__ import annotations

from pathlib import Path

from trsp_ray.run.stage1_store import Stage1Store

TRIALS = "trials"  # finished-trial records: <search_dir>/trials/<trial key>.json
MODELS = "models"  # exported pruned models: <search_dir>/models/<trial key>/
STAGE1 = "stage1"  # the search's stage-1 store: <search_dir>/stage1/<stage-1 key>.json
RANKING = "ranking.json"  # <search_dir>/ranking.json: every trial vs the best, paired (search/objective.py)


def trial_record_path(search_dir: str | Path, key: str) -> Path:
    return Path(search_dir) / TRIALS / f"{key}.json"


def trial_store(config: dict) -> Stage1Store | None:
    """The search's stage-1 store, or None when reuse is off."""
    return Stage1Store(Path(config["search_dir"]) / STAGE1) if config.get("reuse", True) else None


def planned_n_drop(config: dict, skey: str) -> int:
    """Layers the first stage-1 computation of `skey` covers: the most any trial sharing it drops."""
    return int(config.get("plan_n_drop", {}).get(skey, config.get("default_plan_n_drop", 0)))
