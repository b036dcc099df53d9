"""The workbench of a run: the model loaded once with its texts tokenized and split, the device
and dtype it runs in, and the input checks that refuse a bad request before any weights load.
Every method, the benchmark, search trials and reproduction cells work on a `Workbench`
(`prepare(cfg)`); the driver of one pruning run is `trsp_ray.driver`."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from trsp_ray.common.errors import TrspError
from trsp_ray.common.logs import log
from trsp_ray.config.run_config import RunConfig
from trsp_ray.data import assets, calibration, domains
from trsp_ray.data.heldout import HeldoutWindows, text_windows
from trsp_ray.data.perplexity import bos_token, nlls_of, perplexity, ppl_of
from trsp_ray.method.stage1 import candidate_layers, check_drop_count, n_drop_for
from trsp_ray.method.training import Batches, set_checkpointing
from trsp_ray.models import families

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise TrspError("device='cuda' but no CUDA device is visible; use device=cpu or auto")
    return torch.device(device)


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    """The model dtype of `dtype` ('auto': bf16 on CUDA, fp16 on a GPU without bf16, fp32 on CPU)."""
    if dtype == "auto":
        if device.type != "cuda":
            return torch.float32
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return DTYPES[dtype]


def run_dtype(cfg: RunConfig) -> str:
    """cfg.dtype with 'auto' resolved for cfg.device: bf16 | fp16 | fp32."""
    resolved = resolve_dtype(cfg.dtype, resolve_device(cfg.device))
    return next(name for name, dt in DTYPES.items() if dt == resolved)


def load_model(name: str, *, device: str = "cpu", dtype: str = "auto"):
    """(model in eval mode on `device`, tokenizer) for a --model value (default name, directory or hub id)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = assets.resolve_model(name)
    target = resolve_device(device)
    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=resolve_dtype(dtype, target))
    except OSError as exc:
        raise TrspError(f"model {name!r} could not be loaded ({str(exc).splitlines()[0]}); "
                        f"pass a local model directory or {assets.DEFAULT_MODEL!r}") from None
    families.family_of(model)  # unsupported architectures fail here, by name
    return model.to(target).eval(), tokenizer


@dataclass
class Workbench:
    """A loaded model with its data, shared by every method of a run or a benchmark."""

    cfg: RunConfig
    model: object
    tokenizer: object
    calib_ids: torch.Tensor
    texts: domains.TextSplit
    val_ids: torch.Tensor | None = None  # calibration tail, never trained on (for tuning)
    val_docs: list | None = None  # a search's validation chunks' documents (search/trial.with_objective)
    val_seqlen: int = 0  # and their windows' length
    device: str = "cpu"  # where methods train and score; `model` (the original) stays in host memory
    bos: int | None = None  # the BOS id every evaluation window starts with (perplexity.bos_token)
    calib_strata: torch.Tensor | None = None  # source of each calibration window (calibration.Calibration)
    calibration: calibration.Calibration | None = None  # the stream calib_ids, val_ids and calib_strata come from
    heldout: HeldoutWindows | None = None  # what heldout_ppl scores (data.heldout, the one reader of them)

    @property
    def num_layers(self) -> int:
        return families.num_layers(self.model)

    def candidates(self) -> list[int]:
        g = self.cfg.gates
        return candidate_layers(self.num_layers, protect_head=g.protect_head, protect_tail=g.protect_tail)

    def n_drop(self, ratio: float | None = None) -> int:
        ratio = self.cfg.ratio if ratio is None else ratio
        n = n_drop_for(ratio, self.num_layers)
        check_drop_count(n, self.candidates(), ratio, self.num_layers)
        return n

    def batches(self, seed_offset: int = 0) -> Batches:
        d = self.cfg.data
        return Batches(self.calib_ids, seqlen=d.seqlen, batch_size=d.batch_size, seed=self.cfg.seed + seed_offset,
                       bos=self.bos, strata=self.calib_strata)

    def heldout_ppl(self, model=None) -> float:
        progress = _progress_printer("held-out PPL")
        return ppl_of(nlls_of(self.scoring_model(model), self.heldout.windows, batch_size=4, progress=progress))

    def validation_ppl(self, model=None) -> float:
        return perplexity(self.scoring_model(model), self.val_ids, seqlen=self.cfg.data.eval_seqlen, batch_size=4,
                          bos=self.bos)

    def scoring_model(self, model=None):
        """`model`, else the original on the run's device (a transient copy when it lives elsewhere)."""
        if model is not None:
            return model
        here = next(self.model.parameters()).device
        there = torch.device(self.device)
        same = here.type == there.type and (there.index is None or here.index == there.index)
        return self.model if same else self.fresh_model()

    def fresh_model(self):
        """A copy of the original model on the run's device; methods train and cut copies, never
        the original.

        The original stays where `prepare` loaded it (host memory) and the copy's tensors are
        created on the device directly, so a GPU never holds two copies (LLaMA2-13B in bf16 is 26 GB
        each); on CPU both live in host memory, as they always did. With activation checkpointing
        configured, the copy recomputes its layers in backward (training.set_checkpointing).
        """
        import gc

        gc.collect()  # a previous copy kept only by a reference cycle must go before the next one
        model = copy_model(self.model, torch.device(self.device))
        if self.cfg.distributed.activation_checkpointing:
            set_checkpointing(model, True)
        return model


