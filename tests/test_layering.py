"""STYLE.md rule 1 and 12: the method math imports no ray/deepspeed/mlflow/lm_eval, and
`import trsp_ray` stays cheap."""

import ast
import subprocess
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "trsp_ray"
FORBIDDEN = {"ray", "deepspeed", "mlflow", "lm_eval"}
# The method math: plain torch in small modules.
CORE = ["gates.py", "stage1.py", "stage2.py", "surgery.py", "families.py", "baselines.py", "heal.py",
        "training.py", "perplexity.py", "tiny.py", "config.py", "export.py", "methods.py", "errors.py"]


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module.split(".")[0])
    return names


def test_core_modules_import_no_distributed_or_tracking_library():
    for name in CORE:
        bad = _imports(PACKAGE / name) & FORBIDDEN
        assert not bad, f"{name} imports {bad}"


def test_ray_and_deepspeed_only_in_orchestration_packages():
    allowed_dirs = {"distributed", "evaluation", "search", "reproduce"}
    for path in PACKAGE.rglob("*.py"):
        rel = path.relative_to(PACKAGE)
        if rel.parts[0] in allowed_dirs:
            continue
        bad = _imports(path) & {"ray", "deepspeed"}
        assert not bad, f"{rel} imports {bad}"


def test_import_trsp_ray_is_light():
    code = ("import sys, trsp_ray, trsp_ray.config, trsp_ray.cli; "
            "print(sorted(m for m in ('torch','transformers','ray','deepspeed','mlflow','lm_eval') "
            "if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
