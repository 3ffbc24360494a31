"""The typer app, its consoles and the one place errors become exit codes.

Commands live in their own modules of this package and register themselves on :data:`app`;
shared options and helpers are in :mod:`llamatrace.cli.options`. Data goes to stdout (generated text, JSON, trace lines); status lines, summaries and errors go to a
stderr console, so output stays pipeable. Status lines (progress) are printed only through
:func:`status`, :func:`status_spinner` and :func:`status_bar`, which ``--quiet`` turns off.
Exit codes: 0 ok, 1 internal error, 2 bad input or usage, 3 a divergence found by ``compare``,
130 interrupted.
"""

from __future__ import annotations

import codecs
import contextlib
import errno
import functools
import os
import re
import sys
import warnings
import traceback
from pathlib import Path
from typing import Annotated, NoReturn

import typer

try:  # typer >= 0.2x vendors click; its usage errors derive from TyperException
    from typer import TyperException as _UsageError
except ImportError:  # pragma: no cover - older typer re-exports click's
    from click import ClickException as _UsageError
from rich.console import Console

from llamatrace import __version__
from llamatrace.errors import LlamatraceError
from llamatrace.machine import runtime



def plural(n: int, word: str, many: str | None = None) -> str:
    """``"1 query"``, ``"2 queries"``: ``n`` and ``word``, or ``many`` (default ``word + "s"``) when n != 1."""
    return f"{n} {word if n == 1 else (many or word + 's')}"


class StdoutClosed(Exception):
    """stdout's reader went away (``llamatrace generate … | head``): Unix tools end quietly there,
    so :func:`main` turns this into exit 0. Its own type, because a ``BrokenPipeError`` from
    anywhere else (a pipe to a worker process) is an error, never a reason to exit 0."""


def _stdout_closed(exc: BaseException) -> StdoutClosed:
    # later writes and the interpreter's flush at exit go to /dev/null, not to a second warning
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)
    closed = StdoutClosed("stdout closed")
    closed.__cause__ = exc
    return closed


def _json_escape(exc: UnicodeError) -> tuple[str, int]:
    """Codec error handler: what the encoding cannot hold becomes JSON's ``\\u00e9`` escapes
    (astral characters as a surrogate pair), so ``--json`` output stays valid JSON in any encoding
    and text stays readable (Python's ``backslashreplace`` writes ``\\xe9``, which JSON refuses)."""
    if not isinstance(exc, UnicodeEncodeError):
        raise exc
    units = exc.object[exc.start:exc.end].encode("utf-16-be", errors="surrogatepass")
    return "".join(f"\\u{units[i]:02x}{units[i + 1]:02x}" for i in range(0, len(units), 2)), exc.end


JSON_ESCAPE = "llamatrace.json_escape"
codecs.register_error(JSON_ESCAPE, _json_escape)


class _Stdout:
    """``sys.stdout`` (looked up on each use: tests replace it; a live rich progress bar proxies
    it), or the ``file`` given, whose ``write`` and ``flush`` raise :class:`StdoutClosed` instead
    of ``BrokenPipeError``."""

    def __init__(self, file=None) -> None:
        self._fixed = file

    def _file(self):
        return self._fixed or getattr(sys.stdout, "rich_proxied_file", sys.stdout)

    def write(self, text: str) -> int:
        try:
            return self._file().write(text)
        except BrokenPipeError as exc:
            raise _stdout_closed(exc) from exc

    def flush(self) -> None:
        try:
            self._file().flush()
        except BrokenPipeError as exc:
            raise _stdout_closed(exc) from exc

    def __getattr__(self, name: str):
        return getattr(self._file(), name)


stdout = _Stdout()
"""Where commands write raw data (``stdout.write(json.dumps(...) + "\n")``): sys.stdout whose
closed pipe raises :class:`StdoutClosed`."""


