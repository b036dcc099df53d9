"""Perplexity follows the tokenizer's conventions: a tokenizer that puts BOS in front of every text
gets [BOS] + seqlen - 1 text tokens per window (as lm-eval does); one that adds none (SmolLM2) gets
the plain windows it always had."""

import math

import pytest
import torch

from trsp_ray.config import registry
from trsp_ray.data.perplexity import bos_token, encode, perplexity, windows

WORDS = [f"w{i}" for i in range(60)]


def bos_tokenizer():
    """A word-level tokenizer that adds <bos> in front of every text, as Llama's and Gemma's do."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<bos>": 1, "<eos>": 2, "<unk>": 3, **{w: i + 4 for i, w in enumerate(WORDS)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", 1)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>", unk_token="<unk>",
                                   pad_token="<pad>")


def _text(n_words: int, seed: int = 0) -> str:
    gen = torch.Generator().manual_seed(seed)
    return " ".join(WORDS[int(i)] for i in torch.randint(0, len(WORDS), (n_words,), generator=gen))


def _worker_bench(bench):
    from types import SimpleNamespace

    return SimpleNamespace(calib_ids=bench.calib_ids, calib_strata=bench.calib_strata, tokenizer=bench.tokenizer)


def test_bos_token_reads_what_the_tokenizer_does():
    from transformers import AutoTokenizer

    from trsp_ray.data.assets import smollm2_dir

    assert bos_token(bos_tokenizer()) == 1
    smollm2 = AutoTokenizer.from_pretrained(smollm2_dir())
    assert smollm2.bos_token_id is not None  # declared, but never added: no BOS windows
    assert bos_token(smollm2) is None


def test_bos_windows_hold_every_text_token_once():
    ids = torch.arange(100, 131)  # 31 text tokens
    w = windows(ids, 8, bos=1)
    assert w.shape == (4, 8)  # 4 windows of 1 BOS + 7 text tokens; the 3-token tail is dropped
    assert (w[:, 0] == 1).all()
    assert w[:, 1:].reshape(-1).tolist() == list(range(100, 128))
    assert torch.equal(windows(ids, 8), ids[:24].view(3, 8))  # no BOS: unchanged
    with pytest.raises(ValueError, match="fewer than one window"):
        windows(ids[:6], 8, bos=1)


def test_perplexity_with_bos_matches_manual_nll_on_gemma3():
    from trsp_ray.models.tiny import tiny_model

    model = tiny_model("gemma3_text", layers=2, vocab=64)
    tok = bos_tokenizer()
    ids = encode(tok, _text(200))
    assert ids[0].item() != 1 and (ids != 1).all()  # encode adds no special tokens
    seqlen = 16
    got = perplexity(model, ids, seqlen=seqlen, batch_size=3, bos=bos_token(tok))
    nll, count = 0.0, 0
    with torch.no_grad():
        for k in range(ids.numel() // (seqlen - 1)):
            window = torch.cat([torch.tensor([1]), ids[k * (seqlen - 1):(k + 1) * (seqlen - 1)]]).view(1, -1)
            logp = torch.log_softmax(model(input_ids=window).logits.float(), dim=-1)
            nll -= logp[0, torch.arange(seqlen - 1), window[0, 1:]].sum().item()
            count += seqlen - 1
    assert got == pytest.approx(math.exp(nll / count), rel=1e-5)
    assert abs(got - perplexity(model, ids, seqlen=seqlen, batch_size=3)) > 1e-3  # the convention matters


def _bos_workspace(root):
    """A tiny random Gemma-3 text model + the BOS tokenizer, with calibration / held-out texts."""
    from trsp_ray.models.tiny import tiny_model

    tok = bos_tokenizer()
    tiny_model("gemma3_text", layers=6, vocab=64).save_pretrained(root / "model")
    tok.save_pretrained(root / "model")
    (root / "calib.txt").write_text(_text(6000, seed=1))
    (root / "eval.txt").write_text(_text(2000, seed=2))
    return root


def test_prune_reports_bos_convention_dense_ppl(tmp_path):
    """What `trsp-ray prune` prints as the dense held-out PPL of a BOS model is the BOS figure
    (the acceptance's Gemma-3-270m case, on a tiny random gemma3_text model: no weights offline)."""
    from transformers import AutoModelForCausalLM

    from trsp_ray.config.run_config import load_config
    from trsp_ray.driver import run

    root = _bos_workspace(tmp_path)
    cfg = load_config(overrides=[f"model={root / 'model'}", f"data.calib_text={root / 'calib.txt'}",
                                 f"data.eval_text={root / 'eval.txt'}", "method=shortgpt", "ratio=0.34",
                                 "data.seqlen=16", "data.eval_seqlen=32", "data.eval_max_windows=8",
                                 "baselines.calib_windows=2", "tracking.enabled=false", "threads=1"])
    results = run(cfg)
    model = AutoModelForCausalLM.from_pretrained(root / "model", dtype=torch.float32).eval()
    ids = encode(bos_tokenizer(), (root / "eval.txt").read_text())
    with_bos = perplexity(model, ids, seqlen=32, batch_size=4, max_windows=8, bos=1)
    without = perplexity(model, ids, seqlen=32, batch_size=4, max_windows=8)
    assert results["dense_ppl"] == pytest.approx(with_bos, rel=1e-6)
    assert abs(results["dense_ppl"] - without) > 1e-3


def test_smollm2_tokenizer_windows_unchanged(tmp_path):
    """SmolLM2's tokenizer adds no BOS, so the Workbench's held-out windows are plain runs of the
    text's tokens, as they always were."""
    from trsp_ray.config.run_config import load_config
    from trsp_ray.data.calibration import encode_cached
    from trsp_ray.data.perplexity import nlls_of, ppl_of
    from trsp_ray.models.tiny import tiny_workspace
    from trsp_ray.run.workbench import prepare

    root = tiny_workspace(tmp_path, layers=4, calib_chars=20000, eval_chars=8000)
    bench = prepare(load_config(overrides=[f"model={root / 'model'}", f"data.calib_text={root / 'calib.txt'}",
                                           f"data.eval_text={root / 'eval.txt'}", "data.eval_seqlen=64",
                                           "data.eval_max_windows=4", "tracking.enabled=false"]))
    assert bench.bos is None and bench.heldout.bos is None and bench.heldout.windows.shape == (4, 64)
    ids = encode_cached(bench.tokenizer, bench.texts.heldout).tolist()
    for row in bench.heldout.windows.tolist():  # every token is text: a run of the held-out text's tokens
        assert any(ids[k: k + 64] == row for k in range(len(ids) - 63))
    assert bench.heldout_ppl() == ppl_of(nlls_of(bench.model, bench.heldout.windows, batch_size=4))


def test_every_path_starts_its_windows_with_bos(tmp_path):
    """SPEC section 5's one convention: stage 1's training and probe windows, ShortGPT's calibration,
    stage 2, the heal, validation and held-out perplexity, and the Ray Train workers' batch stream
    all start each window with BOS when the tokenizer adds one (the model sees nothing else)."""
    from trsp_ray.config.run_config import load_config
    from trsp_ray.distributed.worker import _batches
    from trsp_ray.run.methods import apply_method, run_stage1_for
    from trsp_ray.run.workbench import prepare

    root = _bos_workspace(tmp_path)
    cfg = load_config(overrides=[f"model={root / 'model'}", f"data.calib_text={root / 'calib.txt'}",
                                 f"data.eval_text={root / 'eval.txt'}", "ratio=0.34", "data.seqlen=16",
                                 "data.eval_seqlen=32", "data.eval_max_windows=4", "stage1.first_round_steps=2",
                                 "stage1.steps_per_round=1", "stage1.probe=2", "stage1.probe_windows=2",
                                 "stage2.steps=2", "baselines.calib_windows=2", "tracking.enabled=false",
                                 "threads=1"])
    bench = prepare(cfg)
    assert bench.bos == 1
    seen: list[torch.Tensor] = []

    def watch(model):
        model.register_forward_pre_hook(lambda m, args, kwargs: seen.append(kwargs["input_ids"][:, 0].clone()),
                                        with_kwargs=True)
        return model

    fresh = bench.fresh_model
    bench.fresh_model = lambda: watch(fresh())
    stage1 = run_stage1_for(bench)  # gate training and removal probes
    for method in ("shortgpt", "trsp", "trsp+heal"):  # calibration, stage 2, heal
        apply_method(bench, registry.method(method), stage1=stage1 if method != "shortgpt" else None)
    model = watch(bench.fresh_model())
    bench.validation_ppl(model), bench.heldout_ppl(model)
    firsts = torch.cat(seen)
    assert len(seen) > 20 and (firsts == 1).all(), f"{int((firsts != 1).sum())} of {firsts.numel()} windows lack BOS"
    worker = _batches(cfg, _worker_bench(bench), seed_offset=0)
    assert (worker.next()[:, 0] == 1).all() and worker.next().shape == (cfg.data.batch_size, 16)
    assert torch.equal(_batches(cfg, _worker_bench(bench),
                                seed_offset=0).next(), bench.batches().next())  # the single process's stream


class _EchoModel(torch.nn.Module):
    """Predicts that the next token repeats the current one (logits: 9 on the input token, 0 elsewhere)."""

    def __init__(self, vocab: int = 8):
        super().__init__()
        self.vocab = vocab
        self.scale = torch.nn.Parameter(torch.tensor(9.0))

    def forward(self, input_ids, use_cache=False):
        from types import SimpleNamespace

        return SimpleNamespace(logits=self.scale * torch.nn.functional.one_hot(input_ids, self.vocab).float())


def test_cloze_accuracy_scores_each_next_token_against_the_greedy_choice():
    from trsp_ray.data.perplexity import nlls_of, scores_of

    chunks = torch.tensor([[5, 5, 5, 5], [1, 2, 1, 2], [1, 1, 2, 2], [3, 3, 3, 4]])
    nlls, accs = scores_of(_EchoModel(), chunks, batch_size=3)
    # the echo is right where a token repeats: all 3, none, 2 of 3 (1->1, 2->2), 2 of 3 (3->3 twice)
    assert accs == pytest.approx([1.0, 0.0, 2 / 3, 2 / 3])
    right = -math.log(math.exp(9) / (math.exp(9) + 7))
    wrong = -math.log(1 / (math.exp(9) + 7))
    assert nlls == pytest.approx([right, wrong, (2 * right + wrong) / 3, (2 * right + wrong) / 3], rel=1e-3)
    assert nlls == pytest.approx(nlls_of(_EchoModel(), chunks, batch_size=2))
