"""The run-config flags shared by the commands that run a method (`trsp-ray prune`, `benchmark`,
`search`, jobs/search.py), and the RunConfig they give."""

from __future__ import annotations

import argparse

from trsp_ray.data.domains import DEFAULT_MIX


def method_type(*, workers: bool = False):
    """argparse type of a --method flag: a registered method, a composed pipeline (registry.method) or
    a YAML file of its mapping form (pipeline.read_yaml), read into its name;
    `workers`: also one Ray Train workers run (registry.on_workers). A bad name exits 2 on one line."""
    def parse(text: str) -> str:
        from trsp_ray.common.errors import TrspError
        from trsp_ray.config import registry

        try:
            if text.endswith((".yaml", ".yml")):  # the pipeline's mapping form (pipeline.py)
                from trsp_ray.run.pipeline import read_yaml

                text = read_yaml(text)
            registry.method(text)
        except TrspError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
        if workers and not registry.on_workers(text, drop_given=True):
            raise argparse.ArgumentTypeError(
                f"method={text!r} is not run on Ray Train workers; use one of {', '.join(registry.WORKER_METHODS)} "
                "or a composed +heal pipeline")
        return text

    return parse


def add_run_arguments(p: argparse.ArgumentParser) -> None:
    """The run-config flags every command that runs a method takes (prune, benchmark, search)."""
    p.add_argument("--model", default=None, help="model dir, hub id, or smollm2-135m (default)")
    p.add_argument("--ratio", type=float, default=None, help="fraction of layers to drop, in (0, 1)")
    p.add_argument("--calib-text", default=None, help="calibration text file (default: the domain mixture)")
    p.add_argument("--calib-mix", default=None, metavar="SPEC",
                   help="calibration mixture: SOURCE:WEIGHT,... of domains (wiki, news, code, math, prose) or text "
                        "files, or a YAML file of source: weight (default: " + DEFAULT_MIX + ")")
    p.add_argument("--eval-text", default=None, help="held-out text file (default: Wikipedia excerpt)")
    p.add_argument("--config", default=None, help="YAML config file")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="config override, e.g. --set stage1.lambda1=0.01 (repeatable)")
    p.add_argument("--no-mlflow", action="store_true", help="do not log to MLflow")


def run_config(args, **extra):
    """The RunConfig of parsed run-config flags: --config, then the flags and `extra`, then --set."""
    from trsp_ray.config.run_config import load_config

    base = {k: v for k, v in {"model": args.model, "ratio": args.ratio, **extra}.items() if v is not None}
    data = {k: v for k, v in {"calib_text": args.calib_text, "calib_mix": args.calib_mix,
                              "eval_text": args.eval_text}.items() if v}
    if data:
        base["data"] = data
    if args.no_mlflow:
        base["tracking"] = {"enabled": False}
    return load_config(args.config, args.overrides, base=base)
