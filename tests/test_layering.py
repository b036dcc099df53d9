"""The house of trsp_ray (ARCHITECTURE.md): packages on floors, each importing only the floors below
it; the method free of ray/deepspeed/mlflow/lm_eval; a short top level and short modules; `import
trsp_ray` cheap (one import path per name: tests/test_import_graph.py). Each rule is checked on the
package and, on a small tree built here, shown to fail where it should."""

import ast
import subprocess
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "trsp_ray"

# Bottom to top. A module may import modules of its own package and of packages on lower floors only;
# packages on one floor do not import each other. "" is the top level (the commands and the driver).
FLOORS = [("common",), ("data",), ("models",), ("method",), ("config",), ("plan",), ("run",), ("distributed",),
          ("evaluation",), ("benchmark", "search", "reproduce"), ("",)]
FORBIDDEN_IN_METHOD = {"ray", "deepspeed", "mlflow", "lm_eval"}
ORCHESTRATION = {"distributed", "evaluation", "benchmark", "search", "reproduce"}  # may import ray / deepspeed
MAX_TOP_LEVEL_MODULES = 15
MAX_LINES = 400


def _module(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _package(module: str) -> str:
    """'trsp_ray.method.stage1' -> 'method'; 'trsp_ray.cli' and 'trsp_ray' -> '' (the top level)."""
    parts = module.split(".")
    return parts[1] if len(parts) >= 2 and parts[1] in _package.packages else ""


_package.packages = set()


def _imports(path: Path, root: Path):
    """(line, imported module or module.name) for every trsp_ray import in `path`, lazy ones included,
    and the set of third-party top-level names it imports."""
    name = _module(path, root)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    ours, theirs = [], set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            for a in node.names:
                (ours.append((node.lineno, a.name)) if a.name.split(".")[0] == root.name
                 else theirs.add(a.name.split(".")[0]))
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(up + ([base] if base else []))
            if base.split(".")[0] == root.name:
                ours += [(node.lineno, f"{base}.{a.name}") for a in node.names]
            else:
                theirs.add(base.split(".")[0])
    return ours, theirs


def layering_violations(root: Path = PACKAGE, floors=FLOORS) -> list[str]:
    """`file:line imports X` for every import that runs sideways or up the floors."""
    floor_of = {pkg: i for i, names in enumerate(floors) for pkg in names}
    _package.packages = {p.name for p in root.iterdir() if (p / "__init__.py").exists()}
    bad = []
    for path in sorted(root.rglob("*.py")):
        here = _package(_module(path, root))
        if here not in floor_of:
            bad.append(f"{path.relative_to(root)} is in package {here!r}, which is on no floor")
            continue
        for line, target in _imports(path, root)[0]:
            there = _package(target)
            if target == root.name or there == here:
                continue
            if there not in floor_of or floor_of[there] >= floor_of[here]:
                bad.append(f"{path.relative_to(root)}:{line} imports {target} "
                           f"({here or 'top level'} -> {there or 'top level'})")
    return bad


def method_imports(root: Path = PACKAGE) -> list[str]:
    return [f"{path.relative_to(root)} imports {sorted(bad)}" for path in sorted((root / "method").rglob("*.py"))
            if (bad := _imports(path, root)[1] & FORBIDDEN_IN_METHOD)]


def test_every_package_imports_only_the_floors_below_it():
    assert layering_violations() == []


def test_every_package_of_the_house_is_on_a_floor():
    packages = {p.name for p in PACKAGE.iterdir() if (p / "__init__.py").exists()}
    assert packages == {pkg for names in FLOORS for pkg in names} - {""}


def test_the_method_imports_no_ray_deepspeed_mlflow_or_lm_eval():
    assert len(list((PACKAGE / "method").glob("*.py"))) >= 10  # the method lives there
    assert method_imports() == []


def test_ray_and_deepspeed_only_in_orchestration_packages():
    for path in PACKAGE.rglob("*.py"):
        rel = path.relative_to(PACKAGE)
        if rel.parts[0] in ORCHESTRATION:
            continue
        bad = _imports(path, PACKAGE)[1] & {"ray", "deepspeed"}
        assert not bad, f"{rel} imports {bad}"


def test_a_short_top_level_short_modules_and_init_files_that_only_name_things():
    top = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert len(top) <= MAX_TOP_LEVEL_MODULES, top
    long = {str(p.relative_to(PACKAGE)): n for p in PACKAGE.rglob("*.py")
            if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert long == {}
    for init in PACKAGE.rglob("__init__.py"):  # a docstring, imports (re-exports) and names like __version__
        for node in ast.parse(init.read_text()).body:
            assert isinstance(node, (ast.Expr, ast.Import, ast.ImportFrom, ast.Assign)), ast.dump(node)[:80]
            if isinstance(node, ast.Assign):
                assert all(isinstance(t, ast.Name) and t.id.startswith("__") for t in node.targets), init


def _tree(tmp_path: Path, files: dict[str, str]) -> Path:
    root = tmp_path / "pkg"
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


def test_the_checks_see_an_arrow_up_a_sideways_one_and_a_method_import(tmp_path):
    root = _tree(tmp_path, {
        "__init__.py": "", "cli.py": "from pkg.method import gates\n",
        "method/__init__.py": "",
        "method/gates.py": "import torch\n\ndef f():\n    import ray\n    from pkg.run import w\n",
        "method/heal.py": "from pkg.method.gates import torch\nfrom pkg.common.errors import E\n",
        "run/__init__.py": "", "run/w.py": "from pkg import cli\n",
        "search/__init__.py": "", "search/a.py": "from pkg.benchmark import b\n",
        "benchmark/__init__.py": "", "benchmark/b.py": "from pkg.method import gates\n",
        "common/__init__.py": "", "common/errors.py": "class E(Exception):\n    pass\n"})
    floors = [("common",), ("method",), ("run",), ("benchmark", "search"), ("",)]
    found = layering_violations(root, floors)
    assert found == ["method/gates.py:5 imports pkg.run.w (method -> run)",
                     "run/w.py:1 imports pkg.cli (run -> top level)",
                     "search/a.py:1 imports pkg.benchmark.b (search -> benchmark)"]
    assert method_imports(root) == ["method/gates.py imports ['ray']"]
    assert layering_violations(root, [("method",), ("run",), ("benchmark", "search"), ("",)])[0] == \
        "common/__init__.py is in package 'common', which is on no floor"


def test_import_trsp_ray_is_light():
    code = ("import sys, trsp_ray, trsp_ray.config.run_config, trsp_ray.cli; "
            "print(sorted(m for m in ('torch','transformers','ray','deepspeed','mlflow','lm_eval') "
            "if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
