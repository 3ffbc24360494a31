"""Writing output files safely: checked before any compute, atomic when whole, clean errors.

Two kinds of output:

* whole files (``.npz``, diagrams, ``collect``'s shards and manifest) are written to a temporary
  file beside the target (``.NAME.PID.XXXXXXXX.tmp``, :func:`is_temp_name`; a killed run's are
  removed by the next, :func:`remove_stale_temp_files`), flushed to the disk and
  renamed over it only when complete, then the directory entry is flushed too
  (:func:`replace_durably`, :func:`write_atomic`): an error, Ctrl-C or a power loss leaves no
  partial file and the old file untouched;
* streams (``--jsonl``, ``--log-file``) are written line by line and flushed to such a
  temporary file, renamed when the command commits them (:func:`open_stream`): an interrupted
  run leaves the old file; a device or pipe (``/dev/stderr``, a FIFO) is written in place.

No output is a file the command reads: the CLI notes its inputs (:func:`reading`: the model,
the texts, a base), and a path that is one of them, by name or by link, is refused before anything
is written over it (a trace's ``--jsonl`` on the model it maps once truncated it, and the process
died of SIGBUS).

Every ``OSError`` (disk full, permissions, a vanished directory) becomes one
:class:`~llamatrace.errors.OutputError` line naming the option and the path.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import stat
import tempfile
from pathlib import Path
from typing import BinaryIO, Callable

from llamatrace.errors import OptionError, OutputError
from llamatrace.machine.runtime import check_interrupt


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


_INPUTS: list[tuple[Path, str]] = []
"""The files the running command reads (:func:`reading`), which none of its outputs may be."""


def reading(path: Path | None, what: str) -> Path | None:
    """Note that the running command reads the file ``path`` (``what``: how an error names it, e.g.
    ``"the model this run reads (-m)"``), so that no output of the command is written over it
    (:func:`check_output_path`, :func:`open_stream`). A path that is no file (a known model's name,
    ``-`` for stdin, None) is passed over. Returns ``path``: a typer option's ``callback``."""
    if path is not None and Path(path).is_file():
        _INPUTS.append((Path(path), what))
    return path


def forget_inputs() -> None:
    """Start a command: no file noted by :func:`reading` yet (in-process runs one after another)."""
    _INPUTS.clear()


def _refuse_input(path: Path, shown: str) -> None:
    # by the file itself, not its name: a symlink or a hard link to the model is the model
    for read, what in _INPUTS:
        with contextlib.suppress(OSError):
            if os.path.samefile(path, read):
                raise OutputError(f"{shown} is {what}: writing it would replace it; give another output file")


def check_output_path(path: Path, option: str, *, whole_file: bool = True) -> None:
    """Fail early, before any model is loaded, if ``path`` cannot be written. Leaves nothing
    behind (a probe file is created and deleted in its directory, :func:`check_writable_dir`).

    Args:
        whole_file: the output is renamed into place (:func:`write_atomic`), so an existing
            target must be a regular file — never a device such as ``/dev/null``, where a stream
            (``False``, :class:`OutputStream`) may go.

    Raises:
        OutputError: ``path`` is ``-`` (stdout is not a file here), a directory or not a regular
            file, its parent is missing or not a directory, either is not writable, or it is a file
            the command reads (:func:`reading`).
    """
    path = Path(path)
    shown = _where(option, path)
    if str(path) == "-":         # '-' is stdin for -f; as an output it would be a file named '-'
        raise OutputError(f"{shown}: this output is a file, not stdout; give a file name")
    _refuse_input(path, shown)
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
    # every output but a stream into a device (/dev/null) is a temporary file in parent, renamed
    if not path.exists() or stat.S_ISREG(path.stat().st_mode):
        check_writable_dir(parent, shown)


