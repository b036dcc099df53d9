"""Safetensors shards written one tensor at a time, as a streaming export gathers them.

Every tensor's name, shape and dtype is known before any weight is gathered (ZeRO-3 keeps each
parameter's full shape), so each shard's header can be written first and the tensors appended in
the planned order: rank 0 never holds a shard, only the tensor being written. The files are the
standard format (8-byte little-endian header length, JSON header, contiguous data), read back by
`safetensors.safe_open` in `verify_shards`, the only reader the format needs to satisfy.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from dataclasses import dataclass
from pathlib import Path

import torch

INDEX = "model.safetensors.index.json"
_DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
           torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
           torch.bool: "BOOL"}


@dataclass(frozen=True)
class TensorSpec:
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


@dataclass(frozen=True)
class Shard:
    file: str
    tensors: tuple[TensorSpec, ...]

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)


def plan_shards(specs: list[TensorSpec], *, max_shard_bytes: int) -> list[Shard]:
    """Consecutive runs of `specs` (write order kept) of at most `max_shard_bytes` each; a tensor
    larger than that gets a shard of its own, as transformers' save_pretrained does. One shard is
    `model.safetensors`, several are `model-0000i-of-0000n.safetensors` plus an index."""
    groups: list[list[TensorSpec]] = []
    size = 0
    for spec in specs:
        if spec.dtype not in _DTYPES:
            raise ValueError(f"tensor {spec.name} has dtype {spec.dtype}, which safetensors export does not handle")
        if not groups or size + spec.nbytes > max_shard_bytes:
            groups.append([])
            size = 0
        groups[-1].append(spec)
        size += spec.nbytes
    n = len(groups)
    names = ["model.safetensors"] if n == 1 else [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
    return [Shard(name, tuple(group)) for name, group in zip(names, groups)]


def header(shard: Shard) -> bytes:
    """The shard's header bytes: length prefix + JSON, padded with spaces to 8-byte alignment so
    that tensors of one dtype stay aligned to their element size."""
    entries, offset = {}, 0
    for t in shard.tensors:
        entries[t.name] = {"dtype": _DTYPES[t.dtype], "shape": list(t.shape),
                           "data_offsets": [offset, offset + t.nbytes]}
        offset += t.nbytes
    text = json.dumps({"__metadata__": {"format": "pt"}, **entries}, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return len(text).to_bytes(8, "little") + text


def raw_bytes(tensor: torch.Tensor):
    """A zero-copy byte view of a contiguous CPU tensor (what is hashed and written)."""
    flat = tensor.detach().contiguous().reshape(-1)
    return flat.view(torch.uint8).numpy() if flat.numel() else b""


def digest(tensor: torch.Tensor) -> str:
    return hashlib.sha256(raw_bytes(tensor)).hexdigest()


class ShardWriter:
    """Appends tensors to the planned shards in plan order; each shard is fsynced and closed as its
    last tensor lands, so host memory holds one tensor (plus the OS page cache), never a shard."""

    def __init__(self, directory: Path, shards: list[Shard]):
        self.directory, self.shards = Path(directory), shards
        self._order = [(k, spec) for k, shard in enumerate(shards) for spec in shard.tensors]
        self._next = 0
        self._file = None
        self.digests: dict[str, str] = {}

    def write(self, name: str, tensor: torch.Tensor) -> None:
        """Write `tensor` as `name` (must be the next planned tensor, same shape and dtype)."""
        if self._next >= len(self._order):
            raise RuntimeError(f"tensor {name} was not planned (all {len(self._order)} are written)")
        k, spec = self._order[self._next]
        if (name, tuple(tensor.shape), tensor.dtype) != (spec.name, spec.shape, spec.dtype):
            raise RuntimeError(f"export stream out of plan: got {name} {tuple(tensor.shape)} {tensor.dtype}, "
                               f"expected {spec.name} {spec.shape} {spec.dtype}")
        if self._file is None:
            self._file = open(self.directory / self.shards[k].file, "wb")
            self._file.write(header(self.shards[k]))
        data = raw_bytes(tensor.detach().to("cpu"))
        self.digests[name] = hashlib.sha256(data).hexdigest()
        self._file.write(data)
        self._next += 1
        if self._next == len(self._order) or self._order[self._next][0] != k:
            self._close_file()

    def _close_file(self) -> None:
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()
        self._file = None

    def close(self) -> None:
        """Finish: every planned tensor must have been written; writes the index if sharded."""
        if self._file is not None:
            self._file.close()
            self._file = None
        if self._next != len(self._order):
            raise RuntimeError(f"export stream ended after {self._next} of {len(self._order)} planned tensors")
        if len(self.shards) > 1:
            index = {"metadata": {"total_size": sum(s.nbytes for s in self.shards)},
                     "weight_map": {t.name: s.file for s in self.shards for t in s.tensors}}
            (self.directory / INDEX).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")

    def abort(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def verify_shards(directory: Path, shards: list[Shard], digests: dict[str, str]) -> int:
    """Re-read every written tensor lazily (safe_open, one tensor in memory at a time) and compare
    its sha256 with the digest taken when it was gathered; returns the number of tensors checked.
    Raises RuntimeError naming the first tensors that differ, are missing or are unexpected."""
    from safetensors import safe_open

    bad, checked = [], 0
    for shard in shards:
        planned = {t.name: t for t in shard.tensors}
        with safe_open(str(Path(directory) / shard.file), framework="pt") as fh:
            names = set(fh.keys())
            bad += [f"{n} missing from {shard.file}" for n in sorted(set(planned) - names)]
            bad += [f"{n} unexpected in {shard.file}" for n in sorted(names - set(planned))]
            for name in sorted(names & set(planned)):
                tensor = fh.get_tensor(name)
                spec = planned[name]
                if (tuple(tensor.shape), tensor.dtype) != (spec.shape, spec.dtype):
                    bad.append(f"{name} in {shard.file} reads back as {tuple(tensor.shape)} {tensor.dtype}")
                elif digest(tensor) != digests.get(name):
                    bad.append(f"{name} in {shard.file}: sha256 of the file differs from what was gathered")
                checked += 1
                del tensor
    if bad:
        raise RuntimeError(f"export checksum check failed ({len(bad)} problems): {'; '.join(bad[:5])}")
    return checked
