"""Stage 1: learn which layers to drop with an L1 penalty on per-layer gates.

    L1 = CE(next token) + lambda1 * sum_{i in candidates \\ P} |s_i|

Iterative greedy selection (default): each round trains the gates, moves the remaining candidate
with the smallest |s_i| into the drop set P and bypasses it; gates are warm-started. One-shot
selection takes the n_drop smallest after the first round. The result is the ordered drop list;
the drop set for a smaller ratio is a prefix of it.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

from trsp_ray.errors import TrspError
from trsp_ray.training import Batches, MakeStepper, Report, TorchStepper, freeze, null_report, split_over_ranks


@dataclass
class Stage1Result:
    drop_order: list[int]  # original layer indices, in the order they were chosen
    round1_ranking: list[int]  # candidates by |s| after round 1, smallest first (one-shot order)
    gate_history: list[list[float]] = field(default_factory=list)  # gate values after each step
    round_ends: list[int] = field(default_factory=list)  # step count at the end of each round
    rounds_computed: int = 0  # rounds run in this call (a resumed run skips finished ones)
    steps: int = 0
    tokens: int = 0
    tokens_per_step: int = 0
    probes: list[dict] = field(default_factory=list)  # per round: removal score of each probed layer
    probe_tokens: int = 0  # calibration tokens of the probe windows (0 without probes)
    probe_cost: int = 0  # dense-forward tokens the probes spent (teacher passes included)
    swaps: list[dict] = field(default_factory=list)  # refinement: {"out", "in", "score"} per accepted swap
    refine_calls: int = 0  # scorer calls refinement spent (at most its budget)
    refine_cost: int = 0  # dense-forward tokens of those calls (part of probe_cost)

    def drop_for(self, method: str, n_drop: int) -> list[int]:
        """The first `n_drop` layers of this run's order for a TRSP method: one-shot takes the
        round-1 ranking, the iterative methods the greedy drop order (a prefix serves any smaller ratio)."""
        from trsp_ray.registry import method as lookup

        return (self.round1_ranking if lookup(method).ranking == "round1" else self.drop_order)[:n_drop]


def candidate_layers(num_layers: int, *, protect_head: int, protect_tail: int) -> list[int]:
    return list(range(protect_head, num_layers - protect_tail))


def n_drop_for(ratio: float, num_layers: int) -> int:
    """Decoder layers a `ratio` drops out of `num_layers`: round(ratio * L), the one rule every path applies."""
    return round(ratio * num_layers)


def check_drop_count(n_drop: int, candidates: list[int], ratio: float, num_layers: int) -> None:
    if n_drop < 1:
        raise TrspError(f"ratio={ratio} drops round({ratio}*{num_layers})=0 layers; "
                        f"use a ratio >= {0.5 / num_layers:.3f}")
    if n_drop > len(candidates):
        raise TrspError(f"ratio={ratio} asks to drop {n_drop} layers but only {len(candidates)} are candidates "
                        f"(layers {candidates[0]}..{candidates[-1]}); "
                        f"use a ratio <= {len(candidates) / num_layers:.3f} "
                        f"or protect fewer head/tail layers")


# Dense log-probs of this rank's probe windows kept on the device (model dtype) up to this many
# bytes per rank; above it the dense model is re-run each call (same dtype, so the scores agree).
TEACHER_CACHE_BYTES = 2 * 2**30


def probe_memory_bytes(*, chunk_tokens: int, cached_tokens: int, vocab: int, dtype_bytes: int) -> dict[str, int]:
    """Device bytes of a removal probe beyond the model, per rank (see RemovalScorer), at the larger
    of its two peaks over one chunk's scored tokens (bytes = tokens x V x the sum): while the
    student's log-probs are made, the teacher's chunk in the model's dtype (e), the model's logits
    (e), their fp32 upcast (4, none for an fp32 model) and the fp32 log-probs (4); while the KL is
    summed, the teacher's chunk (e), the student's log-probs (4, overwritten in place) and the
    teacher's fp32 probabilities (4). Plus the teacher cache (`cached_tokens` = this rank's scored
    tokens when they fit TEACHER_CACHE_BYTES, else 0) in the model's dtype."""
    e = dtype_bytes
    per_token = max(2 * e + (4 if e < 4 else 0) + 4, e + 8)
    return {"probe chunk (student log-probs + teacher)": chunk_tokens * vocab * per_token,
            "probe teacher cache": cached_tokens * vocab * dtype_bytes}


