"""A pipeline resolved once, where a run starts: selector x fit x heal recipe, on this model.

`resolve(cfg)` reads the model's config.json (no weights) and decides, in this order and nowhere
else: the family's fallback (a compensating pipeline on a family no fold reaches runs without its
fit, said in the log), the fit the name spells and its settings (config.for_method), the fit's
calibration sized to the hidden size and refused below the floor, and the heal steps that
heal.compute_budget buys after the selection's and the fit's planned cost (budget.py). The result, a
`Pipeline`, carries the config every stage reads, what was decided and why, the planned compute
split and whether Ray Train workers run it; the one process (driver.run, `prune --dry-run`), the
workers (train.run_distributed), the jobs, the plan and the benchmark's rows start from it, and the
manifest and MLflow record `to_dict()`.

A pipeline is named (`tail+cos+heal.tail`, registry.method) or given as a mapping, on the command
line as a YAML file (`--method pipeline.yaml`) or under `method:` in a config file:

    selector: tail      # trsp | shortgpt | sleb | random | tail | angular | merge
    fit: cosine         # none | comp (lstsq) | cos (cosine) | scalar
    heal: tail          # none | all | lora | tail | map
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from trsp_ray.common.errors import TrspError
from trsp_ray.common.logs import log
from trsp_ray.config import registry


@dataclass(frozen=True)
class Pipeline:
    requested: str  # the pipeline asked for
    cfg: object  # the RunConfig every stage reads: cfg.method is the pipeline that runs
    fallback: str | None = None  # why the pipeline that runs differs from the one asked for
    hidden: int | None = None  # the model's hidden size (None: config.json unreadable or not needed)
    num_layers: int | None = None  # decoder layers (read when a compute budget is planned)

    @property
    def name(self) -> str:
        return self.cfg.method

    @functools.cached_property
    def spec(self) -> registry.Method:
        """The registry's entry of the pipeline that runs, read once per Pipeline: what the stages,
        workers and plans read (selector, ranking, stage2, heal, fit, recipe) instead of its name."""
        return registry.method(self.name)

    @property
    def fit(self) -> str | None:
        """The fit that runs: lstsq (mse | cosine objective) | scalar, or None."""
        c = self.cfg.compensation
        if c.method == "none":
            return None
        return f"{c.method} ({c.objective})" if c.method == "lstsq" else c.method

    @property
    def recipe(self) -> str | None:
        """Which weights the heal or stage 2 trains (None: nothing is trained)."""
        from trsp_ray.config.run_config import heal_recipe

        spec = self.spec
        if spec.heal:
            return heal_recipe(self.cfg, heal_method=True)[0]
        return self.cfg.stage2.trainable if spec.stage2 and self.cfg.stage2.enabled else None

    @property
    def on_workers(self) -> bool:
        """Whether Ray Train workers can run it (registry.on_workers; the route decides whether they do)."""
        return registry.on_workers(self.name)

    def compute(self) -> dict:
        """The planned compute split in dense-forward tokens (budget.Budget, split once per Pipeline):
        select (None for TRSP's stage 1, known only after it runs), fit, teacher, heal (steps x one
        step of its recipe, the teacher's forward included) and total; None where the model's layers
        are unknown."""
        b = self.budget
        if b is None:
            return {"select": None, "fit": None, "heal_steps": training_steps(self.cfg, spec=self.spec),
                    "heal": None, "total": None, "budget": self.cfg.heal.compute_budget or None}
        return {"select": b.selection, "fit": b.fit, "heal_steps": b.steps, "heal": b.heal + b.teacher,
                "teacher": b.teacher, "heal_tokens": b.tokens, "seqlen": b.seqlen, "batch": b.batch,
                "total": b.spent, "budget": b.total}

    @functools.cached_property
    def budget(self):
        """The run's budget.Budget on this model (None where its layers are unknown)."""
        from trsp_ray.run import budget

        if not self.num_layers:
            return None
        return budget.split(self.cfg, spec=self.spec, num_layers=self.num_layers,
                            steps=training_steps(self.cfg, spec=self.spec))

    def describe(self) -> str:
        """One line for the log: what runs, and what was decided for this model."""
        c = self.cfg.compensation
        fit = "no fit" if self.fit is None else f"fit {self.fit}" + (
            f" on {c.windows} x {self.cfg.data.seqlen} tokens" if c.windows else "")
        steps = training_steps(self.cfg, spec=self.spec)
        train = "no training" if self.recipe is None else f"{'heal' if self.spec.heal else 'stage 2'} " \
                                                          f"{self.recipe} {steps} steps"
        said = f" (asked for {self.requested}: {self.fallback})" if self.fallback else ""
        return f"pipeline {self.name}: selector {self.spec.selector}, {fit}, {train}{said}"

    def to_dict(self) -> dict:
        """What the manifest and MLflow record of the pipeline (plain values)."""
        return {"requested": self.requested, "name": self.name, "selector": self.spec.selector, "fit": self.fit,
                "recipe": self.recipe, "fallback": self.fallback, **{f"compute_{k}": v for k, v in
                                                                       self.compute().items()}}


def named(cfg) -> Pipeline:
    """The Pipeline `cfg` names, with nothing decided for a model and no file read: a config resolved
    where its run started (a Ray Train worker's plain dict, STYLE 3), or one planned before any run
    (the reproduction's cells, a hand-over's check)."""
    return Pipeline(requested=cfg.method, cfg=cfg)


def training_steps(cfg, *, spec: registry.Method) -> int:
    """Steps `cfg`'s pipeline (`spec`, its registry entry) trains: stage 2's, or its heal's (methods.method_heal)."""
    from trsp_ray.run.methods import method_heal

    if spec.stage2 and cfg.stage2.enabled:
        return cfg.stage2.steps
    return method_heal(cfg).steps if spec.heal else cfg.heal.steps


def _model_config(model: str):
    """The model's config.json (transformers' AutoConfig, read-only here), or None when unreadable
    (check_inputs then says why in one line). A search resolves every grid point and probe value:
    the file is read once per path and modification time."""
    from pathlib import Path

    from trsp_ray.data import assets

    try:
        path = assets.resolve_model(model)
    except (OSError, ValueError, TrspError):
        return None
    config = Path(path) / "config.json"
    return _read_config(str(path), config.stat().st_mtime_ns if config.is_file() else None)


@functools.lru_cache(maxsize=32)
def _read_config(path: str, mtime: int | None):
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(path)
    except (OSError, ValueError):
        return None


def resolve(cfg, *, hidden: int | None = None, budget_layers: bool = True) -> Pipeline:
    """`cfg`'s pipeline on its model, decided once (module doc). `hidden`: the model's hidden size
    when the caller knows it without a config.json (the planner's --model-config); `budget_layers`:
    read the number of layers (and check model, texts and ratio: workbench.check_inputs) to plan a
    compute budget. One-line TrspError for anything that cannot run, before any weight loads."""
    from trsp_ray.config.run_config import for_method, replace, sized, uncompensated
    from trsp_ray.method.compensation_forms import check_tokens
    from trsp_ray.models import families

    requested, spec = cfg.method, registry.method(cfg.method)
    config = _model_config(cfg.model) if hidden is None else None
    if config is not None and config.model_type not in families.FAMILIES:
        config = None  # an unsupported family is check_inputs' one-line error
    fallback = None
    if spec.compensate and cfg.compensation.method == "auto" and config is not None:
        reason = families.fold_refusal(config)
        if reason:  # the default on Gemma 2/3 with a fit asked for by default only
            fallback = f"no compensation on this model ({reason}); running {uncompensated(cfg.method)}"
            log(f"method {cfg.method}: {fallback}")
            cfg = replace(cfg, method=uncompensated(cfg.method))
            spec = registry.method(cfg.method)  # the pipeline that runs
    out = for_method(cfg)
    hidden = hidden if hidden is not None else (families.hidden_size(config) if config is not None else None)
    if out.compensation.method != "none" and hidden is not None:
        out = sized(out, hidden=hidden)  # compensation.windows 0: sized to the model
        c = out.compensation
        if c.method == "lstsq" and (config is None or not families.fold_refusal(config)):
            # too few tokens per map column: refused before any weight loads (a family no fold
            # reaches is refused by name when the fit runs)
            check_tokens(tokens=c.windows * out.data.seqlen, hidden=hidden, form=c.form,
                         minimum=c.min_tokens_per_column)
    layers = None
    if out.heal.compute_budget and budget_layers:
        from trsp_ray.run import budget
        from trsp_ray.run.workbench import check_inputs

        layers = check_inputs(out)
        out = budget.resolve(out, spec=spec, num_layers=layers)
    elif config is not None:
        layers = families._get(config, families.FAMILIES[config.model_type].config_path).num_hidden_layers
    pipe = Pipeline(requested=requested, cfg=out, fallback=fallback, hidden=hidden, num_layers=layers)
    if out.heal.compute_budget and budget_layers:
        log(pipe.budget.describe())
    return pipe


def read_yaml(path: str) -> str:
    """The pipeline name of a YAML file in the mapping form (module doc); one-line TrspError otherwise."""
    from pathlib import Path

    import yaml

    p = Path(path)
    if not p.is_file():
        raise TrspError(f"pipeline file {path!r} does not exist; pass a YAML file of selector, fit, heal "
                        f"or a pipeline name ({registry.GRAMMAR})")
    try:
        spec = yaml.safe_load(p.read_text())
    except yaml.YAMLError as exc:
        raise TrspError(f"pipeline file {path!r} is not valid YAML: {str(exc).splitlines()[0]}") from None
    return registry.name_of(spec)
