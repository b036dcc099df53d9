"""ReplaceMe's cosine objective for the compensation map (`compensation.objective=cosine`): the map T
of trsp_ray/method/compensation.py, of the same form and folded the same way, fitted to minimise

    L(T) = sum over the calibration tokens of 1 - cos(x T + r, y)

with compensation.py's conventions: x = M (the MLP output of layer a-1, the rows the fold
right-multiplies), r = h_mid (the residual stream x is added to) and y = the dense input of layer
b+1, so x T + r is what the folded layer a-1 writes. The least squares fits the same prediction to
y by squared error; the cosine counts each token by its angle alone, which is what the next layer's
RMSNorm passes on (so compensation.weighting changes only the start).

L is no function of the least-squares sums, so the fit keeps the activations: (x, r, y) of every
token, on the host in the forward's dtype (3 x n x d values per block, n this rank's tokens), moved
to the map's device CHUNK tokens at a time (compensation_forms.cosine_bytes counts them). The rows
come from the least-squares fit's own pass: a step costs matmuls over them, never a model forward.

The fit starts at the least-squares map T0 and takes Gauss-Newton steps. Near p = y the Hessian of
1 - cos(p, y) in p is (I - p p^T / |p|^2) / |p|^2, so the curvature of L in T is about
A = sum x^T x / |x T0 + r|^2 (over the rows, + a ridge shift), and the step direction is -A^-1 G,
G = dL/dT, restricted to the form's maps: diagonal keeps its diagonal (A's diagonal preconditions
it); lowrank keeps the right subspace of the least-squares correction T0 - I (T stays I + a rank-k
map). The step length is the best of a fixed ladder (LADDER) evaluated in one pass, taken only
where it lowers L; the fit stops when none does, when a step gains less than TOLERANCE of L, or
after `steps`.

Data parallel: `reduce` (an all-reduce sum; identity in one process) sums A once, then G with L and
the ladder's losses at every step over the ranks' token shards: two collectives per step, and the
sums come back identical on every rank, so every rank takes the same steps and folds the same T.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from trsp_ray.method.compensation_forms import COSINE_CHUNK as CHUNK

# Gauss-Newton steps from the least-squares map (each 4 matmuls over the cached rows: ~2.5 s at
# SmolLM2's 16k tokens x 576 on 2 busy CPU cores). On the tiny Llama (block 2-3, 512 tokens) the mean
# 1 - cos goes 0.18846 -> 0.18676 -> 0.18651 -> 0.18650 and no lower than 0.186498 by 100 steps, where
# full-batch Adam (lr 1e-3) needs ~1,600 steps to that loss; the fit stops once a step gains less than
# TOLERANCE of L (after the third there), and 10 bounds it
COSINE_STEPS = 10
TOLERANCE = 1e-4
LADDER = tuple(2.0 ** -k for k in range(-1, 7))  # step lengths 2 .. 1/64 tried at once
_RIDGE_FLOOR = 1e-6  # A + shift I must factor even at compensation.ridge=0


@dataclass
class Samples:
    """The cached (x, r, y) rows of one block, [n_i, d] each, on the host in the forward's dtype."""

    block: tuple[int, int]
    parts: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = field(default_factory=list)

    @property
    def tokens(self) -> int:
        return sum(x.shape[0] for x, _, _ in self.parts)


class Collector:
    """The `sink` of compensation.accumulate: keeps every batch's (x, r, y) per block."""

    def __init__(self):
        self.samples: dict[tuple[int, int], Samples] = {}

    def __call__(self, block, out: torch.Tensor, m: torch.Tensor, target: torch.Tensor) -> None:
        """`out` layer a-1's output, `m` its MLP output, `target` the dense stream [n, d]."""
        dtype = out.dtype
        # the difference of two large streams, taken in float64 (in place: one float64 [n, d] at a time)
        r = out.to(torch.float64, copy=True).sub_(m).to(dtype)
        self.samples.setdefault(block, Samples(block)).parts.append(
            tuple(t.detach().to("cpu", dtype) for t in (m, r, target)))

    def pop(self, block) -> Samples:
        """The block's rows (an empty Samples on a rank that had none: its sums are zeros)."""
        return self.samples.pop(block, None) or Samples(block)


def _chunks(samples: Samples, device):
    for x, r, y in samples.parts:
        for i in range(0, x.shape[0], CHUNK):
            yield tuple(t[i:i + CHUNK].to(device=device, dtype=torch.float64) for t in (x, r, y))


def _cosine(p: torch.Tensor, y: torch.Tensor):
    pn, yn = p.norm(dim=-1).clamp_min(1e-30), y.norm(dim=-1).clamp_min(1e-30)
    return (p * y).sum(-1) / (pn * yn), pn, yn


def loss(samples: Samples, t: torch.Tensor) -> torch.Tensor:
    """sum over this rank's tokens of 1 - cos(x T + r, y) (float64 scalar on T's device)."""
    total = torch.zeros((), dtype=torch.float64, device=t.device)
    for x, r, y in _chunks(samples, t.device):
        total += (1 - _cosine(x @ t + r, y)[0]).sum()
    return total