def teacher_cached(*, windows: int, scored_positions: int, world: int, vocab: int, dtype_bytes: int,
                   budget: int = TEACHER_CACHE_BYTES) -> bool:
    """Whether the dense log-probs of the largest rank's share of the probe windows fit the budget
    (the one rule RemovalScorer and the planner apply)."""
    return math.ceil(windows / world) * scored_positions * vocab * dtype_bytes <= budget


def recall_positions(windows, *, common: set[int], min_gap: int = 16):
    """Bool mask [n, T-1] of the positions t whose next token x[t+1] is a word piece that already
    occurred at least `min_gap` tokens earlier in the same window and is not one of the text's
    `common` tokens (its most frequent ones): predictions that need the passage, e.g. a name or a
    noun coming back, the skill passage-level tasks such as LAMBADA's final words test. Built from
    calibration text only."""
    import torch

    mask = torch.zeros(windows.shape[0], windows.shape[1] - 1, dtype=torch.bool)
    for row, window in enumerate(windows.tolist()):
        first: dict[int, int] = {window[0]: 0}
        for t, tok in enumerate(window[1:]):
            if tok not in common and tok in first and t + 1 - first[tok] >= min_gap:
                mask[row, t] = True
            first.setdefault(tok, t + 1)
    return mask


def common_tokens(ids, count: int = 200) -> set[int]:
    """The `count` most frequent token ids of a calibration text (shape [N])."""
    import torch

    return set(torch.argsort(torch.bincount(ids), descending=True)[:count].tolist())


