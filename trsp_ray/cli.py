"""The `trsp-ray` command line: prune, benchmark, and the subcommands of the other packages."""

from __future__ import annotations

import argparse

from trsp_ray.config.registry import GRAMMAR, METHOD_NAMES
from trsp_ray.data import domains
from trsp_ray.run.run_args import add_run_arguments, method_type, run_config


def prune_config(args, *, gpu_default: bool = False):
    """The run config of `trsp-ray prune`'s flags (--compute-budget is heal.compute_budget); what the
    command then refuses before any work is `run.pipeline.resolve`'s (the tests check every documented
    command with these two). With a budget the default pipeline (no --method) is the one measured best
    at the nearest budget; `gpu_default` (the command itself) gives the default pipeline on a GPU
    budgets.GPU_DEFAULT_BUDGET when no budget is given."""
    from trsp_ray.common.logs import log
    from trsp_ray.config import budgets, registry
    from trsp_ray.config.run_config import replace

    cfg = run_config(args, method=args.method, output=args.output)
    default = args.method is None and cfg.method == registry.DEFAULT_METHOD
    budget = args.compute_budget
    if gpu_default and budget is None and default and not cfg.heal.compute_budget and _on_gpu(cfg.device):
        budget = budgets.GPU_DEFAULT_BUDGET
        log(f"on a GPU the default pipeline gets --compute-budget {budgets.budget_label(int(budget))} unless "
            "given (the heals published for depth pruning train on 1.6M-15M tokens)")
    if budget is None:
        return cfg
    cfg = replace(cfg, **{"heal.compute_budget": budget})
    if default:  # the default, per budget
        measured, method, objective = budgets.budget_default(budget)
        chosen = cfg.recovery.objective != "ce"  # a --set recovery.objective=kd is kept
        cfg = replace(cfg, method=method, **({} if chosen else {"recovery.objective": objective}))
        log(f"compute budget {budgets.budget_label(int(budget))}: running {method} with "
            f"recovery.objective={cfg.recovery.objective}, the default measured best at "
            f"{budgets.budget_label(int(measured))} (docs/results.md); --method chooses another")
    return cfg


def _on_gpu(device: str) -> bool:
    """This process runs on a GPU: device=cuda without one is refused later, in one line before any log
    (driver.run), so it gets no budget line first; a driver without a GPU in front of GPU workers is
    given its budget with --compute-budget."""
    import torch

    return device in ("cuda", "auto") and torch.cuda.is_available()


def _prune(args) -> int:
    from trsp_ray.driver import route_for, run

    cfg = prune_config(args, gpu_default=True)
    if cfg.output:  # a path no export can use: one line before anything logs, --dry-run included (the
        # free disk the planned export needs is checked in driver.run, once the route is known)
        from trsp_ray.run.export import check_output_dir

        check_output_dir(cfg.output, overwrite=args.overwrite)
    if args.dry_run:
        from trsp_ray.run import heal_store
        from trsp_ray.run.pipeline import resolve, training_steps
        from trsp_ray.run.workbench import resolve_device

        pipe = resolve(cfg)  # as driver.run resolves it: the fit that runs, then the heal
        cfg = pipe.cfg
        chosen = route_for(cfg, pipe=pipe)
        if not chosen.workers:  # as driver.run: the one process's device must exist here
            resolve_device(cfg.device)
        print(pipe.describe())
        print(_describe(chosen))
        print(_fit_line(cfg))
        if pipe.spec.merges:
            print(_merge_store_line(cfg, chosen.plan))
        if not chosen.workers and (line := heal_store.planned_line(
                cfg, pipe.spec, chosen.plan.shape, steps=training_steps(cfg, spec=pipe.spec))):
            print(line)
        return 0
    run(cfg, overwrite=args.overwrite)
    return 0


def _tokens(text: str) -> float:
    """A token count such as 200000, 200k, 1.5M or 1B (argparse type; G is a billion too)."""
    scale = {"k": 1e3, "m": 1e6, "b": 1e9, "g": 1e9}.get(text[-1:].lower(), 1.0)
    try:
        value = float(text[:-1] if scale != 1.0 else text) * scale
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a token count; pass e.g. 200000, 200k, 1.5M or 1B") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a token count > 0")
    return value


