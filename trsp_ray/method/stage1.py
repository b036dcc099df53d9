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

from trsp_ray.common.errors import TrspError
from trsp_ray.method.probes import RemovalScorer
from trsp_ray.method.training import Batches, MakeStepper, Report, TorchStepper, freeze, null_report

# how a TRSP method reads a stage-1 result: "order" = the greedy drop order (iterative), "round1" =
# the candidates by |s| after round 1 (one-shot)
RANKINGS = ("order", "round1")


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

    def drop_for(self, ranking: str, n_drop: int) -> list[int]:
        """The first `n_drop` layers of this run's order for a TRSP method's `ranking` (its registry
        entry's, registry.Method.ranking): "round1" (one-shot) takes the round-1 ranking, "order" (the
        iterative methods) the greedy drop order (a prefix serves any smaller ratio). Anything else is
        refused: a method name passed here once made `trsp-oneshot` run the iterative order."""
        if ranking not in RANKINGS:
            raise ValueError(f"drop_for takes a ranking, one of {', '.join(RANKINGS)}; got {ranking!r} "
                             f"(a method's ranking is registry.method(name).ranking)")
        return (self.round1_ranking if ranking == "round1" else self.drop_order)[:n_drop]


HEAD_SHARE = 8  # gates.protect_head=auto protects one layer in HEAD_SHARE, rounded up


def head_protected(protect_head: int | str, num_layers: int) -> int:
    """How many first layers gates.protect_head keeps: its count, or for auto ceil(num_layers / 8)
    (SmolLM2's 30: 4; a 32-layer 8B: 4; an 80-layer 70B: 10; a model of 8 layers or fewer: 1)."""
    return math.ceil(num_layers / HEAD_SHARE) if protect_head == "auto" else protect_head


def candidate_layers(num_layers: int, *, protect_head: int | str, protect_tail: int) -> list[int]:
    """The layers a selection may drop: all but the protected first and last ones."""
    return list(range(head_protected(protect_head, num_layers), num_layers - protect_tail))


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
            penalty = gates.l1(active, like=ce)
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


def stage1_cost(result: Stage1Result, *, num_layers: int, train_base: bool) -> float:
    """Dense-forward tokens of a stage-1 run: forward + backward over the layers still in the model,
    plus the removal probes."""
    per_token = 1.0 + (2.0 if train_base else 1.0)
    cost, start = 0.0, 0
    for r, end in enumerate(result.round_ends):
        active = (num_layers - r) / num_layers  # after round r, r layers are bypassed
        cost += (end - start) * result.tokens_per_step * per_token * active
        start = end
    return cost + result.probe_cost
