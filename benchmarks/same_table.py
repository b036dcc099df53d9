"""Whether two runs of `trsp-ray benchmark` printed the same results: every line of the tables and
verdicts compared to the last digit, except each row's `wall s` (a timing) and the progress log.

    trsp-ray benchmark > before.txt   # (same seed, same settings)
    ... change the code ...
    trsp-ray benchmark > after.txt
    python benchmarks/same_table.py before.txt after.txt

Prints the lines that differ (besides wall s) and exits 1 when any does; a refactor that must not
change behaviour (a package move, a rename) should print "same table" and exit 0.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

_LOG = re.compile(r"^(\x1b\[\d+m)?\(\w+ pid=\d+\)|^\[trsp_ray ")  # Ray worker lines and the driver's log


def results(path: Path) -> list[str]:
    """The result lines of a benchmark's stdout, each table row without its last column (wall s)."""
    lines, in_table = [], False
    for line in path.read_text().splitlines():
        if _LOG.match(line):
            continue
        if line.startswith("row ") and line.rstrip().endswith("wall s"):
            in_table = True
            line = line.rstrip()[:-len("wall s")].rstrip()  # its width follows the timings
        elif in_table and not line.strip():
            in_table = False
        elif in_table:
            line = line.rstrip().rsplit(None, 1)[0]  # the last column (and its rule) is wall s
        lines.append(line)
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("before", type=Path)
    parser.add_argument("after", type=Path)
    args = parser.parse_args(argv)
    a, b = results(args.before), results(args.after)
    if not any(line.startswith("row ") for line in a):
        print(f"{args.before}: no benchmark table in it", file=sys.stderr)
        return 2
    differ = [(i, x, y) for i, (x, y) in enumerate(zip(a, b)) if x != y]
    if len(a) != len(b):
        differ.append((min(len(a), len(b)), f"{len(a)} result lines", f"{len(b)} result lines"))
    for i, x, y in differ:
        print(f"line {i + 1}:\n  - {x}\n  + {y}")
    print("same table (wall s aside)" if not differ else f"{len(differ)} result lines differ")
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
