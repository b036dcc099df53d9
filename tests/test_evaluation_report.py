"""Results table: the paper's 5-task mean, every task's acc/acc_norm, CSV/markdown round trips."""

import csv
import io

import pytest

from trsp_ray.evaluation import report

TASKS = {
    "piqa": {"acc": 0.60, "acc_norm": 0.62, "n": 10},
    "winogrande": {"acc": 0.50, "n": 10},  # stock WinoGrande defines acc only
    "hellaswag": {"acc": 0.30, "acc_norm": 0.35, "n": 10},
    "arc_easy": {"acc": 0.40, "acc_norm": 0.38, "n": 10},
    "arc_challenge": {"acc": 0.20, "acc_norm": 0.25, "n": 10},
    "boolq": {"acc": 0.70, "n": 10},
}
OK = {"name": "trsp-25", "model": "/x/trsp-25", "status": "ok", "layers": 22, "ppl": 38.41, "tasks": TASKS,
      "speed": {"prefill_speedup": 1.33, "ideal_speedup": 30 / 22, "throughput_speedup": 1.3,
                "prefill_ms": 10.0, "tokens_per_s": 50.0}, "seconds": 3.0}
BAD = {"name": "broken", "model": "/x/broken", "status": "failed", "attempts": 2, "tasks": {}, "ppl": None,
       "speed": None, "error": "candidate '/x/broken' does not load: OSError: bad | file"}


def test_paper_mean_uses_the_five_tasks_and_falls_back_to_acc():
    assert report.paper_mean(TASKS) == pytest.approx((0.6 + 0.5 + 0.3 + 0.4 + 0.2) / 5)
    assert report.paper_mean(TASKS, "acc_norm") == pytest.approx((0.62 + 0.5 + 0.35 + 0.38 + 0.25) / 5)
    assert report.paper_mean({"piqa": TASKS["piqa"]}) is None  # incomplete: no mean rather than a wrong one


def test_flat_metrics_names_every_number():
    m = report.flat_metrics(OK)
    assert m["ppl"] == 38.41 and m["piqa.acc_norm"] == 0.62 and "winogrande.acc_norm" not in m
    assert m["mean5.acc"] == pytest.approx(0.4) and m["speed.prefill_speedup"] == 1.33
    assert report.flat_metrics(BAD) == {}


def test_csv_and_markdown_hold_every_task_and_the_failure():
    text = report.to_csv([OK, BAD])
    rows = list(csv.DictReader(io.StringIO(text)))
    assert [r["candidate"] for r in rows] == ["trsp-25", "broken"]
    assert float(rows[0]["mean5_acc"]) == pytest.approx(0.4)
    assert float(rows[0]["boolq.acc"]) == 0.7 and rows[0]["boolq.acc_norm"] == ""
    assert (float(rows[0]["prefill_speedup"]) == 1.33
            and float(rows[0]["ideal_speedup"]) == pytest.approx(1.3636, abs=1e-4))
    assert rows[1]["status"] == "failed" and "does not load" in rows[1]["error"] and rows[1]["ppl"] == ""
    md = report.to_markdown([OK, BAD], footer="PPL on held-out text")
    header = md.splitlines()[0]
    for col in ("mean5_acc", "piqa.acc", "piqa.acc_norm", "arc_challenge.acc_norm", "ppl", "prefill_speedup"):
        assert f" {col} " in header
    assert "bad \\| file" in md and md.rstrip().endswith("PPL on held-out text")
    table = report.format_table([OK, BAD])
    assert "38.41" in table and "0.4000" in table


def test_write_reports_and_summary_lines(tmp_path):
    paths = report.write_reports([OK, BAD], tmp_path / "out", footer="f")
    assert all(p.is_file() for p in paths.values())
    assert "trsp-25: ok, 22 layers, PPL 38.41, 5-task mean acc 0.4000, prefill x1.33 (ideal x1.36)" in \
        report.summary_line(OK)
    assert report.summary_line(BAD).startswith("broken: FAILED after 2 attempt(s): candidate")
