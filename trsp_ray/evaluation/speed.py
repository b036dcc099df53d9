"""Speed benchmark (SLEB's protocol, scaled to the machine): prefill latency and generation throughput.

Prefill: one forward of a batch-1 prompt of `prompt_len` tokens with a KV cache, keeping only the last
position's logits, exactly what `generate` does before its first new token. (Computing logits for
every prompt position would add a vocab-sized matmul per token that no generation pays for.)
Generation: `new_tokens` greedy tokens for a batch of `gen_batch` prompts; throughput in new tokens/s.

Dense and pruned models are timed in the same process, interleaved round by round with alternating
order, and each is summarised by its fastest round: load from other processes only ever adds time,
so the minimum is the least disturbed estimate of the model's own cost (as `timeit` advises).
Several CPU actors on one node still disturb each other's timings; for speed figures on CPU, run
one actor per node, or give each actor its own GPU.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass

import torch

from trsp_ray.errors import TrspError


@dataclass(frozen=True)
class SpeedSettings:
    prompt_len: int = 512  # prefill prompt (tokens)
    gen_batch: int = 4  # prompts decoded together
    gen_prompt_len: int = 32  # prompt per decoded sequence (tokens)
    new_tokens: int = 16  # greedy tokens generated per sequence
    rounds: int = 4  # timed repetitions, after one warm-up

    def __post_init__(self):
        for name, value in asdict(self).items():
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise TrspError(f"speed.{name}={value!r} is invalid; pass a positive integer")


def _prompt(model, batch: int, length: int) -> torch.Tensor:
    # Token content does not change the cost of a forward pass; a fixed seed keeps runs comparable.
    generator = torch.Generator().manual_seed(0)
    vocab = model.get_input_embeddings().num_embeddings
    return torch.randint(0, vocab, (batch, length), generator=generator).to(model.device)


def _sync(model) -> None:
    if model.device.type == "cuda":
        torch.cuda.synchronize(model.device)


def _clocks() -> tuple[float, float]:
    return time.perf_counter(), time.process_time()


def _elapsed(start: tuple[float, float]) -> tuple[float, float]:
    """(wall, CPU) seconds since `start`. CPU time ignores the time this process waits for a core,
    so on a shared CPU it is the steadier figure; wall time is what a user sees (and on a GPU the
    only meaningful one)."""
    wall, cpu = _clocks()
    return wall - start[0], cpu - start[1]


@torch.inference_mode()
def prefill_seconds(model, ids: torch.Tensor) -> tuple[float, float]:
    """(wall, CPU) time of one prefill of `ids` (shape [1, T]), with the cache, last logits only."""
    _sync(model)
    start = _clocks()
    model(input_ids=ids, use_cache=True, logits_to_keep=1)
    _sync(model)
    return _elapsed(start)


@torch.inference_mode()
def generate_seconds(model, ids: torch.Tensor, new_tokens: int) -> tuple[float, float]:
    """(wall, CPU) time to generate exactly `new_tokens` greedy tokens after `ids` (shape [B, T])."""
    pad = model.config.eos_token_id if model.config.pad_token_id is None else model.config.pad_token_id
    if isinstance(pad, list):
        pad = pad[0]
    _sync(model)
    start = _clocks()
    model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                   min_new_tokens=new_tokens, do_sample=False, pad_token_id=pad if pad is not None else 0)
    _sync(model)
    return _elapsed(start)


def _time_models(models: dict, settings: SpeedSettings) -> dict[str, dict[str, list]]:
    """Per model: (wall, CPU) prefill and generation times over `rounds`, interleaved across models."""
    s = settings
    inputs = {name: (_prompt(m, 1, s.prompt_len), _prompt(m, s.gen_batch, s.gen_prompt_len))
              for name, m in models.items()}
    times = {name: {"prefill": [], "generate": []} for name in models}
    order = list(models)
    for round_ in range(s.rounds + 1):
        for name in order if round_ % 2 == 0 else order[::-1]:
            prefill_ids, gen_ids = inputs[name]
            p = prefill_seconds(models[name], prefill_ids)
            g = generate_seconds(models[name], gen_ids, s.new_tokens)
            if round_ > 0:  # round 0 warms allocator and kernels
                times[name]["prefill"].append(p)
                times[name]["generate"].append(g)
    return times


def _summary(t: dict[str, list], settings: SpeedSettings) -> dict[str, float]:
    tokens = settings.gen_batch * settings.new_tokens
    out = {}
    for k, suffix in ((0, ""), (1, "_cpu")):
        out[f"prefill{suffix}_ms"] = 1000.0 * min(x[k] for x in t["prefill"])
        out[f"tokens_per{suffix}_s"] = tokens / min(x[k] for x in t["generate"])
    return out


def measure_speed(model, settings: SpeedSettings = SpeedSettings()) -> dict[str, float]:
    """Prefill latency (ms) and generation throughput (new tokens/s) of one model."""
    return _summary(_time_models({"model": model}, settings)["model"], settings)


def compare_speed(dense, pruned, settings: SpeedSettings = SpeedSettings()) -> dict[str, float]:
    """Dense vs pruned, timed side by side; speed-ups (wall and CPU time) beside the ideal L / L_kept."""
    times = _time_models({"dense": dense, "pruned": pruned}, settings)
    d, p = _summary(times["dense"], settings), _summary(times["pruned"], settings)
    layers, kept = dense.config.num_hidden_layers, pruned.config.num_hidden_layers
    out = {**p, **{f"dense_{k}": v for k, v in d.items()}}
    for suffix in ("", "_cpu"):
        out[f"prefill_speedup{suffix}"] = d[f"prefill{suffix}_ms"] / p[f"prefill{suffix}_ms"]
        out[f"throughput_speedup{suffix}"] = p[f"tokens_per{suffix}_s"] / d[f"tokens_per{suffix}_s"]
    return {**out, "ideal_speedup": layers / kept, "layers": layers, "layers_kept": kept}
