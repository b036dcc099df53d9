"""The one exit of every command and job: `trsp-ray` (cli.entry), `jobs/*.py` and
`python -m trsp_ray.reproduce.cli` end with `exit_after(main)`; a process whose main is not ours (the
test run: pytest's) registers `skip_teardown_at_exit` instead.

A finished run must end with its status and nothing else. The interpreter's own exit tears torch's,
transformers' and Ray's modules down one object at a time: 3-4 s of a 2-core machine on every
command, and once a segfault after a finished run, which turned a finished `ray job submit` into
FAILED. So this does what CPython's Py_FinalizeEx does before that teardown, in its order, and then
leaves with `os._exit`:

1. `threading._shutdown()`: first the threading atexit hooks, among them concurrent.futures'
   `_python_exit`, which wakes the idle workers of every ThreadPoolExecutor (MLflow's artifact
   repositories own one; joining those threads without the wake-up waits forever), then every
   non-daemon thread is joined;
2. the atexit handlers (MLflow's run end, Ray's shutdown, logging's flush);
3. stdout and stderr flushed, then `os._exit(status)`.
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
from collections.abc import Callable
from typing import NoReturn


def exit_after(main: Callable[[], int | None]) -> NoReturn:
    """Run `main` and end the process with its status (None = 0) without the interpreter's teardown.
    A SystemExit inside `main` (argparse's --help or a bad flag) gives its code; any other uncaught
    exception is printed as the interpreter would print it and gives 1. Call it from the main thread."""
    code = _status(main)
    # the interpreter's own shutdown of threads; CPython internal since 3.9, the hook that
    # concurrent.futures registers itself with (threading._register_atexit)
    threading._shutdown()
    atexit._run_exitfuncs()
    _flush_and_leave(code)


def skip_teardown_at_exit(status: Callable[[], int | None]) -> None:
    """For a process whose main is not ours (pytest's): leave with `os._exit(status())` once its atexit
    handlers have run, before the interpreter's module teardown. Register it before the libraries are
    imported: atexit runs handlers last-in first-out, so every handler registered after it (Ray's
    shutdown, MLflow's run end) still runs first. A `status()` of None (the run ended before it knew
    its status) leaves the exit to the interpreter."""

    def leave() -> None:
        code = status()
        if code is not None:
            _flush_and_leave(int(code))

    atexit.register(leave)


def _flush_and_leave(code: int) -> NoReturn:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a reader that went away, a stream already closed
            pass
    os._exit(code)


def _status(main: Callable[[], int | None]) -> int:
    try:
        return int(main() or 0)
    except SystemExit as exc:
        if exc.code is None or isinstance(exc.code, int):
            return exc.code or 0
        sys.stderr.write(f"{exc.code}\n")  # sys.exit("message"): the interpreter prints it and exits 1
        return 1
    except BaseException:  # the interpreter's last frame: nothing may escape past os._exit
        sys.excepthook(*sys.exc_info())
        return 1
