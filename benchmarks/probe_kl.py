"""The removal probe's KL per chunk: probes._kl_sum against the F.kl_div it replaced, side by side.

    python benchmarks/probe_kl.py [--batch 4] [--seqlen 128] [--vocab 49152] [--reps 6] [--dtype float32]

One thread, a chunk of the probe's shape (SmolLM2's vocabulary by default); both sides get the
same student log-probs and the same teacher (in --dtype, as the scorer caches it) and are timed
alternately, so the machine's load hits both alike. Prints the median seconds of each, their ratio,
whether the two sums are equal to the bit, and the load average.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seqlen", type=int, default=128)
    parser.add_argument("--vocab", type=int, default=49152)
    parser.add_argument("--reps", type=int, default=6)
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    args = parser.parse_args()

    import torch
    import torch.nn.functional as F

    from trsp_ray.method.probes import _kl_sum

    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    shape = (args.batch, args.seqlen, args.vocab)
    teacher = torch.log_softmax(torch.randn(shape, generator=g) * 3, -1).to(getattr(torch, args.dtype))
    student_logits = torch.randn(shape, generator=g) * 3

    def old():
        lp = torch.log_softmax(student_logits, -1)
        return F.kl_div(lp, teacher.float(), log_target=True, reduction="sum").item()

    def new():
        lp = torch.log_softmax(student_logits, -1)
        return _kl_sum(teacher, lp).item()

    times: dict[str, list[float]] = {"kl_div": [], "_kl_sum": []}
    values = {}
    for _ in range(args.reps):
        for name, fn in (("kl_div", old), ("_kl_sum", new)):
            t0 = time.perf_counter()
            values[name] = fn()
            times[name].append(time.perf_counter() - t0)
    a, b = (statistics.median(times[k]) for k in ("kl_div", "_kl_sum"))
    print(f"chunk {args.batch} x {args.seqlen} x {args.vocab}, teacher {args.dtype}, log_softmax included, "
          f"median of {args.reps}")
    print(f"  F.kl_div: {a:.3f} s   probes._kl_sum: {b:.3f} s   ratio {a / b:.2f}x")
    print(f"  equal to the bit: {values['kl_div'] == values['_kl_sum']} ({values['kl_div']:.6f})")
    print(f"  load average: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
