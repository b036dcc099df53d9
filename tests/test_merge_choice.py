"""The attention units a merge keeps by the loss they leave (merging.units=loss, method/merge_choice.py): the
candidate sets, and that each candidate's loss is the loss of the model cut that way."""

import copy
import dataclasses
import math

import pytest
import torch

from trsp_ray.common.errors import TrspError
from trsp_ray.config.run_config import load_config
from trsp_ray.method import merge
from trsp_ray.method.merge_blocks import cut_part, flatten
from trsp_ray.method.merge_choice import candidates, choose_units, first_rows, mean_loss, sub_stats
from trsp_ray.models import families
from trsp_ray.models.tiny import tiny_model


def _windows(n, seed=0):
    return [torch.randint(3, 256, (4, 40), generator=torch.Generator().manual_seed(seed + k)) for k in range(n)]


def test_every_set_is_tried_when_few_else_the_energy_choice_and_its_nearest_swaps():
    energy = torch.tensor([5.0, 1.0, 3.0, 6.0, 2.0, 4.0])  # keep 3 of 6: the top is (0, 3, 5)
    top = torch.tensor([0, 3, 5])
    sets = candidates(top, energy, trials=24)
    assert len(sets) == math.comb(6, 3) == len(set(sets)) and sets[0] == (0, 3, 5)
    assert all(len(s) == 3 and list(s) == sorted(s) for s in sets)
    few = candidates(top, energy, trials=4)
    # nearest swaps first: the weakest kept (5, energy 4) for the strongest dropped (2), then for the next (4),
    # then the next weakest kept (0) for the strongest dropped (2)
    assert few == [(0, 3, 5), (0, 2, 3), (0, 3, 4), (2, 3, 5)]


def test_first_rows_cuts_the_batches_to_the_windows_asked_for():
    got = first_rows(_windows(3), 6)
    assert [len(b) for b in got] == [4, 2] and torch.equal(got[1], _windows(3)[1][:2])


def test_each_candidates_loss_is_the_loss_of_the_model_cut_that_way_and_the_model_is_left_wide():
    model = tiny_model("llama", layers=6).float().eval()
    windows, loss_windows = _windows(6), _windows(2, seed=50)
    flat = flatten(model, 2)
    attn, _ = merge.refit_sums(model, flat, windows, units=torch.arange(2 * flat.attention.units), channels=None)
    o_proj = merge._outputs(model, flat)[0]
    width = flat.attention.output.sizes[0]

    @torch.no_grad()
    def refit(keep):
        return merge._solved(sub_stats(attn, merge.columns(keep, width)), o_proj, merge.columns(keep, width),
                             ridge=1e-2, key="attn")[0]

    before = mean_loss(model, loss_windows, reduce=lambda t: t)
    sets = candidates(torch.tensor([0, 1]), torch.tensor([4.0, 3.0, 2.0, 1.0]), trials=24)
    best, losses = choose_units(model, flat, sets, refit, loss_windows, reduce=lambda t: t)
    assert mean_loss(model, loss_windows, reduce=lambda t: t) == before  # still the wide block
    assert len(set(round(x, 6) for x in losses)) == len(sets)  # every cut differs
    for units, loss in zip(sets, losses):
        cut = copy.deepcopy(model)
        keep = torch.tensor(units)
        cut_part(cut, dataclasses.replace(flat, restore=dict(flat.restore)), "attention", keep=keep, out=refit(keep))
        assert families.decoder_layers(cut)[2].self_attn.o_proj.in_features == width * flat.attention.units
        assert mean_loss(cut, loss_windows, reduce=lambda t: t) == pytest.approx(loss, rel=1e-5)
    assert tuple(best.tolist()) == sets[losses.index(min(losses))]


def test_a_merge_by_loss_tries_the_counted_sets_and_counts_their_passes():
    """merge_pairs(units="loss") tries choice_sets' count of unit sets a pair, keeps the one whose loss is
    lowest, and its cost adds the trials' whole passes to the energy merge's (merge_costs.merge_cost)."""
    from trsp_ray.method.merge_costs import choice_sets, merge_cost

    model = tiny_model("llama", layers=6).float().eval()
    windows = _windows(6)
    info = merge.merge_pairs(model=copy.deepcopy(model), firsts=[1, 3], windows=windows, units="loss",
                             choice_windows=6)
    units = families.text_config(model).num_key_value_heads
    for pair in info["per_pair"]:
        assert len(pair["unit_losses"]) == choice_sets(units, 24) == math.comb(2 * units, units)
        assert 0 <= pair["energy_rank"] < len(pair["unit_losses"])
    energy = merge_cost(firsts=[1, 3], num_layers=6, tokens=info["tokens"], target="dense")
    # 6 choice windows of 40 tokens (one batch of 4, then 2); pair k runs through the 6 - k layers left
    trials = choice_sets(units, 24) * 6 * 40 * (6 + 5) / 6
    assert info["cost"] == pytest.approx(energy + trials)


def test_bad_settings_are_refused_in_one_line_before_any_pass():
    model = tiny_model("llama", layers=6).float().eval()
    for bad, match in (({"units": "random"}, "units='random' is not valid; choose loss or energy"),
                       ({"target": "teacher"}, "target='teacher' is not valid; choose one of pair, wide, dense")):
        with pytest.raises(TrspError, match=match):
            merge.merge_pairs(model=model, firsts=[1], windows=_windows(2), **bad)
    with pytest.raises(TrspError, match="merging.units='random' is not valid"):
        load_config(None, ["merging.units=random"])
