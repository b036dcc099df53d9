"""User-facing errors: one line naming the bad value and what would be valid."""

from __future__ import annotations

import sys
from typing import Callable


class TrspError(ValueError):
    """Bad input or an impossible request. The CLI prints the message on one line and exits 2."""


def run_main(prog: str, body: Callable[[], int | None]) -> int:
    """The outer frame of every entry point (`trsp-ray` and the jobs): a TrspError becomes one
    `<prog>: error: ...` line on stderr and exit 2, the same shape argparse gives a bad flag; Ctrl-C
    becomes exit 130 with a line saying that finished work is intact."""
    try:
        return int(body() or 0)
    except TrspError as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"{prog}: interrupted; finished exports and checkpoints are intact", file=sys.stderr)
        return 130
