"""Thread policy of the parallel kernels: Numba's layer, a fixed count, or the cores other processes leave free.

Every :func:`llamatrace.kernels.types.registry.matmul` call is one ``prange`` region, so callers
fuse matrices (:func:`llamatrace.kernels.types.packing.pack_concat`). Which threading layer runs them
is :mod:`llamatrace.machine.runtime`'s choice (OpenMP first, for llamatrace's own processes).

OpenMP's threads spin while they wait for each other. When other processes keep the cores
busy, a region's slowest thread waits for a core (a scheduler time slice is ~3 ms, a region
~40 µs) while its partner spins away its own slice: decode fell from 52 tok/s on one thread to
0.7 on two (issue 38). So llamatrace's own processes let a waiting OpenMP thread spin only
briefly (:mod:`llamatrace.machine.runtime`), and by default (:class:`AutoThreads`) a forward call runs
on the cores other processes' runnable tasks leave free (every core on a quiet machine; with none
free, one for a small model, every core for the others), read from the kernel's count just before
the call (:func:`runnable_elsewhere`). docs/performance.md "Threads" has the measurements.
"""

from __future__ import annotations

import os
import threading
import time
from collections import deque
from typing import Callable, Iterable

import numba
import numpy as np
from numba import njit, prange

from llamatrace.errors import OptionError
from llamatrace.machine.jit import JIT_PARALLEL
from llamatrace.machine.runtime import usable_cpus


@njit(**JIT_PARALLEL)
def _touch_threads(a):
    for i in prange(a.shape[0]):
        a[i] = i


def threading_layer() -> str:
    """Numba's threading layer in use (``tbb``, ``omp`` or ``workqueue``): runs one tiny parallel
    kernel first, since Numba picks the layer at the first parallel call."""
    _touch_threads(np.zeros(4, dtype=np.int64))
    return numba.threading_layer()


_fixed_threads: int | None = None


def set_threads(n: int) -> None:
    """Use ``n`` threads in the parallel kernels (``numba.set_num_threads``), from now on:
    :class:`AutoThreads` no longer chooses.

    Raises :class:`OptionError` unless ``1 <= n <= numba.config.NUMBA_NUM_THREADS``.
    """
    global _fixed_threads
    limit = numba.config.NUMBA_NUM_THREADS
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or not 1 <= n <= limit:
        raise OptionError(f"threads must be an integer from 1 to {limit} (this machine), got {n!r}")
    numba.set_num_threads(int(n))
    _fixed_threads = int(n)


def running_count(loadavg: str) -> int:
    """Runnable tasks machine-wide, from the text of ``/proc/loadavg`` (its 4th field,
    ``running/total``: an instantaneous count, the reader included).

    Raises :class:`ValueError` on text of another shape."""
    fields = loadavg.split()
    if len(fields) < 4 or "/" not in fields[3]:
        raise ValueError(f"not /proc/loadavg: {loadavg!r}")
    return int(fields[3].partition("/")[0])


def running_threads(task_stats: Iterable[str]) -> int:
    """How many of a process's threads are running or runnable (state ``R``), from the text of
    each ``/proc/self/task/TID/stat``. The state follows the command name, which is in
    parentheses and may itself hold spaces and parentheses."""
    return sum(1 for text in task_stats if text[text.rindex(")") + 1:].split()[:1] == ["R"])


class _ProcFiles:
    """``/proc`` files kept open and re-read from offset 0 (``pread``): an open of one cost ~20 µs
    in a VM, several times its read (the load signal: 225 -> 88 µs, 520 -> 250 µs with the caches
    cold after a decode step's matmuls). Dropped and reopened in a forked child, whose
    ``/proc/self`` is another process. Not thread-safe: :data:`_PROC_LOCK` guards its use."""

    def __init__(self) -> None:
        self._pid = -1
        self._fds: dict[str, int] = {}

    def read(self, path: str) -> str:
        """The text of ``path``; ``OSError`` if it cannot be read (a thread that ended)."""
        if self._pid != os.getpid():
            self._fds, self._pid = {}, os.getpid()           # a parent's descriptors: not ours to close
        fd = self._fds.get(path)
        if fd is None:
            fd = self._fds[path] = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            return os.pread(fd, 4096, 0).decode("utf-8", errors="replace")
        except OSError:
            self.forget(path)
            raise

    def forget(self, path: str) -> None:
        fd = self._fds.pop(path, None)
        if fd is not None:
            os.close(fd)

    def paths(self) -> list[str]:
        return list(self._fds)


