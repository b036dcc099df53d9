"""What a search trial's pipeline reads of its config, and the compute every trial may spend.

A space is generic over config keys, but a key acts only in the pipelines that read it: stage1.* in
TRSP's selection (and in the window count of Block Influence when baselines.calib_windows is unset),
compensation.* where a fit runs, heal.* where a heal runs, stage2.steps not at all under a compute
budget (the budget sets the heal's steps). `effective` is the part of a trial's config its pipeline
reads, resolved as the pipeline resolves it (config.for_method: the name's fit and recipe and
compensation auto; methods.method_heal: the heal a heal method runs; the windows a selector scores),
so a key another section gains is covered without code here.

The rule (`reduce_points`): a searched key that acts in no trial of a search is a one-line error; a
key that acts in some trials is dropped from the points of the others (their trials run the base
config's value; their records say `ignored`: {key: the value the grid point asked for}),
and points that then run the same pipeline run once (the run log says `point_merged`). A grid point
its pipeline refuses (heal.trainable=map where no fit runs) is left out (`point_refused`).

Compute (SPEC section 5): with heal.compute_budget every trial's heal gets the steps the budget leaves
after its selection and its fit (budget.heal_steps, from the selection's measured cost and the fit's
cost for the drop set), so every total lies within one heal step below the budget. `check_budgets`
refuses, before any trial, a budget that a point's selection (TRSP: its gate training alone, a floor
known in advance) and planned fit leave no heal step of.
"""

from __future__ import annotations

import dataclasses
import json

from trsp_ray.common.errors import TrspError
from trsp_ray.config import registry

# the sections every pipeline reads whole (the calibration windows, the gates' protected layers)
COMMON = ("model", "seed", "device", "dtype", "method")


def selection_content(cfg, n_drop: int) -> dict:
    """What chooses a drop set of `n_drop` layers beyond the model and the calibration windows: the
    selector and what it reads (methods.select: TRSP's stage 1, the windows Block Influence / the
    angular block / SLEB score; tail and random read nothing but the seed and gates)."""
    from trsp_ray.run.methods import shortgpt_windows

    spec = registry.method(cfg.method)
    out = {"selector": spec.selector, "n_drop": n_drop}
    if spec.uses_stage1:
        out.update(ranking=spec.ranking, stage1=dataclasses.asdict(cfg.stage1))
    elif spec.selector in (registry.SHORTGPT_SELECTOR, registry.ANGULAR_SELECTOR):
        out["windows"] = shortgpt_windows(cfg, n_drop)
    elif spec.selector == registry.SLEB_SELECTOR:
        out["windows"] = cfg.baselines.sleb_windows
    return out


def selection_key(cfg_dict: dict, fingerprint: str, *, num_layers: int) -> str:
    """Content key of a baseline selection: trials of any pipeline with the same selector, windows,
    drop count, model, calibration (its fingerprint), precision, seed and gates share it."""
    from trsp_ray.config.run_config import from_dict
    from trsp_ray.method.stage1 import n_drop_for
    from trsp_ray.run.stage1_store import content_key

    cfg = from_dict(cfg_dict)
    d = cfg_dict["data"]
    return content_key({"selection": selection_content(cfg, n_drop_for(cfg.ratio, num_layers)),
                        **{k: cfg_dict[k] for k in ("seed", "device", "dtype")}, "gates": cfg_dict["gates"],
                        "data": {k: d[k] for k in ("calib_text", "seqlen", "batch_size")}, "fp": fingerprint})


def effective(cfg_dict: dict, *, num_layers: int) -> dict:
    """The part of a trial config its pipeline reads, as the pipeline resolves it (module doc);
    raises the config's own one-line TrspError for a combination no pipeline runs."""
    from trsp_ray.config.run_config import from_dict
    from trsp_ray.method.stage1 import n_drop_for
    from trsp_ray.run.methods import method_heal
    from trsp_ray.run.pipeline import resolve

    cfg = resolve(from_dict(cfg_dict), budget_layers=False).cfg
    spec = registry.method(cfg.method)
    d = cfg.to_dict()
    n_drop = n_drop_for(cfg.ratio, num_layers)
    out = {**{k: d[k] for k in COMMON}, "data": d["data"], "gates": d["gates"],
           "select": selection_content(cfg, n_drop)}
    trains = False
    if spec.stage2 and cfg.stage2.enabled and cfg.stage2.steps > 0:
        out["stage2"], trains = d["stage2"], True
    heal = dataclasses.asdict(method_heal(cfg) if spec.heal else cfg.heal)
    if spec.heal and cfg.heal.compute_budget:
        heal["steps"] = None  # the budget sets them, whatever stage2.steps / heal.steps say
    if heal["steps"] is None or heal["steps"] > 0:
        out["heal"], trains = heal, True
    if trains:
        out["recovery"] = d["recovery"]
    out["compensation"] = _fit_content(cfg.compensation)
    return out


