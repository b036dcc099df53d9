"""The one thin wrapper around lm-evaluation-harness: score an in-memory model on zero-shot tasks.

Every other module goes through `run_tasks`; nothing else imports lm_eval. Offline task YAMLs come
from `tasks.write_task_dir`; lm-eval's built-in registry is indexed only when a stock task
(`lm_eval:<name>`) is asked for, because indexing it costs ~10 s per call.
"""

from __future__ import annotations

import contextlib
import logging
import os
from pathlib import Path

from trsp_ray.common.errors import TrspError
from trsp_ray.evaluation.tasks import STOCK_PREFIX, check_task_names, lm_eval_name, write_task_dir

METRICS = ("acc", "acc_norm")


def lm_eval_version() -> str:
    from importlib.metadata import version

    return version("lm_eval")


def check_limit(limit: int | None) -> int | None:
    """`limit` (items per task) must be a positive integer or None (all items)."""
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit <= 0):
        raise TrspError(f"limit={limit!r} is invalid; pass a positive number of items per task, or omit it for all")
    return limit


def _task_manager(names: list[str], task_dir: Path | None):
    from lm_eval.tasks import TaskManager

    stock = any(n.startswith(STOCK_PREFIX) for n in names)
    offline = [n for n in names if not n.startswith(STOCK_PREFIX)]
    include = str(task_dir or write_task_dir(offline)) if offline else None
    manager = TaskManager(include_defaults=stock, include_path=include)
    missing = [n for n in names if lm_eval_name(n) not in manager.all_tasks]
    if missing:
        raise TrspError(f"lm-eval does not know task(s) {', '.join(missing)}; check the name in "
                        "`lm_eval ls tasks` (stock tasks also need network access to their dataset)")
    return manager


def _quiet_lm(base):
    """`base` (lm-eval's HFLM) whose request bars follow trsp_ray's quiet switch (logs.quiet_libraries
    sets TQDM_DISABLE, which Ray workers inherit): lm-eval passes `disable=` to tqdm itself, so the
    switch alone does not reach its "Running loglikelihood requests" bar."""
    def quiet(flag: bool) -> bool:
        return flag or os.environ.get("TQDM_DISABLE") == "1"

    class QuietLM(base):
        def loglikelihood(self, requests, disable_tqdm: bool = False):
            return super().loglikelihood(requests, disable_tqdm=quiet(disable_tqdm))

        def loglikelihood_rolling(self, requests, disable_tqdm: bool = False):
            return super().loglikelihood_rolling(requests, disable_tqdm=quiet(disable_tqdm))

        def generate_until(self, requests, disable_tqdm: bool = False):
            return super().generate_until(requests, disable_tqdm=quiet(disable_tqdm))

    return QuietLM


def evaluate_lm(model, tokenizer, *, tasks: list, limit: int | None = None, batch_size: int = 8,
                task_manager=None, log_samples: bool = False, samples: dict | None = None) -> dict:
    """Raw `lm_eval.simple_evaluate` output for an in-memory model; `tasks` are names or config dicts.

    `samples` ({task: [doc index, ...]}) picks given items instead of the first `limit`."""
    from lm_eval import simple_evaluate
    from lm_eval.models.huggingface import HFLM

    logging.getLogger("lm_eval").setLevel(logging.WARNING)  # its per-task INFO lines drown our progress
    lm = _quiet_lm(HFLM)(pretrained=model, tokenizer=tokenizer, batch_size=batch_size, device=str(model.device))
    with _no_environment_report():
        return simple_evaluate(
            model=lm, tasks=tasks, num_fewshot=0, limit=check_limit(limit), samples=samples,
            task_manager=task_manager,
            bootstrap_iters=0,  # stderr by bootstrap costs minutes on CPU; we report the point estimates
            log_samples=log_samples, random_seed=0, numpy_random_seed=0, torch_random_seed=0,
        )


@contextlib.contextmanager
def _no_environment_report():
    """simple_evaluate ends by describing the machine: `git describe` in the working directory
    (outside a checkout, as in every Ray worker, git prints "fatal: not a git repository" on the
    run's stderr) and torch's collect_env (~2 s of subprocesses per call, once per row). Nothing of
    ours reads either (our manifests record versions and the commit), so both are skipped."""
    from lm_eval import evaluator

    saved = evaluator.get_git_commit_hash, evaluator.add_env_info
    evaluator.get_git_commit_hash, evaluator.add_env_info = (lambda: None), (lambda storage: None)
    try:
        yield
    finally:
        evaluator.get_git_commit_hash, evaluator.add_env_info = saved


def run_tasks(model, tokenizer, *, tasks: list[str], limit: int | None, batch_size: int = 8,
              task_dir: Path | None = None, items: bool = False) -> dict:
    """Zero-shot scores of `model` on `tasks` (our names, or `lm_eval:<stock>`).

    Returns {"tasks": {name: {"acc": float, "acc_norm": float (if the task defines it), "n": int,
    with `items` also "items": {metric: [per-item 0/1 in doc order]}}}, "lm_eval_version": str}: the
    per-item results are what paired comparisons of two models on the same items read.
    """
    names = check_task_names(tasks)
    check_limit(limit)
    manager = _task_manager(names, task_dir)
    raw = evaluate_lm(model, tokenizer, tasks=[lm_eval_name(n) for n in names], limit=limit,
                      batch_size=batch_size, task_manager=manager, log_samples=items)
    scores = {}
    for name in names:
        block = raw["results"][lm_eval_name(name)]
        entry = {m: float(block[f"{m},none"]) for m in METRICS if f"{m},none" in block}
        entry["n"] = int(raw.get("n-samples", {}).get(lm_eval_name(name), {}).get("effective", 0))
        if items:
            rows = per_item(raw, lm_eval_name(name))
            entry["items"] = {m: [r[m] for r in rows] for m in METRICS if rows and m in rows[0]}
        scores[name] = entry
    return {"tasks": scores, "lm_eval_version": lm_eval_version()}


def per_item(raw: dict, task: str) -> list[dict]:
    """Per-item results of a `log_samples=True` run: doc id, per-choice loglikelihoods, acc, acc_norm."""
    items = []
    for sample in sorted(raw["samples"][task], key=lambda s: s["doc_id"]):
        items.append({
            "doc_id": sample["doc_id"],
            "loglik": [float(r[0]) for r in sample["filtered_resps"]],
            **{m: float(sample[m]) for m in METRICS if m in sample},
        })
    return items
