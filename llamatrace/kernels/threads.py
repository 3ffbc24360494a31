"""Thread policy of the parallel kernels: Numba's threading layer, a fixed count, or measuring.

Every :func:`llamatrace.kernels.registry.matmul` call is one ``prange`` region, so callers
fuse matrices (:func:`llamatrace.kernels.packing.pack_concat`). llamatrace asks Numba for its
threading layers in the order omp, tbb, workqueue: a region costs ~4-5 us with ``omp``
(libgomp), ~9 us with ``tbb`` (``pip install tbb``) and 54-100 us with ``workqueue``, which turns
a ~6 ms decode step of SmolLM2 into ~40 ms. All three give the same results. OpenMP's spinning
threads slow down badly when another process keeps a core busy; :class:`AutoThreads` then drops
to one thread.
"""

from __future__ import annotations

import numba
import numpy as np
from numba import njit, prange

from llamatrace.errors import OptionError
from llamatrace.kernels.jit import JIT_PARALLEL


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


class AutoThreads:
    """Chooses the thread count of each forward call by measuring, unless :func:`set_threads` fixed it.

    With every core free, all of them are fastest. When another process keeps a core busy, a
    parallel region waits for its slowest thread, which then shares a core (a scheduler time
    slice is ~3 ms, a region ~40 µs), and one thread beats two. So each kind of call (decode)
    keeps a moving average of seconds per token for each candidate count (all cores, one fewer,
    one) and uses the fastest. It retries another count after ``explore`` calls, then after
    twice as many each time the fastest stays the same (up to ``max_interval``; a retry of a
    slower count costs one slow token), and again after ``explore`` once the fastest changes.
    A prefill is one long call, too costly to spend on a slower count: it takes decode's
    fastest (:meth:`best`).

    Fewer threads can only win when another process takes cores, so while all cores are the
    fastest and this process gets their CPU time (``cpu_seconds_per_token`` at least
    ``threads - 0.3`` times the wall time, averaged) it does not explore: each exploration
    costs a slow token (at 8B, ~0.5 s), and a short generation pays it several times.
    """

    def __init__(self, explore: int = 16, max_interval: int = 256) -> None:
        limit = numba.config.NUMBA_NUM_THREADS
        self.candidates = sorted({limit, max(1, limit - 1), 1}, reverse=True)
        self.explore = explore
        self.max_interval = max_interval
        self._avg: dict[tuple[str, int], float] = {}
        self._calls: dict[str, int] = {}
        self._interval: dict[str, int] = {}
        self._next: dict[str, int] = {}
        self._retries: dict[str, int] = {}
        self._share: dict[str, float] = {}     # CPU seconds per wall second with all cores

    def _cores_busy_elsewhere(self, kind: str) -> bool:
        """True unless calls with all cores got (on average) nearly all of their CPU time;
        also True when that was never measured."""
        top = self.candidates[0]
        return self._share.get(kind, 0.0) < top - 0.3

    def _fastest(self, kind: str) -> int:
        return min(self.candidates, key=lambda c: self._avg[kind, c])

    def pick(self, kind: str) -> int:
        """The thread count for the next call of ``kind`` (and sets it); the fixed one if any."""
        if _fixed_threads is not None:
            return _fixed_threads
        calls = self._calls.get(kind, 0)
        self._calls[kind] = calls + 1
        untried = [n for n in self.candidates if (kind, n) not in self._avg]
        top = self.candidates[0]
        measured = [c for c in self.candidates if (kind, c) in self._avg]
        if (measured and not self._cores_busy_elsewhere(kind)
                and min(measured, key=lambda c: self._avg[kind, c]) == top):
            n = top                           # the cores are ours and all of them are fastest
        elif untried:
            n = untried[0]
        else:
            n = self._fastest(kind)
            interval = self._interval.setdefault(kind, self.explore)
            if len(self.candidates) > 1 and calls >= self._next.setdefault(kind, calls + interval):
                others = [c for c in self.candidates if c != n]
                retries = self._retries.get(kind, 0)
                n = others[retries % len(others)]
                self._retries[kind] = retries + 1
                self._interval[kind] = min(2 * interval, self.max_interval)
                self._next[kind] = calls + self._interval[kind]
        numba.set_num_threads(n)
        return n

    def best(self, kind: str) -> int:
        """The fastest count measured so far for ``kind`` (all cores before any measurement; the
        fixed one if any), set without exploring."""
        if _fixed_threads is not None:
            return _fixed_threads
        known = [c for c in self.candidates if (kind, c) in self._avg]
        n = min(known, key=lambda c: self._avg[kind, c]) if known else self.candidates[0]
        numba.set_num_threads(n)
        return n

    def record(self, kind: str, n: int, seconds_per_token: float,
               cpu_seconds_per_token: float | None = None) -> None:
        """Add one measurement of ``n`` threads for ``kind`` (wall seconds and, when known, the
        process's CPU seconds, ``time.process_time``); a new fastest count restarts the
        retries at every ``explore`` calls."""
        if cpu_seconds_per_token is not None and n == self.candidates[0] and seconds_per_token > 0:
            share = cpu_seconds_per_token / seconds_per_token
            old_share = self._share.get(kind)
            self._share[kind] = share if old_share is None else 0.7 * old_share + 0.3 * share
        key = (kind, n)
        old = self._avg.get(key)
        tried = all((kind, c) in self._avg for c in self.candidates)
        before = self._fastest(kind) if tried else None
        self._avg[key] = seconds_per_token if old is None else 0.7 * old + 0.3 * seconds_per_token
        if tried and self._fastest(kind) != before:
            self._interval[kind] = self.explore
            self._next[kind] = self._calls.get(kind, 0) + self.explore


AUTO_THREADS = AutoThreads()
"""The process's policy (Numba's threads are a process-wide resource); :func:`llamatrace.model.generate.generate` uses it."""
