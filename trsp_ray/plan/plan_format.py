"""A ZeRO-3 plan as the text `trsp-ray plan` prints."""

from __future__ import annotations

from trsp_ray.plan.zero3_plan import Plan


def format_plan(p: Plan, *, after_stages: tuple[str, ...] = (), fit_host_gb: float = 0.0,
                fit_holds: str = "the fit holds its maps") -> str:
    """The plan as text; `after_stages`: lines printed after the stages (stage 1's probes);
    `fit_host_gb`: a worker's host memory while the pipeline's fit holds its maps (0: no fit), `fit_holds`
    saying what it holds."""
    st = p.setup
    lines = [f"model: {p.shape.params / 1e9:.2f}B parameters, {p.shape.layers} layers; {st.workers} workers x "
             f"{st.gpu_memory_gb:g} GB, {'bf16' if st.dtype_bytes == 2 else 'fp32'}, micro batch {st.micro_batch} x "
             f"{st.seqlen} tokens"]
    for stage in p.stages:
        verdict = "fits" if stage.total <= st.gpu_memory_gb else "DOES NOT FIT"
        host = f", host {stage.host:.1f} GB" if stage.host else ""
        lines.append(f"  {stage.name}: {stage.total:.1f} GB per worker ({verdict}{host})")
        lines += [f"      {k}: {v:.2f} GB" for k, v in stage.parts.items()]
    lines += after_stages
    h = p.host(fit_host_gb=fit_host_gb)
    workers = min(st.gpus_per_node, st.workers)
    after = f"{workers} workers x {h.host_per_worker_gb:.1f} GB + the export on rank 0's node"
    node = after
    if h.fit_host_per_worker_gb:  # the larger phase first: the fit holding its maps, or the heal and export
        fit, rest = h.fit_host_per_worker_gb * workers, h.host_per_worker_gb * workers + h.export_host_gb
        fit_text = f"{workers} workers x {h.fit_host_per_worker_gb:.1f} GB while {fit_holds}"
        node = f"{fit_text}; after it, {after}: {rest:.1f} GB" if fit >= rest else \
            f"{after}; {fit_text}: {fit:.1f} GB"
    budget = f" (budget {st.disk_budget_gb:g} GB)" if st.disk_budget_gb is not None else ""
    lines += [f"  checkpoint: {h.checkpoint_gb:.1f} GB per save; storage {h.storage_gb:.1f} GB for "
              f"keep_checkpoints={st.keep_checkpoints} + 1 being written{budget}",
              f"  disk per node: {h.disk_per_node_gb:.1f} GB ("
              + (("its ranks' share of two saves: one uploading in the background, the next being written"
                  if st.async_upload else "its ranks' share of a save, staged before upload") if st.remote_storage else
                 "none: saves are written in place on the shared path") + ")",
              f"  host memory per node: {h.host_per_node_gb:.1f} GB ({node}); "
              f"{h.threads_per_worker} CPU threads per worker",
              f"  export host memory: {h.export_host_gb:.1f} GB above baseline on rank 0 "
              f"(2 x {st.export_shard_gb:.1f} GB shards, one layer gathered at a time)"]
    lines.append(f"plan {'fits' if p.fits else 'does not fit: ' + p.reason()}")
    if not p.fits:
        lines.append(p.suggestion())
    if p.disk_problem():
        lines.append(f"refused: {p.disk_problem()}")
    return "\n".join(lines)
