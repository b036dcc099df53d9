"""trsp_ray.common.runlog: whole lines from concurrent writers, a torn last line skipped on read."""

import json
import multiprocessing

import pytest

from trsp_ray.common import runlog


def test_append_and_read_round_trip(tmp_path):
    path = tmp_path / "sub" / "events.jsonl"
    assert runlog.read(path) == []
    runlog.append(path, "start", run_id="r1", where=tmp_path, path="p")  # `path`/`event` are free field names
    runlog.append(path, "end", computed=["a"])
    events = runlog.read(path)
    assert [e["event"] for e in events] == ["start", "end"]
    assert events[0]["run_id"] == "r1" and events[0]["where"] == str(tmp_path) and events[0]["path"] == "p"
    assert 0 < events[0]["time"] <= events[1]["time"]
    assert path.read_text().count("\n") == 2


def test_read_skips_a_torn_last_line_only(tmp_path):
    path = tmp_path / "log.jsonl"
    runlog.append(path, "a")
    with open(path, "a") as fh:
        fh.write('{"event": "b", "ti')  # a writer killed mid-line
    assert [e["event"] for e in runlog.read(path)] == ["a"]
    with open(path, "a") as fh:
        fh.write('me": 1}')  # complete JSON without its newline is kept
    assert [e["event"] for e in runlog.read(path)] == ["a", "b"]
    path.write_text('{"event": "a"}\n{broken\n{"event": "c"}\n')
    with pytest.raises(json.JSONDecodeError):  # damage in the middle is not a torn tail: say so
        runlog.read(path)


def _writer(path, worker: int) -> None:
    for i in range(50):
        runlog.append(path, "step", worker=worker, i=i, pad="x" * 20000)  # lines far above PIPE_BUF


def test_concurrent_processes_never_interleave_lines(tmp_path):
    path = tmp_path / "events.jsonl"
    ctx = multiprocessing.get_context("fork")
    procs = [ctx.Process(target=_writer, args=(path, w)) for w in range(4)]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    events = runlog.read(path)
    assert len(events) == 200
    for w in range(4):
        assert [e["i"] for e in events if e["worker"] == w] == list(range(50))