# what compensation.describe records for least squares alone (rank only within its lowrank form);
# the scalar fold reads none of them, nor a least-squares objective
LSTSQ_ONLY = ("ridge", "form", "rank", "weighting")


def fit_key(cfg_dict: dict, *, selection: str, drop: list[int]) -> str:
    """Content key of a trial's fit: its selection's key, the drop set and every fit setting
    (_fit_content) with the calibration windows' seqlen; trials that differ only in their heal share it."""
    from trsp_ray.config.run_config import for_method, from_dict
    from trsp_ray.run.stage1_store import content_key

    cfg = for_method(from_dict(cfg_dict))  # the fit the name spells (a trial's config is resolved already)
    return content_key({"fit_of": selection, "drop": sorted(drop), "fit": _fit_content(cfg.compensation),
                        "seqlen": cfg.data.seqlen})


def _fit_content(comp) -> dict | str:
    """The fit a trial runs: every compensation setting but those its method does not read."""
    from trsp_ray.method import compensation

    if comp.method == "none":
        return "none"
    rest = {k: v for k, v in dataclasses.asdict(comp).items() if k not in LSTSQ_ONLY}
    if comp.method == "scalar":
        rest.pop("objective", None)
    return {**rest, **compensation.describe(comp)}


def _fingerprint(content: dict) -> str:
    return json.dumps(content, sort_keys=True, default=str)


def _probe_values(dim) -> tuple:
    return dim.values if dim.kind == "choice" else (dim.low, dim.high)


def _acts(base: dict, point: dict, dim, *, num_layers: int) -> bool:
    """Whether `dim`'s key changes the pipeline of `point` (some value of it gives another effective config)."""
    from trsp_ray.search.space import apply_point

    def content(value) -> str:
        try:
            return _fingerprint(effective(apply_point(base, {**point, dim.key: value}), num_layers=num_layers))
        except TrspError as e:  # a value no pipeline runs with this point differs from every valid one
            return f"invalid: {e}"

    return len({content(v) for v in _probe_values(dim)}) > 1


def reduce_points(base: dict, space, points: list[dict], *, num_layers: int) -> tuple[list[dict], dict, list, list]:
    """(points to run, {index in that list: {key: value} dropped from it}, [(merged point, the point
    it runs as)], [(refused point, why)]) under the module's rule. A grid point its pipeline refuses
    (config.for_method: e.g. heal.trainable=map where no fit runs) is left out and recorded, so a grid
    may cross fits with recipes; one-line errors: every point refused, a key acting in no point."""
    from trsp_ray.search.space import apply_point

    refused, valid = [], []
    for point in points:
        try:
            effective(apply_point(base, point), num_layers=num_layers)
            valid.append(point)
        except TrspError as e:
            refused.append((point, str(e)))
    if not valid:
        point, why = refused[0]
        raise TrspError(f"every search point is refused by its pipeline, e.g. {point}: {why}")
    acting = {d.key: [_acts(base, p, d, num_layers=num_layers) for p in valid] for d in space.dims}
    for d in space.dims:
        if len(_probe_values(d)) > 1 and not any(acting[d.key]):
            methods = sorted({apply_point(base, p)["method"] for p in valid})
            raise TrspError(f"search key {d.key!r} changes nothing in the searched pipeline(s) {', '.join(methods)}; "
                            "drop it from the space or search a method it acts in")
    kept, ignored, merged, seen = [], {}, [], {}
    for i, point in enumerate(valid):
        drop = {k: v for k, v in point.items() if len(_probe_values(space_dim(space, k))) > 1 and not acting[k][i]}
        reduced = {k: v for k, v in point.items() if k not in drop}
        fp = _fingerprint(effective(apply_point(base, reduced), num_layers=num_layers))
        if fp in seen:
            merged.append((point, kept[seen[fp]]))
            continue
        seen[fp] = len(kept)
        if drop:
            ignored[len(kept)] = drop
        kept.append(reduced)
    return kept, ignored, merged, refused


def space_dim(space, key: str):
    return next(d for d in space.dims if d.key == key)


def check_conditional(base: dict, space, *, num_layers: int) -> None:
    """Optuna proposes points one at a time, so a key acting in only some searched pipelines would make
    trials that differ in nothing: refused in one line (grid and random drop such keys per trial)."""
    methods = next((d.values for d in space.dims if d.key == "method"), (base["method"],))
    low = {d.key: _probe_values(d)[0] for d in space.dims}
    for d in space.dims:
        if d.key == "method":
            continue
        acts = {m: _acts(base, {**low, "method": m}, d, num_layers=num_layers) for m in methods}
        if not all(acts.values()):
            idle = ", ".join(m for m, a in acts.items() if not a)
            raise TrspError(f"search key {d.key!r} changes nothing in {idle}; algorithm=optuna cannot search a key "
                            "that acts in only some pipelines: use algorithm=grid or random, or drop the key")


