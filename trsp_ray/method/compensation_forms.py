"""The least-squares map's forms (trsp_ray/method/compensation.py builds the sums, this solves them).

Every form minimises the same ridge objective over the calibration tokens,
    ||M T - Y||^2 + r ||T - I||^2,   r = ridge * mean(diag(M^T M)),
from the sums A = M^T M and B = M^T Y alone, and differs only in which maps T it allows:
  full      any d x d map: T = (A + r I)^-1 (B + r I) (ReplaceMe's form; d^2 numbers fitted);
  diagonal  one scale per channel of the MLP output: t_j = (B_jj + r) / (A_jj + r) (d numbers);
  lowrank   the identity plus a rank-k correction, T = I + D: the reduced-rank ridge regression of
            the residual target Y - M on M. With D* the full ridge solution of that residual
            problem, the best rank-k D is D* V_k V_k^T, V_k the top-k eigenvectors of
            D*^T (A + r I) D* (the ridge objective is a least-squares problem on M stacked over
            sqrt(r) I, whose reduced-rank optimum projects its fitted values onto their top-k
            right singular vectors). 2dk numbers; k = d is the full form.
A form with fewer numbers fits less of the calibration text's own structure: on a small model the
full map fitted on one domain overfits it (SPEC section 7, issue 21's measurements).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from trsp_ray.common.errors import TrspError

if TYPE_CHECKING:  # torch is imported where a map is solved: the config validates forms without it
    import torch

FORMS = ("full", "diagonal", "lowrank")
# how tokens count in the fit (trsp_ray/method/compensation.py): relative to their stream's norm, or absolute
WEIGHTINGS = ("norm", "none")
# what the map minimises: mse, the ridge objective above (closed form); cosine, ReplaceMe's mean
# 1 - cos over the tokens, refined from the mse map (trsp_ray/method/compensation_cosine.py)
OBJECTIVES = ("mse", "cosine")


# Calibration for a map, sized from the hidden size d (issue 33 item 3): a d x d map has d unknowns
# per output column, so its calibration scales with d. On SmolLM2 (d = 576) 7 tokens per column
# overfit (32 x 128 tokens: calibration-tail PPL 47.2 above held-out 39.7) and 28 was chosen on the
# calibration KL (128 x 128 tokens); ReplaceMe fits on ~2,000 per column at d = 4096. So the
# default is 28 per column (16k tokens at d = 576, 115k at 4096, 229k at 8192) and below 8 a fit is
# refused. The diagonal form has one unknown per column and needs no more than a token.
TOKENS_PER_COLUMN = 28.0
MIN_TOKENS_PER_COLUMN = 8.0


# the cosine fit's cached rows moved to the map's device at a time (trsp_ray/method/compensation_cosine.py)
COSINE_CHUNK = 4096


def cosine_bytes(*, tokens: int, hidden: int, dtype_bytes: int, blocks: int) -> dict[str, int]:
    """What the cosine objective adds to a fit of `tokens` calibration tokens (this rank's), in bytes:
    "host", the cached rows (x, r, y) of every block in the forward's dtype; on the map's device,
    "matrices", six d x d float64 (T, the gradient with L, the step and its solve, the curvature's
    Cholesky factor, the lowrank projection), and "chunk", seven float64 [COSINE_CHUNK, d] working rows
    (x, r, y, the prediction, the step's image and two temporaries). One formula for every plan."""
    return {"host": blocks * 3 * tokens * hidden * dtype_bytes, "matrices": 6 * hidden * hidden * 8,
            "chunk": 7 * min(tokens, COSINE_CHUNK) * hidden * 8}


def sized_windows(*, windows: int, hidden: int, seqlen: int, tokens_per_column: float = TOKENS_PER_COLUMN) -> int:
    """compensation.windows, with 0 (auto) resolved to ceil(tokens_per_column x hidden / seqlen)."""
    import math

    return windows or math.ceil(tokens_per_column * hidden / seqlen)


def check_tokens(*, tokens: int, hidden: int, form: str, minimum: float = MIN_TOKENS_PER_COLUMN) -> None:
    """Refuse a fit from fewer than `minimum` calibration tokens per unknown of a map column, in one line."""
    if form == "diagonal":
        if tokens < 1:
            raise TrspError(f"compensation has {tokens} calibration tokens; the diagonal map needs at least 1")
        return
    if tokens < minimum * hidden:
        raise TrspError(f"compensation has {tokens} calibration tokens, {tokens / hidden:.1f} per column of the "
                        f"{hidden} x {hidden} map, below the floor of {minimum:g} (7 overfit on SmolLM2); raise "
                        f"compensation.windows or leave it 0 (auto: {TOKENS_PER_COLUMN:g} per column)")


def check_form(form: str, rank: int | None, hidden: int | None = None) -> None:
    """Refuse an unknown form or a rank outside 1..hidden, in one line."""
    if form not in FORMS:
        raise TrspError(f"compensation.form={form!r} is not valid; choose one of {', '.join(FORMS)}")
    if form == "lowrank":
        top = f"1..{hidden}" if hidden else "an integer >= 1"
        if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1 or (hidden and rank > hidden):
            raise TrspError(f"compensation.rank={rank!r} is not valid for the lowrank form; pass {top} "
                            "(the hidden size is the full form)")


def check_objective(objective: str, *, method: str) -> None:
    """Refuse an unknown objective, or a cosine objective where no linear map is fitted, in one line
    (`method`: compensation.method; auto passes, its resolution is checked again once resolved)."""
    if objective not in OBJECTIVES:
        raise TrspError(f"compensation.objective={objective!r} is not valid; choose one of {', '.join(OBJECTIVES)}")
    if objective != "mse" and method in ("none", "scalar"):
        fits = "no map" if method == "none" else "per-block scales, not a map"
        raise TrspError(f"compensation.objective={objective!r} refines a least-squares map and "
                        f"compensation.method={method!r} fits {fits} (auto is none for a method without a fit); "
                        "use compensation.method=lstsq or a +comp/+cos method, or compensation.objective=mse")


def _shift(a: torch.Tensor, ridge: float) -> torch.Tensor:
    return ridge * a.diagonal().mean()


def solve(mtm: torch.Tensor, mty: torch.Tensor, *, ridge: float = 1e-2, form: str = "full",
          rank: int | None = None) -> torch.Tensor:
    """The map T [d, d] (float64) of `form` minimising ||M T - Y||^2 + r ||T - I||^2 (module doc)."""
    import torch

    a, b = mtm.double(), mty.double()
    check_form(form, rank, a.shape[0])
    r = _shift(a, ridge)
    if form == "diagonal":
        num, den = b.diagonal() + r, a.diagonal() + r
        t = torch.where(den > 0, num / torch.where(den > 0, den, torch.ones_like(den)), torch.ones_like(den))
        return torch.diag(t)
    eye = None if form == "full" else torch.eye(a.shape[0], dtype=a.dtype, device=a.device)
    try:
        if form == "full":  # the ridge added on copies' diagonals: no d x d identity beside them
            a_r, b_r = a.clone(), b.clone()
            a_r.diagonal().add_(r)
            b_r.diagonal().add_(r)
            return torch.linalg.solve(a_r, b_r)
        d_full = torch.linalg.solve(a + r * eye, b - a)  # ridge solution of the residual target Y - M
    except torch.linalg.LinAlgError:
        raise TrspError(f"the compensation system is singular at compensation.ridge={ridge}; raise the ridge "
                        "or compensation.windows") from None
    g = d_full.T @ (a + r * eye) @ d_full
    _, vecs = torch.linalg.eigh((g + g.T) / 2)  # ascending eigenvalues
    v = vecs[:, -rank:]
    return eye + d_full @ v @ v.T


def objective(mtm: torch.Tensor, mty: torch.Tensor, yty: torch.Tensor, t: torch.Tensor, *,
              ridge: float) -> float:
    """||M T - Y||^2 + r ||T - I||^2 from the sums (what every form minimises over its maps)."""
    import torch

    a, b, t = mtm.double(), mty.double(), t.double()
    eye = torch.eye(a.shape[0], dtype=a.dtype, device=a.device)
    fit = yty.double() - 2 * (t * b).sum() + (t * (a @ t)).sum()
    return float(fit + _shift(a, ridge) * ((t - eye) ** 2).sum())
