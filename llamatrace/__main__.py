"""The ``llamatrace`` command (``[project.scripts]``) and ``python -m llamatrace``.

:func:`main` takes Ctrl-C before anything heavy is imported: the app's imports (typer, rich,
NumPy, Numba) take seconds on a busy machine, and an interrupt there must end as one at any
later moment does, with ``interrupted`` and exit code 130, no traceback.
"""

import os
import signal
import sys

EXIT_BAD_INPUT, EXIT_INTERRUPTED = 2, 130       # as llamatrace.cli.app's, which is not imported yet


def _fail(line: str) -> int:
    sys.stderr.write(f"error: {line}\n")
    return EXIT_BAD_INPUT


def _open_standard_streams() -> None:
    # `llamatrace … 2>&-` (or >&-): /dev/null in the closed stream's place, before the first file
    # opened takes its number and gets the stream's text, and writes fail with EBADF
    for fd, name in ((0, "stdin"), (1, "stdout"), (2, "stderr")):
        try:
            os.fstat(fd)
            continue
        except OSError:
            pass
        null = os.open(os.devnull, os.O_RDONLY if fd == 0 else os.O_WRONLY)
        if null != fd:
            os.dup2(null, fd)
            os.close(null)
        if getattr(sys, name) is None:
            setattr(sys, name, open(fd, "r" if fd == 0 else "w", encoding="utf-8", closefd=False))


def main() -> int:
    """Run ``llamatrace`` with ``sys.argv``; returns the exit code (see :mod:`llamatrace.cli.app`)."""
    _open_standard_streams()
    package = sys.modules.get(__package__ or "llamatrace")
    if getattr(package, "__file__", None) is None:
        # `llamatrace` resolved to a folder without __init__.py (a namespace package), such as a
        # clone of the repository in the current folder, and this file came from elsewhere
        where = next(iter(getattr(package, "__path__", [])), "llamatrace")
        return _fail(f"`python -m llamatrace` found the folder {where!r} (a llamatrace checkout?) before the "
                     f"installed package; run it from another folder, or use the `llamatrace` command")
    from llamatrace.errors import LlamatraceError
    from llamatrace.machine import runtime
    runtime.catch_interrupts()
    try:
        runtime.numba_threads()                 # Numba reads it at import, and fails with a traceback
        try:
            from llamatrace.cli import main as run_app
        except ModuleNotFoundError as exc:
            if (exc.name or "").startswith("llamatrace"):
                raise
            return _fail(f"llamatrace's dependency {exc.name!r} is not installed in this Python ({sys.executable}); "
                         f"install llamatrace with its dependencies: `pip install -e .` in the checkout, or "
                         f"`bash scripts/setup.sh`")
        return run_app()
    except LlamatraceError as exc:
        return _fail(str(exc))
    except KeyboardInterrupt:                   # before the app took over, or after it gave back
        sys.stderr.write("interrupted\n")
        return EXIT_INTERRUPTED
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)     # the process only ends now: nothing left to stop


if __name__ == "__main__":
    sys.exit(main())
