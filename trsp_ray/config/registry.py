"""The methods and the benchmark rows, by name: what each one selects with, and how it recovers.

A *method* is what `trsp-ray prune --method` runs: a selector (how the drop set is chosen) plus
the recovery that follows by default: TRSP's stage 2, a heal of the pruned model, or none, with or
without a closed-form compensation of the cut before it. `shortgpt+comp+heal` (ShortGPT's
Block-Influence selection, a norm-weighted least-squares fold of each removed block's boundary, then
a heal with stage 2's weight-update budget) is the default: it is the best pipeline the comparison
found at equal total compute (docs/results.md: against `shortgpt+heal` given the compensation's
compute as extra heal steps it wins held-out perplexity beyond the seed spread and ties news
perplexity, LAMBADA and the zero-shot tasks; `trsp+heal` wins held-out perplexity at equal
weight-update tokens only, at 3x the compute, and loses LAMBADA). A *row* of the comparison is a
method's drop set with one recovery (none, TRSP's stage 2, or a heal) in one budget group (SPEC
section 5):

- ``selection``: the drop set alone, no weight is trained;
- ``trained``: every row trains the same number of weight-update tokens with the same recovery
  objective (stage 2 for the TRSP rows, a heal after the baselines' selections).

Every package reads names from here; nothing else spells out a list of methods.
"""

from __future__ import annotations

from dataclasses import dataclass

from trsp_ray.common.errors import TrspError
from trsp_ray.method.recipes import HEAL_RECIPES

TRSP_SELECTOR = "trsp"  # the selector that is TRSP's stage 1
SHORTGPT_SELECTOR = "shortgpt"  # Block Influence: the default's selector, also run on Ray Train workers
SLEB_SELECTOR = "sleb"  # the report notes how many windows it scored
RANDOM_SELECTOR = "random"  # a seeded random drop set: no forward pass, no compute
TAIL_SELECTOR = "tail"  # the last candidates: no forward pass, no compute
ANGULAR_SELECTOR = "angular"  # one dense forward of ShortGPT's windows, every layer boundary kept
# pairs of adjacent blocks merged into one block each (trsp_ray/method/merge.py), not dropped: its "drop
# set" is the second layer of every pair, the layers the merged model no longer has
MERGE_SELECTOR = "merge"
# chosen by how well each candidate recovers: every candidate drop set (method/candidates.py) gets a short
# distillation heal as a Ray Tune trial under ASHA, ranked on the calibration's validation tail
RECOVER_SELECTOR = "recover"


SELECTORS = (TRSP_SELECTOR, SHORTGPT_SELECTOR, SLEB_SELECTOR, RANDOM_SELECTOR, TAIL_SELECTOR, ANGULAR_SELECTOR,
             MERGE_SELECTOR, RECOVER_SELECTOR)
# A pipeline's fit, by the token its name spells: the map fitted after removal and folded before the
# heal (trsp_ray/method/compensation.py): comp = least squares (the default's), cos = ReplaceMe's cosine
# objective for the same map, scalar = Prune&Comp's norm-ratio scales
FITS = {"comp": ("lstsq", "mse"), "cos": ("lstsq", "cosine"), "scalar": ("scalar", None)}
# A heal's recipe, by the suffix its name spells (`+heal.tail`): which weights the heal trains
# (heal.trainable): HEAL_RECIPES of trsp_ray/method/recipes.py; a bare `+heal` trains what stage2.trainable
# says (all weights by default)


@dataclass(frozen=True)
class Method:
    """A pipeline: selector x fit x recovery, read from its name (`method`) once where a run starts."""

    name: str
    selector: str  # trsp | shortgpt | sleb | random | tail | angular: which computation chooses the drop set
    ranking: str = "order"  # trsp only: "order" = the iterative drop order, "round1" = one-shot ranking
    stage2: bool = False  # TRSP's stage 2 runs by default (stage2.enabled can still turn it off)
    heal: bool = False  # the pruned model is healed with stage 2's budget (stage2.steps, lr, trainable)
    # the cut is compensated after removal, before the heal (a FITS token; None = no fit): the
    # configured compensation (compensation.*) with the method and objective the token names
    # (config.for_method)
    fit: str | None = None
    recipe: str | None = None  # a HEAL_RECIPES entry the name spells; None = stage2.trainable as configured

    @property
    def uses_stage1(self) -> bool:
        return self.selector == TRSP_SELECTOR

    @property
    def compensate(self) -> bool:
        return self.fit is not None

    @property
    def merges(self) -> bool:
        """Its pairs are merged (method/merge.py), not removed: no fit (on workers: distributed/merging.py)."""
        return self.selector == MERGE_SELECTOR