def output_suffix(path: Path, option: str, formats, kind: str, example: str) -> str:
    """The format an output file's extension names (lowercase, no dot), one of ``formats``: the
    same words for every command that writes a picture or diagram (``kind``: "an image", "a diagram").

    Raises:
        OptionError: ``-`` (standard output), a directory (``example`` is a file name to give in it),
            no extension or another one (the message lists ``formats``).
    """
    listed = ", ".join("." + f for f in formats)
    if str(path) == "-":
        raise OptionError(f"{option} -: {kind} is written to a file, not to standard output; give a file name "
                          f"ending in one of {listed} (e.g. {option} {example})")
    if path.is_dir():
        raise OptionError(f"{option} {str(path)!r} is a directory: give a file name in it, "
                          f"e.g. {option} {str(path / example)!r}")
    ext = path.suffix.lower().lstrip(".")
    if not ext:
        raise OptionError(f"{option} {str(path)!r} has no extension: end the name in one of {listed} "
                          f"(it picks the format)")
    if ext not in formats:
        raise OptionError(f"{option} {str(path)!r}: '.{ext}' is not {kind} format here; use one of {listed}")
    return ext


def is_temp_name(name: str) -> bool:
    """Whether ``name`` is one of our temporary files (``.NAME.PID.XXXXXXXX.tmp``): one a killed run
    can leave behind, which a later run may delete."""
    return name.startswith(".") and name.endswith(".tmp")


# .NAME.PID.XXXXXXXX.tmp: mkstemp's 8 characters (tempfile._RandomNameSequence) after the writer's pid
_TEMP_NAME = re.compile(r"^\..+\.(?P<pid>[0-9]+)\.[a-z0-9_]{8}\.tmp$")


