"""Every trsp-ray and jobs/ command the documentation shows parses with the program it names: the
README's blocks, docs/*.md (blocks and inline commands), cluster/README.md, the jobs' and the package
modules' docstrings and the KubeRay entrypoints. A renamed or removed flag (or a narrowed choice, like a
default method) fails here instead of on a user's cluster."""

import functools
import importlib.util
import re
import shlex
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
COMMAND = re.compile(r"(trsp-ray|python jobs/\w+\.py)(?=\s|$)")
END = re.compile(r" #| \[| &&|;|`|\)")  # a comment, a [--optional] summary, the next shell command


def _logical_lines(lines: list[str]) -> list[str]:
    out, pending = [], ""
    for line in lines:
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
        else:
            out.append(pending + line)
            pending = ""
    return out


def code_lines(path: Path) -> list[str]:
    """The lines a reader copies: fenced bash blocks and indented code in Markdown, indented lines of
    a job's docstring, a KubeRay entrypoint."""
    text = path.read_text()
    if path.suffix == ".yaml":
        entry = (yaml.safe_load(text) or {}).get("spec", {}).get("entrypoint")
        return [entry] if entry else []
    if path.suffix == ".py":
        import ast

        text = ast.get_docstring(ast.parse(text)) or ""
        return _logical_lines([line for line in text.splitlines() if line.startswith("    ")])
    lines = [b for block in re.findall(r"```bash\n(.*?)\n```", text, flags=re.S) for b in block.splitlines()]
    return (_logical_lines(lines) + _logical_lines([line for line in text.splitlines() if line.startswith("    ")])
            + inline_commands(text))


def inline_commands(text: str) -> list[str]:
    """Commands quoted inline in prose (`trsp-ray benchmark --rows ... --lambada 200`, possibly broken
    over lines): a span that starts with a program and passes a flag. A bare name (`trsp-ray plan`)
    or `--help` is a mention, not a command."""
    prose = re.sub(r"```.*?```", "", text, flags=re.S)
    spans = (" ".join(span.split()) for span in re.findall(r"`([^`]+)`", prose))
    return [s for s in spans if COMMAND.match(s) and any(w.startswith("--") and w != "--help" for w in s.split())]


def commands(lines: list[str]) -> list[list[str]]:
    """Each command as argv, program first ('trsp-ray' or 'jobs/NAME.py'), cut where the shell line
    or the documentation's own notation takes over."""
    found = []
    for line in lines:
        for match in COMMAND.finditer(line):
            rest = line[match.end():]
            cut = END.search(rest)
            argv = shlex.split(rest[: cut.start()] if cut else rest)
            found.append([match.group(1).removeprefix("python "), *argv])
    return found


@functools.cache
def _job(name: str):
    spec = importlib.util.spec_from_file_location(f"job_{name}", ROOT / "jobs" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def parse(argv: list[str]):
    """Parse argv with its program's own parser; argparse's error message on a bad one."""
    from trsp_ray.cli import build_parser

    program, args = argv[0], argv[1:]
    parsers = {"trsp-ray": lambda a: build_parser().parse_args(a),
               "jobs/prune_70b.py": lambda a: _job("prune_70b").parse_args(a),
               "jobs/search.py": lambda a: _job("search").parse_args(a),
               "jobs/reproduce.py": lambda a: _job("reproduce").job_config(a)}
    return parsers[program](args)


DOCUMENTS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "cluster" / "README.md",
             *sorted((ROOT / "jobs").glob("*.py")),
             *sorted((ROOT / "trsp_ray").rglob("*.py")), *sorted((ROOT / "cluster" / "kuberay").glob("rayjob-*.yaml"))]


def test_every_documented_command_parses(capsys):
    found = [(doc.relative_to(ROOT), argv) for doc in DOCUMENTS for argv in commands(code_lines(doc))]
    programs = {argv[0] for _, argv in found}
    assert programs == {"trsp-ray", "jobs/prune_70b.py", "jobs/search.py", "jobs/reproduce.py"}, programs
    assert len(found) >= 15
    bad = []
    for doc, argv in found:
        try:
            parse(argv)
        except SystemExit:
            bad.append(f"{doc}: {shlex.join(argv)}\n  {capsys.readouterr().err.strip().splitlines()[-1]}")
    assert not bad, "\n".join(bad)
    # the config keys the commands set (`--set KEY=VALUE`) exist and take the value shown
    from trsp_ray.config.run_config import load_config

    sets = [argv[i + 1] for _, argv in found for i, a in enumerate(argv[:-1]) if a == "--set"]
    assert "device=cuda" in sets
    load_config(overrides=sets)


def test_the_check_reads_continued_lines_and_sees_a_bad_flag(tmp_path, capsys):
    doc = tmp_path / "doc.md"
    doc.write_text("```bash\ntrsp-ray prune --model m \\\n    --ratio 0.25 [--method M]\n"
                   "ray job submit -- python jobs/prune_70b.py --workers 2 --no-such-flag  # note\n```\n")
    found = commands(code_lines(doc))
    assert found == [["trsp-ray", "prune", "--model", "m", "--ratio", "0.25"],
                     ["jobs/prune_70b.py", "--workers", "2", "--no-such-flag"]]
    assert parse(found[0]).ratio == 0.25
    with pytest.raises(SystemExit):
        parse(found[1])
    assert "--no-such-flag" in capsys.readouterr().err


def test_docs_commands_are_read_and_a_renamed_flag_in_prose_fails(tmp_path, capsys):
    for doc in ("pipelines.md", "cluster.md", "evaluation.md", "results.md"):  # each page's commands are seen
        assert commands(code_lines(ROOT / "docs" / doc)), doc
    doc = tmp_path / "doc.md"
    doc.write_text("Run `trsp-ray benchmark --seeds 3\n--lambada 200` (a mention: `trsp-ray plan`), then\n"
                   "`trsp-ray benchmark --lambada-passages 200`.\n")
    found = commands(code_lines(doc))
    assert found == [["trsp-ray", "benchmark", "--seeds", "3", "--lambada", "200"],
                     ["trsp-ray", "benchmark", "--lambada-passages", "200"]]
    parse(found[0])
    with pytest.raises(SystemExit):
        parse(found[1])
    assert "--lambada-passages" in capsys.readouterr().err

