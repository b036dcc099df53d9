"""Reproduction presets: which models, methods and ratios a run covers, with what budgets.

`paper`: the paper's three models on a GPU cluster with model-hub access, 128 x 2048-token
WikiText-2 calibration windows, the paper's 5 zero-shot tasks on whole splits.
`local`: SmolLM2-135M with the shipped Wikipedia excerpt (NOT WikiText-2) and small budgets, so
the whole grid finishes on a 2-core CPU machine.

The paper's published numbers (SPEC section 1, 25% of layers removed) are kept here so tables can
show them beside ours; they exist only for the paper's models at ratio 0.25.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from trsp_ray.common.errors import TrspError
from trsp_ray.config import registry

PAPER_RATIO = 0.25


@dataclass(frozen=True)
class GridMethod:
    """A row of the grid: the RunConfig method it runs (None: the dense model, nothing pruned) and
    the config overrides that define the row. Rows are data: a new one is a line in
    registry.GRID_ROWS, and every part of the reproduction (grid, routes, the shared stage 1 of the
    TRSP methods, tables) follows."""

    name: str
    method: str | None
    overrides: tuple[str, ...] = ()


# The paper compares TRSP with baselines healed after pruning; the +heal rows are heal methods, so
# the baselines (and TRSP's selection, trsp+heal) train stage 2's tokens on stage 2's weights.
GRID = tuple(GridMethod(name, method) for name, method in registry.GRID_ROWS)
GRID_METHODS = tuple(m.name for m in GRID)  # also the tables' row order


def grid_method(name: str) -> GridMethod:
    for m in GRID:
        if m.name == name:
            return m
    raise TrspError(f"unknown method {name!r}; valid: {', '.join(GRID_METHODS)}")

# (model key, method) -> (WikiText-2 PPL, mean acc over PIQA/WinoGrande/HellaSwag/ARC-e/ARC-c in %).
# The paper's ShortGPT and SLEB figures are of LoRA-healed models, so they sit on the +heal rows
# (ours heal stage 2's trainable set, as trsp and trsp+heal train: equal budget, not the paper's).
PAPER_NUMBERS: dict[tuple[str, str], tuple[float, float]] = {
    ("llama2-7b", "dense"): (5.47, 69.00), ("llama2-7b", "shortgpt+heal"): (8.89, 57.10),
    ("llama2-7b", "sleb+heal"): (9.63, 54.79), ("llama2-7b", "trsp"): (7.08, 60.57),
    ("llama2-7b", "trsp-oneshot"): (9.26, 56.19), ("llama2-7b", "trsp-no-stage2"): (10.15, 54.36),
    ("llama2-13b", "dense"): (4.88, 71.76), ("llama2-13b", "shortgpt+heal"): (6.79, 62.96),
    ("llama2-13b", "sleb+heal"): (7.08, 58.59), ("llama2-13b", "trsp"): (5.82, 65.11),
    ("llama3-8b", "dense"): (5.76, 75.62), ("llama3-8b", "shortgpt+heal"): (9.26, 66.17),
    ("llama3-8b", "sleb+heal"): (10.38, 63.12), ("llama3-8b", "trsp"): (7.68, 68.38),
}


@dataclass(frozen=True)
class ModelSpec:
    """One model of a preset. `shape` (config.json fields) lets the memory planner size the
    cluster before any hub access; None = read the model's own config.json."""

    key: str  # short name used in cell ids, tables and PAPER_NUMBERS
    model: str  # what RunConfig.model accepts: smollm2-135m, a directory or a hub id
    shape: dict | None = None


@dataclass(frozen=True)
class Preset:
    name: str
    description: str
    models: tuple[ModelSpec, ...]
    methods: tuple[str, ...]
    ratios: tuple[float, ...]
    run: dict  # RunConfig values applied to every cell (nested dict, as in a YAML config)
    evaluation: dict  # EvalSettings values (tasks, limit, ppl_seqlen, ppl_windows, dtype, speed)
    calibration: str  # what the calibration text is, for the report footer
    gpus_per_model: int = 0  # GPUs per single-process prune task (0: CPU)
    gpu_memory_gb: float = 80.0  # per-GPU memory the planner checks against
    max_workers: int = 0  # most Ray Train workers a cell may use (one node of 8 for the paper's models)
    eval_actors: int = 1
    eval_gpus_per_actor: float = 0.0
    keep_models: bool = True  # keep exported pruned models after scoring
    notes: tuple[str, ...] = field(default_factory=tuple)

    def model(self, key: str) -> ModelSpec:
        for spec in self.models:
            if spec.key == key:
                return spec
        raise TrspError(f"unknown model {key!r} for preset {self.name!r}; valid: "
                        f"{', '.join(m.key for m in self.models)}")


