"""What a pruned model predicts where LAMBADA's last word should be, beside its accuracy.

LAMBADA's last word almost always appears earlier in the passage, so a model that still copies from
its context predicts a context token there; one that lost that ability falls back on frequent words.
For each drop set, run through `--method`'s pipeline without a heal (the probe's training-free path)
and scored on the first N test passages (the lambada_openai rule, benchmarks/capability.py):
accuracy, the share of passages whose first predicted token occurs in the context ("copies"), the
share whose first predicted token is a frequent word (among the dense model's ten most predicted at
that position, "falls back") and the most predicted first tokens.

    python benchmarks/lambada_misses.py --sets 12,13,14,15,16,17,25,26 20,21,22,23,24,25,26,27 --n 200

Prints one table; the load average is printed beside the wall time.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections import Counter

sys.path.insert(0, os.path.dirname(__file__))


def first_predictions(model, tokenizer, passages, *, bos: int | None) -> list[tuple[int, bool, bool]]:
    """Per passage: (the first predicted token of the last word, whether it is in the context,
    whether every token of the last word is predicted: the lambada_openai rule)."""
    import torch

    out = []
    with torch.no_grad():
        for ctx, cont in passages:
            ctx_ids = tokenizer(ctx, add_special_tokens=False).input_ids
            ids = ([bos] if bos is not None else []) + tokenizer(ctx + cont, add_special_tokens=False).input_ids
            n = len(ctx_ids) + (bos is not None)
            batch = torch.tensor([ids], device=next(model.parameters()).device)
            pred = model(input_ids=batch, use_cache=False).logits[0, n - 1:len(ids) - 1].argmax(-1).cpu()
            out.append((int(pred[0]), int(pred[0]) in set(ids[:n]), pred.tolist() == ids[n:]))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sets", nargs="+", required=True, help="drop sets, comma-separated layer indices")
    p.add_argument("--method", default="shortgpt+comp", help="training-free pipeline that cuts each set")
    p.add_argument("--n", type=int, default=200, help="LAMBADA passages")
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()

    import torch
    from capability import lambada_passages

    from trsp_ray.config.run_config import load_config
    from trsp_ray.distributed.audition import audition
    from trsp_ray.run.methods import apply_method
    from trsp_ray.run.pipeline import resolve
    from trsp_ray.run.workbench import prepare

    torch.set_num_threads(args.threads)
    pipe = resolve(load_config(overrides=["tracking.enabled=false", f"method={args.method}"]))
    if pipe.spec.heal:
        sys.exit(f"--method {args.method!r} heals; pass a training-free pipeline such as shortgpt+comp")
    bench = prepare(pipe.cfg)
    passages = lambada_passages(args.n)
    rows, frequent = [], None
    for spec in ["dense", *args.sets]:
        t0 = time.time()
        if spec == "dense":
            model = bench.scoring_model()
        else:
            model = apply_method(bench, pipe.spec, drop=[int(x) for x in spec.split(",")], audition=audition).model
        got = first_predictions(model, bench.tokenizer, passages, bos=bench.bos)
        counts = Counter(tok for tok, _, _ in got)
        frequent = frequent or {tok for tok, _ in counts.most_common(10)}
        top = ", ".join(f"{bench.tokenizer.decode([t])!r} {c}" for t, c in counts.most_common(4))
        n = len(got)
        rows.append((spec, sum(r for _, _, r in got) / n, sum(c for _, c, _ in got) / n,
                     sum(t in frequent for t, _, _ in got) / n, top, time.time() - t0))
    print(f"| drop set | LAMBADA ({args.n}) | copies | falls back | most predicted first tokens | s |")
    print("|---|---|---|---|---|---|")
    for spec, acc, copies, falls, top, secs in rows:
        print(f"| {spec} | {acc:.3f} | {copies:.2f} | {falls:.2f} | {top} | {secs:.0f} |")
    print(f"load average {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
