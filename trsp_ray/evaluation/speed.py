"""Speed benchmark (SLEB's protocol, scaled to the device): prefill latency and generation throughput.

Prefill: one forward of a batch-1 prompt of `prompt_len` tokens with a KV cache, keeping only the last
position's logits, exactly what `generate` does before its first new token. (Computing logits for
every prompt position would add a vocab-sized matmul per token that no generation pays for.)
Generation: `new_tokens` greedy tokens for a batch of `gen_batch` prompts; throughput in new tokens/s.

How the figures are made to hold from one run to the next:
- Dense and pruned are timed in the same process, interleaved round by round (ABBA order), after
  `warmup` untimed rounds. A speed-up is the median over rounds of the ratio of the two adjacent
  measurements of that round, so slow drift of the machine's load cancels within a pair and a
  disturbed round cannot move the median; absolute figures are medians too.
- Token counts are chosen per device (`DEFAULTS`): enough generated tokens that generate()'s set-up
  and the prompts' prefill are a small part of the time, and on a GPU a batch and a length large
  enough that a decode step is the model's work rather than kernel-launch and Python overhead
  (4 x 16 tokens there measure launch overhead, not the model).
- Clock (`clock="auto"`): on a CPU with one torch thread, CPU time of this process (it ignores the
  time spent waiting for a core while other processes run); otherwise wall time (after
  `torch.cuda.synchronize` on a GPU; with several CPU threads, CPU time would count spin-waiting).
Several CPU actors on one node still disturb each other's timings through shared caches and memory
bandwidth; for speed figures on CPU, run one actor per node, or give each actor its own GPU.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass, fields, replace

import torch

from trsp_ray.common.errors import TrspError

# Per-device defaults (what `benchmarks/speed.py` and the evaluation pool's speed column both use).
# CPU: SmolLM2-135M at 1 thread, a 512-token prefill is ~1.7 s and a 4 x 32-token generation ~3 s,
# so a candidate costs ~2.5 minutes of CPU. This VM's per-measurement noise is +-10% even when it is
# idle, and 16 paired rounds bring two consecutive runs within ~1% (10 rounds: up to 3-4%).
# GPU: a 7B decode step at batch 32 is weight-read bound (~5-10 ms), 256 of them amortise
# generate()'s set-up and the 128-token prompts' prefill.
DEFAULTS = {
    "cpu": {"prompt_len": 512, "gen_batch": 4, "gen_prompt_len": 32, "new_tokens": 32, "warmup": 1, "rounds": 16},
    "cuda": {"prompt_len": 2048, "gen_batch": 32, "gen_prompt_len": 128, "new_tokens": 256, "warmup": 2,
             "rounds": 7},
}
CLOCKS = ("auto", "wall", "cpu")


@dataclass(frozen=True)
class SpeedSettings:
    """What to time; a field left at None takes the device's value from DEFAULTS when measured."""

    prompt_len: int | None = None  # prefill prompt (tokens)
    gen_batch: int | None = None  # prompts decoded together
    gen_prompt_len: int | None = None  # prompt per decoded sequence (tokens)
    new_tokens: int | None = None  # greedy tokens generated per sequence
    warmup: int | None = None  # untimed rounds first (allocator, kernels, caches)
    rounds: int | None = None  # timed rounds; figures are medians over them
    clock: str = "auto"  # auto | wall | cpu (see the module docstring)

    def __post_init__(self):
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name == "clock":
                if value not in CLOCKS:
                    raise TrspError(f"speed.clock={value!r} is invalid; choose one of {', '.join(CLOCKS)}")
            elif value is not None and (not isinstance(value, int) or isinstance(value, bool) or value <= 0):
                raise TrspError(f"speed.{f.name}={value!r} is invalid; pass a positive integer")

    def resolve(self, device_type: str) -> "SpeedSettings":
        """Every unset field filled with the defaults of `device_type` ("cpu" or "cuda")."""
        base = DEFAULTS["cuda" if device_type == "cuda" else "cpu"]
        return replace(self, **{k: v for k, v in base.items() if getattr(self, k) is None})

    def clock_for(self, device_type: str) -> str:
        if self.clock != "auto":
            return self.clock
        return "cpu" if device_type == "cpu" and torch.get_num_threads() == 1 else "wall"


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
    """(wall, CPU) seconds since `start`."""
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


