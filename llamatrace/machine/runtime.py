"""The Numba and heap settings llamatrace's own processes run with; importing llamatrace changes none.

:func:`configure_process` is called where llamatrace's own processes start: the CLI
(:mod:`llamatrace.cli`, which ``llamatrace`` and ``python -m llamatrace`` import first), the
``bench`` engines and the corpus workers (local processes and Ray actors). A program that
imports llamatrace as a library keeps its own settings (the kernels run on whichever threading
layer Numba picks there, its arrays are allocated as glibc decides); it may call
:func:`configure_process` itself, before its first parallel kernel, to run them as the CLI does.

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
- glibc's heap keeps freed blocks of up to :data:`HEAP_REUSE` bytes for the next allocation
  (unless ``MALLOC_MMAP_THRESHOLD_``, ``MALLOC_TRIM_THRESHOLD_`` or a ``glibc.malloc`` tunable in
  ``GLIBC_TUNABLES`` is set). By default an array over 32 MiB is a map of its own, unmapped when
  freed, so each prefill layer at 8B (a 58 MiB gate|up product, 32 MiB of attention
  probabilities, …) faulted in and zeroed fresh pages: ~100,000 faults and 0.7-1.3 s of system
  time per 512-token chunk, 5 % of its time (docs/performance.md "Corpus throughput"). llama.cpp
  allocates its compute buffers once.

Spawned child processes inherit the environment variables; the libtbb preload and the heap settings
are per process.

Also here, for the same processes: Ctrl-C that cannot be lost (:func:`catch_interrupts`), and the
CPUs and Numba threads a process may use (:func:`usable_cpus`, :func:`numba_threads`), read
without importing Numba.
"""

from __future__ import annotations

import ctypes
import os
import platform
import signal
import sys

LAYER_PRIORITY = "omp tbb workqueue"
SPIN_COUNT = "10000"
HEAP_REUSE = 1 << 30
"""Bytes of freed memory glibc keeps for reuse, and the largest block it serves from its heap
rather than from a map of its own (``mallopt`` M_TRIM_THRESHOLD and M_MMAP_THRESHOLD): a 512-token
8B layer's arrays fit many times over, a KV cache for long contexts (one allocation, zeroed) does not."""
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3           # <malloc.h>

ENV_NUMBA_THREADS = "NUMBA_NUM_THREADS"


def configure_process() -> None:
    """Set the Numba threading-layer priority, OpenMP spin count, kernel cache folder, libtbb
    preload and heap reuse for this process (see the module docstring). Call it before the first
    parallel kernel runs: Numba picks its threading layer then. Patches ``numba.config`` if Numba
    is already imported."""
    if not os.environ.get("NUMBA_CACHE_DIR"):
        package = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))   # llamatrace/
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
    _reuse_freed_memory()


def _reuse_freed_memory() -> None:
    env = os.environ
    if "MALLOC_MMAP_THRESHOLD_" in env or "MALLOC_TRIM_THRESHOLD_" in env or "glibc.malloc." in env.get(
            "GLIBC_TUNABLES", ""):
        return
    mallopt = getattr(ctypes.CDLL(None), "mallopt", None) if os.name == "posix" else None
    if mallopt is None:                  # not glibc (macOS, musl without it): its own policy
        return
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    mallopt(_M_MMAP_THRESHOLD, HEAP_REUSE)
    mallopt(_M_TRIM_THRESHOLD, HEAP_REUSE)


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


# ---- Ctrl-C ------------------------------------------------------------------------------------
_interrupted = False


