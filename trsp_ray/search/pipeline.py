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

Keys: every setting that changes a selection, a stage 1 or a fit is in its store key (selection_key,
trial_stage1_key, fit_key), the trial's own calibration too (its settings and its text's fingerprint:
trial_fingerprint), so a trial that asks for another mixture never reuses another mixture's work.
`check_keys` refuses, before any trial, a searched key (outside AFTER_FIT) that changes what a point
does but none of its keys. The data.eval_* settings act in no trial: every trial is scored on the base
config's validation windows (search/objective.py).

Compute (SPEC section 5): with heal.compute_budget every trial's heal gets the steps the budget leaves
after its selection and its fit (compute.heal_steps, from the selection's measured cost and the fit's
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
# data settings a trial does not read: every trial is scored on the base config's validation windows
# and the evaluation pool reads the base config's held-out settings (search/objective.py)
OBJECTIVE_DATA = ("eval_text", "eval_seqlen", "eval_max_windows", "eval_domains")
# what a searched key may change without changing a selection, stage-1 or fit key: the pipeline's name
# and parts (each part enters the key it changes), the ratio (a stage 1 serves every smaller ratio;
# the selection and fit keys hold the drop count and set), and the settings read after the fit (a
# merge's too: it runs after its selection, in every trial, and nothing of it is stored)
AFTER_FIT = ("method", "selector", "fit", "heal", "ratio", "stage2.", "heal.", "recovery.", "merging.")


def selection_content(cfg, n_drop: int, *, spec: registry.Method) -> dict:
    """What chooses a drop set of `n_drop` layers beyond the model and the calibration windows: the
    selector of `spec` (the pipeline's registry entry) and what it reads (methods.select: TRSP's
    stage 1, the windows Block Influence / the angular block / SLEB score; tail and random read
    nothing but the seed and gates)."""
    from trsp_ray.run.methods import shortgpt_windows

    out = {"selector": spec.selector, "n_drop": n_drop}
    if spec.uses_stage1:
        out.update(ranking=spec.ranking, stage1=dataclasses.asdict(cfg.stage1))
    elif spec.selector in (registry.SHORTGPT_SELECTOR, registry.ANGULAR_SELECTOR, registry.MERGE_SELECTOR):
        out["windows"] = shortgpt_windows(cfg, n_drop)
    elif spec.selector == registry.SLEB_SELECTOR:
        out["windows"] = cfg.baselines.sleb_windows
    return out


def search_fingerprint(base: dict) -> str:
    """What every trial of a search started from `base` shares beyond its config: the model's files and
    the validation text (the base calibration's tail, which no trial trains on: search/objective.py)."""
    from trsp_ray.common.digest import content_key
    from trsp_ray.run.content import calibration_content, data_fingerprint

    d = base["data"]
    return content_key({"data": data_fingerprint(model=base["model"], calib_text=d["calib_text"],
                                                 calib_mix=d["calib_mix"]),
                        "validation": calibration_content(d)})


def trial_fingerprint(cfg_dict: dict, fingerprint: str) -> str:
    """`fingerprint` (what every trial of a search shares: the model's files, the validation text no
    trial trains on) with the trial's own calibration text (a file's bytes, a mixture's sources): a
    trial that asks for another mixture gets other keys, whatever the base config calibrates on."""
    from trsp_ray.common.digest import content_key
    from trsp_ray.run.content import text_fingerprint

    d = cfg_dict["data"]
    return content_key({"search": fingerprint, "calib": text_fingerprint(d["calib_text"], d["calib_mix"])})


def selection_key(cfg_dict: dict, fingerprint: str, *, spec: registry.Method, num_layers: int) -> str:
    """Content key of a baseline selection: trials of any pipeline with the same selector, windows,
    drop count, model, calibration (its settings and its text: trial_fingerprint), precision, seed
    and gates share it. `spec`: the trial's pipeline's registry entry."""
    from trsp_ray.common.digest import content_key
    from trsp_ray.config.run_config import from_dict
    from trsp_ray.method.stage1 import n_drop_for
    from trsp_ray.run.content import calibration_content

    cfg = from_dict(cfg_dict)
    return content_key({"selection": selection_content(cfg, n_drop_for(cfg.ratio, num_layers), spec=spec),
                        **{k: cfg_dict[k] for k in ("seed", "device", "dtype")}, "gates": cfg_dict["gates"],
                        "data": calibration_content(cfg_dict["data"]),
                        "fp": trial_fingerprint(cfg_dict, fingerprint)})


def effective(cfg_dict: dict, *, num_layers: int) -> dict:
    """The part of a trial config its pipeline reads, as the pipeline resolves it (module doc);
    raises the config's own one-line TrspError for a combination no pipeline runs."""
    from trsp_ray.config.run_config import from_dict
    from trsp_ray.method.stage1 import n_drop_for
    from trsp_ray.run.methods import method_heal
    from trsp_ray.run.pipeline import resolve

    pipe = resolve(from_dict(cfg_dict), budget_layers=False)
    cfg, spec = pipe.cfg, pipe.spec
    d = cfg.to_dict()
    n_drop = n_drop_for(cfg.ratio, num_layers)
    data = {k: v for k, v in d["data"].items() if k not in OBJECTIVE_DATA}
    out = {**{k: d[k] for k in COMMON}, "data": data, "gates": d["gates"],
           "select": selection_content(cfg, n_drop, spec=spec)}
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
    if spec.merges:  # merging.* acts in a merge pipeline only
        out["merging"] = d["merging"]
    return out


# what compensation.describe records for least squares alone (rank only within its lowrank form);
# the scalar fold reads none of them, nor a least-squares objective
LSTSQ_ONLY = ("ridge", "form", "rank", "weighting")


def fit_key(cfg_dict: dict, *, selection: str, drop: list[int]) -> str:
    """Content key of a trial's fit: its selection's key, the drop set and every fit setting
    (_fit_content) with the calibration windows' seqlen; trials that differ only in their heal share it."""
    from trsp_ray.common.digest import content_key
    from trsp_ray.config.run_config import for_method, from_dict

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


def selection_key_of(cfg_dict: dict, fingerprint: str, *, spec: registry.Method, num_layers: int) -> str:
    """The store key of a trial's selection (`spec`: its pipeline's registry entry): TRSP's stage-1
    key, or a baseline's selection key."""
    from trsp_ray.config.run_config import from_dict
    from trsp_ray.method.stage1 import n_drop_for

    cfg = from_dict(cfg_dict)
    if spec.uses_stage1:
        return trial_stage1_key(cfg_dict, fingerprint, n_drop=n_drop_for(cfg.ratio, num_layers))
    return selection_key(cfg_dict, fingerprint, spec=spec, num_layers=num_layers)


def _after_fit(key: str) -> bool:
    return key in AFTER_FIT or key.startswith(tuple(k for k in AFTER_FIT if k.endswith(".")))


def check_keys(base: dict, space, points: list[dict], *, num_layers: int) -> None:
    """One-line TrspError, before any trial, for a searched key (outside AFTER_FIT) that changes what a
    point's pipeline does but none of its selection, stage-1 or fit keys: trials that differ in it
    would share one selection or fit computed for another value."""
    from trsp_ray.config.run_config import from_dict
    from trsp_ray.run.pipeline import named
    from trsp_ray.search.space import apply_point

    for d in space.dims:
        if _after_fit(d.key) or len(_probe_values(d)) < 2:
            continue
        for point in points:
            seen: dict[str, str] = {}
            for value in _probe_values(d):
                cfg = apply_point(base, {**point, d.key: value})
                try:
                    content = _fingerprint(effective(cfg, num_layers=num_layers))
                except TrspError:
                    continue  # a value its pipeline refuses runs nothing
                sel = selection_key_of(cfg, "", spec=named(from_dict(cfg)).spec, num_layers=num_layers)
                keys = (sel, fit_key(cfg, selection=sel, drop=[]))
                if any(keys == other and content != c for c, other in seen.items()):
                    raise TrspError(f"search key {d.key!r} changes what {cfg['method']} does before its heal, but no "
                                    "selection, stage-1 or fit key holds it (its trials would reuse work done for "
                                    "another value); drop it from the space")
                seen[content] = keys


def stage1_floor_cost(cfg, *, num_layers: int) -> float:
    """Dense-forward tokens TRSP's stage 1 spends at least: its gate training (the rounds' steps are
    fixed in advance; probes and refinement only add), by stage1.stage1_cost's formula."""
    from types import SimpleNamespace

    from trsp_ray.method.stage1 import n_drop_for, stage1_cost

    s1, d = cfg.stage1, cfg.data
    rounds = 1 if s1.selection == "oneshot" else n_drop_for(cfg.ratio, num_layers)
    ends = [s1.first_round_steps + r * s1.steps_per_round for r in range(rounds)]
    planned = SimpleNamespace(round_ends=ends, tokens_per_step=d.batch_size * d.seqlen, probe_cost=0)
    return stage1_cost(planned, num_layers=num_layers, train_base=s1.train_base)


def planned_costs(cfg, *, spec: registry.Method, num_layers: int) -> tuple[float, float]:
    """(selection, fit) dense-forward tokens a budgeted point (`spec`: its pipeline's registry entry)
    plans: budget.py's plan, TRSP's floor."""
    from trsp_ray.run import budget

    select = budget.planned_select_cost(cfg, spec=spec, num_layers=num_layers)
    if select is None:
        select = stage1_floor_cost(cfg, num_layers=num_layers)
    return select, budget.planned_compensation_cost(cfg, spec=spec, num_layers=num_layers)


def check_trial_selectors(base: dict, points: list[dict]) -> None:
    """One-line TrspError for a point whose pipeline selects by recovery: a Ray Tune run of its own."""
    from trsp_ray.config.run_config import from_dict
    from trsp_ray.run.pipeline import named
    from trsp_ray.search.space import apply_point

    for point in points:
        spec = named(from_dict(apply_point(base, point))).spec
        if spec.selector == registry.RECOVER_SELECTOR:
            raise TrspError(f"method={spec.name} runs its candidates as Ray Tune trials of its own and cannot be a "
                            f"search trial; run `trsp-ray prune --method {spec.name}`, or search the pipelines whose "
                            "drop sets it auditions")


def check_budgets(base: dict, points: list[dict], *, num_layers: int) -> None:
    """One-line TrspError, before any trial, for a budgeted point whose method does not heal or whose
    selection and fit leave no heal step (compute.heal_steps says by how much)."""
    from trsp_ray.config.run_config import from_dict
    from trsp_ray.plan import compute
    from trsp_ray.run.pipeline import resolve
    from trsp_ray.search.space import apply_point

    for point in points:
        pipe = resolve(from_dict(apply_point(base, point)), budget_layers=False)
        cfg, spec = pipe.cfg, pipe.spec
        if not cfg.heal.compute_budget:
            continue
        if not spec.heal:
            raise TrspError(f"--compute-budget {cfg.heal.compute_budget:g} is spent on a heal, and method "
                            f"{cfg.method!r} does not heal; search heal methods (e.g. shortgpt+heal, trsp+heal)")
        select, comp = planned_costs(cfg, spec=spec, num_layers=num_layers)
        compute.heal_steps(cfg, spec=spec, select=select, comp=comp)


def max_heal_steps(base: dict, points: list[dict], *, num_layers: int) -> int:
    """The most steps any point trains (a budgeted heal at most what its budget buys after the planned
    selection and fit): how many validation reports ASHA may see."""
    from trsp_ray.config.run_config import from_dict
    from trsp_ray.plan import compute
    from trsp_ray.run.methods import method_heal
    from trsp_ray.run.pipeline import resolve
    from trsp_ray.search.space import apply_point

    most = 0
    for point in points:
        pipe = resolve(from_dict(apply_point(base, point)), budget_layers=False)
        cfg, spec = pipe.cfg, pipe.spec
        if cfg.heal.compute_budget and spec.heal:
            select, comp = planned_costs(cfg, spec=spec, num_layers=num_layers)
            most = max(most, compute.heal_steps(cfg, spec=spec, select=select, comp=comp))
        else:
            heal = method_heal(cfg).steps if spec.heal else cfg.heal.steps
            most = max(most, cfg.stage2.steps, heal)
    return most


def trial_stage1_key(cfg_dict: dict, fingerprint: str, *, n_drop: int) -> str:
    """The stage-1 store key of a TRSP trial (its own calibration text included: trial_fingerprint):
    shared by every ratio as stage1_store says, except under a compute budget, where a trial is
    charged what its own selection costs, so each drop count gets its own stage 1 (a longer one would
    charge it the rounds it does not use)."""
    from trsp_ray.common.digest import content_key
    from trsp_ray.run.stage1_store import stage1_key

    key = stage1_key(cfg_dict, trial_fingerprint(cfg_dict, fingerprint))
    return content_key({"stage1": key, "n_drop": n_drop}) if cfg_dict["heal"]["compute_budget"] else key


def budgeted(cfg, *, spec: registry.Method, drop: list[int], select_cost: float, num_layers: int, hidden: int):
    """(cfg whose heal has the steps heal.compute_budget leaves, the fit's cost for `drop`): the
    selection's measured cost and the fit's exact cost for this drop set, so every trial's total lies
    within one heal step below the budget (compute.heal_steps). Without a budget: cfg unchanged.
    `spec`: the trial's pipeline's registry entry."""
    from trsp_ray.config.run_config import for_method, sized
    from trsp_ray.plan import compute
    from trsp_ray.run import budget

    fit = budget.fit_cost(sized(for_method(cfg), hidden=hidden), spec=spec, drop=drop, num_layers=num_layers)
    if not (cfg.heal.compute_budget and spec.heal):
        return cfg, fit
    return budget.with_heal_steps(cfg, compute.heal_steps(cfg, spec=spec, select=select_cost, comp=fit, drop=drop)), fit
