"""Issue 13: no import cycles inside trsp_ray/ (function-level imports included: a lazy import
still ties two modules into one unit that cannot be understood or changed apart)."""

import ast
import functools
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "trsp_ray"


def _module(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    """module -> the trsp_ray modules it imports (a `from pkg import name` of a submodule counts)."""
    modules = {_module(p): p for p in PACKAGE.rglob("*.py")}
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text())):
            targets = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(up + ([base] if base else []))
                targets = [base] + [f"{base}.{a.name}" for a in node.names]
            for t in targets:
                while t and t not in modules:
                    t = t.rpartition(".")[0]
                if t and t != name and t != "trsp_ray":
                    graph[name].add(t)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every strongly connected group of more than one module (Tarjan)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                out.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_import_cycles_in_the_package():
    found = cycles(import_graph())
    assert not found, "import cycles: " + "; ".join(" <-> ".join(c) for c in found)


def test_the_cycle_finder_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


REPO = PACKAGE.parent


@functools.cache
def _top_level(path: Path) -> tuple[frozenset[str], frozenset[str]]:
    """(names the module defines, names it imports) at its top level, if/try blocks included: together,
    what `from module import name` can take from it."""
    defined: set[str] = set()
    imported: set[str] = set()

    def take(body):
        for node in body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                defined.add(node.name)
            elif isinstance(node, (ast.Assign, ast.AnnAssign)):
                for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                    defined.update(n.id for n in ast.walk(target) if isinstance(n, ast.Name))
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                imported.update((a.asname or a.name).split(".")[0] for a in node.names)
            elif isinstance(node, ast.If):
                take(node.body), take(node.orelse)
            elif isinstance(node, ast.Try):
                take(node.body), take(node.orelse), take(node.finalbody)
                for handler in node.handlers:
                    take(handler.body)

    take(ast.parse(path.read_text()).body)
    return frozenset(defined), frozenset(imported - defined)


def unresolved_imports(files) -> list[str]:
    """`file:line name` for every absolute import of trsp_ray (module or name), and every attribute read
    from an imported trsp_ray module (`atomic.write_json`), that does not exist."""
    def source(module: str) -> Path | None:
        base = REPO.joinpath(*module.split("."))
        return base / "__init__.py" if (base / "__init__.py").exists() else (
            base.with_suffix(".py") if base.with_suffix(".py").exists() else None)

    def has(module: str, name: str) -> bool:
        return any(name in names for names in _top_level(source(module))) or source(f"{module}.{name}") is not None

    bad = []
    for path in files:
        shown = path.relative_to(REPO) if path.is_relative_to(REPO) else path.name
        tree = ast.parse(path.read_text())
        modules = {}  # local name -> the trsp_ray module it is bound to (`from trsp_ray.common import atomic`)
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and not node.level and (node.module or "").startswith("trsp_ray"):
                modules.update({a.asname or a.name: f"{node.module}.{a.name}" for a in node.names
                                if source(f"{node.module}.{a.name}") is not None})
            elif isinstance(node, ast.Import):
                modules.update({a.asname: a.name for a in node.names if a.asname and a.name.startswith("trsp_ray")})
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in modules
                    and source(modules[node.value.id]) is not None and not has(modules[node.value.id], node.attr)):
                bad.append(f"{shown}:{node.lineno} {modules[node.value.id]}.{node.attr}")
            if isinstance(node, ast.Import):
                wanted = [(a.name, None) for a in node.names if a.name.split(".")[0] == "trsp_ray"]
            elif (isinstance(node, ast.ImportFrom) and not node.level
                  and (node.module or "").split(".")[0] == "trsp_ray"):
                wanted = [(node.module, a.name) for a in node.names]
            else:
                continue
            for module, name in wanted:
                if source(module) is None:
                    bad.append(f"{shown}:{node.lineno} {module}")
                elif name and name != "*" and not has(module, name):
                    bad.append(f"{shown}:{node.lineno} {module}.{name}")
    return bad


def test_every_script_imports_what_the_package_has():
    """Jobs, benchmarks, cluster scripts and tests import (and read from imported modules) only names
    trsp_ray has: the benchmark scripts run by hand, so a rename (pipeline.py -> workbench/driver) left
    them importing a module that was gone and nothing failed."""
    folders = ("trsp_ray", "jobs", "benchmarks", "cluster", "tests")
    files = [p for folder in folders for p in (REPO / folder).rglob("*.py")]
    assert len(files) > 50
    assert unresolved_imports(files) == []


def test_the_import_check_sees_a_missing_module_and_name(tmp_path):
    script = tmp_path / "script.py"
    script.write_text("from trsp_ray.nowhere import run\nfrom trsp_ray.run.workbench import nothing_here, prepare\n"
                      "from trsp_ray.common import atomic\nimport trsp_ray.nope\natomic.write_json\natomic.gone\n")
    found = [line.split(" ", 1)[1] for line in unresolved_imports([script])]
    assert found == ["trsp_ray.nowhere", "trsp_ray.run.workbench.nothing_here", "trsp_ray.nope",
                     "trsp_ray.common.atomic.gone"]


def second_import_paths(files, root: Path = PACKAGE) -> list[str]:
    """`file:line module.name` for every `from module import name` where `module` does not define
    `name` but imports it from elsewhere (a second path to one thing); a submodule of a package is fine."""
    bad = []
    for path in files:
        for node in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(node, ast.ImportFrom) and not node.level
                    and (node.module or "").split(".")[0] == root.name):
                continue
            base = root.parent.joinpath(*node.module.split("."))
            source = base / "__init__.py" if (base / "__init__.py").exists() else base.with_suffix(".py")
            if not source.exists():
                continue
            imported = _top_level(source)[1]
            for a in node.names:
                submodule = (base / f"{a.name}.py").exists() or (base / a.name / "__init__.py").exists()
                if a.name in imported and not submodule:
                    bad.append(f"{path.name}:{node.lineno} {node.module}.{a.name}")
    return bad


def test_one_import_path_per_name():
    """ARCHITECTURE.md: every name is imported from the module that defines it, never through a module
    that re-exports it."""
    folders = ("trsp_ray", "jobs", "benchmarks", "cluster", "tests")
    files = [p for folder in folders for p in (REPO / folder).rglob("*.py")]
    assert second_import_paths(files) == []


def test_the_second_path_check_sees_a_re_exported_name(tmp_path):
    root = tmp_path / "pkg"
    (root / "method").mkdir(parents=True)
    (root / "__init__.py").write_text("")
    (root / "method" / "__init__.py").write_text("")
    (root / "method" / "gates.py").write_text("import torch\nfrom pkg.method import heal\n\nSCALE = 2\n")
    heal = "from pkg.method.gates import torch, SCALE\nfrom pkg.method import gates\n"
    (root / "method" / "heal.py").write_text(heal)
    assert second_import_paths(list(root.rglob("*.py")), root) == ["heal.py:1 pkg.method.gates.torch"]
