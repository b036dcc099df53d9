"""The least-squares fit's memory (trsp_ray/method/compensation.py in one process, distributed/compensate.py on
ZeRO-3 workers): one formula for what the fit holds beside the model (`fit_phases`), called by the
ZeRO-3 plan (`compensation_plan`, printed by `trsp-ray plan`, checked by route.py) and by the
single-process plan's "compensation" stage (single_plan.py).

d hidden, I intermediate, e dtype bytes, B blocks of the drop set, n tokens of one forward: rows x
seqlen, rows = min(data.batch_size, ceil(windows / workers)) (each rank runs its share of the windows
in batches of the run's batch size; one process all of them). The fit holds
    sums    B x 2 x d^2 x 8   M^T M and M^T Y of every block in float64, from the first batch to the
                              block's solve (512 MiB each at d = 8192)
and, beside them, the largest of its phases:
    pass    n x (2de + max(F, 3de + 2 x 8d))   one layer's forward at its largest F = e(4d + 3I) per
                              token (activations.forward_layer_bytes) beside layer a-1's output and MLP
                              output, which the hooks hold until the block's last layer b has run; there
                              the block's rows are summed in float64 (Y built in place, and M: two
                              [n, d], beside layer b's input and output and the embedding output) and
                              dropped. Only the last position's logits are computed (boundaries.forward_pass).
                              Counted on a CPU Llama by tests/test_forward_memory.py.
    solve   4 x d^2 x 8       the ridge's two copies, the LU factors and T (the block's all-reduced sums
                              replace its own); the residuals after it hold as many
    fold    d x I x (e + 16) + d^2 x 8   the gathered output projection, W in float64 and T^T W, and T;
                              on ZeRO-3 workers after the fit, the sums freed (compensate.apply); one
                              process folds each block after its solve, beside the sums, into a weight
                              it holds already (d x I x 16), in host memory on a GPU run (methods._dense_beside)
    cosine  compensation_forms.cosine_bytes' six d^2 float64 matrices and one chunk's rows, per block
                              after its solve; the cached rows (3 x n_share x d x e per block) on the host
Host per worker (ZeRO-3): the B maps T (d^2 x 8 each) from the fit to the fold; compensate.apply drops
them once folded, so for a heal method (the fold right after the fit) none is held through the heal
and the export. B is at most min(n_drop, candidates - n_drop + 1) (dropped layers with a kept one
between each pair). Measured against the resident set of 2 gloo ZeRO-3 ranks on CPU:
benchmarks/fit_memory.py.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from trsp_ray.plan.activations import forward_layer_bytes
from trsp_ray.plan.memory import GB, StagePlan
from trsp_ray.plan.shape import Shape
from trsp_ray.plan.zero3_plan import estimate
from trsp_ray.plan.zero3_setup import Setup

F64 = 8
WORKING_SET = "the fit's working set (sums + its largest phase)"


@dataclass
class CompensationPlan:
    memory: StagePlan  # GB per GPU while the maps are fitted and folded
    blocks: int  # the most blocks a drop set of n_drop layers can have
    n_drop: int
    objective: str = "mse"  # compensation.objective: cosine caches the rows (module doc)
    phases: dict[str, float] | None = None  # GB beside the model state, per phase (fit_phases)
    rows: int = 0  # windows per forward on one worker
    windows: int = 0

    @property
    def host_gb(self) -> float:
        return self.memory.host


def max_blocks(*, n_drop: int, candidates: int) -> int:
    return max(0, min(n_drop, candidates - n_drop + 1))


def fit_rows(*, windows: int, batch: int, world: int = 1) -> int:
    """Windows in one of the fit's forwards: a rank's share ceil(windows / world), in batches of `batch`."""
    if windows < 1:
        raise ValueError("the fit's plan needs its calibration windows (compensation.windows, sized)")
    return min(batch, math.ceil(windows / world))


def fit_phases(s: Shape, *, dtype_bytes: int, tokens: int, blocks: int, sharded: bool, fold_here: bool = True,
               cosine_share: int = 0) -> dict[str, float]:
    """GB the fit holds beside the model state in each phase (module doc), each including the sums it
    runs beside: "pass" over `tokens` tokens per forward, "solve", "fold" (`sharded`: a ZeRO-3 worker
    gathers the projection and folds after the fit; `fold_here` False: the fold is in host memory) and,
    with `cosine_share` (this rank's calibration tokens), "cosine"."""
    d, e = s.hidden, dtype_bytes
    sums = blocks * 2 * d * d * F64
    per_token = 2 * d * e + max(forward_layer_bytes(s, e), 3 * d * e + 2 * d * F64)
    out = {"pass": sums + tokens * per_token, "solve": sums + 4 * d * d * F64}
    if fold_here:
        out["fold"] = d * s.intermediate * (e + 2 * F64) + d * d * F64 if sharded else \
            sums + d * s.intermediate * 2 * F64 + d * d * F64
    if cosine_share:
        from trsp_ray.method.compensation_forms import cosine_bytes

        extra = cosine_bytes(tokens=cosine_share, hidden=d, dtype_bytes=e, blocks=blocks)
        out["cosine"] = sums + extra["matrices"] + extra["chunk"]
    return {k: v / GB for k, v in out.items()}


def cosine_host_gb(*, share: int, hidden: int, dtype_bytes: int, blocks: int) -> float:
    from trsp_ray.method.compensation_forms import cosine_bytes

    return cosine_bytes(tokens=share, hidden=hidden, dtype_bytes=dtype_bytes, blocks=blocks)["host"] / GB


def compensation_plan(s: Shape, st: Setup, *, ratio: float, windows: int, protect_head: int | str = 0,
                      protect_tail: int = 0, objective: str = "mse") -> CompensationPlan:
    """The fit's memory per worker: stage 1's model state (the fit is a no-grad pass under its
    engine) and the fit's working set over `windows` calibration windows of st.seqlen tokens, split
    over st.workers in batches of the run's batch size (st.micro_batch x st.workers)."""
    from trsp_ray.method.compensation_forms import check_objective
    from trsp_ray.method.stage1 import candidate_layers, n_drop_for

    check_objective(objective, method="lstsq")
    n_drop = n_drop_for(ratio, s.layers)
    blocks = max_blocks(n_drop=n_drop, candidates=len(candidate_layers(s.layers, protect_head=protect_head,
                                                                         protect_tail=protect_tail)))
    rows = fit_rows(windows=windows, batch=st.micro_batch * st.workers, world=st.workers)
    share = math.ceil(windows / st.workers) * st.seqlen if objective == "cosine" else 0
    phases = fit_phases(s, dtype_bytes=st.dtype_bytes, tokens=rows * st.seqlen, blocks=blocks, sharded=True,
                        cosine_share=share)
    stage1 = estimate(s, st)[0]
    maps = blocks * s.hidden * s.hidden * F64 / GB
    memory = StagePlan("compensation", {k: v for k, v in stage1.parts.items() if k != "activations"},
                       stage1.host + maps)
    memory.parts[WORKING_SET] = max(phases.values())
    if share:
        memory.host += cosine_host_gb(share=share, hidden=s.hidden, dtype_bytes=st.dtype_bytes, blocks=blocks)
    return CompensationPlan(memory=memory, blocks=blocks, n_drop=n_drop, objective=objective, phases=phases,
                            rows=rows, windows=windows)


def calibration_line(*, windows: int, seqlen: int, hidden: int, tokens_per_column: float, floor: float) -> str:
    """The fit's calibration and the rule that sized it (compensation_forms.TOKENS_PER_COLUMN)."""
    tokens = windows * seqlen
    return (f"      calibration: {windows} windows x {seqlen} tokens = {tokens:,} tokens, {tokens / hidden:.1f} per "
            f"column of the {hidden} x {hidden} map (rule: {tokens_per_column:g} per column when "
            f"compensation.windows is 0; a fit below {floor:g} is refused)")


def phase_lines(phases: dict[str, float], *, blocks: int, rows: int, seqlen: int, windows: int, world: int,
                sharded: bool) -> list[str]:
    """The phases of `fit_phases` as the plan prints them, under the working set's line."""
    sums = f"sums M^T M, M^T Y of {blocks} blocks (float64)"
    share = f"{windows} windows / {world} workers, " if world > 1 else ""
    text = {"pass": f"pass: {sums} + {rows} windows x {seqlen} tokens per forward ({share}in batches of the run's "
                    "batch size): a layer's intermediates, layer a-1's output and MLP output held to the block's end, "
                    "its rows in float64",
            "solve": f"solve: {sums} + the ridge's two copies, LU factors and T (float64, d x d)",
            "fold": ("fold (after the fit, the sums freed): the gathered projection, W and T^T W in float64, T"
                     if sharded else f"fold: {sums} + W and T^T W in float64, T"),
            "cosine": f"cosine steps: {sums} + six d x d float64 matrices and one chunk of rows"}
    worst = max(phases, key=phases.get)
    return [f"          {text[k]}: {v:.2f} GB" + (" (the largest)" if k == worst else "") for k, v in phases.items()]


def format_compensation_plan(cp: CompensationPlan, st: Setup, *, calibration: str = "") -> list[str]:
    m = cp.memory
    verdict = "fits" if m.total <= st.gpu_memory_gb else "DOES NOT FIT"
    fit = "lstsq" if cp.objective == "mse" else f"lstsq, {cp.objective} objective"
    rows = ", and each block's cached rows of its share of the calibration" if cp.objective == "cosine" else ""
    lines = [f"  compensation ({fit}, after the selection): {m.total:.1f} GB per worker ({verdict}), "
             f"host {m.host:.1f} GB "
             f"(its {cp.blocks} maps T, from the fit to the fold, dropped once folded: at most {cp.blocks} blocks "
             f"in a drop set of {cp.n_drop}{rows})"]
    lines += [calibration] if calibration else []
    for k, v in m.parts.items():
        lines.append(f"      {k}: {v:.2f} GB")
        if k == WORKING_SET and cp.phases:
            lines += phase_lines(cp.phases, blocks=cp.blocks, rows=cp.rows, seqlen=st.seqlen, windows=cp.windows,
                                 world=st.workers, sharded=True)
    return lines
