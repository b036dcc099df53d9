"""Stage-1 selection that keeps passage-level skill (issue 18): the 'recall' probe criterion (KL plus
the CE increase where a rare token recurs), long probe windows and Block Influence in the
shortlist, all from calibration text only."""

import math

import pytest
import torch

from trsp_ray.common.errors import TrspError
from trsp_ray.method.gates import attach_gates
from trsp_ray.method.probes import RemovalScorer, common_tokens, recall_positions
from trsp_ray.method.stage1 import run_stage1
from trsp_ray.method.training import Batches
from trsp_ray.models.tiny import tiny_model


def test_recall_positions_mark_rare_tokens_that_come_back_after_the_gap():
    window = torch.tensor([[9, 5, 1, 2, 3, 4, 5, 1, 9, 1]])
    mask = recall_positions(window, common={1}, min_gap=4)
    # position t predicts window[t + 1]: the 5 at index 6 recurs 5 tokens after index 1, the 9 at 8
    # only 8 after index 0 -- both count; 1 is common; nothing recurs closer than the gap
    assert mask[0].nonzero().flatten().tolist() == [5, 7]
    assert not recall_positions(window, common={1}, min_gap=9).any()
    assert common_tokens(torch.tensor([4, 4, 4, 7, 7, 2]), count=2) == {4, 7}


def _windows():
    ids = torch.randint(3, 40, (4096,), generator=torch.Generator().manual_seed(0))  # small vocabulary: recurrences
    return [ids[:512].view(4, 128)[:2], ids[:512].view(4, 128)[2:]]


def test_recall_score_is_kl_plus_the_ce_increase_at_recall_positions():
    """Checked against a direct computation from the two models' log-probs."""
    model = tiny_model("llama", layers=6)
    gates = attach_gates(model)
    windows = _windows()
    scorer = RemovalScorer(model=model, gates=gates, windows=windows, criterion="recall", common={3, 4})
    rows = torch.cat(windows)
    mask = recall_positions(rows, common={3, 4})
    assert 50 < int(mask.sum()) < mask.numel()
    with torch.no_grad():
        dense = torch.log_softmax(model(input_ids=rows).logits.float(), -1)[:, :-1]
        with gates.state(gated=False, bypass=[2, 3]):
            cut = torch.log_softmax(model(input_ids=rows).logits.float(), -1)[:, :-1]
    kl = (dense.exp() * (dense - cut)).sum(-1).mean()
    target = rows[:, 1:, None]
    gap = (dense.gather(-1, target) - cut.gather(-1, target))[..., 0][mask].mean()
    assert scorer([2, 3]) == pytest.approx((kl + gap).item(), rel=1e-4)
    assert scorer([]) == pytest.approx(0.0, abs=1e-5)
    kl_only = RemovalScorer(model=model, gates=gates, windows=windows, criterion="kl")([2, 3])
    assert abs(scorer([2, 3]) - kl_only) > 10 * abs(kl_only - kl.item())  # the recall term is what differs


@pytest.mark.parametrize("teacher_dtype", [torch.float32, torch.bfloat16])
def test_the_kl_sum_is_kl_div_to_the_bit_with_fewer_temporaries(teacher_dtype):
    """The probes' KL (probes._kl_sum, in place on the student's log-probs) returns what
    F.kl_div(lp, t, log_target=True, reduction="sum") returns, bit for bit, for an fp32 teacher and
    for a bf16 one (kl_div then sees its fp32 upcast, as the old scorer gave it)."""
    import torch.nn.functional as F

    from trsp_ray.method.probes import _kl_sum

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 64, 3000, generator=g) * 3
    teacher = torch.log_softmax(logits, -1).to(teacher_dtype)
    lp = torch.log_softmax(logits + torch.randn(2, 64, 3000, generator=g), -1)
    expected = F.kl_div(lp, teacher.float(), log_target=True, reduction="sum")
    got = _kl_sum(teacher, lp.clone())
    assert got.item() == expected.item() and got.item() > 1.0