METHODS: dict[str, Method] = {m.name: m for m in (
    Method("trsp+heal", "trsp", heal=True),
    Method("trsp", "trsp", stage2=True),
    Method("trsp-no-stage2", "trsp"),
    Method("trsp-oneshot", "trsp", ranking="round1", stage2=True),
    Method("shortgpt", "shortgpt"),
    Method("shortgpt+heal", "shortgpt", heal=True),
    Method("shortgpt+comp+heal", "shortgpt", heal=True, fit="comp"),
    Method("sleb", "sleb"),
    Method("sleb+heal", "sleb", heal=True),
    Method("random", "random"),
    # the 2024-26 anchors' selectors: the tail cut (the last layers before the protected tail) and the
    # angular-distance block (the contiguous block whose input and output are closest in angle)
    Method("tail", "tail"),
    Method("tail+heal", "tail", heal=True),
    Method("tail+comp+heal", "tail", heal=True, fit="comp"),
    Method("angular", "angular"),
    Method("angular+heal", "angular", heal=True),
    Method("angular+comp+heal", "angular", heal=True, fit="comp"),
    # FlattenGPT's merge (issue 51): each pair's own closed-form refit is its repair, so no +FIT
    Method("merge", "merge"),
    Method("merge+heal", "merge", heal=True),
    # issue 50: the drop set that recovers best in a short distillation heal, then the fit and the heal
    Method("recover+heal", "recover", heal=True),
    Method("recover+comp+heal", "recover", heal=True, fit="comp"),
)}
METHOD_NAMES = tuple(METHODS)
# the best pipeline found on every column at equal total compute; config.py's and the jobs' default
DEFAULT_METHOD = "shortgpt+comp+heal"
STAGE1_ONLY = "trsp-no-stage2"  # the TRSP method that runs stage 1 alone (shared stage-1 cells and plans)
TRSP_METHODS = tuple(m.name for m in METHODS.values() if m.uses_stage1)  # what a search tunes
# what Ray Train workers run: the TRSP methods, and ShortGPT + heal with or without the compensation
# (Block Influence on the workers' shards, the workers' data-parallel fit, then the workers' heal),
# and the tail cut (no forward pass) with or without it
WORKER_METHODS = TRSP_METHODS + ("shortgpt+heal", "shortgpt+comp+heal", "tail+heal", "tail+comp+heal",
                                  "merge", "merge+heal")
# heal methods whose drop set one process chooses and hands to the workers, which heal it: SLEB's
# layer-by-layer replay is not built on the workers; its forward-only selection fits one device
HANDED_OVER_METHODS = tuple(m.name for m in METHODS.values()
                            if m.heal and m.name not in WORKER_METHODS and not m.merges)
STAGE2_METHODS = tuple(m.name for m in METHODS.values() if m.stage2)  # the methods stage2.* settings act in
BASELINE_SELECTORS = ("shortgpt", "sleb", "random", "tail", "angular")
# Baselines that score layers with forward passes (memory plans size them); SLEB and the angular
# block also keep every layer's input of a batch. Random and tail selection cost nothing.
FORWARD_SELECTORS = ("shortgpt", "sleb", "angular", "merge")
LAYER_INPUT_SELECTORS = ("sleb", "angular", "merge")


