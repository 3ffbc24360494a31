"""What the chunk runners share, whichever runs the chunks (:mod:`llamatrace.corpus.runner`:
this process or local worker processes; :mod:`llamatrace.corpus.ray_runner`: Ray actors): what a
worker loads (:class:`ModelSpec`) and runs (:data:`Work`), what it sends back when it fails
(:func:`failure`, :class:`RemoteTraceback`), how many worker deaths a chunk survives
(:data:`MAX_TRIES`) and each worker's kernel threads (:func:`threads_per_worker`).
"""

from __future__ import annotations

import traceback
from dataclasses import dataclass
from typing import Any, Callable

from llamatrace.corpus import faults
from llamatrace.errors import LlamatraceError, ModelNotFoundError, PeerError
from llamatrace.machine.runtime import numba_threads

MAX_TRIES = 3

Work = Callable[[Any, Any], Any]      # work(model, payload) -> result; a module-level function


@dataclass(frozen=True)
class ModelSpec:
    """What a worker needs to load its model: the GGUF path, ``activations``, kernel ``threads``."""

    path: str
    activations: str = "f32"
    threads: int | None = None

    def load(self):
        """Load the model (:meth:`llamatrace.model.llama.Llama.load`), after fixing the thread count."""
        from llamatrace.machine import threads as kernel_threads
        from llamatrace.model.llama import Llama
        if self.threads is not None:
            kernel_threads.set_threads(self.threads)
        if faults.at("load") == "missing":
            raise ModelNotFoundError(f"model file not found: {self.path}")
        return Llama.load(self.path, fetch=False, activations=self.activations)


def threads_per_worker(workers: int, threads: int | None) -> int:
    """Kernel threads of each worker: ``threads`` if given, else the threads Numba may run
    (:func:`llamatrace.machine.runtime.numba_threads`: the CPUs this process may use, or fewer by
    ``$NUMBA_NUM_THREADS``) split evenly.

    Raises:
        OptionError: a bad ``$NUMBA_NUM_THREADS``.
    """
    return threads if threads is not None else max(1, numba_threads() // max(workers, 1))


class RemoteTraceback(Exception):
    """The traceback, as text, of an exception raised in a worker process or a Ray actor; the
    error reported is raised ``from`` it, so ``--debug`` shows where it happened."""

    def __str__(self) -> str:
        return self.args[0]


def failure(exc: BaseException, who: str) -> tuple[str, LlamatraceError, str]:
    """What a worker sends back for ``exc``: ``("error", error, traceback text)``, the error our
    own (already one line that says how to fix it) or a PeerError naming ``who`` and the cause."""
    if not isinstance(exc, LlamatraceError):
        exc = PeerError(f"{who} failed: {type(exc).__name__}: {exc} — please report it with --debug output")
    return "error", exc, traceback.format_exc()
