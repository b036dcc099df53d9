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
from trsp_ray.method.merge_choice import (
    block_inputs,
    candidates,
    choose_units,
    first_rows,
    mean_loss,
    starting_at,
    sub_stats,
)
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


@pytest.mark.parametrize("family", sorted(families.FAMILIES))
def test_a_pass_from_a_stored_block_input_gives_the_whole_models_loss_and_puts_everything_back(family):
    """starting_at runs only the layers from `index` on, fed block_inputs' stream: the loss is the whole
    model's, for every family and every index (Qwen2 and Gemma alternate sliding and full attention layer by
    layer, read by position from config.layer_types: a tail run with the whole list would mask wrongly, as
    the windows are longer than the sliding window), and the layers and config are the same objects after."""
    model = tiny_model(family, layers=6).float().eval()
    windows = [torch.randint(3, 256, (2, 40), generator=torch.Generator().manual_seed(k)) for k in range(2)]
    layers, text = families.decoder_layers(model), families.text_config(model)
    config = copy.deepcopy(text.to_dict())
    whole = mean_loss(model, windows, reduce=lambda t: t)
    ran = []
    for index in range(1, 6):
        inputs = block_inputs(model, index, windows)
        assert [tuple(h.shape) for h in inputs] == [(2, 40, 64)] * 2
        handles = [layer.register_forward_hook(lambda m, *_: ran.append(m)) for layer in layers]
        with starting_at(model, index, inputs):
            assert families.num_layers(model) == 6 - index
            assert mean_loss(model, windows, reduce=lambda t: t) == pytest.approx(whole, rel=1e-5)
        for h in handles:
            h.remove()
        assert ran == list(layers[index:]) * 2  # the layers before index did not run
        ran.clear()
        assert families.decoder_layers(model) is layers and text.to_dict() == config
    with pytest.raises(StopIteration):  # one stored input a pass: a third pass has none
        with starting_at(model, 3, block_inputs(model, 3, windows[:1])):
            mean_loss(model, windows, reduce=lambda t: t)
    assert families.decoder_layers(model) is layers and text.to_dict() == config


@pytest.mark.parametrize("family", ["llama", "opt", "gpt_neox"])
def test_each_candidates_loss_is_the_loss_of_the_model_cut_that_way_and_the_model_is_left_wide(family):
    model = tiny_model(family, layers=6).float().eval()
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
    units = flat.attention.units  # llama's 2 KV groups of the 4 (every set tried), OPT's and NeoX's 4 heads of 8
    sets = candidates(torch.arange(units), torch.arange(2 * units, 0, -1).float(), trials=8)
    best, losses = choose_units(model, flat, sets, refit, loss_windows, reduce=lambda t: t)
    assert mean_loss(model, loss_windows, reduce=lambda t: t) == before  # still the wide block
    assert len(set(round(x, 6) for x in losses)) == len(sets)  # every cut differs
    for units, loss in zip(sets, losses):
        cut = copy.deepcopy(model)
        keep = torch.tensor(units)
        cut_part(cut, dataclasses.replace(flat, restore=dict(flat.restore)), "attention", keep=keep, out=refit(keep))
        assert merge._outputs(cut, flat)[0].in_features == width * flat.attention.units
        assert mean_loss(cut, loss_windows, reduce=lambda t: t) == pytest.approx(loss, rel=1e-5)
    assert tuple(best.tolist()) == sets[losses.index(min(losses))]
    _, whole = choose_units(model, flat, sets, refit, loss_windows, reduce=lambda t: t, stop=False)  # ZeRO-3's
    assert whole == pytest.approx(losses, rel=1e-5)


def test_a_merge_by_loss_tries_the_counted_sets_and_counts_their_passes():
    """merge_pairs(units="loss") tries choice_sets' count of unit sets a pair, keeps the one whose loss is
    lowest, and its cost adds the trials' whole passes to the energy merge's (merge_costs.merge_cost)."""
    from trsp_ray.method.merge_costs import choice_sets, merge_cost

    model = tiny_model("llama", layers=6).float().eval()
    windows = _windows(6)
    calls = []
    info = merge.merge_pairs(model=copy.deepcopy(model), firsts=[1, 3], windows=windows, units="loss",
                             choice_windows=6, progress=lambda k, n, pair: calls.append((k, n, pair)))
    assert calls == [(1, 2, info["per_pair"][0]), (2, 2, info["per_pair"][1])]
    units = families.text_config(model).num_key_value_heads
    for pair in info["per_pair"]:
        assert len(pair["unit_losses"]) == choice_sets(units, 24) == math.comb(2 * units, units)
        assert 0 <= pair["energy_rank"] < len(pair["unit_losses"])
    energy = merge_cost(firsts=[1, 3], num_layers=6, tokens=info["tokens"], target="dense")
    # 6 choice windows of 40 tokens (one batch of 4, then 2); per pair one pass to its block (pair 1-2: the
    # 1 layer before it; pair 3-4: the 2 before it, pair 1-2 being one layer by now), then every trial from
    # the block on (pair 1-2: the wide block, two layers' worth, and 3 more; pair 3-4: the block and 1)
    trials = (1 + choice_sets(units, 24) * 5 + 2 + choice_sets(units, 24) * 3) * 6 * 40 / 6
    assert info["cost"] == pytest.approx(energy + trials)


def test_bad_settings_are_refused_in_one_line_before_any_pass():
    model = tiny_model("llama", layers=6).float().eval()
    for bad, match in (({"units": "random"}, "units='random' is not valid; choose loss or energy"),
                       ({"target": "teacher"}, "target='teacher' is not valid; choose one of pair, wide, dense")):
        with pytest.raises(TrspError, match=match):
            merge.merge_pairs(model=model, firsts=[1], windows=_windows(2), **bad)
    with pytest.raises(TrspError, match="merging.units='random' is not valid"):
        load_config(None, ["merging.units=random"])