def copy_model(model, device: torch.device):
    """A deep copy of `model` whose parameters and buffers are made on `device` straight from the
    source tensors (tied weights stay tied); nothing of the copy is ever materialised elsewhere."""
    import copy
    import itertools

    memo: dict = {}
    for t in itertools.chain(model.parameters(), model.buffers()):
        if id(t) not in memo:
            data = t.detach().to(device, copy=True)
            memo[id(t)] = torch.nn.Parameter(data, requires_grad=t.requires_grad) if isinstance(
                t, torch.nn.Parameter) else data
    return copy.deepcopy(model, memo)


def _progress_printer(what: str):
    def progress(done: int, total: int) -> None:
        if done == total or done % max(1, total // 4) == 0:
            log(f"  {what}: {done}/{total} windows")
    return progress


def model_hidden(model: str) -> int | None:
    """The hidden size in a model's config.json, or None when it cannot be read (check_inputs says why)."""
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(assets.resolve_model(model))
    except (OSError, ValueError, TrspError):
        return None
    return families.hidden_size(config) if config.model_type in families.FAMILIES else None


def check_inputs(cfg: RunConfig) -> int:
    """Validate model, texts and ratio from config.json alone, before any weights are loaded.

    Returns the model's number of decoder layers."""
    from transformers import AutoConfig

    from trsp_ray.data.assets import read_text_file

    path = assets.resolve_model(cfg.model)
    for text, what in ((cfg.data.calib_text, "calibration text"), (cfg.data.eval_text, "evaluation text")):
        if text:
            read_text_file(text, what)
    try:
        config = AutoConfig.from_pretrained(path)
    except (OSError, ValueError) as exc:
        raise TrspError(f"model {cfg.model!r} has no readable config ({str(exc).splitlines()[0]}); "
                        f"pass a Hugging Face model directory") from None
    if config.model_type not in families.FAMILIES:
        raise TrspError(f"model_type {config.model_type!r} is not supported; supported: "
                        f"{', '.join(sorted(families.FAMILIES))}")
    family = families.FAMILIES[config.model_type]
    num = families._get(config, family.config_path).num_hidden_layers
    g = cfg.gates
    n_drop = n_drop_for(cfg.ratio, num)
    check_drop_count(n_drop, candidate_layers(num, protect_head=g.protect_head, protect_tail=g.protect_tail),
                     cfg.ratio, num)
    return num


def prepare(cfg: RunConfig, *, methods: tuple[str, ...] | None = None) -> Workbench:
    """Check inputs (cheaply, first: the device, config.json, the single-process memory plan of
    `cfg.method` or of every method in `methods`), load the model and tokenize the texts."""
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.seed)
    device = resolve_device(cfg.device)
    check_inputs(cfg)
    check_single_plan(cfg, methods=methods)
    texts = domains.load_texts(cfg.data.eval_text)
    model, tokenizer = load_model(cfg.model, device="cpu", dtype=run_dtype(cfg))
    bos = bos_token(tokenizer)
    cal = calibration_of(cfg, tokenizer, bos=bos)
    if cfg.compensation.method == "lstsq":  # a d x d fit needs that many distinct windows
        calibration.check_windows(cal, windows=cfg.compensation.windows,
                                  what=f"compensation.windows={cfg.compensation.windows}")
    heldout = text_windows(tokenizer, texts, seqlen=cfg.data.eval_seqlen, max_windows=cfg.data.eval_max_windows)
    return Workbench(cfg=cfg, model=model, tokenizer=tokenizer, calib_ids=cal.ids,
                     texts=texts, val_ids=cal.val_ids, device=str(device), bos=bos, calib_strata=cal.strata,
                     calibration=cal, heldout=heldout)


