"""Issue 13: a method's name is spelled out only where the registry and the CLI need it; every
other module asks `trsp_ray.config.registry` (so a new method is one line there, not a hunt over packages)."""

import ast
from pathlib import Path

from trsp_ray.config import registry

ROOT = Path(__file__).resolve().parents[1]
# Where a name may be spelled: the registry itself, the search CLI's default method, the table of
# the paper's published numbers (data keyed by row), and the dispatch to each baseline selector.
ALLOWED = {"trsp_ray/config/registry.py": set(registry.METHOD_NAMES), "trsp_ray/search/cli.py": {"trsp"},
           "trsp_ray/reproduce/presets.py": set(registry.METHOD_NAMES),
           # "random" is also a Ray Tune search algorithm, not the random-selection method.
           "trsp_ray/search/space.py": {"random"}, "trsp_ray/search/run.py": {"random"}}
ALLOWED["trsp_ray/search/cli.py"] = {"trsp", "random"}
ALLOWED["trsp_ray/run/methods.py"] = set(registry.BASELINE_SELECTORS)  # where each baseline selector is computed
# the heal recipes (HEAL_RECIPES) name one recipe "tail", which is also the tail selector's name
ALLOWED["trsp_ray/method/recipes.py"] = {"tail"}


def _spelled(path: Path) -> list[tuple[int, str]]:
    tree = ast.parse(path.read_text())
    docstrings = {id(n.body[0].value) for n in ast.walk(tree)
                  if isinstance(n, (ast.Module, ast.FunctionDef, ast.ClassDef, ast.AsyncFunctionDef))
                  and n.body and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)}
    return [(n.lineno, n.value) for n in ast.walk(tree)
            if isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in docstrings
            and n.value in registry.METHOD_NAMES]


def test_method_names_are_spelled_only_in_the_registry_and_cli():
    found = []
    for path in sorted(list((ROOT / "trsp_ray").rglob("*.py")) + list((ROOT / "jobs").glob("*.py"))):
        rel = path.relative_to(ROOT).as_posix()
        found += [f"{rel}:{line} {name!r}" for line, name in _spelled(path) if name not in ALLOWED.get(rel, set())]
    assert not found, "method names outside the registry:\n" + "\n".join(found)


def test_the_scan_sees_a_spelled_name(tmp_path):
    # The check above must be able to fail: a module comparing against a method name is caught.
    bad = tmp_path / "bad.py"
    bad.write_text('def f(cfg):\n    """trsp-oneshot in a docstring is prose."""\n'
                   '    return cfg.method == "trsp-oneshot"\n')
    assert _spelled(bad) == [(3, "trsp-oneshot")]
