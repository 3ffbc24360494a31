"""Busy loops: a reproducible "the machine is busy" for timing runs (``bench --background-load N``).

Each loop is a Python process that spins on one core until it is stopped. It ignores Ctrl-C
(the terminal sends it to the whole process group; the loops are stopped by their parent, which
sees the same Ctrl-C), and it exits by itself within ~10 ms of its parent's death, so even a
killed parent leaves no orphan spinning.

    python -m llamatrace.analysis.busy 2      # two busy loops until Ctrl-C
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from typing import Iterator

# spins in chunks of ~10 ms, checking between them that its parent still lives
_LOOP = """
import os, signal, sys
signal.signal(signal.SIGINT, signal.SIG_IGN)
parent = int(sys.argv[1])
sys.stdout.write("ready\\n")
sys.stdout.flush()
while os.getppid() == parent:
    for _ in range(200_000):
        pass
"""


@contextlib.contextmanager
def busy_loops(n: int) -> Iterator[list[subprocess.Popen]]:
    """Run ``n`` busy-loop processes for the duration of the ``with`` block; each is running
    (it has said so) when the block starts, and stopped and reaped when it ends, however it ends
    (an exception, Ctrl-C). ``n`` = 0 starts none.

    Raises:
        ValueError: ``n`` < 0.
    """
    if n < 0:
        raise ValueError(f"the number of busy loops must be 0 or more, got {n}")
    procs: list[subprocess.Popen] = []
    try:
        for _ in range(n):
            procs.append(subprocess.Popen([sys.executable, "-c", _LOOP, str(os.getpid())],
                                          stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                          stderr=subprocess.DEVNULL))
        for p in procs:
            p.stdout.readline()          # started: its loop is about to spin
        yield procs
    finally:
        for p in procs:
            p.kill()
        for p in procs:
            p.wait()
            p.stdout.close()


def main(argv: list[str] | None = None) -> int:
    """``python -m llamatrace.analysis.busy N``: ``N`` busy loops until Ctrl-C or SIGTERM."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1 or not args[0].isdecimal():
        sys.stderr.write("usage: python -m llamatrace.analysis.busy N   (N busy-loop processes until Ctrl-C)\n")
        return 2
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    with busy_loops(int(args[0])):
        try:
            signal.pause()
        except KeyboardInterrupt:
            pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