def calibration_of(cfg: RunConfig, tokenizer, *, bos: int | None) -> calibration.Calibration:
    """The run's calibration stream (every path that trains or selects reads this one), with the
    checks that refuse a method more windows than the data has. With data.validation_base (a search's
    base calibration) the text of that calibration's validation tail is taken out of this one's training
    text (calibration.without_text): the one place a search trial's training data loses what it is
    scored on, on one device and on the Ray Train workers alike."""
    import json

    d = cfg.data
    cal = calibration.load(tokenizer, calib_text=d.calib_text, calib_mix=d.calib_mix, seqlen=d.seqlen, bos=bos)
    if not d.validation_base:
        return cal
    base = json.loads(d.validation_base)
    if base == validation_base(cfg):  # its own tail: never trained on by construction
        return cal
    return calibration.without_text(cal, calibration.load(tokenizer, **base, bos=bos).val_ids)


def validation_base(cfg: RunConfig) -> dict:
    """What data.validation_base names of a calibration: its text, mixture and window length."""
    d = cfg.data
    return {"calib_text": d.calib_text, "calib_mix": d.calib_mix, "seqlen": d.seqlen}


def device_kind(cfg: RunConfig) -> tuple[str, float]:
    """('gpu' | 'cpu', GB that one device holds) for the planner, on the machine that runs `cfg`:
    the smaller of distributed.gpu_memory_gb and the visible GPU's memory; host memory on CPU."""
    import os

    device = resolve_device(cfg.device)
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        visible = torch.cuda.get_device_properties(index).total_memory / 2**30
        return "gpu", min(cfg.distributed.gpu_memory_gb, visible)
    return "cpu", os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30


def check_single_plan(cfg: RunConfig, *, methods: tuple[str, ...] | None = None):
    """Refuse, in one line and before any weights load, a single-process run whose memory plan does
    not fit this machine's device; returns the plan (see plan/single_plan.py)."""
    from trsp_ray.plan.single_plan import single_hint, single_plan_for_run

    kind, memory = device_kind(cfg)
    plan = single_plan_for_run(cfg, device=kind, memory_gb=memory, methods=methods)
    if not plan.fits:
        raise TrspError(f"the single-process plan does not fit: {plan.reason()}; {single_hint(cfg, plan)}")
    return plan


def kept_parameters(model) -> int:
    """Parameter count with tied weights counted once."""
    return sum(p.numel() for p in model.parameters())


def heal_stream(cfg, cal, *, bos: int | None, seed_offset: int, steps: int | None = None):
    """The heal's batch stream (data/stream.HealStream) over calibration `cal`'s sources at their
    weights, in windows of compute.heal_shape(cfg): the one definition for one process and the Ray
    Train workers, so both heal on the same windows. Below the first budget of HEAL_SHAPES (and
    without heal.seqlen / heal.batch_size) the calibration mixture's training.Batches, as before.
    With `steps`, a heal that needs more windows than the stream gives is refused in one line, and
    the passes over each source are logged."""
    from trsp_ray.data.stream import HealStream
    from trsp_ray.plan import compute

    seqlen, batch = compute.heal_shape(cfg)
    if not compute.heal_reads_stream(cfg):
        # a short heal (today's default budget, ~10k tokens) reads the mixture stage 2 reads: it
        # holds each source's share many times over what such a heal trains on
        return Batches(cal.ids, seqlen=seqlen, batch_size=batch, seed=cfg.seed + seed_offset, bos=bos,
                       strata=cal.strata)
    stream = HealStream(cal.parts, cal.weights, seqlen=seqlen, batch_size=batch, bos=bos,
                        seed=cfg.seed + seed_offset, max_passes=cfg.heal.max_passes)
    if steps:
        stream.check(steps * batch)
        log(f"  {stream.describe(steps * batch)}")
    return stream
