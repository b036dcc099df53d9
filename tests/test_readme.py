"""README keeps exactly two set-up commands at the top, and CI runs the second one verbatim; it stays
a five-minute read (the rest is in docs/), and every relative link in it and in docs/ resolves."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def _blocks():
    return re.findall(r"```bash\n(.*?)\n```", (ROOT / "README.md").read_text(), flags=re.S)


def test_two_setup_commands_and_ci_runs_the_test_one():
    blocks = _blocks()
    install_and_run, install_and_test = blocks[0], blocks[1]
    assert "\n" not in install_and_run and "\n" not in install_and_test
    assert install_and_run.startswith("pip install torch==2.13.0") and "trsp-ray benchmark" in install_and_run
    assert "pytest" in install_and_test
    assert install_and_test in (ROOT / ".ci" / "run").read_text().splitlines()
    # ... and they are the first code a reader meets: no block of any language comes before them
    first_two = re.findall(r"```\w*\n(.*?)\n```", (ROOT / "README.md").read_text(), flags=re.S)[:2]
    assert first_two == [install_and_run, install_and_test]


def test_readme_is_a_five_minute_read():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 220, f"README.md has {len(lines)} lines; move detail to docs/"


def anchor(heading: str) -> str:
    """GitHub's anchor of a Markdown heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)
    return {anchor(h) for h in re.findall(r"^#+ (.+)$", text, flags=re.M)}


def test_every_relative_link_resolves():
    bad = []
    for doc in DOCS:
        for target in LINK.findall(doc.read_text()):
            if re.match(r"[a-z]+:", target):
                continue  # http(s): and mailto: are not checked offline
            path, _, fragment = target.partition("#")
            dest = (doc.parent / path).resolve() if path else doc
            if not dest.exists():
                bad.append(f"{doc.relative_to(ROOT)}: {target} (no such file)")
            elif fragment and dest.suffix == ".md" and fragment not in _anchors(dest):
                bad.append(f"{doc.relative_to(ROOT)}: {target} (no such heading)")
    assert not bad, "\n".join(bad)


def test_the_anchor_rule_matches_githubs():
    assert anchor("B. KubeRay (operator >= 1.1, CRDs `ray.io/v1`)") == "b-kuberay-operator--11-crds-rayiov1"
    assert anchor("What has run on a GPU, and what only on CPU") == "what-has-run-on-a-gpu-and-what-only-on-cpu"
