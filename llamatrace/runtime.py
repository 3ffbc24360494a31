"""The Numba settings llamatrace's own processes run with; importing llamatrace changes none.

:func:`configure_numba` is called where llamatrace's own processes start: the CLI
(:mod:`llamatrace.cli`, which ``llamatrace`` and ``python -m llamatrace`` import first), the
``bench`` engines and the corpus workers (local processes and Ray actors). A program that
imports llamatrace as a library keeps its own Numba settings (the kernels run on whichever
threading layer Numba picks there); it may call :func:`configure_numba` itself, before its first
parallel kernel, to run them as the CLI does.

What it sets, each only where the user has not:

- ``NUMBA_THREADING_LAYER_PRIORITY`` = ``omp tbb workqueue``: OpenMP first, where a parallel
  region costs least (docs/performance.md "Threads" has the figures; a decode step of SmolLM2
  opens ~120 regions). Numba's own order is ``tbb omp workqueue``.
- ``GOMP_SPINCOUNT`` = :data:`SPIN_COUNT` (unless ``OMP_WAIT_POLICY`` or ``GOMP_SPINCOUNT`` is
  set): an OpenMP thread waiting for work spins that many times, then sleeps. libgomp's
  default, 300,000 spins, burns a whole time slice when another process holds the core the
  awaited thread needs; sleeping at once (``OMP_WAIT_POLICY=passive``) costs every region a
  wake-up: decode at 0.4-0.5x on free cores. docs/performance.md "Threads" has the tables.
- ``NUMBA_CACHE_DIR``: when the installed package is read-only, compiled kernels go to
  llamatrace's user cache (``numba/``) rather than Numba's.
- libtbb is loaded globally when ``pip install tbb`` put it in ``<venv>/lib``, where the
  dynamic loader does not look: without it Numba cannot use its TBB layer (the fallback when
  libgomp is missing) and drops to ``workqueue``.

Spawned child processes inherit the environment variables; the libtbb preload is per process.
"""

from __future__ import annotations

import ctypes
import os
import sys

LAYER_PRIORITY = "omp tbb workqueue"
SPIN_COUNT = "10000"

AUTO_THREADS_HELP = ("every core; for small models (SmolLM2-135M, -360M), one while other processes' "
                     "runnable tasks outnumber the cores (read before each forward call)")
"""What the kernels' default thread count is (:class:`llamatrace.kernels.threads.AutoThreads`), in
the words ``--threads`` and ``bench`` show; here because the CLI's options must not import Numba."""


def configure_numba() -> None:
    """Set the Numba threading-layer priority, OpenMP spin count, kernel cache folder and libtbb
    preload for this process (see the module docstring). Call it before the first parallel kernel runs: Numba
    picks its threading layer then. Patches ``numba.config`` if Numba is already imported."""
    if not os.environ.get("NUMBA_CACHE_DIR"):
        package = os.path.dirname(os.path.abspath(__file__))
        if not os.access(package, os.W_OK):
            from llamatrace.gguf.fetch import cache_root
            os.environ["NUMBA_CACHE_DIR"] = os.path.join(cache_root(), "numba")
    if "NUMBA_THREADING_LAYER" not in os.environ:
        os.environ.setdefault("NUMBA_THREADING_LAYER_PRIORITY", LAYER_PRIORITY)
    if "OMP_WAIT_POLICY" not in os.environ:      # libgomp reads it when it loads: the first launch
        os.environ.setdefault("GOMP_SPINCOUNT", SPIN_COUNT)
    numba = sys.modules.get("numba")
    config = getattr(numba, "config", None)
    if config is not None:
        # Numba read its environment at import; the layer itself is chosen at the first launch
        config.CACHE_DIR = os.environ.get("NUMBA_CACHE_DIR", config.CACHE_DIR)
        if "NUMBA_THREADING_LAYER" not in os.environ:
            config.THREADING_LAYER_PRIORITY = os.environ["NUMBA_THREADING_LAYER_PRIORITY"].split()
    if os.name == "posix":
        _preload_tbb()


def _preload_tbb() -> None:
    try:
        ctypes.CDLL("libtbb.so.12", mode=ctypes.RTLD_GLOBAL)
        return
    except OSError:
        pass
    for prefix in dict.fromkeys((sys.prefix, sys.base_prefix)):
        path = os.path.join(prefix, "lib", "libtbb.so.12")
        if os.path.exists(path):
            try:
                ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
            except OSError:
                continue
            return