def _describe(chosen) -> str:
    """The route and, stage by stage, the plan it was chosen by."""
    from trsp_ray.plan.plan_format import format_plan

    if chosen.workers:
        return f"route: {chosen.describe()}\n{format_plan(chosen.plan)}"
    lines = [f"route: {chosen.describe()}"]
    for stage in chosen.plan.stages:
        lines.append(f"  {stage.name}: {stage.total:.2f} GB")
        lines += [f"      {k}: {v:.2f} GB" for k, v in stage.parts.items()]
    return "\n".join(lines)


def _fit_line(cfg) -> str:
    """Which compensation the run fits (compensation.method resolved by config.for_method)."""
    from trsp_ray.method.compensation import describe

    c = cfg.compensation
    if c.method == "none":
        return f"compensation: none ({cfg.method} fits nothing)"
    how = ", ".join(f"{k.removeprefix('compensation_')} {v}" for k, v in describe(c).items() if k != "compensation")
    tokens = c.windows * cfg.data.seqlen
    return (f"compensation: {c.method}" + (f" ({how})" if how else "") + f", fitted after the selection on "
            f"{c.windows} windows x {cfg.data.seqlen} tokens ({tokens:,}; compensation.windows 0 sizes it to "
            f"{c.tokens_per_column:g} tokens per column of the model's hidden size)")


def _merge_store_line(cfg, plan) -> str:
    """The disk a merge's resume store takes (plan/merge_plan.store_gb) and where."""
    from trsp_ray.method.stage1 import n_drop_for
    from trsp_ray.plan.merge_plan import store_gb
    from trsp_ray.run.content import checkpoint_root

    pairs = n_drop_for(cfg.ratio, plan.shape.layers)
    gb = store_gb(cfg, dtype_bytes=plan.setup.dtype_bytes, shape=plan.shape)
    return (f"merge store: at most {gb:.2f} GB of disk under {checkpoint_root(cfg.checkpoint_dir)}/merged_pairs "
            f"({pairs} merged blocks, one stored as each pair is done so an interrupted merge resumes; kept "
            "beside the heal's checkpoint until the heal is done)")


# What the README's quick `trsp-ray benchmark` runs and what `--full` adds (the quick run fits 15
# minutes on 2 CPU cores; its report says what it cut)
QUICK = {"lambada": 100, "zeroshot": 0, "budgets": "1"}
QUICK_EVAL_WINDOWS = 8  # held-out windows per domain in the quick run (data.eval_max_windows: 16)
FULL = {"lambada": 500, "zeroshot": 100, "budgets": "1,4"}
# --budget-curve: does a recovery's accuracy rise or fall as its heal budget grows? (issue 42)
CURVE = {"lambada": 500, "budgets": "1,4,16", "seeds": 2}


def _int_list(text: str, flag: str) -> tuple[int, ...]:
    """Comma-separated integers; a count may carry a k / M / B suffix (--budgets 70k,300k,1M)."""
    from trsp_ray.common.errors import TrspError

    try:
        return tuple(int(round(_tokens(x))) if x[-1:].isalpha() else int(x) for x in text.split(","))
    except (ValueError, argparse.ArgumentTypeError):
        raise TrspError(f"{flag}={text!r} is not valid; pass comma-separated integers, e.g. 1,4") from None