class StdoutConsole(Console):
    """The data console: it writes through :data:`stdout`, so a closed pipe raises
    :class:`StdoutClosed` (rich itself would answer ``SystemExit(1)``)."""

    @property
    def file(self):
        return self._file if self._file is not None else stdout

    @file.setter
    def file(self, new_file) -> None:
        self._file = new_file

    def on_broken_pipe(self) -> None:
        raise _stdout_closed(BrokenPipeError("stdout closed"))


# soft_wrap: summary and error lines stay whole lines when stderr is a file or pipe (80 columns)
err = Console(stderr=True, highlight=False, soft_wrap=True)
out = StdoutConsole(highlight=False, soft_wrap=True)

EXIT_OK, EXIT_INTERNAL, EXIT_BAD_INPUT, EXIT_INTERRUPTED = 0, 1, 2, 130
EXIT_DIVERGED = 3          # `llamatrace compare`: a stage exceeds its threshold

class _Group(typer.core.TyperGroup):
    """The app's command group: in ``--help``, a flag (``--raw``, ``--json``, ``-h/--help`` itself)
    shows no value type — typer labels every flag ``<bool>``, though a flag takes no value."""

    def get_command(self, ctx, name: str):
        command = super().get_command(ctx, name)
        if command is not None:
            _no_flag_metavar(command, ctx)
            if not hasattr(command.format_help, "__wrapped__"):
                command.format_help = _help_to_stdout(command.format_help)
        return command

    def format_help(self, ctx, formatter) -> None:
        _no_flag_metavar(self, ctx)
        _help_to_stdout(super().format_help)(ctx, formatter)

    def invoke(self, ctx):
        # click answers any EPIPE with a silent exit 1, meant for a closed stdout; ours raises
        # StdoutClosed, so any other broken pipe is a bug, reported as one (_run_app)
        try:
            return super().invoke(ctx)
        except BrokenPipeError as exc:
            raise RuntimeError(f"BrokenPipeError on a pipe that is not stdout: {exc}") from exc


def _help_to_stdout(format_help):
    """``format_help`` with a closed stdout (``llamatrace perplexity --help | head``) raising
    :class:`StdoutClosed`, as every other write to stdout does: typer prints the help through a
    rich console of its own, which would answer the broken pipe with ``SystemExit(1)``."""
    @functools.wraps(format_help)
    def wrapped(ctx, formatter) -> None:
        with contextlib.redirect_stdout(_Stdout(sys.stdout)):
            format_help(ctx, formatter)
    return wrapped


def _no_flag_metavar(command, ctx) -> None:
    for param in [*command.params, command.get_help_option(ctx)]:
        if getattr(param, "is_flag", False) and param.metavar is None:
            param.metavar = ""


app = typer.Typer(
    name="llamatrace",
    cls=_Group,
    help="Run a GGUF model (Llama, Qwen, Phi-3, Gemma, gpt-oss; mixtures of experts, Qwen3.5's DeltaNet hybrids) on the CPU and watch every stage of its forward pass.\n\n"
         "Examples:\n\n"
         "  llamatrace generate \"What is the capital of France?\"\n\n"
         "  llamatrace trace --layer 0 --dump-shapes\n\n"
         "  llamatrace info --model Llama-3.2-1B-Instruct-Q8_0.gguf\n\n"
         "Without --model, the default model (SmolLM2-135M-Instruct Q4_1) is used and fetched once "
         "into the user cache (`llamatrace pull`).",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode="markdown",
    context_settings={"help_option_names": ["-h", "--help"]},
)

_state = {"debug": False, "quiet": False, "interrupt_reported": False}
ENV_DEBUG, ENV_QUIET = "LLAMATRACE_DEBUG", "LLAMATRACE_QUIET"
# taken anywhere before a `--`, so every command accepts them without declaring them
GLOBAL_FLAGS = {"--debug": "debug", "--quiet": "quiet", "-q": "quiet"}


