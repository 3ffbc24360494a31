"""Typed errors raised by the library.

Library code raises these and never prints or exits; the CLI catches :class:`LlamatraceError`
once and shows ``str(err)`` as one line on stderr with ``err.exit_code``.
Messages say what is wrong, where (file / option) and how to fix it.
"""

from __future__ import annotations


class LlamatraceError(Exception):
    """Base class of every error llamatrace reports to the user (exit code 2: bad input)."""

    exit_code = 2


class ModelNotFoundError(LlamatraceError):
    """The model file does not exist or cannot be read or fetched."""


class ModelFormatError(LlamatraceError):
    """The file is not a well-formed GGUF file (bad magic, truncated, inconsistent header...)."""


class UnsupportedModelError(LlamatraceError):
    """A well-formed GGUF that llamatrace cannot run (architecture, vocabulary, tensor type)."""


class PromptError(LlamatraceError):
    """The prompt or chat template cannot be turned into tokens (empty, too long, bad template)."""


class OptionError(LlamatraceError):
    """A command-line option or API argument has an invalid value."""


class OutputError(LlamatraceError):
    """An output file cannot be written (unwritable path, a directory, disk full)."""


class NumericalError(LlamatraceError):
    """A traced stage produced NaN or Inf (raised by ``--check-finite``)."""


class HookError(LlamatraceError):
    """A hook (``model.hooks``) returned an array of another shape or dtype than it was given."""


class PeerError(LlamatraceError):
    """Another engine (llama.cpp, HF transformers) is not installed or failed."""


class WorkerDiedError(PeerError):
    """A corpus run's worker process or Ray actor died again and again (a crash, or the memory ran
    out): no fault of the input, so exit code 1."""

    exit_code = 1


SHOWN_CHARS = 80
"""How much of a string read from a file an error message echoes (:func:`shown`)."""


def shown(value: object, limit: int = SHOWN_CHARS) -> str:
    """``value`` as an error message echoes what a file says (an architecture, a key, a tensor
    name, a string value): quoted (``repr``, so a line break or a control character cannot break
    the one line) and cut to ``limit`` characters with an ellipsis and the original length, so a
    crafted 10 kB name stays a readable line: ``'llamallama…' (10240 characters)``. A non-string
    (a list, a number) is shown as its ``repr``, cut the same way."""
    text = value if isinstance(value, str) else repr(value)
    if len(text) <= limit:
        return repr(text) if isinstance(value, str) else text
    cut = text[:limit] + "…"
    return f"{repr(cut) if isinstance(value, str) else cut} ({len(text):,} characters)"