def _pid_alive(pid: int) -> bool:
    """Whether process ``pid`` exists on this machine (another user's counts: signal 0 is refused, not missing)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError):
        return True
    return True


def remove_stale_temp_files(directory: Path) -> list[tuple[str, int]]:
    """Delete the temporary files :func:`replace_durably` left in ``directory`` when its process
    was killed (SIGKILL, power loss: no ``finally`` ran): names ``.NAME.PID.XXXXXXXX.tmp`` whose
    PID no longer runs. A file of a live process (another run writing now) is left alone, as is
    anything else; a file that cannot be deleted is skipped.

    Returns:
        ``(name, bytes)`` of each file deleted.
    """
    removed = []
    try:
        entries = list(os.scandir(directory))
    except OSError:
        return removed
    for entry in entries:
        m = _TEMP_NAME.match(entry.name)
        if m is None or int(m["pid"]) == os.getpid() or _pid_alive(int(m["pid"])):
            continue
        try:
            if not entry.is_file(follow_symlinks=False):
                continue
            size = entry.stat(follow_symlinks=False).st_size
            os.unlink(entry.path)
        except OSError:
            continue
        removed.append((entry.name, size))
    return removed


def replace_durably(path: Path, write: Callable[[BinaryIO], None]) -> None:
    """Call ``write(file)`` on a temporary file beside ``path``, ``fsync`` it, rename it over
    ``path`` and ``fsync`` the directory, so that after a crash or power loss ``path`` is either
    the old file or the whole new one. The file gets the usual mode (``0o666`` less the umask).

    Raises:
        OSError: from any step (disk full, permissions); the temporary file is removed first,
            as it is on any other exception (Ctrl-C).
        KeyboardInterrupt: a Ctrl-C came while writing (:func:`~llamatrace.machine.runtime.check_interrupt`),
            even one lost in a finalizer: ``path`` is left as it was.
    """
    path = Path(path)
    parent = path.parent if str(path.parent) else Path(".")
    # the pid in the name tells a later run whether the writer still lives (remove_stale_temp_files)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.{os.getpid()}.", suffix=".tmp", dir=parent)
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())      # the data on disk before the name points at it
        _give_name(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    _fsync_dir(parent)


def _give_name(tmp: str, path: Path) -> None:
    """Rename the finished temporary file ``tmp`` over ``path``, with the usual mode (``0o666`` less
    the umask; mkstemp makes 0600), unless a Ctrl-C came while writing: then KeyboardInterrupt."""
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o666 & ~umask)
    check_interrupt()     # a Ctrl-C lost in a finalizer while writing: the old file stays
    os.replace(tmp, path)


def _fsync_dir(directory: Path) -> None:
    """Make a rename in ``directory`` durable (POSIX; file systems that cannot sync a directory
    say EINVAL, and have nothing to flush; a directory we may write but not read cannot be opened:
    the rename stands, unsynced)."""
    if os.name == "nt":
        return
    try:
        fd = os.open(directory, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except PermissionError:
        return
    try:
        os.fsync(fd)
    except OSError as exc:
        if exc.errno not in (errno.EINVAL, errno.ENOTSUP):
            raise
    finally:
        os.close(fd)


def write_atomic(path: Path, write: Callable[[BinaryIO], None], option: str) -> None:
    """Write ``path`` with :func:`replace_durably` (``write(file)`` on a temporary file beside it),
    after :func:`check_output_path`.

    Raises:
        OutputError: the file cannot be written (disk full, permissions, not a regular file),
            naming ``option`` and the path; no temporary file is left.
    """
    path = Path(path)
    check_output_path(path, option)
    try:
        replace_durably(path, write)
    except OSError as exc:
        raise OutputError(f"{_where(option, path)}: cannot write it ({exc.strerror or exc}); "
                          f"free some space or choose another path") from None


class OutputStream:
    """A text file written line by line; each ``write_line`` is flushed at once.

    A regular file (or a new one) is written beside its name (:func:`replace_durably`'s
    temporary name) and takes the name at :meth:`commit`: a run that fails or is interrupted
    before it leaves an existing file as it was and no partial one. A device or pipe
    (``/dev/stderr``, a FIFO) is written in place, as a stream.

    Raises:
        OutputError: on any write error (e.g. disk full), naming the option and the path.
    """

    def __init__(self, path: Path, option: str) -> None:
        self.path, self.option = Path(path), option
        _refuse_input(self.path, _where(option, self.path))
        self._tmp: str | None = None
        try:
            if self.path.exists() and not stat.S_ISREG(self.path.stat().st_mode):
                self._file = open(self.path, "w", encoding="utf-8", newline="\n")
            else:
                parent = self.path.parent if str(self.path.parent) else Path(".")
                fd, self._tmp = tempfile.mkstemp(prefix=f".{self.path.name}.{os.getpid()}.", suffix=".tmp",
                                                 dir=parent)
                self._file = os.fdopen(fd, "w", encoding="utf-8", newline="\n")
        except OSError as exc:
            raise OutputError(f"{_where(option, self.path)}: cannot write it ({exc.strerror or exc})") from None

    def write_line(self, line: str) -> None:
        try:
            self._file.write(line + "\n")
            self._file.flush()
        except OSError as exc:
            raise OutputError(f"{_where(self.option, self.path)}: write failed ({exc.strerror or exc}); "
                              f"{self.kept()}") from None

    def kept(self) -> str:
        """What is at the path if the run ends now, uncommitted: the end of a one-line message."""
        if self._tmp is None:
            return f"every line written to {self.path} so far is complete"
        return f"{self.path} was not written" + (" (the old file is kept)" if self.path.exists() else "")

    def commit(self) -> None:
        """Give the lines written so far the file's name (``fsync`` first; a stream: nothing to do).

        Raises:
            OutputError: the file cannot be renamed into place.
        """
        if self._tmp is None:
            return
        try:
            self._file.flush()
            os.fsync(self._file.fileno())
            self._file.close()
            _give_name(self._tmp, self.path)
        except OSError as exc:
            raise OutputError(f"{_where(self.option, self.path)}: cannot write it ({exc.strerror or exc})") from None
        self._tmp = None
        _fsync_dir(self.path.parent if str(self.path.parent) else Path("."))

    def close(self) -> None:
        """Close the file; an uncommitted temporary file is removed."""
        with contextlib.suppress(OSError):
            self._file.close()
        if self._tmp is not None:
            with contextlib.suppress(OSError):
                os.unlink(self._tmp)
            self._tmp = None

    def __enter__(self) -> "OutputStream":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def open_stream(path: Path, option: str) -> OutputStream:
    """Open ``path`` for line-by-line output (``--jsonl``, ``--log-file``); :meth:`OutputStream.commit`
    gives it its name.

    Raises:
        OutputError: ``path`` cannot be opened, or it is a file the command reads (:func:`reading`).
    """
    return OutputStream(path, option)
