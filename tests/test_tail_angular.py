"""The anchors' selectors (issue 32 item 1): `tail` drops exactly the last k candidates before the
protected final layer; `angular` picks the contiguous block an independent brute-force scan over
every block picks, from the model's own hidden states."""

import math

import pytest
import torch

from trsp_ray.method import selectors
from trsp_ray.method.gates import attach_gates
from trsp_ray.method.stage1 import candidate_layers
from trsp_ray.models.tiny import tiny_model


def test_tail_drops_the_last_candidates_before_the_protected_tail():
    candidates = candidate_layers(10, protect_head=1, protect_tail=1)  # 1..8
    assert selectors.tail_drop(n_drop=3, candidates=candidates) == [8, 7, 6]
    assert selectors.tail_drop(n_drop=3, candidates=candidate_layers(10, protect_head=1, protect_tail=2)) == [7, 6, 5]
    assert selectors.tail_drop(n_drop=0, candidates=candidates) == []


@pytest.mark.parametrize("family", ["llama", "qwen2", "opt"])
def test_angular_equals_a_brute_force_scan_over_every_contiguous_block(family):
    torch.manual_seed(0)
    model = tiny_model(family, layers=8).eval()
    batches = [torch.randint(3, 200, (2, 24)) for _ in range(3)]
    candidates = candidate_layers(8, protect_head=1, protect_tail=1)
    # brute force: every block's distance from the stock model's hidden states (no gates involved)
    with torch.no_grad():
        hidden = [model(input_ids=b, output_hidden_states=True).hidden_states for b in batches]

    def distance(a: int, n: int) -> float:
        total, count = 0.0, 0
        for h in hidden:  # h[i] enters layer i; h[i + n] leaves layer i + n - 1 (the last is normed: unused)
            cos = torch.nn.functional.cosine_similarity(h[a].float(), h[a + n].float(), dim=-1)
            total += (torch.arccos(cos.clamp(-1, 1)) / math.pi).sum().item()
            count += cos.numel()
        return total / count

    gates = attach_gates(model)
    for n in (2, 3):
        starts = [a for a in candidates if all(a + k in candidates for k in range(n))]
        brute = {a: distance(a, n) for a in starts}
        best = min(brute, key=brute.get)
        ours = selectors.angular_distances(model, gates, batches, n_drop=n, starts=starts)
        assert ours == pytest.approx(brute, rel=1e-5, abs=1e-6)
        assert selectors.angular_drop(model, gates, batches, n_drop=n, candidates=candidates) == \
            list(range(best, best + n))
    assert len(set(brute.values())) > 1  # the blocks differ: the choice is a real one


def test_no_contiguous_block_is_a_one_line_error():
    from trsp_ray.common.errors import TrspError

    model = tiny_model("llama", layers=6).eval()
    with pytest.raises(TrspError, match="no 3 contiguous candidate layers") as err:
        selectors.angular_drop(model, attach_gates(model), [torch.randint(3, 50, (1, 8))], n_drop=3,
                               candidates=[1, 2, 4])
    assert "\n" not in str(err.value)


def test_tail_and_angular_prune_a_tiny_model_with_a_heal(tmp_path):
    from trsp_ray.config.run_config import load_config
    from trsp_ray.driver import run
    from trsp_ray.models.tiny import tiny_workspace

    root = tiny_workspace(tmp_path / "ws", layers=6, calib_chars=20000, eval_chars=8000)
    base = [f"model={root / 'model'}", f"data.calib_text={root / 'calib.txt'}", f"data.eval_text={root / 'eval.txt'}",
            "data.seqlen=32", "data.eval_seqlen=64", "data.eval_max_windows=2", "ratio=0.34", "threads=1",
            "tracking.enabled=false", "stage2.steps=2", "baselines.calib_windows=2"]
    tail = run(load_config(overrides=[*base, "method=tail+heal", f"output={tmp_path / 'tail'}"]))
    assert tail["dropped_layers"] == [4, 3] and tail["select_cost"] == 0.0 and tail["heal_steps"] == 2
    angular = run(load_config(overrides=[*base, "method=angular+comp+heal", "compensation.windows=16",
                                         f"output={tmp_path / 'angular'}"]))
    a, b = sorted(angular["dropped_layers"])
    assert b == a + 1 and angular["select_cost"] == 2 * 32 and angular["compensation_tokens"] == 16 * 32


@pytest.mark.parametrize("family", ["mistral", "qwen2", "qwen3", "gemma2", "gemma3_text", "phi3", "opt", "gpt_neox"])
def test_tail_and_angular_pipelines_run_and_export_on_every_family(tmp_path, family):
    """Issue 32 acceptance: `prune --method tail+heal` and `angular+comp+heal` on every family of
    families.py (Llama above): the drop sets their selectors define, the fit on the angular block (a
    diagonal map on Gemma), and an export that reloads with the in-memory logits."""
    import json

    from trsp_ray.config.run_config import load_config
    from trsp_ray.driver import run
    from trsp_ray.models.tiny import tiny_workspace

    root = tiny_workspace(tmp_path / "ws", layers=6, calib_chars=12000, eval_chars=6000, family=family)
    base = [f"model={root / 'model'}", f"data.calib_text={root / 'calib.txt'}", f"data.eval_text={root / 'eval.txt'}",
            "data.seqlen=32", "data.eval_seqlen=64", "data.eval_max_windows=1", "ratio=0.34", "threads=1",
            "tracking.enabled=false", "stage2.steps=1", "baselines.calib_windows=2"]
    tail = run(load_config(overrides=[*base, "method=tail+heal", f"output={tmp_path / 'tail'}"]))
    assert sorted(tail["dropped_layers"]) == [3, 4] and tail["num_layers_kept"] == 4
    angular = run(load_config(overrides=[*base, "method=angular+comp+heal", "compensation.windows=16",
                                         f"output={tmp_path / 'angular'}"]))
    a, b = sorted(angular["dropped_layers"])
    assert b == a + 1 and angular["compensation_tokens"] == 16 * 32
    assert angular["compensation_form"] == ("diagonal" if family.startswith("gemma") else "full")
    for name in ("tail", "angular"):
        check = json.loads((tmp_path / name / "trsp_ray.json").read_text())["export_check"]
        assert check["max_abs_logit_diff"] <= check["atol"], (name, check)
