"""The planner's activation model against what autograd actually keeps for backward, per token and
decoder layer: SmolLM2-135M (or --model), fp32 and bf16, stage 1 (gates train, weights frozen) and
stage 2 (weights train), in one process and with DeepSpeed ZeRO-3's Linear (which keeps its input
even when the weight is frozen).

    python benchmarks/activation_check.py [--model smollm2-135m] [--seqlen 128] [--batch 2]

Counts the bytes of every distinct storage that autograd's saved-tensor hooks see during one
training forward (parameters excluded: they are not activations), for the first 4 and the first 8
decoder layers; the difference over 4 layers and the tokens is one layer's figure, which
`activations.layer_activation_bytes` should equal. No optimizer, no backward: a few seconds on CPU.
"""

from __future__ import annotations

import argparse
import contextlib


@contextlib.contextmanager
def zero3_linear(on: bool):
    """torch's F.linear replaced by DeepSpeed ZeRO-3's, as deepspeed.zero.Init does in a worker."""
    import torch.nn.functional as F

    original = F.linear
    if on:
        from deepspeed.runtime.zero.linear import zero3_linear_wrap

        F.linear = zero3_linear_wrap
    try:
        yield
    finally:
        F.linear = original


def saved_bytes(path: str, *, dtype, layers: int, trained: bool, gated: bool, zero3: bool,
                tokens: tuple[int, int]) -> int:
    """Bytes autograd keeps for backward in one forward of the first `layers` decoder layers."""
    import torch
    from transformers import AutoModelForCausalLM

    from trsp_ray.method.gates import attach_gates
    from trsp_ray.models import families

    with zero3_linear(zero3):
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
        families.set_decoder_layers(model, torch.nn.ModuleList(list(families.decoder_layers(model))[:layers]))
        for p in model.parameters():
            p.requires_grad_(trained)
        if gated:
            stack = attach_gates(model)
            stack.set_gated(True)
            for g in stack.gate_params():
                g.requires_grad_(True)
        params = {p.untyped_storage().data_ptr() for p in model.parameters()}
        seen: dict[int, int] = {}

        def pack(t):
            storage = t.untyped_storage()
            if storage.data_ptr() not in params:
                seen[storage.data_ptr()] = storage.nbytes()
            return t

        ids = torch.randint(0, model.config.vocab_size, tokens)
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            model(input_ids=ids, use_cache=False)
    return sum(seen.values())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--seqlen", type=int, default=128)
    parser.add_argument("--batch", type=int, default=2)
    args = parser.parse_args()

    import torch

    from trsp_ray.common.logs import quiet_libraries
    from trsp_ray.data import assets
    from trsp_ray.plan.activations import layer_activation_bytes
    from trsp_ray.plan.shape import read_shape

    quiet_libraries()
    torch.set_num_threads(1)
    path = assets.resolve_model(args.model)
    s = read_shape(path)
    tokens = (args.batch, args.seqlen)
    print(f"{'dtype':<9}{'stage':<9}{'where':<9}{'measured B':>11}{'model B':>9}{'error':>8}")
    worst = 0.0
    for dtype, e in ((torch.float32, 4), (torch.bfloat16, 2)):
        for stage, trained, gated in (("stage 1", False, True), ("stage 2", True, False)):
            for zero3 in (False, True):
                kw = {"dtype": dtype, "trained": trained, "gated": gated, "zero3": zero3, "tokens": tokens}
                diff = saved_bytes(path, layers=8, **kw) - saved_bytes(path, layers=4, **kw)
                per = diff / 4 / (tokens[0] * tokens[1])
                model = layer_activation_bytes(s, e, trained=trained, gated=gated, zero3=zero3)
                worst = max(worst, abs(model / per - 1))
                print(f"{str(dtype).split('.')[-1]:<9}{stage:<9}{'ZeRO-3' if zero3 else 'one proc':<9}{per:>11.0f}"
                      f"{model:>9.0f}{model / per - 1:>+8.1%}")
    print(f"largest error: {worst:.2%} (bytes per token per decoder layer, {args.model})")


if __name__ == "__main__":
    main()