@dataclass(frozen=True)
class Row:
    name: str
    method: str | None  # None = the dense model
    recovery: str  # none | stage2 | heal
    group: str  # dense | selection | trained
    default: bool = True  # `trsp-ray benchmark --full` runs it unless --rows says otherwise
    quick: bool = False  # the README's `trsp-ray benchmark` (15 minutes on 2 CPU cores) runs it
    # a healed baseline that also gets the TRSP selection's extra compute as extra heal steps, so it
    # is compared at equal *total* compute (SPEC section 5), not only at equal weight-update tokens
    equal_compute: bool = False
    # the drop set is compensated after removal, before any heal (a FITS token, as a method's `fit`:
    # comp = the configured compensation.method, least squares when it is auto; cos | scalar = that fit)
    fit: str | None = None
    recipe: str | None = None  # the heal's HEAL_RECIPES entry (None = stage2.trainable as configured)
    # a healed row that gets what the +comp rows' compensation of its drop set costs as extra heal
    # steps: is a closed-form fit worth more than the same compute spent healing? (SPEC section 5)
    comp_compute: bool = False
    # a partial heal (tail, map, LoRA) that gets, as extra steps of its own recipe, what a full heal of
    # the same steps would cost beyond it: partial and full heals compared at equal total compute
    full_compute: bool = False
    # the recovery objective this row trains with (None = recovery.objective as configured); an '@kd'
    # row distils from the dense model with as many steps as spend the cross-entropy row's training
    # compute (the teacher's forward counted: fewer steps), so the two objectives compare at equal compute
    objective: str | None = None

    @property
    def compensate(self) -> bool:
        return self.fit is not None

    @property
    def is_default(self) -> bool:
        """The row that is what `trsp-ray prune` runs with no --method (DEFAULT_METHOD)."""
        return (self.method is not None and recipe(self.name) == recipe(DEFAULT_METHOD)
                and self.fit == METHODS[DEFAULT_METHOD].fit and self.recipe == METHODS[DEFAULT_METHOD].recipe
                and not self.equal_compute and not self.comp_compute and not self.full_compute
                and self.objective is None)

    @property
    def is_baseline(self) -> bool:
        """A baseline as its authors run it: a baseline selector, healed or not, never compensated (the
        product's own default is compensated, and TRSP's rows are not judged against it as a baseline)."""
        return self.method is not None and METHODS[self.method].selector in BASELINE_SELECTORS and not self.compensate

    @property
    def uses_stage1(self) -> bool:
        return self.method is not None and METHODS[self.method].uses_stage1

    @property
    def pipeline(self) -> str | None:
        """The pipeline name the row runs (None: the dense model): its method's selector with the
        row's fit, heal and recipe (trsp-selection+comp+heal -> trsp+comp+heal); a stage-2 row or a
        bare selection runs its method."""
        if self.method is None:
            return None
        if self.recovery == "stage2" or (self.recovery == "none" and self.fit is None):
            return self.method
        return compose(METHODS[self.method].selector, fit=self.fit, heal=self.recovery == "heal", recipe=self.recipe)