def test_two_ranks_of_recall_probes_sum_to_the_one_process_score():
    model = tiny_model("llama", layers=6)
    gates = attach_gates(model)
    windows = [w[:1] for w in _windows()] + [w[1:] for w in _windows()]  # 4 chunks of one window
    one = RemovalScorer(model=model, gates=gates, windows=windows, criterion="recall", common={3, 4})([1, 4])
    sums = []
    for rank in (0, 1):
        scorer = RemovalScorer(model=model, gates=gates, windows=windows, criterion="recall", common={3, 4},
                               rank=rank, world=2, all_reduce=lambda v: sums.append(list(v)) or v)
        scorer([1, 4])
    total = [a + b for a, b in zip(*sums)]
    assert total[0] / total[1] + total[2] / total[3] == pytest.approx(one, rel=1e-6)
    assert sums[0] != sums[1]  # each rank scored different windows


def test_block_influence_joins_the_shortlist():
    """With shortlist_bi, the lowest-influence layers the gates did not shortlist are probed too
    (here the influence puts layer 4 first; the gates probe one layer per round)."""
    model = tiny_model("llama", layers=6)
    gates = attach_gates(model)
    scorer = RemovalScorer(model=model, gates=gates, windows=_windows(), criterion="kl")
    batches = Batches(torch.randint(3, 200, (8000,), generator=torch.Generator().manual_seed(1)), seqlen=32,
                      batch_size=4, seed=1)
    influence = {0: 0.9, 1: 0.5, 2: 0.6, 3: 0.7, 4: 0.01, 5: 0.9}
    result = run_stage1(model=model, gates=gates, batches=batches, scorer=scorer, n_drop=2, candidates=[1, 2, 3, 4],
                        lambda1=0.01, lr=0.05, first_round_steps=4, steps_per_round=1, probe=2, shortlist_bi=1,
                        influence=influence)
    first = result.probes[0]["scores"]
    assert len(first) == 3 and "4" in first  # 2 by gate + layer 4 by influence (unless a gate already had it)
    without = run_stage1(model=model, gates=gates, batches=Batches(batches.windows.flatten(), seqlen=32, batch_size=4,
                                                                   seed=1),
                         scorer=scorer, n_drop=2, candidates=[1, 2, 3, 4], lambda1=0.01, lr=0.05,
                         first_round_steps=4, steps_per_round=1, probe=2)
    assert len(without.probes[0]["scores"]) == 2


def test_probe_windows_follow_probe_seqlen_and_bos():
    from trsp_ray.config.run_config import load_config
    from trsp_ray.run.methods import fixed_windows, probe_windows

    cfg = load_config(None, ["stage1.probe_windows=3", "stage1.probe_seqlen=64", "data.seqlen=16",
                             "data.batch_size=8"])
    ids = torch.arange(100, 2100)
    got = probe_windows(ids, s1=cfg.stage1, data=cfg.data, seed=0, bos=1)
    rows = torch.cat(got)
    assert rows.shape == (3, 64) and (rows[:, 0] == 1).all() and [w.shape[0] for w in got] == [2, 1]
    default = load_config(None, ["stage1.probe_windows=3", "data.seqlen=16", "data.batch_size=8"])
    same = fixed_windows(Batches(ids, seqlen=16, batch_size=8, seed=200), 3)  # what probes always used
    assert all(torch.equal(a, b) for a, b in zip(probe_windows(ids, s1=default.stage1, data=default.data, seed=0,
                                                               bos=None), same))
    with pytest.raises(TrspError, match="stage1.probe_seqlen=1"):
        load_config(None, ["stage1.probe_seqlen=1"])
    with pytest.raises(TrspError, match="probe_criterion='recall'"):
        RemovalScorer(model=tiny_model("llama", layers=2), gates=None, windows=[rows], criterion="recall", start=4)
    assert math.isfinite(float(got[0].sum()))