def benchmark_request(args) -> tuple:
    """(run config, rows, the run's keyword arguments) of `trsp-ray benchmark`'s flags, with every
    check the command makes before any work but the memory plan of this machine (the tests check every
    documented command with it)."""
    from trsp_ray.benchmark.comparison import DEFAULT_ROWS, QUICK_ROWS, check_request
    from trsp_ray.config import registry
    from trsp_ray.config.run_config import replace

    mode = FULL if args.full else {**QUICK, **CURVE} if args.budget_curve else QUICK
    default_rows = (DEFAULT_ROWS if args.full else registry.CURVE_ROWS if args.budget_curve
                    else registry.LEAVE_ONE_OUT_ROWS if args.leave_one_out else QUICK_ROWS)
    rows = tuple(r.strip() for r in args.rows.split(",")) if args.rows else default_rows
    lambada = mode["lambada"] if args.lambada is None else args.lambada
    zeroshot = mode["zeroshot"] if args.zeroshot is None else args.zeroshot
    budgets = _int_list(args.budgets or mode["budgets"], "--budgets")
    seeds = args.seeds if args.seeds is not None else mode.get("seeds", 1)
    cfg = run_config(args)
    if args.leave_one_out and args.left_out not in (None, "none"):
        from trsp_ray.common.errors import TrspError

        raise TrspError(f"--left-out {args.left_out} and --leave-one-out disagree: --leave-one-out leaves every domain "
                        "out in turn; drop --left-out")
    left = domains.BENCHMARK_LEFT_OUT if args.left_out is None else args.left_out
    if not args.leave_one_out and not cfg.data.calib_text and left != "none":
        # the table's left-out column: the product's mixture without that domain (never the product's default)
        cfg = replace(cfg, **{"data.calib_mix": domains.without(cfg.data.calib_mix, left)})
    quick = not (args.full or args.rows or args.budget_curve or args.leave_one_out)
    # The README's cut: TRSP's swap refinement off (6 of the command's 21 minutes on 2 cores; at seed 0
    # its 56 scorer calls found no swap), unless a --config or --set says how to refine.
    cut_refine = quick and not args.config and not any(o.startswith("stage1.refine") for o in args.overrides)
    if cut_refine:
        cfg = replace(cfg, **{"stage1.refine": 0})
    # ... and scores QUICK_EVAL_WINDOWS windows per domain instead of data.eval_max_windows (each row's
    # five domains x 16 x 256 tokens took 110 s of one core, the largest cost of the run), unless the
    # --config or a --set chooses the windows
    cut_windows = quick and not args.config and not any(o.startswith("data.eval_max_windows") for o in args.overrides)
    if cut_windows:
        cfg = replace(cfg, **{"data.eval_max_windows": QUICK_EVAL_WINDOWS})
    if args.full_baselines or args.full:
        from trsp_ray.config.sections import FULL_SLEB_WINDOWS

        cfg = replace(cfg, **{"baselines.sleb_windows": max(cfg.baselines.sleb_windows, FULL_SLEB_WINDOWS)})
    # bad rows / seeds / item counts / budgets fail before Ray starts
    check_request(cfg, rows, seeds, zeroshot, lambada_limit=lambada, budgets=budgets)
    if args.leave_one_out:
        from trsp_ray.benchmark.comparison import leave_one_out_configs

        leave_one_out_configs(cfg)  # a text file or a one-domain mixture: refused before any work
    cut = "" if not quick else _quick_cut(lambada, cut_refine=cut_refine, cut_windows=cut_windows)
    return cfg, rows, {"seeds": seeds, "zeroshot_limit": zeroshot, "lambada_limit": lambada, "budgets": budgets,
                       "cut": cut, "cache": not args.no_cache}


def _quick_cut(lambada: int, *, cut_refine: bool, cut_windows: bool) -> str:
    """What the README's quick run leaves out, for its report."""
    from trsp_ray.benchmark.comparison import DEFAULT_ROWS, QUICK_ROWS
    from trsp_ray.config.sections import DataConfig

    return (f"quick run (the README's): CUT the rows {', '.join(r for r in DEFAULT_ROWS if r not in QUICK_ROWS)} "
            f"(docs/results.md has the equal-compute rows' figures), the zero-shot mean and "
            f"the 4x heal budget, LAMBADA on {lambada} passages"
            + (", TRSP's swap refinement (stage1.refine=0; `prune` refines)" if cut_refine else "")
            + (f", the held-out windows to {QUICK_EVAL_WINDOWS} per domain (data.eval_max_windows="
               f"{QUICK_EVAL_WINDOWS}; --full: {DataConfig().eval_max_windows})" if cut_windows else "")
            + "; --full runs every row, SLEB in full, "
            f"{FULL['lambada']} LAMBADA passages, {FULL['zeroshot']} zero-shot items per task and budgets "
            f"{FULL['budgets']}.")