_PROC = _ProcFiles()
_PROC_LOCK = threading.Lock()        # two threads' forward calls: one must not close the other's file


def _new_proc_lock() -> None:
    global _PROC_LOCK
    _PROC_LOCK = threading.Lock()      # a forked child: the parent's may be held by a thread it lacks


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_new_proc_lock)


def _task_stats() -> dict[str, str]:
    """The text of ``/proc/self/task/TID/stat`` for each of this process's threads."""
    tids = os.listdir("/proc/self/task")
    live = {f"/proc/self/task/{tid}/stat" for tid in tids}
    for path in _PROC.paths():
        if path.startswith("/proc/self/task/") and path not in live:
            _PROC.forget(path)                            # a thread that ended
    stats = {}
    for tid in tids:
        try:
            stats[tid] = _PROC.read(f"/proc/self/task/{tid}/stat")
        except OSError:                  # the thread ended meanwhile
            continue
    return stats


def runnable_elsewhere() -> int | None:
    """Tasks of other processes running or waiting for a core right now (Linux ``/proc``), or
    None where that cannot be read. This process's own runnable threads (the caller, OpenMP
    threads still spinning after a region) are not counted: a thread is ours if it runs just
    before or just after the machine's count is read (read once, after only, a thread that
    went to sleep in between was counted as another process's: 1 in 4-5 reads of an idle
    machine decoding SmolLM2). One read cost ~0.2 ms at load average 10 on 2 cores (read once),
    0.22 ms on an idle Zen 4 (twice; 0.52 cold), 0.09 ms (0.25) with the files kept open."""
    try:
        with _PROC_LOCK:
            before = _task_stats()
            running = running_count(_PROC.read("/proc/loadavg"))
            after = _task_stats()
        ours = sum(1 for tid in before.keys() | after.keys()
                   if running_threads(text for text in (before.get(tid), after.get(tid)) if text))
        return max(0, running - ours)
    except (OSError, ValueError):
        return None


_crowded = False


def crowded() -> bool:
    """Whether the last :meth:`AutoThreads.pick` (every forward call's, fixed thread count or not)
    found other processes' runnable tasks and its own threads outnumbering the machine's cores
    (on 2 cores at 2 threads: one busy task elsewhere): then a region waits for a thread the
    scheduler set aside (a time slice, ~3 ms), and the kernels run their short regions serial (a
    decode step's attention products, a router's product: the same bits). False until a forward
    call has asked."""
    return _crowded


SMALL_MATRIX = 4_000_000
"""Weights of a model's largest matrix (``dim * hidden_dim``) below which its parallel regions are
short (SmolLM2-135M: 0.9 M weights, regions of ~40 µs; Llama-3.1-8B: 59 M, regions of
milliseconds)."""


def threads_for(cores: int, cpus: int, elsewhere: int | None, matrix_weights: int | None = None) -> int:
    """The thread count for the next forward call: every core while our threads and the other
    processes' runnable tasks fit on the machine's cores; else as many as the free cores take;
    with no core free, one for a model with short regions and every core for the others.

    A region ends when its last thread does: a thread that shares a core with a busy task waits
    for its time slice (~3 ms) in every region. Beside one busy loop on 2 cores (Zen 4 EPYC,
    2026-11-30) one thread against two decoded SmolLM2-135M at 75-93 against 11-16 tok/s, the
    qwen3moe-8 benchmark file at 23.5-25.9 against 16.3-17.4 and the 8B-shaped one (4 layers,
    Q4_0) at 18.0-21.8 against 15.9-16.2. With no core free (two busy loops) two threads still get
    twice one thread's share of the CPU: the 8B-shaped file decoded at 16.1-17.8 against 11.0-14.4
    tok/s, but SmolLM2's regions (~40 µs) wait many times their length: 8-23 against 54-57.

    Args:
        cores: the cores this process may use (its affinity, at most Numba's thread pool).
        cpus: the machine's cores (:func:`os.cpu_count`), which ``elsewhere`` is counted over.
        elsewhere: other processes' runnable tasks (:func:`runnable_elsewhere`); None
            (unknown) gives ``cores``.
        matrix_weights: weights in the model's largest matrix; None counts as small
            (below :data:`SMALL_MATRIX`).
    """
    if elsewhere is None or elsewhere + cores <= cpus:
        return cores
    if elsewhere < cpus:
        return min(cores, cpus - elsewhere)
    if matrix_weights is not None and matrix_weights >= SMALL_MATRIX:
        return cores
    return 1