ROWS: dict[str, Row] = {r.name: r for r in (
    Row("dense", None, "none", "dense", quick=True),
    Row("trsp-no-stage2", "trsp-no-stage2", "none", "selection", quick=True),
    Row("shortgpt", "shortgpt", "none", "selection", quick=True),
    Row("sleb", "sleb", "none", "selection"),
    Row("random", "random", "none", "selection"),
    Row("trsp", "trsp", "stage2", "trained"),
    Row("trsp-oneshot", "trsp-oneshot", "stage2", "trained", default=False),  # the paper's ablation
    Row("trsp-selection+heal", "trsp+heal", "heal", "trained", quick=True),  # = `prune --method trsp+heal`
    Row("shortgpt+heal", "shortgpt", "heal", "trained", quick=True),  # = `prune --method shortgpt+heal`
    Row("sleb+heal", "sleb", "heal", "trained"),
    Row("random+heal", "random", "heal", "trained"),
    # (not quick: its 89 heal steps alone take longer than the README job's 15 minutes on 2 cores)
    Row("shortgpt+heal@compute", "shortgpt", "heal", "trained", equal_compute=True),
    Row("sleb+heal@compute", "sleb", "heal", "trained", equal_compute=True),
    Row("trsp-no-stage2+comp", "trsp-no-stage2", "none", "selection", fit="comp"),
    Row("shortgpt+comp", "shortgpt", "none", "selection", fit="comp"),
    Row("trsp-selection+comp+heal", "trsp+heal", "heal", "trained", fit="comp"),
    Row("shortgpt+comp+heal", "shortgpt", "heal", "trained", quick=True, fit="comp"),  # = the default `prune`
    Row("shortgpt+heal@comp", "shortgpt", "heal", "trained", comp_compute=True),
    Row("tail", "tail", "none", "selection", default=False),
    Row("tail+heal", "tail", "heal", "trained", default=False),
    Row("tail+comp+heal", "tail", "heal", "trained", default=False, fit="comp"),
    Row("angular", "angular", "none", "selection", default=False),
    Row("angular+heal", "angular", "heal", "trained", default=False),
    Row("angular+comp+heal", "angular", "heal", "trained", default=False, fit="comp"),
    # merged pairs instead of dropped layers (issue 51), training-free and healed
    Row("merge", "merge", "none", "selection", default=False),
    Row("merge+heal", "merge", "heal", "trained", default=False),
    # the anchors' fits and partial heals on the default's selection and on the tail cut: ReplaceMe's
    # cosine objective for the same map; its "LT" heal of the folded maps alone; Lu et al.'s tail
    # cut healed in lm_head + the last kept layers only (heal.tail_layers)
    Row("shortgpt+cos+heal", "shortgpt", "heal", "trained", default=False, fit="cos"),
    Row("shortgpt+comp+heal.map", "shortgpt", "heal", "trained", default=False, fit="comp", recipe="map"),
    Row("shortgpt+heal.tail", "shortgpt", "heal", "trained", default=False, recipe="tail"),
    Row("tail+heal.tail", "tail", "heal", "trained", default=False, recipe="tail"),
    Row("shortgpt+comp+heal.map@full", "shortgpt", "heal", "trained", default=False, fit="comp", recipe="map",
        full_compute=True),
    Row("shortgpt+heal.tail@full", "shortgpt", "heal", "trained", default=False, recipe="tail", full_compute=True),
    Row("shortgpt+comp+heal.lora@full", "shortgpt", "heal", "trained", default=False, fit="comp", recipe="lora",
        full_compute=True),
    # distillation from the dense model at the cross-entropy rows' training compute (issue 42: the
    # recovery whose accuracy does not fall as its budget grows); the heal-budget curve's rows
    Row("shortgpt+comp+heal@kd", "shortgpt", "heal", "trained", default=False, fit="comp", objective="kd"),
    Row("shortgpt+heal@kd", "shortgpt", "heal", "trained", default=False, objective="kd"),
)}
ROW_NAMES = tuple(ROWS)
DEFAULT_ROWS = tuple(r.name for r in ROWS.values() if r.default)
QUICK_ROWS = tuple(r.name for r in ROWS.values() if r.quick)
# `trsp-ray benchmark --budget-curve`: the default's recovery with cross-entropy and with distillation
# at equal compute, and a partial heal at a full heal's compute, at growing heal budgets (issue 42)
CURVE_ROWS = ("dense", "shortgpt+comp+heal", "shortgpt+comp+heal@kd", "shortgpt+comp+heal.map@full", "merge+heal")
# `trsp-ray benchmark --leave-one-out`: the default against the plain heal at its total compute and
# against its distilled recovery, once per left-out domain
LEAVE_ONE_OUT_ROWS = ("dense", "shortgpt+heal@comp", "shortgpt+comp+heal", "shortgpt+comp+heal@kd")
GROUP_TITLES = {"dense": "dense model", "selection": "selection only (no weight is trained)",
                "trained": "trained (equal weight-update tokens, same recovery objective)"}


