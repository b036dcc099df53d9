"""benchmarks/same_table.py: two benchmark outputs are the same table when every result digit agrees;
the wall-time column and the progress log may differ, anything else is reported."""

import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "same_table.py"

TABLE = """[trsp_ray 07:04:40] [1/2] selection shortgpt seed 0 done
\x1b[36m(_row_task pid=17463)\x1b[0m [trsp_ray 07:07:51] row shortgpt+heal x1 (seed 0): PPL wiki 36.72
dense model
row    kept %  geo-mean x dense  wiki PPL  wall s
-----  ------  ----------------  --------  --------
dense  100.00  1.000             16.56     {wall}

the default `trsp-ray prune` against every row of its group:
against        geo-mean x dense
-------------  -----------------------------
shortgpt+heal  better (no spread) -13.1±2.0%
"""


def _run(tmp_path, before: str, after: str) -> subprocess.CompletedProcess:
    (tmp_path / "a.txt").write_text(before)
    (tmp_path / "b.txt").write_text(after)
    return subprocess.run([sys.executable, str(SCRIPT), str(tmp_path / "a.txt"), str(tmp_path / "b.txt")],
                          capture_output=True, text=True)


def test_the_same_results_with_other_wall_times_and_logs_are_the_same_table(tmp_path):
    other_log = TABLE.replace("07:04:40", "07:30:02").replace("pid=17463", "pid=9")
    done = _run(tmp_path, TABLE.format(wall="5.88e-03"), other_log.format(wall="1234.56"))
    assert done.returncode == 0 and done.stdout.strip() == "same table (wall s aside)"


def test_one_digit_of_a_result_or_a_verdict_differs(tmp_path):
    before = TABLE.format(wall="5.88")
    done = _run(tmp_path, before, before.replace("16.56", "16.57"))
    assert done.returncode == 1 and "- dense  100.00  1.000             16.56" in done.stdout
    assert "16.57" in done.stdout and "1 result lines differ" in done.stdout
    done = _run(tmp_path, before, before.replace("-13.1±2.0%", "-13.2±2.0%"))
    assert done.returncode == 1 and "-13.2±2.0%" in done.stdout
    assert _run(tmp_path, "no table here\n", before).returncode == 2


def test_a_wall_s_column_printed_wider_is_still_the_same_table(tmp_path):
    """A longer timing widens the wall s header and its rule (1,010.75 against 489.00), nothing else."""
    wide = TABLE.replace("  wall s\n", "    wall s\n").replace("  --------\ndense", "  ----------\ndense")
    assert wide != TABLE
    done = _run(tmp_path, TABLE.format(wall="5.88"), wide.format(wall="1,010.75"))
    assert done.returncode == 0 and done.stdout.strip() == "same table (wall s aside)", done.stdout
    narrower_result = wide.replace("100.00  1.000", "100.00  1.001")
    assert _run(tmp_path, TABLE.format(wall="5.88"), narrower_result.format(wall="1,010.75")).returncode == 1
