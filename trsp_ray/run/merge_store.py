"""A merge's finished pairs, stored as they are done, so an interrupted merge (Ctrl-C, a lost machine)
restarts after its last finished pair instead of from the first (SmolLM2-135M's 8 pairs: 37 minutes on
2 CPU cores).

A pair, once merged, is final: the later pairs read the model as merged so far and never change it. So
`<checkpoint_dir>/merged_pairs/<key>/pair-<k>.pt` holds the k-th pair's merged block (its state_dict, on the
host) and what merge_pairs recorded of it, written atomically as the pair is done; a rerun puts the
stored pairs back (merge.merge_pairs' `resume`) and merges the rest. The key covers what a merge depends
on: the model and calibration text (their bytes), the calibration windows' settings, the seed and
precision, the merging settings, the pairs, and stage 2's settings when stage 2 changed the weights
before it; a change to any of them starts afresh. The directory is removed once nothing after the merge
can be interrupted: after the heal of merge+heal (a heal resumed from its checkpoint, run/heal_store.py,
needs the merged model back, which the stored pairs give in seconds instead of a merge redone).
Local storage only, as the stage-1 store's round checkpoints; on Ray Train workers rank 0 stores and reads
the pairs (distributed/merging.py), so a restart resumes where rank 0's checkpoint_dir is the same folder.
"""

from __future__ import annotations

from pathlib import Path

from trsp_ray.common import atomic
from trsp_ray.run.content import calibration_content, data_fingerprint, new_folders, remove_store, store_key


def merge_key(cfg: dict, *, drop: list[int], stage2: bool, ranks: dict | None = None) -> str:
    """The content key of a merge of the pairs (d - 1, d), d in `drop`, by the run `cfg` (a RunConfig dict);
    `stage2`: stage 2 trained the weights the merge starts from; `ranks`: where ZeRO-3 workers merge, their
    count and precision (the rows each rank reads depend on the count)."""
    what = {**{k: cfg.get(k) for k in ("model", "seed", "device", "dtype")},
            "data": calibration_content(cfg["data"]), "merging": cfg["merging"], "drop": sorted(drop),
            "stage2": cfg["stage2"] if stage2 else None, **({"ranks": ranks} if ranks else {})}
    data = cfg["data"]
    return store_key(what, cfg=cfg, data=data_fingerprint(model=cfg["model"], calib_text=data.get("calib_text"),
                                                          calib_mix=data.get("calib_mix")))


class MergeCheckpoints:
    """The finished pairs of one merge (`key`) under `<root>/merged_pairs/<key>/`."""

    def __init__(self, root: str | Path, key: str):
        self.dir = Path(root).expanduser() / "merged_pairs" / key
        self.made: list[Path] = []  # the folders the first save made, deepest first: a finished merge removes them
        self.saved = 0  # pairs this process merged and stored (a resumed merge's stored pairs are not among them)

    def finished(self) -> list[tuple[dict, dict]]:
        """(merge_pairs' "per_pair" entry, the merged block's state_dict) of every pair stored, in order (the
        first missing one ends the list)."""
        import torch

        got = []
        while (path := self.dir / f"pair-{len(got)}.pt").is_file():
            stored = torch.load(path, weights_only=True)  # tensors, numbers, lists and tuples: no pickle
            got.append((stored["pair"], stored["block"]))
        return got

    def save(self, k: int, pair: dict, block) -> None:
        """Store the k-th pair (0-based) as it is done: its entry and `block`'s weights, copied to the host."""
        state = {name: t.detach().to("cpu", copy=True) for name, t in block.state_dict().items()}
        if not self.made:
            self.made = new_folders(self.dir)
        atomic.save_torch(self.dir / f"pair-{k}.pt", {"pair": pair, "block": state})
        self.saved += 1

    def clear(self) -> None:
        """Remove the stored pairs, the store's folder where no other merge's pairs are in it, and the
        folders above it that this merge's first save made, where empty."""
        remove_store(self.dir, self.made)