# The reproduction grid's rows (reproduce/presets.py), in table order: (row, method or None for the
# dense model). A healed baseline (shortgpt+heal, sleb+heal) is a heal method: stage 2's steps, lr
# and trainable set, the same weights trsp's stage 2 and trsp+heal train (the paper LoRA-healed its
# baselines; its figures stay beside ours as a reference, not as an equal-budget row).
GRID_ROWS = (("dense", None), ("trsp", "trsp"), ("trsp+heal", "trsp+heal"), ("trsp-no-stage2", "trsp-no-stage2"),
             ("trsp-oneshot", "trsp-oneshot"), ("shortgpt", "shortgpt"), ("sleb", "sleb"),
             ("shortgpt+heal", "shortgpt+heal"), ("sleb+heal", "sleb+heal"))


GRAMMAR = ("SELECTOR[+FIT][+heal[.RECIPE]] with SELECTOR " + "|".join(SELECTORS) + ", FIT " + "|".join(FITS)
           + ", RECIPE " + "|".join(HEAL_RECIPES) + " (e.g. tail+cos+heal.tail)")


def method(name: str) -> Method:
    """The pipeline `name` runs: a registered method, or a composition SELECTOR[+FIT][+heal[.RECIPE]]
    (`tail+cos+heal`, `angular+comp+heal.map`, `shortgpt+heal.tail`). TRSP's stage-2 variants (trsp,
    trsp-oneshot, trsp-no-stage2) are registered names only; an unknown name is a one-line error."""
    if name in METHODS:
        return METHODS[name]
    parts = name.split("+") if isinstance(name, str) else []
    selector, rest = (parts[0], parts[1:]) if parts else ("", [])
    fit = rest.pop(0) if rest and rest[0] in FITS else None
    heal = recipe = None
    if rest and (rest[0] == "heal" or rest[0].startswith("heal.")):
        heal, dot, recipe = rest.pop(0).partition(".")
        recipe = recipe if dot else None  # `heal.` names no recipe: refused below
    if selector not in SELECTORS or rest or (recipe is not None and recipe not in HEAL_RECIPES):
        raise TrspError(f"method={name!r} is not valid; choose one of {', '.join(METHOD_NAMES)} or compose "
                        f"{GRAMMAR}")
    if selector == MERGE_SELECTOR and fit is not None:
        raise TrspError(f"method={name!r} is not valid: a merge repairs each pair in closed form itself, and a "
                        f"+{fit} fold would read the dense model's layer that the merge replaced; use merge or "
                        "merge+heal")
    if recipe == "map" and fit is None:
        raise TrspError(f"method={name!r} is not valid: heal.map trains only the maps a fit folded, and it names "
                        f"no fit; use {selector}+comp+heal.map or {selector}+heal")
    return Method(name, selector, heal=heal is not None, fit=fit, recipe=recipe)


def on_workers(name: str, *, drop_given: bool = False) -> bool:
    """Whether Ray Train workers run pipeline `name`: a registered name when WORKER_METHODS (or, with
    a drop set chosen in one process, HANDED_OVER_METHODS) holds it; a composition when it heals after
    a selector the workers run (trsp, shortgpt, tail), or after any selector when its drop set is handed
    over. Its fit and recipe are then checked by the worker settings' refusals (check_worker_settings)."""
    if name in WORKER_METHODS or (drop_given and name in HANDED_OVER_METHODS):
        return True
    m = method(name)
    if m.name in METHODS or not m.heal:
        return False
    return drop_given or m.selector in (TRSP_SELECTOR, SHORTGPT_SELECTOR, TAIL_SELECTOR, MERGE_SELECTOR)


def compose(selector: str, *, fit: str | None = None, heal: bool = False, recipe: str | None = None) -> str:
    """The name of a composed pipeline (the inverse of `method` for compositions)."""
    return "+".join([selector] + ([fit] if fit else []) + ([f"heal.{recipe}" if recipe else "heal"] if heal else []))


# The mapping form of a pipeline (a YAML file given as --method, or `method:` in a config file):
# what each key may say, in the words of the name's parts; FIT_WORDS also takes the fit's own names
FIT_WORDS = {"none": None, "comp": "comp", "lstsq": "comp", "cos": "cos", "cosine": "cos", "scalar": "scalar"}
HEAL_WORDS = {"none": None, "false": None, "true": "", "all": "", **{r: r for r in HEAL_RECIPES if r != "all"}}


