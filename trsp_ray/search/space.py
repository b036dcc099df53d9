"""The search space over pipelines (`method`), the ratio and any stage setting: parsing and validation.

A space maps dotted config keys to a dimension: a list of values (grid or choice) or a range
(`uniform` / `loguniform` / `int`, low and high). Everything a trial could get wrong is checked
here, from config.json alone, so a bad space fails on one line before any trial starts:
empty or contradictory spaces, values the config tree rejects, ratios that drop 0 layers or more
than the candidate layers.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

from trsp_ray.common.digest import content_key
from trsp_ray.common.errors import TrspError
from trsp_ray.config.run_config import RunConfig, from_dict

# What a search may vary: the pipeline (`method`), the ratio, the seed, and any key of the sections
# that shape a trial's result, found in the config tree itself (so a key a section gains is
# searchable with no code here). Keys that act only in some pipelines are handled by search/pipeline.py.
TOP_KEYS = ("method", "ratio", "seed")
# the pipeline's parts (registry.name_of): a point that sets any of them runs the pipeline composed of
# them and the base method's other parts, so a grid crosses selector x fit x heal recipe
PIPELINE_KEYS = ("selector", "fit", "heal")
SECTIONS = ("data", "gates", "stage1", "stage2", "heal", "recovery", "compensation", "merging", "baselines",
            "selection")
ALGORITHMS = ("grid", "random", "optuna")
RANGES = ("uniform", "loguniform", "int")


@dataclass(frozen=True)
class Dimension:
    """One searched key: `values` (grid/choice) or `kind` in RANGES with `low` <= `high`."""

    key: str
    values: tuple = ()
    kind: str = "choice"
    low: float | None = None
    high: float | None = None

    def bounds(self) -> tuple[Any, Any]:
        return (min(self.values), max(self.values)) if self.kind == "choice" else (self.low, self.high)


@dataclass(frozen=True)
class SearchSpace:
    dims: tuple[Dimension, ...]
    algorithm: str = "grid"
    num_samples: int = 1  # random/optuna: trials in all; grid: ignored (one trial per grid point)
    seed: int = 0
    objectives: tuple[str, ...] = ("val_ppl",)  # optuna: add "kept_parameters" for a Pareto search
    seeds: int = 1  # grid/random: every point runs on seeds base.seed .. base.seed + seeds - 1, averaged
    extra: dict = field(default_factory=dict)

    def keys(self) -> list[str]:
        return [d.key for d in self.dims]


def searchable(key: str) -> bool:
    """Whether `key` is `method`, `ratio`, `seed` or a leaf of one of SECTIONS of RunConfig."""
    import dataclasses

    if key in TOP_KEYS or key in PIPELINE_KEYS:
        return True
    section, _, leaf = key.partition(".")
    if section not in SECTIONS or not leaf or "." in leaf:
        return False
    return leaf in {f.name for f in dataclasses.fields(getattr(RunConfig(), section))}


def _dimension(key: str, spec: Any) -> Dimension:
    if not searchable(key):
        raise TrspError(f"search key {key!r} is not searchable; choose {', '.join(TOP_KEYS + PIPELINE_KEYS)} or a "
                        f"key of the sections {', '.join(SECTIONS)} (e.g. heal.lr, compensation.method)")
    if isinstance(spec, (list, tuple)):
        if not spec:
            raise TrspError(f"search key {key!r} has no values; give at least one")
        if len(set(map(repr, spec))) != len(spec):
            raise TrspError(f"search key {key!r} lists a value twice ({list(spec)}); each grid point must differ")
        return Dimension(key=key, values=tuple(_absolute(key, v) for v in spec))
    if isinstance(spec, dict) and len(spec) == 1 and next(iter(spec)) in RANGES:
        kind, bounds = next(iter(spec.items()))
        if not (isinstance(bounds, (list, tuple)) and len(bounds) == 2):
            raise TrspError(f"search key {key!r}: {kind} needs [low, high], got {bounds!r}")
        low, high = bounds
        if not low < high:
            raise TrspError(f"search key {key!r}: {kind} range [{low}, {high}] is empty; low must be < high")
        if kind == "loguniform" and low <= 0:
            raise TrspError(f"search key {key!r}: loguniform needs low > 0, got {low}")
        return Dimension(key=key, kind=kind, low=low, high=high)
    return Dimension(key=key, values=(_absolute(key, spec),))


def _absolute(key: str, value: Any) -> Any:
    """A searched text file or mixture with absolute paths: Tune runs trials in their own working
    directory, and a trial's keys read the files."""
    from pathlib import Path

    from trsp_ray.data import domains

    if key == "data.calib_mix" and isinstance(value, str):
        return domains.absolute_mix(value)
    if key in ("data.calib_text", "data.eval_text") and isinstance(value, str) and value:
        return str(Path(value).expanduser().resolve())
    return value


def parse_space(spec: dict) -> SearchSpace:
    """A SearchSpace from a plain dict: {"algorithm", "num_samples", "seed", "objectives", "params"}."""
    spec = dict(spec or {})
    params = spec.pop("params", None) or {}
    algorithm = spec.pop("algorithm", "grid")
    if algorithm not in ALGORITHMS:
        raise TrspError(f"search algorithm {algorithm!r} is not valid; choose one of {', '.join(ALGORITHMS)}")
    if not params:
        raise TrspError("the search space is empty; give at least one key, e.g. --space method=shortgpt+heal,tail+heal")
    dims = tuple(_dimension(k, v) for k, v in params.items())
    objectives = tuple(spec.pop("objectives", ("val_ppl",)))
    space = SearchSpace(dims=dims, algorithm=algorithm, num_samples=int(spec.pop("num_samples", 1)),
                        seed=int(spec.pop("seed", 0)), objectives=objectives, seeds=int(spec.pop("seeds", 1)))
    if spec:
        raise TrspError(f"unknown search setting(s) {', '.join(sorted(spec))}; valid: algorithm, num_samples, "
                        "seed, seeds, objectives, params")
    _check_consistent(space)
    return space