class RemovalScorer:
    """What removing a set of layers costs, measured: the mean over every scored token of fixed
    calibration windows of the next-token CE of the model with those layers bypassed and every gate
    at 1 ("ce"), or of KL(dense || pruned) over the whole next-token distribution ("kl"), which
    averages over every possible next token instead of the one observed and so needs far fewer
    windows for a stable ranking. Positions before `start` in each window are not scored.
    "recall" is "kl" plus the mean CE increase over the dense model at the windows' recall
    positions (`recall_positions`, `common` = the calibration text's frequent tokens): KL averages
    over every token, most of them easy and local, so it keeps what short-range prediction needs;
    the recall term weighs what needs the passage.

    Data-parallel: `windows` are all the probe windows (batches of shape [b, T], b = the chunk
    size); rank `rank` of `world` scores windows k with k % world == rank, in chunks of b
    (training.split_over_ranks, the split every data-parallel forward uses), and
    `all_reduce` sums the per-rank [score sum, token count] (identity in one process), so one
    process and W ranks give the same score. Every rank runs the same number of forwards per call
    (under ZeRO-3 each forward is a collective): a rank with fewer chunks runs a padding forward
    whose result it discards. `cost` counts the dense-forward tokens of the scored windows on all
    ranks together (the one-process figure; padding is not counted)."""

    def __init__(self, *, model, gates, windows: list, criterion: str = "kl", start: int = 0, rank: int = 0,
                 world: int = 1, all_reduce: Callable[[list[float]], list[float]] | None = None,
                 teacher_budget_bytes: int = TEACHER_CACHE_BYTES, common: set[int] | None = None):
        import torch

        rows = torch.cat(list(windows))
        if criterion == "recall" and start:
            raise TrspError("probe start is not used by probe_criterion='recall' (it scores every position); "
                            "pass start=0 or probe_criterion='kl'")
        if not 0 <= start < rows.shape[1] - (1 if criterion == "ce" else 0):
            raise TrspError(f"probe start={start} leaves no scored position in {rows.shape[1]}-token windows")
        self.model, self.gates, self.criterion, self.start = model, gates, criterion, start
        self.all_reduce = all_reduce or (lambda values: values)
        self.chunks, padding = split_over_ranks(windows, rank=rank, world=world)
        self.passes = len(self.chunks) + padding  # forwards per call on every rank
        if criterion == "recall":  # a row's positions depend on that row only: one mask per chunk
            common = common_tokens(rows) if common is None else common
            self.masks = [recall_positions(c, common=common) for c in self.chunks]
        self.padding = rows[:1]
        self.tokens = rows.numel()  # calibration tokens of all probe windows (every rank)
        self.cost = 0
        head = model.get_output_embeddings().weight
        vocab = getattr(head, "ds_shape", head.shape)[0]  # ZeRO-3 leaves an empty placeholder
        # the same decision on every rank (it decides how many forwards each call runs)
        self.cache_teacher = criterion in ("kl", "recall") and teacher_cached(
            windows=rows.shape[0], scored_positions=rows.shape[1] - start, world=world, vocab=vocab,
            dtype_bytes=self._dtype().itemsize, budget=teacher_budget_bytes)
        self._teacher: dict[int, object] = {}

    def _dtype(self):
        return self.model.get_input_embeddings().weight.dtype

    def _logprobs(self, batch):
        import torch

        device = self.model.get_input_embeddings().weight.device
        logits = self.model(input_ids=batch.to(device), use_cache=False).logits[:, self.start:]
        return torch.log_softmax(logits.float(), dim=-1)

    def _teacher_logprobs(self, k: int, chunk):
        """The dense model's log-probs of chunk k in the model's dtype, on the device: cached when
        they fit the budget, else recomputed (rounded alike, so every call scores the same)."""
        if k in self._teacher:
            return self._teacher[k]
        with self.gates.state(gated=False, bypass=[]):
            lp = self._logprobs(chunk).to(self._dtype())
        if self.cache_teacher:
            self._teacher[k] = lp
        return lp

    def _chunk_sum(self, k: int, chunk) -> list[float]:
        """[sum of the per-token score over chunk k's scored positions, their count] (recall: then
        the sum of the CE increase at its recall positions and their count)."""
        import torch.nn.functional as F

        if self.criterion == "recall":
            teacher = self._teacher_logprobs(k, chunk)[:, :-1]
            with self.gates.state(gated=False, bypass=self._drop):
                lp = self._logprobs(chunk)[:, :-1]
            count = lp.shape[0] * lp.shape[1]
            mask = self.masks[k].to(lp.device) if k < len(self.masks) else None
            gap = None
            if mask is not None and mask.any():  # read before _kl_sum overwrites lp; CE(pruned) - CE(dense)
                target = chunk[:, 1:].to(lp.device)[:, :, None]
                gap = (teacher.gather(-1, target).float() - lp.gather(-1, target))[..., 0][mask]
            kl = _kl_sum(teacher, lp)
            if gap is None:
                return [kl.item(), count, 0.0, 0.0]
            return [kl.item(), count, gap.sum().item(), float(mask.sum())]
        if self.criterion == "kl":
            teacher = self._teacher_logprobs(k, chunk)
            with self.gates.state(gated=False, bypass=self._drop):
                lp = self._logprobs(chunk)
            count = lp.shape[0] * lp.shape[1]
            return [_kl_sum(teacher, lp).item(), count]
        with self.gates.state(gated=False, bypass=self._drop):
            lp = self._logprobs(chunk)[:, :-1]
        target = chunk[:, self.start + 1:].to(lp.device)
        total = F.cross_entropy(lp.reshape(-1, lp.shape[-1]), target.reshape(-1), reduction="sum")
        return [total.item(), target.numel()]

    def __call__(self, drop: list[int]) -> float:
        import torch

        teacher_passes = 0 if self.cache_teacher and self._teacher else 1
        self._drop = list(drop)
        sums = [0.0] * (4 if self.criterion == "recall" else 2)
        with torch.no_grad():
            for k in range(self.passes):
                if k < len(self.chunks):
                    sums = [a + float(b) for a, b in zip(sums, self._chunk_sum(k, self.chunks[k]))]
                else:  # this rank is out of windows: keep the collectives in step, discard the result
                    self._chunk_sum(k, self.padding)
        self.cost += self.tokens * (1 + (teacher_passes if self.criterion != "ce" else 0))
        sums = self.all_reduce(sums)
        score = sums[0] / sums[1]
        return score + (sums[2] / sums[3] if self.criterion == "recall" and sums[3] else 0.0)


def _kl_sum(teacher, lp):
    """KL(dense || pruned) summed over the positions of `lp` (the pruned model's fp32 log-probs,
    overwritten in place) against `teacher` (the dense log-probs, model dtype): the sum of
    exp(t) (t - lp), which is what F.kl_div(lp, t, log_target=True, reduction="sum") returns, to the
    bit on contiguous tensors, with one temporary (exp(t) in fp32) instead of kl_div's three and an
    fp32 copy of the teacher (0.44 -> 0.28 s per 4 x 128 x 49k chunk on one core)."""
    import torch

    p = teacher.exp() if teacher.dtype == torch.float32 else teacher.float().exp_()
    return -lp.sub_(teacher).mul_(p).sum()


