"""What CLI tests share: running a command in-process and the one-line error every bad input gets."""

from __future__ import annotations

from llamatrace.cli import main


def run(capsys, *args) -> tuple[int, str, str]:
    """``llamatrace ARGS`` in this process: (exit code, stdout, stderr)."""
    code = main([str(a) for a in args])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def one_error_line(err: str) -> str:
    """The one ``error:`` line of a failed command's stderr (and no traceback): nothing else, as
    the suite runs with ``LLAMATRACE_QUIET=1`` (tests/conftest.py), which turns status lines off."""
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:") and "Traceback" not in err, err
    return lines[0]


def error_line(capsys) -> str:
    """The one ``error:`` line of what the last command wrote to stderr."""
    return one_error_line(capsys.readouterr().err)


def assert_one_line_error(code: int, out: str, err: str, *needles: str) -> None:
    """Exit 2 and one ``error:`` line on stderr naming every needle (stdout may hold what was
    written before the error): ``assert_one_line_error(*run(capsys, ...), "--ctx-size")``."""
    assert code == 2, (code, err)
    line = one_error_line(err)
    for needle in needles:
        assert needle in line, line