def _llama(vocab, hidden, inter, layers, heads, kv):
    return {"vocab_size": vocab, "hidden_size": hidden, "intermediate_size": inter, "num_hidden_layers": layers,
            "num_attention_heads": heads, "num_key_value_heads": kv, "tie_word_embeddings": False}


PAPER = Preset(
    name="paper",
    description="the paper's tables: LLaMA2-7B, LLaMA2-13B, LLaMA3-8B at 25% of layers removed",
    models=(ModelSpec("llama2-7b", "meta-llama/Llama-2-7b-hf", _llama(32000, 4096, 11008, 32, 32, 32)),
            ModelSpec("llama2-13b", "meta-llama/Llama-2-13b-hf", _llama(32000, 5120, 13824, 40, 40, 40)),
            ModelSpec("llama3-8b", "meta-llama/Meta-Llama-3-8B", _llama(128256, 4096, 14336, 32, 32, 8))),
    methods=GRID_METHODS,
    ratios=(PAPER_RATIO,),
    run={"device": "cuda", "seed": 0,
         # 128 windows x 2048 tokens, as the paper; the WikiText-2 files are given as paths on
         # shared storage (no hub download inside the job), see cluster/README.md.
         "data": {"seqlen": 2048, "batch_size": 8, "eval_seqlen": 2048, "eval_max_windows": None,
                  "calib_text": "/shared/data/wikitext2/train.txt", "eval_text": "/shared/data/wikitext2/test.txt"},
         "stage1": {"lambda1": 5e-3, "first_round_steps": 16, "steps_per_round": 4},  # 128 windows / 8
         "stage2": {"lambda2": 1e-3, "steps": 16, "trainable": "all"},
         "baselines": {"calib_windows": 128, "sleb_windows": 128},
         "tracking": {"enabled": True, "experiment": "trsp_ray-reproduce"},
         "distributed": {"use_gpu": True, "activation_checkpointing": True, "gpu_memory_gb": 80.0,
                         "storage_path": "/shared/ray"}},
    evaluation={"tasks": ("piqa", "winogrande", "hellaswag", "arc_easy", "arc_challenge"), "limit": None,
                "ppl_seqlen": 2048, "ppl_windows": None, "dtype": "bfloat16", "speed": {}},
    calibration="128 x 2048-token windows of WikiText-2 train (files on shared storage)",
    gpus_per_model=1, max_workers=8, eval_actors=4, eval_gpus_per_actor=1.0,
)

LOCAL = Preset(
    name="local",
    description="SmolLM2-135M (30 layers) on this CPU machine, small budgets",
    models=(ModelSpec("smollm2-135m", "smollm2-135m"),),
    methods=GRID_METHODS,
    ratios=(PAPER_RATIO,),
    run={"device": "cpu", "seed": 0, "threads": 1,
         "data": {"seqlen": 128, "batch_size": 4, "eval_seqlen": 256, "eval_max_windows": 24},
         "stage1": {"first_round_steps": 8, "steps_per_round": 2},
         "stage2": {"steps": 8},
         "baselines": {"calib_windows": 8, "sleb_windows": 4},
         "tracking": {"enabled": False}},
    evaluation={"tasks": ("piqa", "winogrande", "hellaswag", "arc_easy", "arc_challenge"), "limit": 20,
                "ppl_seqlen": 256, "ppl_windows": 24, "dtype": "float32", "speed": None},
    calibration="gensim enwiki excerpt (real Wikipedia, NOT WikiText-2), 128-token windows",
    keep_models=False,
    notes=("Budgets are tiny (tens of calibration windows); numbers show the pipeline works, "
           "not the paper's quality.",),
)

PRESETS = {p.name: p for p in (PAPER, LOCAL)}


def get_preset(name: str) -> Preset:
    if name not in PRESETS:
        raise TrspError(f"unknown preset {name!r}; valid presets: {', '.join(PRESETS)}")
    return PRESETS[name]


def paper_numbers(model_key: str, method: str, ratio: float) -> tuple[float, float] | None:
    """(PPL, mean acc %) the paper reports for this cell, or None where it reports nothing."""
    if abs(ratio - PAPER_RATIO) > 1e-9:
        return None
    return PAPER_NUMBERS.get((model_key, method))