def run_stage1(*, model, gates, batches: Batches, n_drop: int, candidates: list[int], lambda1: float,
               lr: float, first_round_steps: int, steps_per_round: int, selection: str = "iterative",
               train_base: bool = False, base_lr: float = 2e-5, make_stepper: MakeStepper = TorchStepper,
               report: Report = null_report, resume: dict | None = None, probe: int = 0,
               scorer: RemovalScorer | None = None, refine: int = 0, refine_budget: int | None = None,
               shortlist_bi: int = 0, influence: dict[int, float] | None = None,
               on_round: Callable[[dict], None] | None = None) -> Stage1Result:
    """Run stage 1 on a gated model (see `gates.attach_gates`); returns the ordered drop list.

    With `probe` = k > 1 and a `scorer`, each iterative round measures the removal cost of the k
    remaining candidates with the smallest gates (with P already removed) and drops the cheapest: the
    gates choose what to measure, the measurement decides. `resume` is a state dict previously
    passed to `on_round` (after a round finished): finished rounds are not recomputed and the batch
    stream continues where it stopped.

    Greedy removal is myopic (a layer that is cheapest now can make later removals dear), so with
    probes and `refine` = n > 0 the last round ends with up to n passes of swaps: each dropped layer
    is exchanged with each probed-but-kept layer, and a swap that lowers the measured cost of the
    whole set is kept (first improvement), until `refine_budget` scorer calls are spent (None: no
    cap). It runs before the last round's checkpoint.

    `shortlist_bi` = m > 0 adds to each round's shortlist the m remaining candidates of lowest
    `influence` (ShortGPT's Block Influence of the dense model, {layer: 1 - mean cos}) that the gates
    did not already shortlist: the gates see short-window CE, Block Influence how little a layer
    changes the stream, and the probes measure which of them removal really spares.
    """
    gates.set_gated(True)
    gates.reset_gates()  # s_i = 1: the gated model starts exactly at the original model
    for w in gates.wrappers:
        w.grad_ema = 0.0
    gates.set_bypass([])
    gate_ids = {id(p) for p in gates.gate_params()}
    base = [p for p in model.parameters() if id(p) not in gate_ids]
    # Only candidate gates learn; protected layers keep s = 1 so they cannot absorb the selection.
    trained_gates = [gates[i].gate for i in candidates]
    freeze(model, except_params=trained_gates + (base if train_base else []))
    groups = [{"params": trained_gates, "lr": lr}]
    if train_base:
        groups.append({"params": base, "lr": base_lr})
    stepper = make_stepper(model, groups)
    result = Stage1Result(drop_order=[], round1_ranking=[], tokens_per_step=batches.tokens_per_batch)
    if resume:
        _restore(resume, gates=gates, batches=batches, stepper=stepper, result=result)
    total_rounds = 1 if selection == "oneshot" else n_drop
    done_rounds = len(result.round_ends)
    for r in range(done_rounds, total_rounds):
        active = [c for c in candidates if c not in result.drop_order]
        for _ in range(first_round_steps if r == 0 else steps_per_round):
            ce = stepper.forward(batches.next())
            penalty = gates.l1(active)
            loss = ce + lambda1 * penalty
            stepper.backward(loss)
            stepper.step()
            gates.clamp_nonnegative()
            values = gates.gate_values()
            result.gate_history.append(values)
            result.steps += 1
            result.tokens += batches.tokens_per_batch
            metrics = {"stage1/loss": loss.item(), "stage1/ce": ce.item(), "stage1/penalty": penalty.item(),
                       "stage1/round": r}
            metrics.update({f"gate/{i:02d}": v for i, v in enumerate(values)})
            report(metrics, result.steps)
        values = gates.gate_values()
        # smallest |s| first; among equal |s| (several pinned at 0) the gate CE pulls up least
        ranking = sorted(active, key=lambda i: (round(abs(values[i]), 6), -gates[i].grad_ema))
        if r == 0:
            result.round1_ranking = ranking
        choice = ranking[0]
        if selection == "iterative" and probe > 1 and scorer is not None:
            shortlist, spent = ranking[:probe], scorer.cost
            if shortlist_bi and influence:
                by_bi = sorted((j for j in active if j not in shortlist), key=lambda j: influence[j])
                shortlist = shortlist + by_bi[:shortlist_bi]
            scores = {j: scorer(result.drop_order + [j]) for j in shortlist}
            choice = min(shortlist, key=lambda j: scores[j])  # ties keep the gate order
            result.probes.append({"round": r + 1, "scores": {str(j): v for j, v in scores.items()}})
            result.probe_tokens = scorer.tokens
            result.probe_cost += scorer.cost - spent
            report({f"probe/{j:02d}": v for j, v in scores.items()}, result.steps)
        result.drop_order = ranking[:n_drop] if selection == "oneshot" else result.drop_order + [choice]
        if selection == "iterative" and probe > 1 and scorer is not None and refine > 0 and r == total_rounds - 1:
            spent = scorer.cost
            _refine(result, scorer=scorer, passes=refine, current=scores[choice], budget=refine_budget,
                    report=lambda m: report(m, result.steps))
            result.refine_cost = scorer.cost - spent
            result.probe_cost += result.refine_cost
            report({"stage1/swaps": len(result.swaps), "stage1/refine_calls": result.refine_calls,
                    "stage1/refine_cost": result.refine_cost,
                    "stage1/refine_budget": -1 if refine_budget is None else refine_budget}, result.steps)
        gates.set_bypass(result.drop_order)
        result.round_ends.append(result.steps)
        result.rounds_computed += 1
        report({"stage1/dropped": result.drop_order[-1], "stage1/rounds_done": r + 1}, result.steps)
        if on_round is not None:
            on_round(_state(result, gates=gates, batches=batches, stepper=stepper))
    gates.set_gated(False)
    gates.clear_records()
    return result


