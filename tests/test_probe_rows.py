"""benchmarks/recovery_probe.py's row cache: its key leaves the product's code out (every commit would heal
every row again), so each row records the sources it ran and a row read back under other sources says so."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))


def _row(code=None):
    return {"set": "shortgpt", "budget": 1e6, "objective": "ce", "drop": [3, 4], "acc": 0.2, "items": [1, 0, 0, 1, 0],
            "ppl": {"wiki": 20.0}, "steps": 10, "cost": 1e6, "seconds": 5.0, "load": 1.0,
            **({"code": code} if code is not None else {})}


def test_a_row_read_back_under_other_sources_says_which_commit_computed_it(capsys):
    import recovery_probe as probe

    now = probe.code_version()
    assert len(now["sources"]) == 16
    dense = _row({**now})
    for code, note in ((now, None), ({"sources": "0" * 16, "commit": "abc1234", "changed": False}, "commit abc1234"),
                       (None, "before rows recorded their sources")):
        probe._print(_row(code), dense, cached=True)
        line = capsys.readouterr().out
        assert "[read back" in line and ("computed" in line) == (note is not None), line
        if note:
            assert note in line and "--fresh shortgpt" in line, line
    probe._print(_row({"sources": "0" * 16, "commit": "abc1234"}), dense, cached=False)  # just computed: no note
    assert "computed by" not in capsys.readouterr().out
