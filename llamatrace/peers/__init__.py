"""Adapters to other inference engines (optional extras, imported only when asked for)."""

from __future__ import annotations

import signal

LLAMACPP_BUILD = "docs/comparing.md#installing-llama-cpp-python"
"""Where building llama-cpp-python is described (the flags for CPUs with AMX among them)."""


def exit_reason(engine: str, exitcode: int | None) -> str:
    """One line on why an engine's process ended (``exitcode`` as ``multiprocessing`` or
    ``subprocess`` give it: negative for the signal that killed it)."""
    if exitcode is not None and exitcode < 0:
        try:
            how = f"killed by {signal.Signals(-exitcode).name}"
        except ValueError:
            how = f"killed by signal {-exitcode}"
        if -exitcode == signal.SIGILL:
            return (f"the {engine} process was {how}: it was built for CPU instructions this machine "
                    f"lacks; rebuild it here (for llama-cpp-python: CMAKE_ARGS=\"-DGGML_NATIVE=ON\" "
                    f"pip install --force-reinstall --no-cache-dir llama-cpp-python; with AMX see {LLAMACPP_BUILD})")
        return f"the {engine} process was {how}; run it alone to see why"
    return f"the {engine} process died (exit code {exitcode}); run it alone to see why"