def stage1_floor_cost(cfg, *, num_layers: int) -> float:
    """Dense-forward tokens TRSP's stage 1 spends at least: its gate training (the rounds' steps are
    fixed in advance; probes and refinement only add), by methods.stage1_cost's formula."""
    from types import SimpleNamespace

    from trsp_ray.method.stage1 import n_drop_for
    from trsp_ray.run.methods import stage1_cost

    s1, d = cfg.stage1, cfg.data
    rounds = 1 if s1.selection == "oneshot" else n_drop_for(cfg.ratio, num_layers)
    ends = [s1.first_round_steps + r * s1.steps_per_round for r in range(rounds)]
    planned = SimpleNamespace(round_ends=ends, tokens_per_step=d.batch_size * d.seqlen, probe_cost=0)
    return stage1_cost(planned, num_layers=num_layers, train_base=s1.train_base)


def planned_costs(cfg, *, num_layers: int) -> tuple[float, float]:
    """(selection, fit) dense-forward tokens a budgeted point plans: budget.py's plan, TRSP's floor."""
    from trsp_ray.run import budget

    select = budget.planned_select_cost(cfg, num_layers=num_layers)
    if select is None:
        select = stage1_floor_cost(cfg, num_layers=num_layers)
    return select, budget.planned_compensation_cost(cfg, num_layers=num_layers)


def check_budgets(base: dict, points: list[dict], *, num_layers: int) -> None:
    """One-line TrspError, before any trial, for a budgeted point whose method does not heal or whose
    selection and fit leave no heal step (budget.heal_steps says by how much)."""
    from trsp_ray.config.run_config import from_dict
    from trsp_ray.run import budget
    from trsp_ray.run.pipeline import resolve
    from trsp_ray.search.space import apply_point

    for point in points:
        cfg = resolve(from_dict(apply_point(base, point)), budget_layers=False).cfg
        if not cfg.heal.compute_budget:
            continue
        if not registry.method(cfg.method).heal:
            raise TrspError(f"--compute-budget {cfg.heal.compute_budget:g} is spent on a heal, and method "
                            f"{cfg.method!r} does not heal; search heal methods (e.g. shortgpt+heal, trsp+heal)")
        select, comp = planned_costs(cfg, num_layers=num_layers)
        budget.heal_steps(cfg, select=select, comp=comp)


def max_heal_steps(base: dict, points: list[dict], *, num_layers: int) -> int:
    """The most steps any point trains (a budgeted heal at most what its budget buys after the planned
    selection and fit): how many validation reports ASHA may see."""
    from trsp_ray.config.run_config import from_dict
    from trsp_ray.run import budget
    from trsp_ray.run.methods import method_heal
    from trsp_ray.run.pipeline import resolve
    from trsp_ray.search.space import apply_point

    most = 0
    for point in points:
        cfg = resolve(from_dict(apply_point(base, point)), budget_layers=False).cfg
        if cfg.heal.compute_budget and registry.method(cfg.method).heal:
            select, comp = planned_costs(cfg, num_layers=num_layers)
            most = max(most, budget.heal_steps(cfg, select=select, comp=comp))
        else:
            heal = method_heal(cfg).steps if registry.method(cfg.method).heal else cfg.heal.steps
            most = max(most, cfg.stage2.steps, heal)
    return most


def trial_stage1_key(cfg_dict: dict, fingerprint: str, *, n_drop: int) -> str:
    """The stage-1 store key of a TRSP trial: shared by every ratio as stage1_store says, except under
    a compute budget, where a trial is charged what its own selection costs, so each drop count gets
    its own stage 1 (a longer one would charge it the rounds it does not use)."""
    from trsp_ray.run.stage1_store import content_key, stage1_key

    key = stage1_key(cfg_dict, fingerprint)
    return content_key({"stage1": key, "n_drop": n_drop}) if cfg_dict["heal"]["compute_budget"] else key


def budgeted(cfg, *, drop: list[int], select_cost: float, num_layers: int, hidden: int):
    """(cfg whose heal has the steps heal.compute_budget leaves, the fit's cost for `drop`): the
    selection's measured cost and the fit's exact cost for this drop set, so every trial's total lies
    within one heal step below the budget (budget.heal_steps). Without a budget: cfg unchanged."""
    from trsp_ray.config.run_config import for_method, sized
    from trsp_ray.run import budget

    fit = budget.fit_cost(sized(for_method(cfg), hidden=hidden), drop=drop, num_layers=num_layers)
    if not (cfg.heal.compute_budget and registry.method(cfg.method).heal):
        return cfg, fit
    return budget.with_heal_steps(cfg, budget.heal_steps(cfg, select=select_cost, comp=fit, drop=drop)), fit
