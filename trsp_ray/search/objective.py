"""What a search ranks trials on, and how sure the ranking is.

One text for every trial: the validation tail of the *base* config's calibration (the mixture the
search was started with), whatever mixture, window length or seed a trial calibrates on, so two
trials are compared on the same windows. A trial whose own calibration stream holds some of that text
(a mixture that draws more of a source than the base does runs past the base's tail) trains without
those chunks (`without_text`), so no trial is scored on text it trained on. Each trial keeps its
per-window NLLs; `ranking` groups trials that differ only in their seed (`--seeds`), averages them,
and compares every group with the best one dropping as many layers, paired over the same windows
(clustered by document where the windows carry document ids): a difference within 2 paired SE is a tie.
No Ray here.
"""

from __future__ import annotations

import hashlib
import json
import math
import statistics

import torch

from trsp_ray.common.paired import paired_se

TIE_SE = 2.0  # a difference within this many paired SE is a tie


def validation_text(run: dict, tokenizer, *, bos: int | None):
    """The base config `run`'s calibration (calibration.Calibration): its `val_ids` are what every
    trial of the search is scored on."""
    from trsp_ray.config.run_config import from_dict
    from trsp_ray.run.workbench import calibration_of

    return calibration_of(from_dict(run), tokenizer, bos=bos)


def validation_seqlen(val, bos: int | None) -> int:
    """The validation windows' length: one chunk of the base calibration's tail (and BOS), so that
    each window is one source's text, never two domains joined."""
    return val.chunk + (bos is not None)


def text_id(ids: torch.Tensor) -> str:
    """A short hash of token ids: two records with the same id were scored on the same text."""
    return hashlib.sha256(ids.to(torch.int64).numpy().tobytes()).hexdigest()[:16]


def same_calibration(a: dict, b: dict) -> bool:
    """Whether two run configs cut the same calibration stream (so the same tail)."""
    return all(a["data"][k] == b["data"][k] for k in ("calib_text", "calib_mix", "seqlen")) and a["model"] == b["model"]


def _group(record: dict) -> str:
    """What a trial is apart from its seed: its point without `seed` and the layers it drops."""
    point = {k: v for k, v in (record.get("point") or {}).items() if k != "seed"}
    return json.dumps({"point": point, "method": record.get("method"), "n_drop": len(record["drop"])},
                      sort_keys=True, default=str)


def _row(recs: list[dict]) -> dict:
    recs = sorted(recs, key=lambda r: (r["config"].get("seed", 0), r["trial_key"]))
    losses = [r["val_loss"] for r in recs]
    nlls = [r.get("val_nlls") for r in recs]
    mean_nlls = [statistics.fmean(w) for w in zip(*nlls)] if all(nlls) and len({len(x) for x in nlls}) == 1 else None
    return {"trials": [r["trial_key"] for r in recs], "point": recs[0].get("point"), "method": recs[0].get("method"),
            "n_drop": len(recs[0]["drop"]), "seeds": len(recs), "val_loss": statistics.fmean(losses),
            "val_ppl": math.exp(statistics.fmean(losses)), "spread": max(losses) - min(losses),
            "text": (recs[0].get("objective") or {}).get("text"), "docs": recs[0].get("val_docs"),
            "per_seed": {r["config"].get("seed", 0): r["val_loss"] for r in recs}, "nlls": mean_nlls}


def compare(row: dict, best: dict) -> dict:
    """{diff, se, tie} of `row` - `best` (mean NLL, nats): paired over the windows both were scored on,
    clustered by document when the windows carry ids; with seeds both ran, the per-seed differences'
    variance over the seeds is added (sd^2 / seeds). None where they cannot be paired (no per-window
    losses, or another validation text)."""
    if row is best:
        return {"diff": 0.0, "se": 0.0, "tie": True}
    if row["nlls"] is None or best["nlls"] is None or row["text"] != best["text"] or \
            len(row["nlls"]) != len(best["nlls"]):
        return {"diff": row["val_loss"] - best["val_loss"], "se": None, "tie": None}
    diff, se = paired_se(row["nlls"], best["nlls"], clusters=row["docs"] if row["docs"] == best["docs"] else None)
    seeds = sorted(set(row["per_seed"]) & set(best["per_seed"]))
    if len(seeds) > 1:
        gaps = [row["per_seed"][s] - best["per_seed"][s] for s in seeds]
        se = math.sqrt(se * se + statistics.variance(gaps) / len(seeds))
    return {"diff": diff, "se": se, "tie": abs(diff) <= TIE_SE * se}


def ranking(records: list[dict]) -> list[dict]:
    """The finished trials as rows (trials that differ only in their seed form one row, averaged),
    best first: the most layers dropped, then the lowest mean validation NLL. Each row compared with
    the best row of its drop count (`compare`); `best` marks that row."""
    groups: dict[str, list[dict]] = {}
    for r in records:
        if r.get("status") == "finished" and r.get("val_loss") is not None:
            groups.setdefault(_group(r), []).append(r)
    rows = sorted((_row(g) for g in groups.values()), key=lambda r: (-r["n_drop"], r["val_loss"]))
    out, bests = [], {}
    for row in rows:
        best = bests.setdefault(row["n_drop"], row)
        out.append({**{k: v for k, v in row.items() if k not in ("nlls", "docs")}, **compare(row, best),
                    "best": row is best})
    return out


def ranking_table(rows: list[dict]) -> str:
    """The ranking as text: one line per row, the difference from the best with its paired SE."""
    from trsp_ray.common import table

    def call(r: dict) -> str:
        if r["best"]:
            return "best"
        return "no per-window losses" if r["tie"] is None else ("tie" if r["tie"] else "worse")

    shown = [{"trials": ",".join(r["trials"]), "point": json.dumps(r["point"], default=str), "drop": r["n_drop"],
              "seeds": r["seeds"], "val PPL": f"{r['val_ppl']:.3f}", "spread": f"{r['spread']:.4f}",
              "diff (nats)": f"{r['diff']:+.4f}", "paired SE": "-" if r["se"] is None else f"{r['se']:.4f}",
              "call": call(r)} for r in rows]
    return table.render(shown, list(shown[0])) if shown else ""
