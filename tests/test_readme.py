"""README keeps exactly two set-up commands near the top, and CI runs the second one verbatim."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _blocks():
    return re.findall(r"```bash\n(.*?)\n```", (ROOT / "README.md").read_text(), flags=re.S)


def test_two_setup_commands_and_ci_runs_the_test_one():
    blocks = _blocks()
    install_and_run, install_and_test = blocks[0], blocks[1]
    assert "\n" not in install_and_run and "\n" not in install_and_test
    assert install_and_run.startswith("pip install torch==2.13.0") and "trsp-ray benchmark" in install_and_run
    assert "pytest" in install_and_test
    assert install_and_test in (ROOT / ".ci" / "run").read_text().splitlines()
