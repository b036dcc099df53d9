"""Tiny random models of every supported family (hidden 64, a few layers), for tests and dry runs.

Each config exercises the family's per-layer structure: Gemma 2/3 and Qwen mix sliding-window and
full-attention layers through `layer_types`, so pruning must shorten that list consistently.
"""

from __future__ import annotations

VOCAB = 256


def tiny_config(family: str, *, layers: int = 6, vocab: int = VOCAB):
    """A transformers config of `family` with hidden size 64 and `layers` decoder layers."""
    import transformers as tf

    common = dict(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    alternating = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)]
    if family == "llama":
        return tf.LlamaConfig(**common)
    if family == "mistral":
        return tf.MistralConfig(**common, sliding_window=16)
    if family == "qwen2":
        return tf.Qwen2Config(**common, use_sliding_window=True, sliding_window=16, layer_types=alternating)
    if family == "qwen3":
        return tf.Qwen3Config(**common, head_dim=16, use_sliding_window=True, sliding_window=16,
                              layer_types=alternating)
    if family == "gemma2":
        return tf.Gemma2Config(**common, head_dim=16, sliding_window=16, layer_types=alternating)
    if family == "gemma3_text":
        return tf.Gemma3TextConfig(**common, head_dim=16, sliding_window=16, layer_types=alternating)
    if family == "phi3":
        return tf.Phi3Config(**common, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    if family == "opt":
        return tf.OPTConfig(vocab_size=vocab, hidden_size=64, ffn_dim=128, num_hidden_layers=layers,
                            num_attention_heads=4, max_position_embeddings=256, word_embed_proj_dim=64,
                            pad_token_id=1)
    if family == "gpt_neox":
        return tf.GPTNeoXConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128,
                                num_hidden_layers=layers, num_attention_heads=4, max_position_embeddings=256)
    raise ValueError(f"no tiny config for family {family!r}")


def tiny_model(family: str, *, layers: int = 6, seed: int = 0, vocab: int = VOCAB):
    """A randomly initialised *ForCausalLM of `family` in fp32 eval mode."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(family, layers=layers, vocab=vocab))
    model.to(torch.float32)
    return model.eval()


def tiny_workspace(root, *, layers: int = 8, calib_chars: int = 60000, eval_chars: int = 20000,
                   family: str = "llama"):
    """A directory with a tiny random model of `family` (default Llama) + SmolLM2's real tokenizer (`model/`) and short
    calibration / held-out texts (`calib.txt`, `eval.txt`) cut from the shipped Wikipedia data:
    what tests and benchmarks run the whole pipeline on in seconds. Returns `root` as a Path."""
    from pathlib import Path

    from transformers import AutoTokenizer

    from trsp_ray.data import domains
    from trsp_ray.data.assets import smollm2_dir

    root = Path(root)
    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir())
    tiny_model(family, layers=layers, vocab=len(tokenizer)).save_pretrained(root / "model")
    tokenizer.save_pretrained(root / "model")
    calibration, heldout = domains.texts("wiki")
    (root / "calib.txt").write_text(calibration[:calib_chars])
    (root / "eval.txt").write_text(heldout[:eval_chars])
    return root


def with_random_biases(model, seed: int = 5):
    """`model` with random biases (in place): transformers initialises them to zero, where a weight
    transform that dropped the bias (OPT's, GPT-NeoX's) would still look exact."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, torch.nn.Linear) and module.bias is not None:
                module.bias.copy_(0.1 * torch.randn(module.bias.shape, generator=gen))
    return model