def _env_flag(name: str) -> bool:
    """An on/off environment variable: on when set to anything but empty or ``0``."""
    return os.environ.get(name, "").strip() not in ("", "0")


# ---- status lines ----------------------------------------------------------------------------
# A status line tells a person watching what is happening now: fetching, loading, compiling, a
# spinner, a progress bar. Whether one appears depends on the terminal and on timing (a warm-up
# slower than a second says so), so no script or test may expect one or its absence; --quiet
# (-q) or LLAMATRACE_QUIET=1 turns every one off. Errors, warnings, notes and the end-of-run
# summary are not status lines: they are printed on `err` directly and always appear.
def quiet() -> bool:
    """Whether status lines are off for this command (``--quiet``/``-q`` or ``$LLAMATRACE_QUIET``)."""
    return _state["quiet"]


def status(message: str) -> None:
    """Print ``message`` (plain text: no markup) on stderr as one status line, unless quiet."""
    if not _state["quiet"]:
        err.print(message, markup=False)


class _NoSpinner:
    def update(self, message: str) -> None:
        pass


@contextlib.contextmanager
def status_spinner(message: str):
    """A spinner with ``message`` while the ``with`` block runs, on a terminal unless quiet (in a
    log or a pipe nothing: a spinner is drawn over and over). Yields an object whose
    ``update(message)`` changes the text."""
    if _state["quiet"] or not err.is_terminal:
        yield _NoSpinner()
        return
    with err.status(message) as spinner:
        yield spinner


def status_bar(*columns):
    """A transient rich ``Progress`` with ``columns`` on stderr, drawn on a terminal unless quiet
    (in a log or a pipe it would leave empty lines); use it as a ``with`` block."""
    from rich.progress import Progress
    return Progress(*columns, console=err, transient=True, disable=_state["quiet"] or not err.is_terminal)


def exit_interrupted() -> NoReturn:
    """Leave with exit code 130 after the command has said what it kept; any other exit with 130
    (Ctrl-C while loading: typer turns it into ``Exit(130)``) gets an ``interrupted`` line."""
    _state["interrupt_reported"] = True
    raise typer.Exit(EXIT_INTERRUPTED)


def _version(value: bool) -> None:
    if value:
        out.print(f"llamatrace {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    debug: Annotated[bool, typer.Option("--debug", metavar="", help="Show full tracebacks (for bug reports); "
                                        "also accepted after the command, or $LLAMATRACE_DEBUG=1.")] = False,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", metavar="", help="No status lines on stderr (fetching, "
                                        "loading, compiling, progress bars): only errors, warnings, notes and "
                                        "the summary; also accepted after the command, or $LLAMATRACE_QUIET=1.")] = False,
    version: Annotated[bool, typer.Option("--version", callback=_version, is_eager=True, metavar="",
                                          help="Print the version and exit.")] = False,
) -> None:
    # declared for --help only: _take_global_flags takes --debug and --quiet out of argv before
    # typer parses it, and --version acts in its callback
    del debug, quiet, version
    from llamatrace.outputs import forget_inputs
    forget_inputs()                  # the inputs the command's options note (outputs.reading)


def _take_global_flags(argv: list[str]) -> list[str]:
    """``--debug`` (tracebacks) and ``--quiet``/``-q`` (no status lines) anywhere before a ``--``
    set :data:`_state` and are removed, so every command accepts them without declaring them
    (``llamatrace generate -q …``); after ``--`` they are the prompt's."""
    end = argv.index("--") if "--" in argv else len(argv)
    for flag, key in GLOBAL_FLAGS.items():
        if flag in argv[:end]:
            _state[key] = True
    return [a for a in argv[:end] if a not in GLOBAL_FLAGS] + argv[end:]


