"""trsp_ray.common.atomic: a failed write leaves the old file or directory as it was and no temp behind;
a finished one replaces it."""

import json
import os
import threading

import pytest
import torch

from trsp_ray.common import atomic


def _names(directory):
    return sorted(p.name for p in directory.iterdir())


def test_file_writers_replace_and_leave_nothing_else(tmp_path):
    atomic.write_text(tmp_path / "a.txt", "old")
    atomic.write_text(tmp_path / "a.txt", "new ü")
    atomic.write_bytes(tmp_path / "b.bin", b"\x00\x01")
    atomic.write_json(tmp_path / "sub" / "c.json", {"x": 1.5, "p": tmp_path})
    atomic.save_torch(tmp_path / "d.pt", {"w": torch.arange(4)})
    assert (tmp_path / "a.txt").read_text(encoding="utf-8") == "new ü"
    assert (tmp_path / "b.bin").read_bytes() == b"\x00\x01"
    text = (tmp_path / "sub" / "c.json").read_text()
    assert json.loads(text) == {"x": 1.5, "p": str(tmp_path)}
    assert text == json.dumps({"x": 1.5, "p": str(tmp_path)}, indent=2)  # the format every JSON record has had
    assert torch.equal(torch.load(tmp_path / "d.pt")["w"], torch.arange(4))
    assert _names(tmp_path) == ["a.txt", "b.bin", "d.pt", "sub"]
    umask = os.umask(0)
    os.umask(umask)
    assert (tmp_path / "a.txt").stat().st_mode & 0o777 == 0o666 & ~umask  # as open() would, not mkstemp's 0o600
    assert _names(tmp_path / "sub") == ["c.json"]


def test_failed_file_write_keeps_old_file_and_no_temp(tmp_path):
    target = tmp_path / "a.json"
    atomic.write_json(target, {"v": 1})
    with pytest.raises(RuntimeError, match="no str"):
        atomic.write_json(target, {"v": 2, "bad": _NoStr()})  # fails after "{"v": 2, " is written
    assert json.loads(target.read_text()) == {"v": 1}
    assert _names(tmp_path) == ["a.json"]


class _NoStr:
    def __str__(self):
        raise RuntimeError("no str")


def test_exception_inside_open_file_keeps_old_file(tmp_path):
    target = tmp_path / "log.jsonl"
    atomic.write_text(target, "old\n")
    with pytest.raises(RuntimeError, match="boom"):
        with atomic.open_file(target, "w") as fh:
            fh.write("half of a new fi")
            raise RuntimeError("boom")
    assert target.read_text() == "old\n"
    assert _names(tmp_path) == ["log.jsonl"]
    with pytest.raises(RuntimeError):
        atomic.save_torch(tmp_path / "x.pt", _Unpicklable())
    assert _names(tmp_path) == ["log.jsonl"]


class _Unpicklable:
    def __reduce__(self):
        raise RuntimeError("cannot pickle")


def test_directory_replaces_target_on_success(tmp_path):
    target = tmp_path / "model"
    with atomic.directory(target) as tmp:
        (tmp / "config.json").write_text("1")
        assert not target.exists()  # nothing under the final name until the block ends
    with atomic.directory(target) as tmp:
        (tmp / "weights.bin").write_text("2")
    assert _names(target) == ["weights.bin"]  # the old directory was swapped out whole
    assert _names(tmp_path) == ["model"]


def test_failed_directory_keeps_old_target_and_no_temp(tmp_path):
    target = tmp_path / "model"
    with atomic.directory(target) as tmp:
        (tmp / "config.json").write_text("old")
    with pytest.raises(RuntimeError, match="reload failed"):
        with atomic.directory(target) as tmp:
            (tmp / "config.json").write_text("new")
            raise RuntimeError("reload failed")
    assert (target / "config.json").read_text() == "old"
    assert _names(tmp_path) == ["model"]


def test_directory_without_replace_refuses_a_finished_target(tmp_path):
    target = tmp_path / "model"
    with atomic.directory(target, replace=False) as tmp:
        (tmp / "config.json").write_text("first")
    with pytest.raises(OSError):
        with atomic.directory(target, replace=False) as tmp:
            (tmp / "config.json").write_text("second")
    assert (target / "config.json").read_text() == "first"
    assert _names(tmp_path) == ["model"]


def test_concurrent_identical_writes(tmp_path):
    target = tmp_path / "rows.jsonl"
    text = "".join(f'{{"i": {i}}}\n' for i in range(2000))
    errors = []

    def write():
        try:
            for _ in range(20):
                atomic.write_text(target, text)
        except Exception as exc:  # pragma: no cover - what the test is for
            errors.append(exc)

    threads = [threading.Thread(target=write) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert target.read_text() == text
    assert _names(tmp_path) == ["rows.jsonl"]
