"""`trsp-ray search`: the search's command line. `register(subparsers)` adds the subcommand.

A space is given as repeatable `--space KEY=SPEC`, where SPEC is a comma list of values
(`--space method=shortgpt+heal,tail+heal,trsp+heal`, `--space ratio=0.25,0.375`) or a range
`KIND:LOW:HIGH` with KIND in uniform, loguniform, int (`--space stage2.lr=loguniform:1e-5:1e-3`), or as
a YAML file (`--space-file`) holding {algorithm, num_samples, seed, objectives, params}. Any key of the
config sections is searchable (search/space.py); a key that acts in only some of the searched
pipelines is dropped from the others' trials (search/pipeline.py).
"""

from __future__ import annotations

import argparse


def _value(text: str):
    """A flag value: numbers as numbers (YAML reads `1e-3` as a string), else YAML."""
    import yaml

    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return yaml.safe_load(text)


def parse_space_args(items: list[str], *, algorithm: str | None, num_samples: int | None, seed: int | None,
                     objectives: str | None, space_file: str | None, seeds: int | None = None) -> dict:
    """A plain space dict from the flags (flags win over the file)."""
    import yaml

    from trsp_ray.common.errors import TrspError
    from trsp_ray.search.space import RANGES

    spec: dict = {}
    if space_file:
        from pathlib import Path

        if not Path(space_file).is_file():
            raise TrspError(f"space file {space_file!r} does not exist; pass a YAML file")
        spec = yaml.safe_load(Path(space_file).read_text()) or {}
    params = dict(spec.get("params") or {})
    for item in items:
        if "=" not in item:
            raise TrspError(f"--space {item!r} is not valid; write KEY=v1,v2 or KEY=loguniform:LOW:HIGH")
        key, raw = item.split("=", 1)
        head = raw.split(":", 1)[0]
        if head in RANGES:
            parts = raw.split(":")
            if len(parts) != 3:
                raise TrspError(f"--space {item!r} is not valid; a range is {head}:LOW:HIGH")
            params[key] = {head: [_value(parts[1]), _value(parts[2])]}
        else:
            params[key] = [_value(v) for v in raw.split(",") if v != ""]
    spec["params"] = params
    for name, value in (("algorithm", algorithm), ("num_samples", num_samples), ("seed", seed), ("seeds", seeds)):
        if value is not None:
            spec[name] = value
    if objectives:
        spec["objectives"] = objectives.split(",")
    return spec


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--space", action="append", default=[], metavar="KEY=SPEC",
                   help="a searched key: values v1,v2,... or uniform|loguniform|int:LOW:HIGH (repeatable); "
                        "selector, fit and heal compose the pipeline (e.g. --space selector=shortgpt,tail "
                        "--space fit=none,comp,cos --space heal=all,tail)")
    p.add_argument("--space-file", default=None, help="YAML search space")
    p.add_argument("--algorithm", choices=("grid", "random", "optuna"), default=None)
    p.add_argument("--num-samples", type=int, default=None, help="random/optuna: number of trials")
    p.add_argument("--seed", type=int, default=None, help="sampler seed")
    p.add_argument("--seeds", type=int, default=None, metavar="N",
                   help="run every point on N seeds (the run's seed and the next N - 1): its objective is their mean, "
                        "the spread is reported (grid and random)")
    p.add_argument("--objectives", default=None, help="optuna: val_ppl or val_ppl,kept_parameters (Pareto)")
    p.add_argument("--search-dir", default="runs/search", help="trial records, stage-1 cache, exports, run log")
    p.add_argument("--name", default="search", help="MLflow parent run name")
    p.add_argument("--no-reuse", action="store_true", help="compute every selection in every trial (for comparison)")
    p.add_argument("--no-asha", action="store_true", help="no early stopping")
    p.add_argument("--cpus-per-trial", type=float, default=1.0)
    p.add_argument("--gpus-per-trial", type=float, default=None,
                   help="GPUs (or a fraction) per trial; default: from the memory planner when the run is on GPUs")
    p.add_argument("--trial-workers", type=int, default=None,
                   help="run each trial's stage 2 on this many Ray Train workers (default: when the planner "
                        "says a trial does not fit one GPU)")
    p.add_argument("--max-concurrent", type=int, default=None, help="default: what the cluster's CPUs/GPUs hold")
    p.add_argument("--eval-actors", type=int, default=1)
    p.add_argument("--eval-gpus-per-actor", type=float, default=None,
                   help="default: what a pruned model's inference needs, on a GPU run")
    p.add_argument("--eval-tasks", default="", help="zero-shot tasks scored for every trial, comma-separated")
    p.add_argument("--register-name", default="trsp-search-best", help="registry name of the best model")
    p.add_argument("--address", default=None, help="Ray cluster address (default: start a local one)")


def options(args) -> "SearchOptions":  # noqa: F821
    from trsp_ray.search.run import SearchOptions

    tasks = tuple(t for t in args.eval_tasks.split(",") if t)
    return SearchOptions(search_dir=args.search_dir, name=args.name, reuse=not args.no_reuse,
                         asha=not args.no_asha, cpus_per_trial=args.cpus_per_trial,
                         gpus_per_trial=args.gpus_per_trial, trial_workers=args.trial_workers,
                         max_concurrent=args.max_concurrent, eval_actors=args.eval_actors,
                         eval_gpus_per_actor=args.eval_gpus_per_actor, eval_tasks=tasks,
                         register_name=args.register_name or None, address=args.address)


def search_config(args):
    """(run config, search space) of parsed search flags: --compute-budget is heal.compute_budget of
    every trial (searchable itself: --space heal.compute_budget=...)."""
    from trsp_ray.config.run_config import replace
    from trsp_ray.run.run_args import run_config
    from trsp_ray.search.space import parse_space

    space = parse_space(parse_space_args(args.space, algorithm=args.algorithm, num_samples=args.num_samples,
                                         seed=args.seed, objectives=args.objectives, space_file=args.space_file,
                                         seeds=args.seeds))
    cfg = run_config(args, method=args.method)
    if args.compute_budget is not None:
        cfg = replace(cfg, **{"heal.compute_budget": args.compute_budget})
    return cfg, space


def _search(args) -> int:
    from trsp_ray.search.run import run_search

    cfg, space = search_config(args)
    run_search(cfg, space, options(args))
    return 0


def add_method_argument(p) -> None:
    """--method for a search: any pipeline of the registry (the base of every trial; `--space
    method=a,b` searches several), default the product's default pipeline."""
    from trsp_ray.config import registry

    p.add_argument("--method", default=None,
                   help=f"the trials' pipeline (default {registry.DEFAULT_METHOD}): "
                        f"{', '.join(registry.METHOD_NAMES)}, or {registry.GRAMMAR}; search several with "
                        "--space method=shortgpt+heal,tail+heal")
    p.add_argument("--compute-budget", type=float, default=None, metavar="TOKENS",
                   help="total dense-forward tokens of every trial (selection + fit + heal, SPEC section 5): each "
                        "heal gets the steps its selection and fit leave (heal.compute_budget; heal methods)")


def register(subparsers) -> None:
    """Add `search` to the `trsp-ray` subcommands (same run-config flags as `prune`)."""
    from trsp_ray.run.run_args import add_run_arguments

    p = subparsers.add_parser("search", help="Ray Tune search over pipelines, their settings and the ratio, "
                                             "at an optional total compute budget")
    add_run_arguments(p)
    add_method_argument(p)
    add_arguments(p)
    p.set_defaults(func=_search)