# ---------------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    """Run the app on ``argv`` (default ``sys.argv[1:]``) and map errors to one line + exit code.

    A command that ends after a Ctrl-C whose KeyboardInterrupt was lost (in a finalizer, see
    :func:`llamatrace.machine.runtime.catch_interrupts`) ends with ``interrupted`` and 130 all the same."""
    # a terminal or pipe in another encoding than UTF-8 (PYTHONIOENCODING=ascii, LANG=C on old
    # Pythons): text it cannot hold is escaped, not an internal error
    with contextlib.suppress(AttributeError, ValueError, OSError):
        sys.stdout.reconfigure(errors=JSON_ESCAPE)
    for name in ("stdout", "stderr"):           # a stream Python found closed (`… >&-`, main(argv) from
        if getattr(sys, name) is None:          # Python): its output goes nowhere, as after `| head`
            setattr(sys, name, open(os.devnull, "w", encoding="utf-8"))
    code = _run(argv)
    if runtime.interrupted() and code != EXIT_INTERRUPTED:
        err.print("interrupted")
        code = EXIT_INTERRUPTED
    try:                                         # output lost to a full disk must not pass silently
        stdout.flush()
    except StdoutClosed:
        pass
    except OSError as exc:
        _silence_stdout()
        err.print(f"[red]error:[/] cannot write to standard output ({exc.strerror or exc})")
        return code or EXIT_BAD_INPUT
    return code


def _silence_stdout() -> None:
    # after a failed write, the interpreter's own flush at exit would print a second warning
    try:
        sys.stdout = open(os.devnull, "w")
    except OSError:
        pass


def _show_warning(message, category, filename, lineno, file=None, line=None) -> None:
    """A library warning (a vocabulary that drops bytes, a header value ignored) as one
    ``warning:`` line, the run going on; with --debug, where it came from too."""
    from rich.markup import escape
    where = f" ({filename}:{lineno})" if _state["debug"] else ""
    err.print(f"[yellow]warning:[/] {escape(str(message))}{escape(where)}", soft_wrap=True)


def _run(argv: list[str] | None) -> int:
    _state.update(debug=_env_flag(ENV_DEBUG), quiet=_env_flag(ENV_QUIET), interrupt_reported=False)
    argv = _take_global_flags(list(sys.argv[1:] if argv is None else argv))
    with warnings.catch_warnings():
        warnings.simplefilter("default")
        if not _state["debug"]:     # a file left open by an interrupt, as Python's default filters
            warnings.simplefilter("ignore", ResourceWarning)
        warnings.showwarning = _show_warning
        return _run_app(argv)


def _rejected_input(exc: BaseException) -> object | None:
    """The value a typer option's pydantic check refused ('abc' for an int), if it says; its
    message alone ("Input should be a valid integer") does not name it."""
    cause = exc.__cause__ or exc.__context__
    try:
        return cause.errors()[0]["input"]           # pydantic's ValidationError
    except (AttributeError, TypeError, LookupError):
        return None


def _empty_path_option(argv: list[str]) -> str | None:
    """The path option given an empty value (``-m ""``, ``--output=``: a shell variable left empty),
    which typer would read as ``.``, the current directory; None if there is none."""
    if not any(tok == "" or tok.endswith("=") for tok in argv):
        return None
    import click
    command = getattr(typer.main.get_command(app), "commands", {}).get(argv[0] if argv else "")
    if command is None:
        return None
    paths = {opt for p in command.params for opt in getattr(p, "opts", []) + getattr(p, "secondary_opts", [])
             if isinstance(getattr(p, "type", None), click.Path)                     # older typer
             or getattr(getattr(p, "type_descriptor", None), "annotation", None) is Path}
    args = argv[:argv.index("--")] if "--" in argv else argv
    for prev, tok in zip(args, args[1:]):
        opt, eq, value = tok.partition("=")
        if (tok == "" and prev in paths) or (eq and value == "" and opt in paths):
            return prev if tok == "" else opt
    return None


def _run_app(argv: list[str]) -> int:
    if (option := _empty_path_option(argv)) is not None:
        err.print(f"[red]error:[/] {option} was given an empty path (a shell variable left empty?); give a "
                  f"file's path", soft_wrap=True)
        return EXIT_BAD_INPUT
    try:
        # with standalone_mode=False, click returns a typer.Exit's code instead of raising it;
        # stdout through _Stdout: click echoes --help to sys.stdout itself, after format_help
        with contextlib.redirect_stdout(_Stdout(sys.stdout)):
            code = app(args=argv, standalone_mode=False)
        if isinstance(code, int):
            if code == EXIT_INTERRUPTED and not _state["interrupt_reported"]:
                err.print("interrupted")
            return code
    except LlamatraceError as exc:
        _report(exc, str(exc), exc.exit_code)
        return exc.exit_code
    except typer.Exit as exc:
        code = int(getattr(exc, "exit_code", 0) or 0)
        if code == EXIT_INTERRUPTED and not _state["interrupt_reported"]:
            err.print("interrupted")
        return code
    except typer.Abort as exc:
        if isinstance(exc.__cause__, EOFError):  # click turns an EOFError into Abort: no Ctrl-C came
            cause = exc.__cause__
            _report(cause, f"internal error: EOFError: {cause} — please report it with --debug output", EXIT_INTERNAL)
            return EXIT_INTERNAL
        err.print("interrupted")
        return EXIT_INTERRUPTED
    except _UsageError as exc:                   # bad option, missing argument, no command...
        message = exc.format_message() if hasattr(exc, "format_message") else str(exc)
        # typer >= 0.2x validates choices with pydantic, whose messages start "Value error, "
        message = message.replace("Value error, ", "")
        got = _rejected_input(exc)
        if message and got is not None and repr(got) not in message:
            message += f" (got {got!r})"
        if message:
            ctx = getattr(exc, "ctx", None)
            hint = f" (see `{ctx.command_path} --help`)" if ctx is not None else ""
            name = getattr(exc, "option_name", None) or ""
            if type(exc).__name__ == "NoSuchOption" and re.fullmatch(r"-[^-a-zA-Z].*", name):
                hint = (" (a prompt that starts with '-' goes after '--': "
                        f"`{ctx.command_path if ctx is not None else 'llamatrace'} -- \"-5 °C?\"`)")
            from rich.markup import escape
            err.print(f"[red]error:[/] {escape(message + hint)}", soft_wrap=True)
        return EXIT_BAD_INPUT
    except KeyboardInterrupt:
        err.print("interrupted")
        return EXIT_INTERRUPTED
    except StdoutClosed:                         # `| head`: not an error
        _silence_stdout()
        return EXIT_OK
    except OSError as exc:
        if exc.errno not in (errno.ENOSPC, errno.EDQUOT, errno.EIO, errno.EFBIG):
            _report(exc, f"internal error: {type(exc).__name__}: {exc} — please report it with --debug output",
                    EXIT_INTERNAL)
            return EXIT_INTERNAL
        _silence_stdout()                        # a full disk behind stdout: the only unguarded output
        _report(exc, f"cannot write the output ({exc.strerror}); free some space or redirect elsewhere",
                EXIT_BAD_INPUT)
        return EXIT_BAD_INPUT
    except Exception as exc:  # noqa: BLE001 — the one place unexpected errors are reported
        if runtime.interrupted():       # a Ctrl-C that the compiler lost and left as another error
            if _state["debug"]:         # (Numba: "no compiled object yet" after an interrupted compile)
                traceback.print_exception(exc, file=sys.stderr)
            err.print("interrupted")
            return EXIT_INTERRUPTED
        _report(exc, f"internal error: {type(exc).__name__}: {exc} — please report it with --debug output",
                EXIT_INTERNAL)
        return EXIT_INTERNAL
    return EXIT_OK


def _report(exc: BaseException, line: str, code: int) -> None:
    if _state["debug"]:
        traceback.print_exception(exc, file=sys.stderr)
    from rich.markup import escape
    err.print(f"[red]error:[/] {escape(line)}", soft_wrap=True)