def _refine(result: Stage1Result, *, scorer: RemovalScorer, passes: int, current: float,
            budget: int | None = None, report=lambda metrics: None) -> None:
    """Swap refinement of the final drop set (see run_stage1); the pool is every layer a probe
    measured that is not dropped, plus any layer swapped out. At most `budget` scorer calls (None:
    no cap): a pass that finds nothing costs n_drop x |pool| of them; the calls spent are counted
    in `result.refine_calls`."""
    pool: list[int] = []
    for p in result.probes:
        pool += [int(j) for j in p["scores"] if int(j) not in result.drop_order and int(j) not in pool]
    for _ in range(passes):
        improved = False
        for pos in range(len(result.drop_order)):
            for layer in pool:
                if layer in result.drop_order:
                    continue
                if budget is not None and result.refine_calls >= budget:
                    return
                trial = list(result.drop_order)
                trial[pos] = layer
                score = scorer(trial)
                result.refine_calls += 1
                if result.refine_calls % 20 == 0:  # progress: up to minutes of probes per pass
                    report({"stage1/refine_calls_so_far": result.refine_calls,
                            "stage1/swaps_so_far": len(result.swaps)})
                if score < current - 1e-4:
                    out = result.drop_order[pos]
                    result.swaps.append({"out": out, "in": layer, "score": score})
                    result.drop_order, current, improved = trial, score, True
                    pool.append(out)
                    break
        if not improved:
            break


def _state(result: Stage1Result, *, gates, batches: Batches, stepper) -> dict:
    state = {"drop_order": list(result.drop_order), "round1_ranking": list(result.round1_ranking),
             "gate_history": [list(v) for v in result.gate_history], "round_ends": list(result.round_ends),
             "steps": result.steps, "tokens": result.tokens, "gates": gates.gate_values(),
             "batches_position": batches.position, "probes": list(result.probes),
             "grad_ema": [w.grad_ema for w in gates.wrappers],
             "probe_tokens": result.probe_tokens, "probe_cost": result.probe_cost, "swaps": list(result.swaps),
             "refine_calls": result.refine_calls, "refine_cost": result.refine_cost}
    if hasattr(stepper, "state_dict"):
        import copy

        state["optimizer"] = copy.deepcopy(stepper.state_dict())  # torch returns live references
    return state


def _restore(state: dict, *, gates, batches: Batches, stepper, result: Stage1Result) -> None:
    import torch

    params = gates.gate_params()
    with gates.gather(params), torch.no_grad():
        for p, v in zip(params, state["gates"]):
            p.fill_(v)
    batches.position = state["batches_position"]
    for w, ema in zip(gates.wrappers, state.get("grad_ema", [])):  # the tie-break at s = 0 resumes too
        w.grad_ema = ema
    if "optimizer" in state and hasattr(stepper, "load_state_dict"):
        stepper.load_state_dict(state["optimizer"])
    result.drop_order = list(state["drop_order"])
    result.round1_ranking = list(state["round1_ranking"])
    result.gate_history = [list(v) for v in state["gate_history"]]
    result.round_ends = list(state["round_ends"])
    result.steps, result.tokens = state["steps"], state["tokens"]
    result.probes = list(state.get("probes", []))
    result.probe_tokens, result.probe_cost = state.get("probe_tokens", 0), state.get("probe_cost", 0)
    result.swaps = list(state.get("swaps", []))
    result.refine_calls, result.refine_cost = state.get("refine_calls", 0), state.get("refine_cost", 0)
    gates.set_bypass(result.drop_order)