def parts_of(name: str) -> dict:
    """The mapping form of a composable pipeline (the inverse of name_of): {selector, fit, heal}."""
    m = method(name)
    return {"selector": m.selector, "fit": m.fit or "none", "heal": (m.recipe or "all") if m.heal else "none"}


def name_of(spec: dict) -> str:
    """The pipeline name of its mapping form, e.g. {selector: tail, fit: cos, heal: tail} -> tail+cos+heal.tail
    ({name: trsp} names a registered method). Keys: selector (required), fit (none|comp|lstsq|cos|cosine|scalar,
    default none), heal (none|all|lora|tail|map or true/false, default none). One-line TrspError otherwise."""
    if not isinstance(spec, dict):
        raise TrspError(f"a pipeline mapping must be a YAML mapping of selector, fit, heal; got {spec!r}")
    if "name" in spec:
        if set(spec) != {"name"}:
            raise TrspError(f"pipeline {spec!r}: give either name or selector/fit/heal, not both")
        return method(str(spec["name"])).name
    unknown = set(spec) - {"selector", "fit", "heal"}
    if unknown or "selector" not in spec:
        raise TrspError(f"pipeline {spec!r} is not valid: it takes the keys selector (one of {'|'.join(SELECTORS)}), "
                        f"fit ({'|'.join(FIT_WORDS)}) and heal ({'|'.join(HEAL_WORDS)})"
                        + (f"; unknown key(s) {', '.join(sorted(map(str, unknown)))}" if unknown else ""))
    fit, heal = str(spec.get("fit", "none")).lower(), str(spec.get("heal", "none")).lower()
    if fit not in FIT_WORDS:
        raise TrspError(f"pipeline fit={spec['fit']!r} is not valid; choose one of {', '.join(FIT_WORDS)}")
    if heal not in HEAL_WORDS:
        raise TrspError(f"pipeline heal={spec['heal']!r} is not valid; choose one of {', '.join(HEAL_WORDS)}")
    if spec["selector"] not in SELECTORS:
        raise TrspError(f"pipeline selector={spec['selector']!r} is not valid; choose one of {', '.join(SELECTORS)}")
    recipe_ = HEAL_WORDS[heal]
    name = compose(spec["selector"], fit=FIT_WORDS[fit], heal=recipe_ is not None, recipe=recipe_ or None)
    return method(name).name  # the grammar's own refusals (a map heal without a fit)


def recipe(name: str) -> tuple[str | None, str]:
    """(selector, recovery) of a method or a row name: what a plan must size (None = the dense model)."""
    if name not in METHODS and name in ROWS:
        r = ROWS[name]
        return (METHODS[r.method].selector if r.method else None), r.recovery
    try:
        m = method(name)
    except TrspError:
        raise TrspError(f"{name!r} is neither a method ({', '.join(METHOD_NAMES)}, or {GRAMMAR}) nor a row "
                        f"({', '.join(ROW_NAMES)})") from None
    return m.selector, "stage2" if m.stage2 else "heal" if m.heal else "none"


def rows(names: list[str] | tuple[str, ...]) -> list[Row]:
    """The rows named, in the order given; an unknown or repeated name is a one-line error."""
    out = []
    for name in names:
        if name not in ROWS:
            raise TrspError(f"unknown benchmark row {name!r}; valid rows: {', '.join(ROW_NAMES)}")
        if ROWS[name] in out:
            raise TrspError(f"benchmark row {name!r} is listed twice; list each row once")
        out.append(ROWS[name])
    return out


def selectors_for(selected: list[Row]) -> list[str]:
    """The selections a set of rows needs, each computed once (TRSP's serves every TRSP row; an
    equal-compute row also needs TRSP's, whose compute it matches)."""
    needed = []
    for row in selected:
        wanted = [METHODS[row.method].selector] if row.method is not None else []
        wanted += [TRSP_SELECTOR] if row.equal_compute else []
        needed += [s for s in wanted if s not in needed]
    return needed