def _benchmark(args) -> int:
    from trsp_ray.run.workbench import check_single_plan

    cfg, rows, kwargs = benchmark_request(args)
    check_single_plan(cfg, methods=rows)  # every row runs in one process: refuse before any work
    if args.leave_one_out:
        from trsp_ray.benchmark.comparison import leave_one_out

        if args.workers > 0:
            from trsp_ray.benchmark.cluster import leave_one_out_ray

            leave_one_out_ray(cfg, rows, workers=args.workers, **kwargs)
        else:
            leave_one_out(cfg, rows, **kwargs)
        return 0
    if args.workers > 0:
        from trsp_ray.benchmark.cluster import run_benchmark_ray

        run_benchmark_ray(cfg, rows, workers=args.workers, **kwargs)
    else:
        from trsp_ray.benchmark.comparison import run_benchmark

        run_benchmark(cfg, rows, **kwargs)
    return 0


def version_line(prog: str) -> str:
    """`<prog> <trsp_ray version> (git <commit>)`; the commit only when trsp_ray runs from a git checkout."""
    import importlib.metadata as md
    import subprocess
    from pathlib import Path

    try:
        version = md.version("trsp_ray")
    except md.PackageNotFoundError:
        version = "unknown"
    root = Path(__file__).resolve().parents[1]
    commit = ""
    if (root / ".git").exists():
        try:
            commit = subprocess.run(["git", "-C", str(root), "rev-parse", "--short", "HEAD"], capture_output=True,
                                    text=True, timeout=5).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            pass
    return f"{prog} {version}" + (f" (git {commit})" if commit else "")


class _Version(argparse.Action):
    """--version, computed when asked (argparse's own takes the string when the parser is built)."""

    def __init__(self, option_strings, dest=argparse.SUPPRESS, default=argparse.SUPPRESS, help=None):
        super().__init__(option_strings, dest=dest, default=default, nargs=0, help=help)

    def __call__(self, parser, namespace, values, option_string=None):
        print(version_line(parser.prog))
        parser.exit()


