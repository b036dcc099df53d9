"""The closed-form compensation in the ZeRO-3 plan (distributed/compensate.py): memory per GPU
and host memory per worker while the maps are fitted and folded, right after stage 1.

Per GPU (d hidden, I intermediate, e dtype bytes, B blocks of the drop set, t tokens of one batch
on one GPU): stage 1's model state without its training activations (the fit is a no-grad
forward under stage 1's engine), one layer's forward intermediates over the batch, then
    sums           B x 2 x d^2 x 8      M^T M and M^T Y of every block, float64, all held through
                                        the one dense pass (512 MiB each at d = 8192)
    batch float64  3 x t x d x 8        M, the residual and Y of one batch upcast for the sums
    solve          6 x d^2 x 8          one block's all-reduced sums (2), the ridge term's eye and
                                        the regularised copy, the LU factors torch.linalg.solve
                                        works on, and T
    fold           d x I x (e + 2 x 8)  the gathered projection and T^T W computed in float64
Host per worker: the B maps T (d^2 x 8 each) kept from the fit to the fold (after stage 2). B is
at most min(n_drop, candidates - n_drop + 1) (dropped layers with a kept one between each pair).
The cosine objective (compensation_cosine.py) adds compensation_forms.cosine_bytes at n = this
worker's share of the calibration tokens: on the host, the cached rows 3 x n x d x e of every
block; per GPU, six d^2 float64 matrices of the Gauss-Newton steps and one chunk's float64 rows.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from trsp_ray.distributed.activations import forward_layer_bytes
from trsp_ray.distributed.memory import GB, StagePlan
from trsp_ray.distributed.shape import Shape
from trsp_ray.distributed.zero3_plan import estimate
from trsp_ray.distributed.zero3_setup import Setup

F64 = 8


@dataclass
class CompensationPlan:
    memory: StagePlan  # GB per GPU while the maps are fitted and folded
    blocks: int  # the most blocks a drop set of n_drop layers can have
    n_drop: int
    objective: str = "mse"  # compensation.objective: cosine caches the rows (module doc)

    @property
    def host_gb(self) -> float:
        return self.memory.host


def max_blocks(*, n_drop: int, candidates: int) -> int:
    return max(0, min(n_drop, candidates - n_drop + 1))


def compensation_plan(s: Shape, st: Setup, *, ratio: float, protect_head: int = 0, protect_tail: int = 0,
                      objective: str = "mse", calibration_tokens: int = 0) -> CompensationPlan:
    """The fit's memory; `calibration_tokens`: the fit's over every worker (the cosine objective caches
    each worker's share; unused by mse)."""
    from trsp_ray.compensation_forms import COSINE_CHUNK, check_objective, cosine_bytes
    from trsp_ray.stage1 import n_drop_for

    check_objective(objective, method="lstsq")
    if objective == "cosine" and calibration_tokens < 1:
        raise ValueError("the cosine objective's plan needs the fit's calibration tokens")

    n_drop = n_drop_for(ratio, s.layers)
    blocks = max_blocks(n_drop=n_drop, candidates=s.layers - protect_head - protect_tail)
    d, tokens = s.hidden, st.micro_batch * st.seqlen
    stage1 = estimate(s, st)[0]
    maps = blocks * d * d * F64 / GB
    memory = StagePlan("compensation", {k: v for k, v in stage1.parts.items() if k != "activations"},
                       stage1.host + maps)
    memory.parts.update({
        "one layer's forward (one batch)": tokens * forward_layer_bytes(s, st.dtype_bytes) / GB,
        f"sums M^T M, M^T Y (float64, {blocks} blocks)": blocks * 2 * d * d * F64 / GB,
        "one batch's M, residual, Y in float64": 3 * tokens * d * F64 / GB,
        "solve (reduced sums, eye, ridge copy, LU, T in float64)": 6 * d * d * F64 / GB,
        "fold (gathered projection, T^T W in float64)": d * s.intermediate * (st.dtype_bytes + 2 * F64) / GB,
    })
    if objective == "cosine":
        share = math.ceil(calibration_tokens / st.workers)
        extra = cosine_bytes(tokens=share, hidden=d, dtype_bytes=st.dtype_bytes, blocks=blocks)
        memory.parts["cosine steps (T, gradient, step, solve, Cholesky, projection in float64)"] = \
            extra["matrices"] / GB
        memory.parts[f"cosine rows of one chunk in float64 ({min(share, COSINE_CHUNK)} tokens)"] = extra["chunk"] / GB
        memory.host += extra["host"] / GB
    return CompensationPlan(memory=memory, blocks=blocks, n_drop=n_drop, objective=objective)


def calibration_line(*, windows: int, seqlen: int, hidden: int, tokens_per_column: float, floor: float) -> str:
    """The fit's calibration and the rule that sized it (compensation_forms.TOKENS_PER_COLUMN)."""
    tokens = windows * seqlen
    return (f"      calibration: {windows} windows x {seqlen} tokens = {tokens:,} tokens, {tokens / hidden:.1f} per "
            f"column of the {hidden} x {hidden} map (rule: {tokens_per_column:g} per column when "
            f"compensation.windows is 0; a fit below {floor:g} is refused)")


def format_compensation_plan(cp: CompensationPlan, st: Setup, *, calibration: str = "") -> list[str]:
    m = cp.memory
    verdict = "fits" if m.total <= st.gpu_memory_gb else "DOES NOT FIT"
    fit = "lstsq" if cp.objective == "mse" else f"lstsq, {cp.objective} objective"
    rows = ", and each block's cached rows of its share of the calibration" if cp.objective == "cosine" else ""
    lines = [f"  compensation ({fit}, after the selection): {m.total:.1f} GB per worker ({verdict}), "
             f"host {m.host:.1f} GB "
             f"(its {cp.blocks} maps T kept until the fold: at most {cp.blocks} blocks in a drop set of {cp.n_drop}"
             f"{rows})"]
    lines += [calibration] if calibration else []
    lines += [f"      {k}: {v:.2f} GB" for k, v in m.parts.items()]
    return lines
