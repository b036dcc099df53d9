"""The method comparison (`trsp-ray benchmark`) as a local or cluster Ray workload.

`ray_runner(workers)` executes bench.plan's jobs as Ray tasks: every selection (TRSP's stage 1 first,
it is on the critical path of the TRSP rows) starts at once, and each row starts as soon as the
selection it uses is done (Ray resolves the selection's ObjectRef before the row task runs). Tasks
return plain dicts; the driver alone writes to MLflow, so the sqlite store never sees two writers.
"""

from __future__ import annotations

from trsp_ray.distributed import ray_session


def _quiet_like_the_driver() -> None:
    """A Ray worker imported tqdm before it saw the driver's TQDM_DISABLE: quiet it the same way
    when the driver runs quiet (the hub's switch, which the worker does inherit, says so)."""
    import os

    from trsp_ray.logs import quiet_libraries

    if os.environ.get("HF_HUB_DISABLE_PROGRESS_BARS") == "1":
        quiet_libraries()


def _selection_task(cfg_dict: dict, selector: str, seed: int, threads: int) -> dict:
    import torch

    _quiet_like_the_driver()

    from trsp_ray.comparison_jobs import selection_job

    torch.set_num_threads(threads)
    return selection_job(cfg_dict, selector, seed)


def _row_task(cfg_dict: dict, row: str, seed: int, selection: dict | None, export_dir: str | None,
              threads: int, options: dict, reference: dict | None) -> dict:
    import torch

    _quiet_like_the_driver()

    from trsp_ray.comparison_jobs import row_job

    torch.set_num_threads(threads)
    return row_job(cfg_dict, row, seed, selection, export_dir, options, reference)


def task_gpus(device: str, cluster_gpus: float) -> int:
    """GPUs each benchmark task requests: one when the run's device is a GPU (cuda, or auto on a
    cluster that has GPUs), else none; a task that asked for CPUs alone would get no visible GPU
    and fail (cuda) or silently run on CPU (auto)."""
    return 1 if device == "cuda" or (device == "auto" and cluster_gpus >= 1) else 0


def ray_runner(workers: int):
    """A bench runner that spreads the jobs over `workers` one-CPU Ray tasks at a time. Joins the
    cluster named by RAY_ADDRESS, else starts (and stops) a local Ray instance with `workers` CPUs."""

    def run(jobs, *, cfg_dict: dict, export_dir: str | None, on_done, options: dict) -> None:
        import ray

        from trsp_ray.comparison import job_inputs

        started = ray_session.connect(local_cpus=workers)
        try:
            cpus = int(ray.cluster_resources().get("CPU", workers))
            threads = max(1, cpus // max(1, workers))
            gpus = task_gpus(cfg_dict["device"], ray.cluster_resources().get("GPU", 0))
            selection_remote = ray.remote(num_cpus=1, num_gpus=gpus)(_selection_task)
            row_remote = ray.remote(num_cpus=1, num_gpus=gpus)(_row_task)
            ordered = sorted(jobs, key=submission_order)
            selections, pending = {}, {}
            for job in ordered:
                if job.kind == "selection":
                    ref = selection_remote.remote(cfg_dict, job.name, job.seed, threads)
                    selections[(job.name, job.seed)] = ref
                else:  # Ray resolves the selections' ObjectRefs before the row task runs
                    dep, reference = job_inputs(job, selections)
                    ref = row_remote.remote(cfg_dict, job.name, job.seed, dep, export_dir, threads,
                                            {**options, "budget": job.budget}, reference)
                pending[ref] = job
            while pending:
                [ref], _ = ray.wait(list(pending), num_returns=1)
                on_done(pending.pop(ref), ray.get(ref))
        finally:
            if started:
                ray.shutdown()

    return run


def submission_order(job) -> tuple:
    """Ray starts ready tasks in the order they were submitted, so the longest go first: the
    selections (TRSP's stage 1, the longest, first of all), then trained rows (a heal is ~2x a
    row's evaluation; larger budgets first), then selection-only rows, the dense row last. On 2
    CPUs this packs the README job's work ~25 s tighter than the plan's order."""
    from trsp_ray import registry

    if job.kind == "selection":
        return (0, job.name != registry.TRSP_SELECTOR, 0, job.seed)
    group = registry.ROWS[job.name].group
    return (1, {"trained": 0, "selection": 1}.get(group, 2), -job.budget, job.seed)


def run_benchmark_ray(cfg, rows, *, workers: int = 2, **kwargs) -> list[dict]:
    """comparison.run_benchmark (same keyword arguments) with its jobs on Ray (the evaluation pool
    gets one actor per worker)."""
    from trsp_ray.comparison import run_benchmark

    return run_benchmark(cfg, rows, runner=ray_runner(workers), zeroshot_actors=workers, **kwargs)