def catch_interrupts(repeat: bool = True) -> None:
    """Make Ctrl-C (SIGINT) impossible to lose in this process, from now on.

    Python raises KeyboardInterrupt wherever the main thread is when the signal is handled; if
    that is a finalizer (an llvmlite ``ObjectRef.__del__`` while Numba compiles, a weakref
    callback), Python prints ``Exception ignored in …`` and carries on as if nothing happened.
    So the handler installed here records the interrupt before raising, :func:`check_interrupt`
    (called at safe points: each forward call, each chunk) raises it again, and a
    KeyboardInterrupt lost in a finalizer is no longer printed. SIGINT is unblocked last (see
    :func:`start_process`): one that came while it was held is handled at once.

    Args:
        repeat: a second SIGINT raises again (the CLI: the user's second Ctrl-C stops a slow
            clean-up); False for a worker process, whose parent stops it: its clean-up runs to the end.
    """
    def on_sigint(signum, frame) -> None:
        global _interrupted
        first = not _interrupted
        _interrupted = True
        if first or repeat:
            raise KeyboardInterrupt

    signal.signal(signal.SIGINT, on_sigint)
    sys.unraisablehook = _quiet_lost_interrupt
    if hasattr(signal, "pthread_sigmask"):
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})


def _quiet_lost_interrupt(unraisable) -> None:
    # the handler recorded it: check_interrupt raises it again where it cannot be lost
    if not isinstance(unraisable.exc_value, KeyboardInterrupt):
        sys.__unraisablehook__(unraisable)


def interrupted() -> bool:
    """Whether a SIGINT came since :func:`catch_interrupts` (always False without it)."""
    return _interrupted


def check_interrupt() -> None:
    """A safe point: raises KeyboardInterrupt if a SIGINT came (:func:`catch_interrupts`), in case
    the one its handler raised was lost in a finalizer. Costs one global read; without
    :func:`catch_interrupts` (llamatrace as a library) it never raises."""
    if _interrupted:
        raise KeyboardInterrupt


def start_process(process) -> None:
    """``process.start()`` (a :mod:`multiprocessing` process) with SIGINT blocked in the new process
    until its own :func:`catch_interrupts`: a Ctrl-C during its start-up (seconds of imports)
    waits there, pending, instead of ending it with a traceback. This thread blocks SIGINT only
    while the process starts; one that comes meanwhile is handled when it unblocks."""
    if not hasattr(signal, "pthread_sigmask"):
        process.start()
        return
    from multiprocessing import resource_tracker
    resource_tracker.ensure_running()   # spawn starts it first, and unblocks SIGINT when it does
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        process.start()
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


# ---- CPUs and threads -------------------------------------------------------------------------
def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo``), else :func:`platform.processor`."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as fh:
            for line in fh:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def usable_cpus() -> int:
    """CPUs this process may run on: its affinity (``taskset``, a container's cpuset) where the OS
    says (Linux), else :func:`os.cpu_count`; at least 1. Numba sizes its thread pool the same way."""
    if hasattr(os, "sched_getaffinity"):
        return max(1, len(os.sched_getaffinity(0)))
    return max(1, os.cpu_count() or 1)


def numba_threads() -> int:
    """The threads of Numba's pool in this process and the processes it starts: ``$NUMBA_NUM_THREADS``,
    else :func:`usable_cpus` (as ``numba.config`` reads them; Numba need not be imported).

    Raises:
        OptionError: ``$NUMBA_NUM_THREADS`` is not a whole number from 1 to :func:`usable_cpus`
            (Numba itself fails on 0 or less with a traceback, ignores other text with a warning,
            and starts any larger number of threads, which only wait for each other's cores).
    """
    cpus = usable_cpus()
    given = os.environ.get(ENV_NUMBA_THREADS)
    if given is None or not given.strip():
        return cpus
    try:
        n = int(given.strip())
    except ValueError:
        n = None
    if n is None or not 1 <= n <= cpus:
        from llamatrace.errors import OptionError
        shown = given if len(given) <= 40 else given[:40] + "…"
        raise OptionError(f"{ENV_NUMBA_THREADS}={shown!r}: Numba's thread count must be a whole number from 1 to "
                          f"{cpus} (the CPUs this process may use); set it in that range, or unset it")
    return n
