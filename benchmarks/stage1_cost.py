"""Cost of a stage-1 step (gates train, base frozen) relative to a full-weight training step.

    python benchmarks/stage1_cost.py [--model smollm2-135m] [--batch 4] [--seqlen 128] [--rounds 5]

Both steps run on the same model and the same batch, alternated in one process (so machine load
hits both alike); the median of `--rounds` timed steps of each is reported after one warm-up.
A frozen base skips the weight gradients (about a third of a step's FLOPs) and the optimizer
update of every weight, but activations must still flow back through every layer to the gates.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def _timed_step(stepper, batch, extra_loss) -> float:
    t0 = time.perf_counter()
    loss = stepper.forward(batch)
    stepper.backward(loss + extra_loss())
    stepper.step()
    return time.perf_counter() - t0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seqlen", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    args = parser.parse_args()

    import torch

    from trsp_ray.method.gates import attach_gates
    from trsp_ray.method.training import TorchStepper, freeze
    from trsp_ray.run.workbench import load_model

    torch.set_num_threads(args.threads)
    model, _ = load_model(args.model)
    gates = attach_gates(model)
    candidates = list(range(1, len(gates) - 1))
    batch = torch.randint(0, model.config.vocab_size, (args.batch, args.seqlen),
                          generator=torch.Generator().manual_seed(0))
    gate_params = gates.gate_params()
    base = [p for p in model.parameters() if all(p is not g for g in gate_params)]

    def stage1_stepper():
        gates.set_gated(True)
        freeze(model, except_params=gate_params)
        return TorchStepper(model, [{"params": gate_params, "lr": 1e-2}])

    def full_stepper():
        gates.set_gated(False)
        freeze(model, except_params=base)
        return TorchStepper(model, [{"params": base, "lr": 1e-5}])

    s1, full = stage1_stepper(), full_stepper()
    times = {"stage1": [], "full": []}
    for r in range(args.rounds + 1):  # round 0 warms up both (allocator, optimizer state)
        for name, make, stepper in (("stage1", stage1_stepper, s1), ("full", full_stepper, full)):
            make()  # switch requires_grad to this step's trainable set
            extra = (lambda: 5e-3 * gates.l1(candidates)) if name == "stage1" else (lambda: 0.0)
            dt = _timed_step(stepper, batch, extra)
            if r:
                times[name].append(dt)
    t1, tf = statistics.median(times["stage1"]), statistics.median(times["full"])
    print(f"model {args.model}, batch {args.batch} x {args.seqlen} tokens, {args.threads} threads, "
          f"median of {args.rounds} steps each")
    print(f"stage-1 step (gates only, base frozen): {t1 * 1000:.0f} ms")
    print(f"full-weight training step (AdamW):      {tf * 1000:.0f} ms")
    print(f"stage-1 step / full step = {t1 / tf:.2f}")


if __name__ == "__main__":
    main()
