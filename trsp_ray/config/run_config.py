"""One typed, validated configuration tree for a run, loadable from YAML with `a.b=value` overrides.

Every section is a frozen dataclass that checks itself in `__post_init__` and raises a one-line
`TrspError` naming the bad value and what is valid. `to_dict()` gives the plain dict that crosses
Ray boundaries and lands in MLflow params and the export manifest.
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from trsp_ray.common.errors import TrspError
from trsp_ray.config import registry
from trsp_ray.config.registry import DEFAULT_METHOD
from trsp_ray.config.registry import method as method_spec
from trsp_ray.config.sections import (
    BaselineConfig,
    CompensationConfig,
    DataConfig,
    DistributedConfig,
    GateConfig,
    HealConfig,
    MergeConfig,
    RecoveryConfig,
    Stage1Config,
    Stage2Config,
    TrackingConfig,
    _choice,
    _positive,
)
from trsp_ray.config.selection import SelectionConfig
from trsp_ray.method.recipes import MAP_RECIPE, PARTIAL_RECIPES


def heal_recipe(cfg, *, heal_method: bool) -> tuple[str, int]:
    """(trainable, lora_rank) of the heal `cfg` runs: a heal method's heal (`heal_method`, stage 2's
    budget) trains stage2.trainable unless heal.trainable names another recipe than all; an extra heal
    after any other method trains heal.trainable. One rule for one process, the workers and the plans."""
    h, s2 = cfg.heal, cfg.stage2
    if heal_method and h.trainable == "all":
        return s2.trainable, s2.lora_rank
    return h.trainable, h.lora_rank


def check_heal_recipe(cfg, *, method, stage2: bool) -> None:
    """One-line refusals of a recipe the run cannot serve, before any work (`method`: the resolved
    registry.Method; `stage2`: whether TRSP's stage 2 runs; `cfg` with compensation.method resolved,
    config.for_method): tail | map in TRSP's
    own stage 2 (its penalty needs the drop set's layers trained, and no fold precedes it), and map
    without a least-squares fold (there is no map to train)."""
    if stage2 and cfg.stage2.trainable in PARTIAL_RECIPES:
        raise TrspError(f"stage2.trainable={cfg.stage2.trainable!r} is a heal recipe; TRSP's stage 2 (method="
                        f"{method.name}) trains all or lora weights; use stage2.trainable=all|lora, or a heal method "
                        f"(e.g. trsp+heal) with heal.trainable={cfg.stage2.trainable}")
    heals = (method.heal and cfg.stage2.steps + cfg.heal.steps > 0) or cfg.heal.steps > 0
    trainable, _ = heal_recipe(cfg, heal_method=method.heal)
    if heals and trainable == MAP_RECIPE and cfg.compensation.method != "lstsq":
        raise TrspError(f"heal.trainable=map trains only the down_proj weights a least-squares fold wrote its maps "
                        f"into, and compensation.method={cfg.compensation.method} folds no map; use a compensating "
                        f"method (e.g. {method.selector}+comp+heal) or heal.trainable=all|lora|tail")


@dataclass(frozen=True)
class RunConfig:
    model: str = "smollm2-135m"
    # ShortGPT selection + least-squares compensation + heal: best at equal total compute (README)
    method: str = DEFAULT_METHOD
    ratio: float = 0.25  # fraction of decoder layers to drop; n_drop = round(ratio * L)
    output: str | None = None  # export directory; None = do not export
    seed: int = 0
    device: str = "cpu"  # cpu | cuda | auto
    # Model dtype: auto = fp32 on CPU, bf16 on CUDA. Gates, and the fp32 master copies and Adam
    # moments of trained bf16/fp16 weights, stay fp32 (training.TorchStepper says why).
    dtype: str = "auto"  # auto | bf16 | fp16 | fp32
    threads: int | None = None  # torch intra-op threads (None = torch default)
    checkpoint_dir: str | None = None  # stores, checkpoints; default $TRSP_RAY_CHECKPOINT_DIR, else ./runs/checkpoints
    data: DataConfig = field(default_factory=DataConfig)
    gates: GateConfig = field(default_factory=GateConfig)
    stage1: Stage1Config = field(default_factory=Stage1Config)
    stage2: Stage2Config = field(default_factory=Stage2Config)
    heal: HealConfig = field(default_factory=HealConfig)
    recovery: RecoveryConfig = field(default_factory=RecoveryConfig)
    compensation: CompensationConfig = field(default_factory=CompensationConfig)
    merging: MergeConfig = field(default_factory=MergeConfig)
    baselines: BaselineConfig = field(default_factory=BaselineConfig)
    selection: SelectionConfig = field(default_factory=SelectionConfig)
    tracking: TrackingConfig = field(default_factory=TrackingConfig)
    distributed: DistributedConfig = field(default_factory=DistributedConfig)

    def __post_init__(self):
        method_spec(self.method)  # a registered name or a composition (registry.method); else one line
        if not 0.0 < self.ratio < 1.0:
            raise TrspError(f"ratio={self.ratio!r} is not valid; it must be in the open interval (0, 1)")
        _choice("device", self.device, ("cpu", "cuda", "auto"))
        r = self.recovery
        if r.objective == "kd" and self.distributed.workers > 0 and (r.teacher == "live" or r.kd_topk == 0):
            raise TrspError(f"recovery.objective=kd with recovery.teacher={r.teacher}, kd_topk={r.kd_topk} is not "
                            f"available with distributed.workers={self.distributed.workers}: the workers distil from "
                            "the stored teacher only (no second model beside the student); use recovery.teacher="
                            "auto|stored with kd_topk >= 1, recovery.objective=ce or distributed.workers=0")
        _choice("dtype", self.dtype, ("auto", "bf16", "fp16", "fp32"))
        if self.threads is not None:
            _positive("threads", self.threads)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def _coerce(value: Any, annotation: Any, name: str) -> Any:
    """Check/convert a YAML-parsed value against a dataclass field annotation (str form)."""
    ann = str(annotation).replace(" ", "")
    optional = "None" in ann
    if value is None:
        if optional:
            return None
        raise TrspError(f"{name}=None is not valid; it needs a value of type {ann}")
    base = ann.replace("|None", "").replace("None|", "")
    try:
        if base == "bool":
            if isinstance(value, bool):
                return value
            raise ValueError
        if base == "int":
            if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
                raise ValueError
            return int(value)
        if base == "float":
            if isinstance(value, bool):
                raise ValueError
            return float(value)
        if base == "str":
            return str(value)
    except (TypeError, ValueError):
        raise TrspError(f"{name}={value!r} is not valid; it must be of type {base}") from None
    return value


def from_dict(data: dict, cls: type = RunConfig, prefix: str = "") -> Any:
    """Build a config dataclass from a nested dict, rejecting unknown keys by name."""
    if not isinstance(data, dict):
        raise TrspError(f"config section {prefix or '<root>'!r} must be a mapping, got {data!r}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    kwargs = {}
    for key, value in data.items():
        name = f"{prefix}{key}"
        if key not in fields:
            valid = ", ".join(f"{prefix}{k}" for k in fields)
            raise TrspError(f"unknown config key {name!r}; valid keys here: {valid}")
        hint = hints[key]
        if dataclasses.is_dataclass(hint):
            kwargs[key] = from_dict(value, hint, prefix=f"{name}.")
        else:
            kwargs[key] = _coerce(value, fields[key].type, name)
    return cls(**kwargs)


def apply_overrides(data: dict, overrides: list[str]) -> dict:
    """Apply `a.b=value` strings (value parsed as YAML) to a nested dict, returning a new dict."""
    import copy

    import yaml

    out = copy.deepcopy(data)
    for item in overrides:
        item = item[2:] if item.startswith("--") else item
        if "=" not in item:
            raise TrspError(f"override {item!r} is not valid; write it as key.path=value")
        key, raw = item.split("=", 1)
        value = yaml.safe_load(raw) if raw != "" else None
        node = out
        parts = key.strip().split(".")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise TrspError(f"override {key!r} is not valid; {part!r} is not a config section")
        node[parts[-1]] = value
    return out


def load_config(path: str | None = None, overrides: list[str] | None = None, base: dict | None = None) -> RunConfig:
    """Config from an optional YAML file, then `base` values, then overrides (last wins)."""
    import yaml

    data: dict = {}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise TrspError(f"config file {path!r} does not exist; pass a YAML file")
        try:
            data = yaml.safe_load(p.read_text()) or {}
        except yaml.YAMLError as exc:
            def at(mark) -> str:  # marks are 0-based; editors count from 1
                return f"line {mark.line + 1}, column {mark.column + 1}"

            mark, start = getattr(exc, "problem_mark", None), getattr(exc, "context_mark", None)
            what = getattr(exc, "problem", None) or str(exc).splitlines()[0]
            where = f" at {at(mark)}" if mark is not None else ""
            # an unclosed bracket is reported at the end of the file; say where it was opened
            opened = f" ({exc.context} from {at(start)})" if start is not None and exc.context else ""
            raise TrspError(f"config file {path!r} is not valid YAML{where}: {what}{opened}") from None
        if not isinstance(data, dict):
            raise TrspError(f"config file {path!r} must hold a YAML mapping, got {type(data).__name__}")
    if isinstance(data.get("method"), dict):  # a pipeline's mapping form: {selector, fit, heal}
        data = {**data, "method": registry.name_of(data["method"])}
    merged = apply_overrides(data, [f"{k}={_yaml_value(v)}" for k, v in _flat(base or {}).items()])
    merged = apply_overrides(merged, overrides or [])
    return from_dict(merged)


def _flat(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def _yaml_value(v: Any) -> str:
    import yaml

    return yaml.safe_dump(v, default_flow_style=True).strip().removesuffix("...").strip()


def uncompensated(method: str) -> str:
    """The method that runs as `method` without its compensation (shortgpt+comp+heal -> shortgpt+heal)."""
    spec = method_spec(method)
    named = [m.name for m in registry.METHODS.values() if not m.compensate
             and (m.selector, m.ranking, m.heal, m.stage2, m.recipe) == (spec.selector, spec.ranking, spec.heal,
                                                                      spec.stage2, spec.recipe)]
    return named[0] if named else registry.compose(spec.selector, heal=spec.heal,
                                                   recipe=spec.recipe if spec.recipe != "map" else None)


def compensated(cfg: RunConfig, *, method: str | None = None) -> RunConfig:
    """`cfg` with its compensation switched on for `method` (a compensating method, or a +comp row
    when None): compensation.method as configured, least squares for auto (the default). An explicit
    none is refused in one line: the fit a compensating method names never runs against the config,
    and is never dropped without the method's name saying so."""
    c = cfg.compensation.method
    if c == "none":
        instead = (f"--method {uncompensated(method)} for no compensation" if method is not None
                   else "the rows without +comp for no compensation")
        where = f"--method {method}, which compensates" if method is not None else "the +comp rows"
        raise TrspError(f"compensation.method='none' is not valid with {where}; use {instead}, or leave "
                        "compensation.method at auto (least squares) or set lstsq|scalar")
    return cfg if c != "auto" else replace(cfg, **{"compensation.method": "lstsq"})


def named_fit(cfg: RunConfig, fit: str, *, method: str) -> RunConfig:
    """`cfg` with the fit a pipeline's name spells (registry.FITS): compensation.method (and objective)
    set where they are left at their defaults; a setting that contradicts the name is refused in one line."""
    want_method, want_objective = registry.FITS[fit]
    c = cfg.compensation
    if c.method not in ("auto", want_method):
        raise TrspError(f"compensation.method={c.method!r} contradicts --method {method} (its +{fit} is "
                        f"{want_method}); leave compensation.method at auto or set {want_method}")
    out = replace(cfg, **{"compensation.method": want_method})
    if want_objective is not None:
        if c.objective not in (CompensationConfig().objective, want_objective):
            raise TrspError(f"compensation.objective={c.objective!r} contradicts --method {method} (its +{fit} "
                            f"fits {want_objective}); leave compensation.objective unset")
        out = replace(out, **{"compensation.objective": want_objective})
    return out


def for_method(cfg: RunConfig, method: str | None = None, *, stage2: bool | None = None) -> RunConfig:
    """`cfg` as `method` (default cfg.method) runs it, with compensation.method resolved: auto is least
    squares for a compensating method (shortgpt+comp+heal, the default; compensated) and none for
    any other; an explicit lstsq|scalar after any other method's selection is run as configured.
    Applied where a run starts (driver.run and `prune --dry-run` through pipeline.resolve, the
    Ray Train path, the jobs, the planner, methods.apply_method), so the manifest, MLflow params, the
    budget and the plan all see the compensation that runs.

    A compensation after TRSP's stage 2 is refused in one line: the fit reads the dense model's
    activations and would fold into weights stage 2 has trained. `stage2`: whether stage 2 runs
    (default: as the method and stage2.enabled / stage2.steps say)."""
    name = method or cfg.method
    spec = method_spec(name)
    if spec.fit is not None and spec.fit != "comp":  # cos | scalar: the name says which fit
        cfg = named_fit(cfg, spec.fit, method=name)
    if spec.recipe is not None:  # heal.RECIPE: the name says which weights the heal trains
        cfg = replace(cfg, **{"stage2.trainable": spec.recipe, "heal.trainable": spec.recipe})
    if spec.compensate:
        out = compensated(cfg, method=name)
    elif cfg.compensation.method == "auto":
        out = replace(cfg, **{"compensation.method": "none"})
    else:
        out = cfg
    if stage2 is None:
        stage2 = spec.stage2 and cfg.stage2.enabled and cfg.stage2.steps > 0
    comp = out.compensation.method
    if spec.merges and comp != "none":
        raise TrspError(f"compensation.method={comp!r} is not available with --method {name}: a merge repairs each "
                        "pair itself (merging.refit); leave compensation.method at auto")
    if stage2 and comp != "none":
        able = ", ".join(m.name for m in registry.METHODS.values() if not m.stage2)
        raise TrspError(f"compensation.method={comp!r} is not available with --method {name}: its stage 2 trains "
                        "the weights that a fit on the dense model's activations would fold into; compensate one "
                        f"of {able}, or set stage2.enabled=false")
    check_heal_recipe(out, method=spec, stage2=bool(stage2))  # tail | map where nothing can train them
    return out


def sized(cfg: RunConfig, *, hidden: int) -> RunConfig:
    """`cfg` with compensation.windows 0 (auto) sized from the model's hidden size
    (compensation_forms.sized_windows): what every path that fits reads, resolved once where the run
    starts (pipeline.resolve: one process, the workers, the benchmark, the plan)."""
    from trsp_ray.method.compensation_forms import sized_windows

    c = cfg.compensation
    if c.windows:
        return cfg
    windows = sized_windows(windows=0, hidden=hidden, seqlen=cfg.data.seqlen, tokens_per_column=c.tokens_per_column)
    return replace(cfg, **{"compensation.windows": windows})


def replace(cfg: Any, **changes: Any) -> Any:
    """dataclasses.replace that accepts dotted keys: replace(cfg, **{"stage1.lambda1": 0.01})."""
    nested: dict[str, dict] = {}
    flat = {}
    for key, value in changes.items():
        head, _, rest = key.partition(".")
        if rest:
            nested.setdefault(head, {})[rest] = value
        else:
            flat[key] = value
    for head, sub in nested.items():
        flat[head] = replace(getattr(cfg, head), **sub)
    return dataclasses.replace(cfg, **flat)


def trial_config(cfg: RunConfig) -> RunConfig:
    """The configuration a selection-by-recovery trial heals with (run/audition_plan.py): the
    pipeline's, its heal at the calibration's windows without a budget (data.seqlen x
    data.batch_size, a constant learning rate), with the trials' objective, its teacher beside it,
    one process."""
    return replace(cfg, **{"heal.compute_budget": 0.0, "heal.seqlen": 0, "heal.batch_size": 0, "heal.schedule":
                           "constant", "recovery.objective": cfg.selection.objective, "recovery.teacher": "auto",
                           "distributed.workers": 0, "tracking.enabled": False})