class AutoThreads:
    """Sets the thread count of each forward call (:func:`threads_for`: every core, or those
    other processes' runnable tasks leave free), unless :func:`set_threads` fixed it.

    The count of other runnable tasks is read at most every ``every`` seconds, and the largest
    of the last ``window`` reads is used: on an oversubscribed machine two threads can be 10x
    slower than one (a region waits for a thread set aside for a time slice), while one thread
    on free cores costs at most 2x, so a burst of load keeps one thread for ~``every * window``
    seconds. Nothing is timed, so no token is spent on a slow trial.

    Args:
        cores, cpus: as :func:`threads_for`; default the CPUs this process may use
            (:func:`llamatrace.machine.runtime.usable_cpus`, at most ``numba.config.NUMBA_NUM_THREADS``)
            and :func:`os.cpu_count`.
        elsewhere: the load signal, :func:`runnable_elsewhere` (tests inject their own).
        clock: seconds, monotonic (:func:`time.monotonic`).
    """

    def __init__(self, cores: int | None = None, cpus: int | None = None,
                 elsewhere: Callable[[], int | None] = runnable_elsewhere,
                 clock: Callable[[], float] = time.monotonic, every: float = 0.05, window: int = 3) -> None:
        if cores is None:
            cores = min(usable_cpus(), numba.config.NUMBA_NUM_THREADS)
        self.cores = cores
        self.cpus = max(cpus or os.cpu_count() or cores, cores)
        self.every = every
        self._elsewhere = elsewhere
        self._clock = clock
        self._recent: deque[int | None] = deque(maxlen=window)
        self._read_at: float | None = None

    def pick(self, matrix_weights: int | None = None) -> int:
        """Set (``numba.set_num_threads``) and return the thread count for the next forward
        call of a model whose largest matrix holds ``matrix_weights`` weights
        (:func:`threads_for`); the fixed count if :func:`set_threads` was called. Either way,
        note for :func:`crowded` whether other processes' runnable tasks and this call's threads
        outnumber the cores."""
        global _crowded
        now = self._clock()
        if self._read_at is None or now - self._read_at >= self.every:
            self._read_at = now
            self._recent.append(self._elsewhere())
        known = [n for n in self._recent if n is not None]
        elsewhere = None
        if known:
            # a burst beyond the cores is remembered for the window; a busy task beside our threads
            # must be in every read of it, not a passing one (an idle machine decoding SmolLM2: 7
            # reads in 1,000 counted one)
            elsewhere = max(known) if max(known) > self.cpus else min(known)
        n = _fixed_threads if _fixed_threads is not None else threads_for(self.cores, self.cpus, elsewhere,
                                                                           matrix_weights)
        # our n threads and the other tasks do not all fit on the cores: a region waits for a thread
        # the scheduler set aside
        _crowded = elsewhere is not None and elsewhere + n > self.cpus
        if _fixed_threads is None:
            numba.set_num_threads(n)
        return n

    def describe(self) -> str:
        """What this policy does, in a few words (``bench`` shows it)."""
        if _fixed_threads is not None:
            return f"{_fixed_threads} thread{'s' if _fixed_threads > 1 else ''}"
        return f"auto threads ({self.cores} cores; the ones other processes leave free)"


AUTO_THREADS = AutoThreads()
"""The process's policy (Numba's threads are a process-wide resource); every
:meth:`llamatrace.model.llama.Llama.forward` call asks it first."""