def _time_models(models: dict, s: SpeedSettings) -> dict[str, dict[str, list]]:
    """Per model: (wall, CPU) prefill and generation times of each timed round. Within a round the
    models' prefills are timed back to back, then their generations, the order alternating between
    rounds (ABBA), so the two halves of each paired ratio see the same moment's machine load."""
    inputs = {name: (_prompt(m, 1, s.prompt_len), _prompt(m, s.gen_batch, s.gen_prompt_len))
              for name, m in models.items()}
    times = {name: {"prefill": [], "generate": []} for name in models}
    order = list(models)
    for round_ in range(s.warmup + s.rounds):
        names = order if round_ % 2 == 0 else order[::-1]
        for kind in ("prefill", "generate"):
            for name in names if kind == "prefill" else names[::-1]:
                prefill_ids, gen_ids = inputs[name]
                t = (prefill_seconds(models[name], prefill_ids) if kind == "prefill"
                     else generate_seconds(models[name], gen_ids, s.new_tokens))
                if round_ >= s.warmup:
                    times[name][kind].append(t)
    return times


def _pick(t: dict[str, list], clock: str) -> dict[str, list[float]]:
    k = 1 if clock == "cpu" else 0
    return {kind: [x[k] for x in values] for kind, values in t.items()}


def _summary(t: dict[str, list[float]], s: SpeedSettings) -> dict[str, float]:
    tokens = s.gen_batch * s.new_tokens
    return {"prefill_ms": 1000.0 * statistics.median(t["prefill"]),
            "tokens_per_s": tokens / statistics.median(t["generate"])}


def _settings_record(s: SpeedSettings, clock: str) -> dict:
    return {**asdict(s), "clock": clock}


def _device_type(model) -> str:
    return model.device.type


def measure_speed(model, settings: SpeedSettings = SpeedSettings()) -> dict:
    """Prefill latency (ms) and generation throughput (new tokens/s) of one model (medians)."""
    s = settings.resolve(_device_type(model))
    clock = s.clock_for(_device_type(model))
    t = _pick(_time_models({"model": model}, s)["model"], clock)
    return {**_summary(t, s), "settings": _settings_record(s, clock)}


def _paired(dense: list[float], pruned: list[float]) -> tuple[float, float, float]:
    """(median, min, max) over rounds of dense / pruned time (the speed-up of each round)."""
    ratios = [d / p for d, p in zip(dense, pruned)]
    return statistics.median(ratios), min(ratios), max(ratios)


def compare_speed(dense, pruned, settings: SpeedSettings = SpeedSettings()) -> dict:
    """Dense vs pruned, timed side by side: medians, and speed-ups (median of each round's paired
    ratio, with the rounds' range) beside the ideal L / L_kept."""
    device = _device_type(pruned)
    s = settings.resolve(device)
    clock = s.clock_for(device)
    times = _time_models({"dense": dense, "pruned": pruned}, s)
    d, p = _pick(times["dense"], clock), _pick(times["pruned"], clock)
    out = {**_summary(p, s), **{f"dense_{k}": v for k, v in _summary(d, s).items()}}
    for key, kind in (("prefill_speedup", "prefill"), ("throughput_speedup", "generate")):
        mid, low, high = _paired(d[kind], p[kind])
        out.update({key: mid, f"{key}_min": low, f"{key}_max": high})
    layers, kept = dense.config.num_hidden_layers, pruned.config.num_hidden_layers
    return {**out, "ideal_speedup": layers / kept, "layers": layers, "layers_kept": kept,
            "settings": _settings_record(s, clock)}
