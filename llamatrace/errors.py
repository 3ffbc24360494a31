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