def add_entry_flags(parser: argparse.ArgumentParser, *, version: bool = True) -> None:
    """--version and --verbose, on `trsp-ray`, its subcommands and the jobs (see logs.quiet_libraries)."""
    if version:
        parser.add_argument("--version", action=_Version, help="print the version (and git commit) and exit")
    # a subcommand's default must not overwrite `trsp-ray --verbose <command>`: SUPPRESS leaves it alone
    parser.add_argument("--verbose", action="store_true", default=False if version else argparse.SUPPRESS,
                        help="keep third-party progress bars and banners (transformers, DeepSpeed, MLflow)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="trsp-ray", description="TRSP layer pruning for LLMs on Ray")
    add_entry_flags(parser)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("prune", help="prune one model with one method and export it")
    add_run_arguments(p)
    p.add_argument("--method", default=None, type=method_type(),
                   help="default shortgpt+comp+heal: ShortGPT's Block-Influence selection, a least-squares fold "
                        "of each cut (compensation.*), then a heal with stage 2's budget (the best pipeline at "
                        "equal total compute, docs/results.md); shortgpt+heal = the same without the fold; trsp+heal = "
                        "TRSP's stage-1 selection + the heal; trsp = the paper's stage 2. Registered: "
                        f"{', '.join(METHOD_NAMES)}; or any pipeline {GRAMMAR}; or a YAML file of "
                        "selector, fit, heal (docs/pipelines.md)")
    p.add_argument("--output", default=None, help="export directory (written atomically)")
    p.add_argument("--compute-budget", type=_tokens, default=None, metavar="TOKENS",
                   help="total dense-forward tokens (e.g. 200k, 1.5M) for selection + compensation + heal: the "
                        "heal gets what the selection leaves (heal.compute_budget; heal methods)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing output directory")
    p.add_argument("--dry-run", action="store_true", help="print the route and memory plan, do nothing")
    p.set_defaults(func=_prune)
    b = sub.add_parser("benchmark", help="compare methods on one model and print a table")
    add_run_arguments(b)
    b.add_argument("--rows", default=None, help="comma-separated rows (default: the quick rows; --full: every row)")
    b.add_argument("--full", action="store_true",
                   help=f"every row, SLEB in full, LAMBADA {FULL['lambada']}, zero-shot {FULL['zeroshot']}, "
                        f"budgets {FULL['budgets']} (hours on CPU; the default is the README's 15-minute cut)")
    b.add_argument("--seeds", type=int, default=None,
                   help=f"seeds per row (mean and spread are printed; default 1, --budget-curve {CURVE['seeds']})")
    b.add_argument("--zeroshot", type=int, default=None, metavar="N",
                   help=f"score every model on the paper's 5 zero-shot tasks, N items each (0 = off; "
                        f"default {QUICK['zeroshot']}, --full {FULL['zeroshot']})")
    b.add_argument("--lambada", type=int, default=None, metavar="N",
                   help=f"LAMBADA last-word accuracy on the first N test passages (0 = off; default "
                        f"{QUICK['lambada']}, --full {FULL['lambada']}); reported, never used to select")
    b.add_argument("--budgets", default=None, metavar="B,B",
                   help="heal budgets of the trained rows: multiples of stage2.steps (default 1; --full 1,4), or "
                        "total compute budgets in dense-forward tokens (e.g. 70k,300k,1M: every trained row heals "
                        "with what its selection and fit leave)")
    b.add_argument("--left-out", default=None, metavar="DOMAIN",
                   help=f"the domain the table's calibration leaves out, scored as its left-out column (default "
                        f"{domains.BENCHMARK_LEFT_OUT}; 'none' calibrates on the product's whole default mixture "
                        f"{domains.DEFAULT_MIX})")
    b.add_argument("--leave-one-out", action="store_true",
                   help="leave every domain of the mixture out in turn (one run each) and print the transfer table: "
                        "pipelines x left-out domain, PPL relative to dense and LAMBADA, and the worst case")
    b.add_argument("--budget-curve", action="store_true",
                   help=f"the heal-budget curve: the recovery rows (CE, distillation, partial heals) at budgets "
                        f"{CURVE['budgets']} x {CURVE['seeds']} seeds, LAMBADA {CURVE['lambada']}, with each budget's "
                        "paired difference against the smallest and a retention-vs-compute PNG")
    b.add_argument("--no-cache", action="store_true",
                   help="recompute every row; by default a row finished by an earlier run with the same config, "
                        "code and model is read back (a stopped run, or one that adds a budget, seed or row, "
                        "loses no finished row)")
    b.add_argument("--full-baselines", action="store_true",
                   help="run SLEB on as many calibration windows as make its drop set stable (slow on CPU); "
                        "the default cuts it to fit 15 minutes on 2 cores, and the report says so")
    b.add_argument("--workers", type=int, default=2,
                   help="Ray workers on a local Ray instance (0 = run in this process without Ray)")
    b.set_defaults(func=_benchmark)
    from trsp_ray.evaluation.cli import register as register_eval
    from trsp_ray.plan_cli import register as register_plan
    from trsp_ray.reproduce.cli import register as register_reproduce
    from trsp_ray.search.cli import register as register_search

    register_eval(sub)
    register_plan(sub)
    register_search(sub)
    register_reproduce(sub)
    for command in sub.choices.values():
        add_entry_flags(command, version=False)
    return parser


def main(argv: list[str] | None = None) -> int:
    from trsp_ray.common.errors import run_main
    from trsp_ray.common.logs import quiet_libraries

    parser = build_parser()
    args = parser.parse_args(argv)
    quiet_libraries(verbose=args.verbose)
    return run_main(parser.prog, lambda: args.func(args))


def entry() -> None:
    """The `trsp-ray` command: `main()`, then the one exit of the commands and jobs (process_exit.py:
    the interpreter's thread shutdown and atexit handlers, without its module teardown)."""
    from trsp_ray.common.process_exit import exit_after

    exit_after(main)


if __name__ == "__main__":
    entry()
