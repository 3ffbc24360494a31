"""Writing output files safely: checked before any compute, atomic when whole, clean errors.

Two kinds of output:

* whole files (``.npz``, diagrams) are written to a temporary file beside the target and renamed
  over it only when complete (:func:`write_atomic`): an error or Ctrl-C leaves no partial file and
  the old file untouched;
* streams (``--jsonl``, ``--log-file``) are written line by line and flushed
  (:func:`open_stream`), so every line already written is complete.

Every ``OSError`` (disk full, permissions, a vanished directory) becomes one
:class:`~llamatrace.errors.OutputError` line naming the option and the path.
"""

from __future__ import annotations

import contextlib
import os
import stat
import tempfile
from pathlib import Path
from typing import BinaryIO, Callable

from llamatrace.errors import OutputError


def _where(option: str, path: Path) -> str:
    return f"{option} {str(path)!r}"


def check_writable_dir(directory: Path, shown: str) -> None:
    """Create and delete a temporary file in ``directory``: the one sure test that files can be
    made there (``os.access`` says yes to root in ``/sys`` or on a read-only bind mount, and
    knows nothing of ACLs or network file systems). Leaves nothing behind.

    Args:
        shown: how the error names the output, e.g. ``"-o 'flow.svg'"``.

    Raises:
        OutputError: no file can be created in ``directory``.
    """
    try:
        fd, probe = tempfile.mkstemp(prefix=".llamatrace-probe.", dir=directory)
    except OSError as exc:
        raise OutputError(f"{shown}: the directory {str(directory)!r} is not writable ({exc.strerror or exc}); "
                          f"choose another") from None
    os.close(fd)
    os.unlink(probe)


def check_output_path(path: Path, option: str, *, whole_file: bool = True) -> None:
    """Fail early, before any model is loaded, if ``path`` cannot be written. Leaves nothing
    behind (a probe file is created and deleted in its directory, :func:`check_writable_dir`).

    Args:
        whole_file: the output is renamed into place (:func:`write_atomic`), so an existing
            target must be a regular file — never a device such as ``/dev/null``.

    Raises:
        OutputError: ``path`` is a directory or not a regular file, its parent is missing or not a
            directory, or either is not writable.
    """
    path = Path(path)
    shown = _where(option, path)
    if path.is_dir():
        raise OutputError(f"{shown} is a directory: give a file name")
    parent = path.parent if str(path.parent) else Path(".")
    if not parent.exists():
        raise OutputError(f"{shown}: the directory {str(parent)!r} does not exist; create it first")
    if not parent.is_dir():
        raise OutputError(f"{shown}: {str(parent)!r} is not a directory")
    if path.exists():
        if whole_file and not stat.S_ISREG(path.stat().st_mode):
            raise OutputError(f"{shown} is not a regular file; give a file name")
        if not os.access(path, os.W_OK):
            raise OutputError(f"{shown}: the file is not writable")
    if whole_file or not path.exists():        # a stream into an existing file (/dev/null) makes none
        check_writable_dir(parent, shown)


def write_atomic(path: Path, write: Callable[[BinaryIO], None], option: str) -> None:
    """Call ``write(file)`` on a temporary file beside ``path``, then rename it over ``path``.

    Raises:
        OutputError: the file cannot be written (disk full, permissions, not a regular file).
    """
    path = Path(path)
    check_output_path(path, option)
    parent = path.parent if str(path.parent) else Path(".")
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=parent)
    except OSError as exc:
        raise OutputError(f"{_where(option, path)}: cannot write it ({exc.strerror or exc})") from None
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)            # mkstemp makes 0600; give the usual file mode
        os.replace(tmp, path)
    except BaseException as exc:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        if isinstance(exc, OSError):
            raise OutputError(f"{_where(option, path)}: cannot write it ({exc.strerror or exc}); "
                              f"free some space or choose another path") from None
        raise


class OutputStream:
    """A text file written line by line; each ``write_line`` is flushed at once.

    Raises:
        OutputError: on any write error (e.g. disk full), naming the option and the path.
    """

    def __init__(self, path: Path, option: str) -> None:
        self.path, self.option = Path(path), option
        try:
            self._file = open(self.path, "w", encoding="utf-8", newline="\n")
        except OSError as exc:
            raise OutputError(f"{_where(option, self.path)}: cannot write it ({exc.strerror or exc})") from None

    def write_line(self, line: str) -> None:
        try:
            self._file.write(line + "\n")
            self._file.flush()
        except OSError as exc:
            raise OutputError(f"{_where(self.option, self.path)}: write failed ({exc.strerror or exc}); "
                              f"the lines written so far are complete") from None

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._file.close()

    def __enter__(self) -> "OutputStream":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def open_stream(path: Path, option: str) -> OutputStream:
    """Open ``path`` for line-by-line output (``--jsonl``, ``--log-file``)."""
    return OutputStream(path, option)
