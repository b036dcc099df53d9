"""Every trsp-ray and jobs/ command the documentation shows parses with the program it names, and passes
what its command checks before any work (config, pipeline, budget; issue 49): the
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



# Models and files a documented command names that this machine does not hold, each replaced by one of
# the same shape (a hub id by a cached config.json, as the driver reads it): the checks a command makes
# before work depend on the model's shape, never on its weights.
NOTATION = "..."  # `--rows ...`: the documentation's notation, not a command
CANDIDATES = ("pruned/", "other/", "/path/to/dense", "out/trsp-25", "out/shortgpt-25",
              "~/.cache/trsp_ray/models/smollm2-135m-instruct")


@pytest.fixture
def stand_ins(tmp_path, monkeypatch):
    """{documented argument: a local stand-in}, with a Hugging Face cache holding the hub ids' config.json."""
    import json

    from test_distributed_hub import fake_hub_snapshot

    from trsp_ray.models.tiny import tiny_model
    from trsp_ray.reproduce.presets import _llama

    def config(name: str, shape: dict) -> Path:
        path = tmp_path / name / "config.json"
        path.parent.mkdir(parents=True)
        path.write_text(json.dumps({"model_type": "llama", "architectures": ["LlamaForCausalLM"], **shape}))
        return path

    tiny = tmp_path / "tiny"
    tiny_model("llama", layers=6, vocab=512).save_pretrained(tiny)
    home = tmp_path / "hf"
    for repo, src in (("meta-llama/Llama-2-70b-hf", ROOT / "cluster" / "models" / "llama-2-70b.json"),
                      ("meta-llama/Llama-3.1-8B", config("llama3-8b", _llama(128256, 4096, 14336, 32, 32, 8))),
                      ("trsp-test/tiny-llama", tiny / "config.json")):
        fake_hub_snapshot(home, repo, {"config.json": src})
    monkeypatch.setenv("HF_HOME", str(home))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    run_yaml = tmp_path / "run.yaml"
    run_yaml.write_text("ratio: 0.25\nmethod: shortgpt+comp+heal\nstage2:\n  steps: 20\n")
    return {"/shared/models/Llama-2-7b-hf": str(config("llama2-7b", _llama(32000, 4096, 11008, 32, 32, 32)).parent),
            "/tmp/tiny": str(tiny), "run.yaml": str(run_yaml), **{c: str(tiny) for c in CANDIDATES}}


def preflight(argv: list[str]) -> None:
    """What the command refuses before any work (config, pipeline, budget), checked by the functions its
    CLI calls first; a TrspError (the CLI's exit 2) when it would refuse. The machine's own checks (a GPU
    for device=cuda, free disk, the output folder) are not the command's and are left out."""
    from trsp_ray.cli import benchmark_request, prune_config
    from trsp_ray.evaluation.cli import eval_request
    from trsp_ray.reproduce.run import dry_run
    from trsp_ray.run.pipeline import resolve
    from trsp_ray.search.cli import search_config
    from trsp_ray.search.run import plan_trials

    program, args = argv[0], parse(argv)
    command = args.command if program == "trsp-ray" else program
    if command in ("reproduce", "jobs/reproduce.py"):
        dry_run(args.preset, models=args.models, methods=args.methods, ratios=args.ratios, overrides=args.overrides)
    elif command == "prune":
        resolve(prune_config(args))
    elif command == "jobs/prune_70b.py":
        resolve(_job("prune_70b").job_config(args))
    elif command in ("search", "jobs/search.py"):
        plan_trials(*search_config(args))
    elif command == "benchmark":
        benchmark_request(args)
    elif command == "eval":
        eval_request(args)
    else:
        assert command == "plan", command
        args.func(args)  # the plan is the whole command: config.json only


def test_every_documented_command_passes_the_checks_the_cli_makes_before_work(stand_ins, capsys):
    from trsp_ray.common.errors import TrspError

    found = [(doc.relative_to(ROOT), argv) for doc in DOCUMENTS for argv in commands(code_lines(doc))
             if NOTATION not in " ".join(argv)]
    assert len(found) >= 60
    bad = []
    for doc, argv in found:
        try:
            preflight([stand_ins.get(a, a) for a in argv])
        except TrspError as err:
            bad.append(f"{doc}: {shlex.join(argv)}\n  {err}")
    capsys.readouterr()
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("argv, words", [
    ("trsp-ray prune --model smollm2-135m --ratio 0.25 --method tail+cos+heal.tail --compute-budget 200k",
     "raise it to at least"),
    ("trsp-ray search --model smollm2-135m --ratio 0.267 --space fit=none,comp,cos --compute-budget 50000",
     r"cannot meet shortgpt\+cos\+heal: its selection costs 20k, compensation 242k"),
    ("trsp-ray benchmark --rows dense,no-such-row", "no-such-row"),
    ("trsp-ray prune --set stage2.lr=-1", "stage2.lr"),
])
def test_a_command_the_cli_refuses_fails_the_check(argv, words):
    """The cosine fit alone costs ~242k dense-forward tokens on SmolLM2: docs/pipelines.md showed both
    budgets below it, and the old test only parsed them."""
    from trsp_ray.common.errors import TrspError

    parse(shlex.split(argv))  # it parses ...
    with pytest.raises(TrspError, match=words):  # ... and the command would exit 2 before any work
        preflight(shlex.split(argv))
