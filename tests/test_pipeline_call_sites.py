"""Decide once, pass the decision (STYLE 16, issue 41 item 6): the modules that run a pipeline read
the resolved Pipeline (its spec) handed to them, and ask the registry for a name's entry only where
a name is parsed (the command line, a searched name) or resolved (run/pipeline.py, config/).

Every module under trsp_ray/ is counted: a registry.method(...) call anywhere else fails, so a stage,
plan, worker, search or benchmark takes the spec (Pipeline.spec) as an argument instead."""

import ast
from pathlib import Path

import pytest

from trsp_ray.config import registry
from trsp_ray.config.run_config import load_config
from trsp_ray.run.pipeline import named

PACKAGE = Path(__file__).resolve().parents[1] / "trsp_ray"

# module -> the registry.method(...) calls it may make, and why; every other module: none
CALLS = {
    "run/pipeline.py": 3,  # Pipeline.spec, and resolve: the name asked for and the one a fallback runs
    "plan_cli.py": 1,  # --compensation none against --method's fit, before the pipeline is resolved
    "run/run_args.py": 1,  # argparse's type of --method: a bad name exits 2 on one line
    "search/space.py": 1,  # a searched combination of parts no pipeline spells: the grid records it as refused
}
MODULES = sorted(str(p.relative_to(PACKAGE)) for p in PACKAGE.rglob("*.py"))


def registry_method_calls(path: Path) -> int:
    """Calls of registry.method(...) in a module's code (its strings and comments do not count)."""
    return sum(isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "method"
               and isinstance(node.func.value, ast.Name) and node.func.value.id == "registry"
               for node in ast.walk(ast.parse(path.read_text())))


@pytest.mark.parametrize("module", MODULES)
def test_a_module_reads_the_resolved_pipeline(module):
    assert registry_method_calls(PACKAGE / module) == CALLS.get(module, 0), (
        f"{module} parses a pipeline's name again: take the resolved Pipeline (or its spec) as an argument")


def test_the_allowed_resolving_places_exist():
    assert set(CALLS) <= set(MODULES) and len(MODULES) > 50


def test_the_counter_counts_calls_not_mentions(tmp_path):
    source = tmp_path / "m.py"
    source.write_text('from x import registry\n"registry.method(name)"\nspec = registry.method("trsp")\n')
    assert registry_method_calls(source) == 1


def test_a_pipeline_reads_the_registry_once_and_hands_its_spec_on():
    pipe = named(load_config(None, ["method=trsp-oneshot"]))
    assert pipe.spec is pipe.spec and pipe.spec.ranking == "round1"
    assert pipe.spec == registry.method("trsp-oneshot")
