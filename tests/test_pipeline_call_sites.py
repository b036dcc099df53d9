"""Decide once, pass the decision (STYLE 16, issue 41 item 6): the modules that run a pipeline read
the resolved Pipeline (its spec) handed to them, and ask the registry for a name's entry only where
a name is parsed (the command line) or resolved (run/pipeline.py, config/).

The per-file counts cover the modules converted so far (the driver, the Ray Train path, the
reproduction's cells, the planner's command, the one-process methods); plan/, search/, run/budget.py
and benchmark/ are a later pass of the same issue and join the table when they are converted."""

import ast
from pathlib import Path

import pytest

from trsp_ray.config import registry
from trsp_ray.config.run_config import load_config
from trsp_ray.run.pipeline import named

PACKAGE = Path(__file__).resolve().parents[1] / "trsp_ray"

# module -> the registry.method(...) calls it may make, and why
CALLS = {
    "distributed/recovery.py": 0,
    "distributed/train.py": 0,
    "distributed/worker.py": 0,
    "distributed/handoff.py": 0,
    "driver.py": 0,
    "reproduce/work.py": 0,
    "run/methods.py": 0,  # a name from a caller that resolved none goes through registry.as_method
    "run/stage1_store.py": 0,
    "plan_cli.py": 1,  # --compensation none against --method's fit, before the pipeline is resolved
    "run/run_args.py": 1,  # argparse's type of --method: a bad name exits 2 on one line
}


def registry_method_calls(path: Path) -> int:
    """Calls of registry.method(...) in a module's code (its strings and comments do not count)."""
    return sum(isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "method"
               and isinstance(node.func.value, ast.Name) and node.func.value.id == "registry"
               for node in ast.walk(ast.parse(path.read_text())))


@pytest.mark.parametrize("module", sorted(CALLS))
def test_a_converted_module_reads_the_resolved_pipeline(module):
    assert registry_method_calls(PACKAGE / module) == CALLS[module], (
        f"{module} parses a pipeline's name again: take the resolved Pipeline (or its spec) as an argument")


def test_the_counter_counts_calls_not_mentions(tmp_path):
    source = tmp_path / "m.py"
    source.write_text('from x import registry\n"registry.method(name)"\nspec = registry.method("trsp")\n')
    assert registry_method_calls(source) == 1


def test_a_pipeline_reads_the_registry_once_and_hands_its_spec_on():
    pipe = named(load_config(None, ["method=trsp-oneshot"]))
    assert pipe.spec is pipe.spec and pipe.spec.ranking == "round1"
    assert registry.as_method(pipe.spec) is pipe.spec  # a spec handed down is not looked up again
    assert registry.as_method("tail+cos+heal.tail") == registry.method("tail+cos+heal.tail")