def _gradient(samples: Samples, t: torch.Tensor) -> torch.Tensor:
    """[dL/dT flattened, L] on this rank's tokens: d(1 - cos)/dp = -(y / (|p||y|) - cos p / |p|^2)."""
    d = t.shape[0]
    out = torch.zeros(d * d + 1, dtype=torch.float64, device=t.device)
    g, value = out[:-1].view(d, d), out[-1:]
    for x, r, y in _chunks(samples, t.device):
        p = x @ t + r
        c, pn, yn = _cosine(p, y)
        g -= x.T @ (y / (pn * yn)[:, None] - (c / pn ** 2)[:, None] * p)
        value += (1 - c).sum()
    return out


def _ladder(samples: Samples, t: torch.Tensor, step: torch.Tensor) -> torch.Tensor:
    """L(T + s step) for every s of LADDER on this rank's tokens, [len(LADDER)]: with b = x T + r and
    e = x step, cos(b + s e, y) = (b.y + s e.y) / (|y| sqrt(|b|^2 + 2 s b.e + s^2 |e|^2)), so a chunk
    costs two matmuls and six dot products per token, whatever the ladder's length."""
    out = torch.zeros(len(LADDER), dtype=torch.float64, device=t.device)
    ladder = torch.tensor(LADDER, dtype=torch.float64, device=t.device)[:, None]  # [k, 1]
    for x, r, y in _chunks(samples, t.device):
        base, dx = x @ t + r, x @ step
        by, ey, bb, be, ee = ((u * v).sum(-1) for u, v in ((base, y), (dx, y), (base, base), (base, dx), (dx, dx)))
        norm = (bb + 2 * ladder * be + ladder ** 2 * ee).clamp_min(1e-60).sqrt() * y.norm(dim=-1).clamp_min(1e-30)
        out += (1 - (by + ladder * ey) / norm).sum(-1)
    return out


def _curvature(samples: Samples, t0: torch.Tensor) -> torch.Tensor:
    """[A flattened, n]: A = sum x^T x / |x T0 + r|^2 over this rank's n tokens (module doc)."""
    d = t0.shape[0]
    out = torch.zeros(d * d + 1, dtype=torch.float64, device=t0.device)
    a = out[:-1].view(d, d)
    for x, r, _y in _chunks(samples, t0.device):
        w = x / (x @ t0 + r).norm(dim=-1, keepdim=True).clamp_min(1e-30)
        a += w.T @ w
        out[-1] += x.shape[0]
    return out


def _preconditioner(a: torch.Tensor, t0: torch.Tensor, *, form: str, rank: int | None, ridge: float) -> Callable:
    """g -> A^-1 g restricted to the form's maps (module doc)."""
    shift = max(ridge, _RIDGE_FLOOR) * a.diagonal().mean()
    if form == "diagonal":
        inverse = 1 / (a.diagonal() + shift)
        return lambda g: torch.diag(g.diagonal() * inverse)
    eye = torch.eye(a.shape[0], dtype=a.dtype, device=a.device)
    factor = torch.linalg.cholesky(a + shift * eye)
    if form == "full":
        return lambda g: torch.cholesky_solve(g, factor)
    correction = t0 - eye  # lowrank: T0 = I + D V_k V_k^T; its right subspace (V_k's span) is kept
    _, vecs = torch.linalg.eigh(correction.T @ correction)  # ascending eigenvalues
    keep = vecs[:, -rank:] @ vecs[:, -rank:].T
    return lambda g: torch.cholesky_solve(g, factor) @ keep


def fit(samples: Samples, t0: torch.Tensor, *, form: str = "full", rank: int | None = None, ridge: float = 1e-2,
        steps: int = COSINE_STEPS, reduce: Callable[[torch.Tensor], torch.Tensor] = lambda t: t,
        ) -> tuple[torch.Tensor, dict]:
    """(T [d, d] float64 on t0's device, {"cosine_lstsq", "cosine", "cosine_steps", "cosine_passes"}): the
    map of `form` (`rank` for lowrank) lowering L from the least-squares map `t0`, the mean 1 - cos over
    all ranks' tokens at t0 and at T, the steps taken and the passes run (what the fit costs: one more
    than the steps when the last pass found no gain, as many when a step's gain stopped it). `ridge`
    only shifts the curvature A (compensation.ridge, relative to A's mean diagonal); `reduce` sums over
    ranks (module doc)."""
    t = t0.double().clone()
    summed = reduce(_curvature(samples, t))
    d = t.shape[0]
    tokens = float(summed[-1])
    step_of = _preconditioner(summed[:-1].view(d, d), t, form=form, rank=rank, ridge=ridge)
    del summed
    start = current = None
    taken = passes = 0
    for _ in range(steps):
        passes += 1  # a pass: the gradient and the ladder, whether a step is taken or not
        got = reduce(_gradient(samples, t))
        current = float(got[-1])
        start = current if start is None else start
        step = -step_of(got[:-1].view(d, d))
        del got
        tries = reduce(_ladder(samples, t, step))
        best = int(torch.argmin(tries))
        if not float(tries[best]) < current:
            break
        t += LADDER[best] * step
        gain, current, taken = current - float(tries[best]), float(tries[best]), taken + 1
        if gain < TOLERANCE * current:
            break
    if start is None:  # steps=0
        start = current = float(reduce(loss(samples, t).reshape(1))[0])
    n = max(tokens, 1.0)
    return t, {"cosine_lstsq": start / n, "cosine": current / n, "cosine_steps": taken, "cosine_passes": passes}
