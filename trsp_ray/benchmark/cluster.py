"""The method comparison (`trsp-ray benchmark`) as a local or cluster Ray workload.

`RayRunner(workers)` executes bench.plan's jobs as Ray tasks, `workers` at a time: whenever one
finishes, the driver starts the first job in priority order whose selections are done (TRSP's stage
1 first, it is on the critical path of the TRSP rows; then the other selections, trained rows,
selection-only rows, the dense row last). Tasks return plain dicts; the driver alone writes to
MLflow, so the sqlite store never sees two writers.
"""

from __future__ import annotations

from trsp_ray.distributed import ray_session


def _quiet_like_the_driver() -> None:
    """A Ray worker imported tqdm before it saw the driver's TQDM_DISABLE: quiet it the same way
    when the driver runs quiet (the hub's switch, which the worker does inherit, says so)."""
    import os

    from trsp_ray.common.logs import quiet_libraries

    if os.environ.get("HF_HUB_DISABLE_PROGRESS_BARS") == "1":
        quiet_libraries()


def _selection_task(cfg_dict: dict, selector: str, seed: int, threads: int) -> dict:
    import torch

    _quiet_like_the_driver()

    from trsp_ray.benchmark.jobs import selection_job

    torch.set_num_threads(threads)
    return selection_job(cfg_dict, selector, seed)


def _row_task(cfg_dict: dict, row: str, seed: int, selection: dict | None, export_dir: str | None,
              threads: int, options: dict, reference: dict | None) -> dict:
    import torch

    _quiet_like_the_driver()

    from trsp_ray.benchmark.jobs import row_job

    torch.set_num_threads(threads)
    return row_job(cfg_dict, row, seed, selection, export_dir, options, reference)


def task_gpus(device: str, cluster_gpus: float) -> int:
    """GPUs each benchmark task requests: one when the run's device is a GPU (cuda, or auto on a
    cluster that has GPUs), else none; a task that asked for CPUs alone would get no visible GPU
    and fail (cuda) or silently run on CPU (auto)."""
    return 1 if device == "cuda" or (device == "auto" and cluster_gpus >= 1) else 0


def warm_worker() -> None:
    """Ray runs this in every worker process as it starts (the runtime_env's
    `worker_process_setup_hook`): the imports every benchmark task makes first (torch, transformers'
    model base and generation code, trsp_ray's jobs and memory plan: 5-9 s of CPU on 2 cores) happen
    while the driver is still setting up MLflow, instead of after the first task arrives."""
    import transformers.generation.utils  # noqa: F401
    import transformers.modeling_utils  # noqa: F401

    import trsp_ray.benchmark.jobs  # noqa: F401
    import trsp_ray.plan.single_plan  # noqa: F401
    import trsp_ray.run.workbench  # noqa: F401


class RayRunner:
    """A bench runner that spreads the jobs over `workers` one-CPU Ray tasks at a time. Joins the
    cluster named by RAY_ADDRESS, else starts (and stops) a local Ray instance with `workers` CPUs.

    `warm()` starts or joins Ray ahead of the run (run_benchmark calls it while MLflow sets up in
    another thread, and a local instance's workers do their imports meanwhile); calling the runner
    warms it if nobody did, and Ray is shut down when the last job is done (or by `close()`)."""

    def __init__(self, workers: int):
        self.workers = workers
        self.started = False

    def warm(self) -> None:
        import os

        import ray

        if ray.is_initialized():
            return
        local = not os.environ.get("RAY_ADDRESS")  # a joined cluster keeps its own runtime_env
        hook = {"runtime_env": {"worker_process_setup_hook": f"{__name__}.warm_worker"}} if local else {}
        self.started = ray_session.connect(local_cpus=self.workers, **hook)

    def close(self) -> None:
        if self.started:
            import ray

            ray.shutdown()
            self.started = False

    def __call__(self, jobs, *, cfg_dict: dict, export_dir: str | None, on_done, options: dict) -> None:
        import ray

        from trsp_ray.benchmark.comparison import job_inputs

        self.warm()
        workers = self.workers
        try:
            cpus = int(ray.cluster_resources().get("CPU", workers))
            threads = max(1, cpus // max(1, workers))
            gpus = task_gpus(cfg_dict["device"], ray.cluster_resources().get("GPU", 0))
            selection_remote = ray.remote(num_cpus=1, num_gpus=gpus)(_selection_task)
            row_remote = ray.remote(num_cpus=1, num_gpus=gpus)(_row_task)
            waiting = sorted(jobs, key=submission_order)
            selections, done, pending = {}, set(), {}
            while waiting or pending:
                # Ray runs a ready task in the order it became ready, so a row whose selection
                # finishes late (TRSP's) would queue behind every row ready before it: the driver
                # keeps `workers` tasks in flight and starts the first ready job in priority order
                while len(pending) < max(1, workers) and (job := next_job(waiting, done)) is not None:
                    waiting.remove(job)
                    if job.kind == "selection":
                        ref = selection_remote.remote(cfg_dict, job.name, job.seed, threads)
                        selections[(job.name, job.seed)] = ref
                    else:  # its selections are done: Ray hands their results to the row task
                        dep, reference = job_inputs(job, selections)
                        ref = row_remote.remote(cfg_dict, job.name, job.seed, dep, export_dir, threads,
                                                {**options, "budget": job.budget}, reference)
                    pending[ref] = job
                [ref], _ = ray.wait(list(pending), num_returns=1)
                job, result = pending.pop(ref), ray.get(ref)
                if job.kind == "selection":
                    done.add((job.name, job.seed))
                on_done(job, result)
        finally:
            self.close()


def next_job(waiting: list, done: set):
    """The first job of `waiting` (in priority order) whose selections are all in `done`
    ({(selector, seed)}), else None."""
    from trsp_ray.benchmark.comparison import job_needs

    return next((j for j in waiting if j.kind == "selection" or job_needs(j) <= done), None)


def submission_order(job) -> tuple:
    """The order the driver starts ready jobs in, longest first: the selections (TRSP's stage 1,
    the longest, first of all), then trained rows (a heal is ~2x a row's evaluation; larger budgets
    first), then selection-only rows, the dense row last."""
    from trsp_ray.config import registry

    if job.kind == "selection":
        return (0, job.name != registry.TRSP_SELECTOR, 0, job.seed)
    group = registry.ROWS[job.name].group
    return (1, {"trained": 0, "selection": 1}.get(group, 2), -job.budget, job.seed)


def run_benchmark_ray(cfg, rows, *, workers: int = 2, **kwargs) -> list[dict]:
    """comparison.run_benchmark (same keyword arguments) with its jobs on Ray (the evaluation pool
    gets one actor per worker)."""
    from trsp_ray.benchmark.comparison import run_benchmark

    return run_benchmark(cfg, rows, runner=RayRunner(workers), zeroshot_actors=workers, **kwargs)


def leave_one_out_ray(cfg, rows, *, workers: int = 2, **kwargs) -> dict:
    """comparison.leave_one_out with each left-out run's jobs on Ray (a fresh local instance per run)."""
    from trsp_ray.benchmark.comparison import leave_one_out

    return leave_one_out(cfg, rows, runner_for=lambda: RayRunner(workers), zeroshot_actors=workers, **kwargs)