def _check_consistent(space: SearchSpace) -> None:
    ranges = [d.key for d in space.dims if d.kind != "choice"]
    if space.algorithm == "grid" and ranges:
        raise TrspError(f"grid search cannot sample the range(s) {', '.join(ranges)}; list values or use "
                        "algorithm=random|optuna")
    if space.algorithm != "grid" and space.num_samples < 1:
        raise TrspError(f"num_samples={space.num_samples} is not valid; it must be >= 1")
    bad = [o for o in space.objectives if o not in ("val_ppl", "kept_parameters")]
    if bad or not space.objectives or len(set(space.objectives)) != len(space.objectives):
        raise TrspError(f"objectives={list(space.objectives)} is not valid; use val_ppl and optionally kept_parameters")
    if space.seeds < 1:
        raise TrspError(f"seeds={space.seeds} is not valid; it must be >= 1")
    if space.seeds > 1 and "seed" in space.keys():
        raise TrspError("--seeds runs every point on several seeds and the space searches `seed` too; use one of them")
    if space.seeds > 1 and space.algorithm == "optuna":
        raise TrspError("--seeds needs algorithm=grid or random (Optuna proposes one trial at a time)")
    if len(space.objectives) > 1 and space.algorithm != "optuna":
        raise TrspError("a multi-objective search (val_ppl vs kept_parameters) needs algorithm=optuna")


def grid_points(space: SearchSpace) -> list[dict]:
    """Every grid point as {key: value}, in a stable order (first key varies slowest)."""
    points: list[dict] = [{}]
    for d in space.dims:
        points = [{**p, d.key: v} for p in points for v in d.values]
    return points


def sample_points(space: SearchSpace) -> list[dict]:
    """`num_samples` random points from a seeded RNG: the same search gives the same points, so a
    rerun finds its finished trials by key."""
    import math

    rng = random.Random(space.seed)
    out = []
    for _ in range(space.num_samples):
        point = {}
        for d in space.dims:
            if d.kind == "choice":
                point[d.key] = rng.choice(d.values)
            elif d.kind == "int":
                point[d.key] = rng.randint(int(d.low), int(d.high))
            elif d.kind == "loguniform":
                point[d.key] = math.exp(rng.uniform(math.log(d.low), math.log(d.high)))
            else:
                point[d.key] = rng.uniform(d.low, d.high)
        out.append(point)
    return out


def apply_point(base: dict, point: dict) -> dict:
    """The run config dict of one trial: `base` with the point's dotted keys set; the pipeline's parts
    (PIPELINE_KEYS) compose its method. A combination no pipeline spells (a map heal without a fit)
    leaves its composed name, which the config refuses in one line (a grid records it as refused)."""
    import copy

    from trsp_ray.config import registry

    out = copy.deepcopy(base)
    parts = {k: v for k, v in point.items() if k in PIPELINE_KEYS}
    if parts:
        spec = {**registry.parts_of(point.get("method", out["method"])), **parts}
        try:
            out["method"] = registry.name_of(spec)
        except TrspError:
            fit = registry.FIT_WORDS.get(str(spec["fit"]).lower(), spec["fit"])
            heal = registry.HEAL_WORDS.get(str(spec["heal"]).lower(), spec["heal"])
            out["method"] = registry.compose(spec["selector"], fit=fit, heal=heal is not None, recipe=heal or None)
    for key, value in point.items():
        if key in PIPELINE_KEYS:
            continue
        node = out
        *parents, leaf = key.split(".")
        for part in parents:
            node = node[part]
        node[leaf] = value
    return out


def check_points(base: RunConfig, space: SearchSpace, points: list[dict] | None, *, num_layers: int) -> None:
    """Every point (or, for ranges, both bounds) must make a valid config that drops 1..candidates layers."""
    from trsp_ray.method.stage1 import candidate_layers, check_drop_count, n_drop_for

    probes = points if points is not None else [
        {d.key: d.bounds()[i] for d in space.dims} for i in (0, 1)]
    g = base.gates
    candidates = candidate_layers(num_layers, protect_head=g.protect_head, protect_tail=g.protect_tail)
    from trsp_ray.config import registry

    for point in probes:
        applied = apply_point(base.to_dict(), point)
        if points is not None and set(point) & set(PIPELINE_KEYS):
            try:
                registry.method(applied["method"])
            except TrspError:
                continue  # a combination of parts no pipeline spells: the grid records it as refused
        try:
            cfg = from_dict(applied)
        except TrspError as e:
            raise TrspError(f"search point {point}: {e}") from None
        check_drop_count(n_drop_for(cfg.ratio, num_layers), candidates, cfg.ratio, num_layers)


def trial_key(cfg: dict) -> str:
    """Content key of a whole trial config (tracking and distributed settings do not change results)."""
    return content_key({k: v for k, v in cfg.items() if k not in ("tracking", "output", "threads")})
