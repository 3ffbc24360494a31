"""One runner for independent chunks: in this process, or in N local worker processes.

Each worker process loads the model once (the GGUF is memory-mapped, so the page cache is
shared) and then takes chunks one at a time; chunks are handed out in order and the results
reach the caller in chunk order, so a run gives the same numbers with any number of workers.
A worker that dies (killed, out of memory) costs a retry of the chunk it held, on a fresh
worker; a chunk whose worker dies :data:`MAX_TRIES` times fails the run. Processes are started
with ``spawn``: a forked copy of a process whose Numba/OpenMP threads are running can hang.
"""

from __future__ import annotations

import multiprocessing as mp
import os
from collections import deque
from dataclasses import dataclass
from multiprocessing.connection import wait
from typing import Any, Callable

from llamatrace.errors import LlamatraceError, OptionError, PeerError

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
        from llamatrace.kernels import threads as kernel_threads
        from llamatrace.model.llama import Llama
        if self.threads is not None:
            kernel_threads.set_threads(self.threads)
        return Llama.load(self.path, fetch=False, activations=self.activations)


def threads_per_worker(workers: int, threads: int | None) -> int:
    """Kernel threads of each worker: ``threads`` if given, else the cores split evenly."""
    return threads if threads is not None else max(1, (os.cpu_count() or 1) // max(workers, 1))


def run_chunks(spec: ModelSpec, n_chunks: int, payload: Callable[[int], Any], work: Work,
               on_result: Callable[[int, Any], None], workers: int = 1, model=None,
               ray: str | None = None) -> None:
    """Run ``work(model, payload(i))`` for ``i`` in ``0 … n_chunks-1``; ``on_result(i, result)`` in order.

    Args:
        spec: how a worker process loads the model.
        payload: the input of chunk ``i`` (picklable); built only when the chunk is handed out.
        work: a module-level function (worker processes import it by name).
        workers: 1 runs in this process (with ``model`` if given, else ``spec.load()``);
            more start that many worker processes (or, with ``use_ray``, Ray actors).
        ray: run on the Ray cluster at this address (``"local"``: start a local one), see
            :mod:`llamatrace.corpus.ray_runner`; ``None``: no Ray.

    Raises:
        LlamatraceError: raised by ``work`` or by a worker's model load (re-raised here).
        PeerError: a chunk's worker died :data:`MAX_TRIES` times; the Ray cluster is unreachable.
        OptionError: ``workers`` below 1; ``ray`` without Ray installed.
    """
    if workers < 1:
        raise OptionError(f"--workers must be a positive integer, got {workers}")
    if ray is not None:
        from llamatrace.corpus.ray_runner import run_ray
        run_ray(spec, n_chunks, payload, work, on_result, workers, None if ray in ("", "local") else ray)
        return
    if workers == 1:
        model = model if model is not None else spec.load()
        for i in range(n_chunks):
            on_result(i, work(model, payload(i)))
        return
    _Pool(spec, payload, work, min(workers, n_chunks)).run(n_chunks, on_result)


def _worker_main(spec: ModelSpec, work: Work, conn) -> None:
    """A worker process: load the model, then answer ``(i, payload)`` with ``("done", i, result)``
    until ``None``. Errors of our own types are sent back, anything else too (as a PeerError)."""
    from llamatrace.runtime import configure_numba
    configure_numba()             # a process of llamatrace's own: the CLI's Numba settings
    try:
        model = spec.load()
        conn.send(("ready",))
        while (job := conn.recv()) is not None:
            i, data = job
            conn.send(("done", i, work(model, data)))
    except LlamatraceError as exc:
        conn.send(("error", exc))
    except (EOFError, KeyboardInterrupt, BrokenPipeError):
        pass
    except Exception as exc:      # noqa: BLE001 - reported to the parent, which raises it
        conn.send(("error", PeerError(f"a worker failed: {type(exc).__name__}: {exc}")))


class _Worker:
    def __init__(self, ctx, spec: ModelSpec, work: Work) -> None:
        self.conn, child = ctx.Pipe()
        self.process = ctx.Process(target=_worker_main, args=(spec, work, child), daemon=True)
        self.process.start()
        child.close()
        self.chunk: int | None = None         # the chunk it holds


class _Pool:
    def __init__(self, spec: ModelSpec, payload, work: Work, size: int) -> None:
        self.spec, self.payload, self.work, self.size = spec, payload, work, size
        self.ctx = mp.get_context("spawn")

    def run(self, n_chunks: int, on_result) -> None:
        pending = deque(range(n_chunks))
        tries = [0] * n_chunks
        done: dict[int, Any] = {}
        next_out = 0
        lost = 0                                      # workers that died without a chunk (loading)
        pool = [_Worker(self.ctx, self.spec, self.work) for _ in range(self.size)]
        try:
            while next_out < n_chunks:
                ready = set(wait([w.conn for w in pool] + [w.process.sentinel for w in pool]))
                for w in list(pool):
                    message = None
                    if w.conn in ready or w.process.sentinel in ready:
                        try:
                            message = w.conn.recv() if w.conn.poll() else None
                        except (EOFError, OSError):
                            message = None
                        if message is None and not w.process.is_alive():
                            pool.remove(w)
                            if w.chunk is not None:           # retry its chunk first, on a new worker
                                tries[w.chunk] += 1
                                if tries[w.chunk] >= MAX_TRIES:
                                    raise PeerError(f"a worker died {MAX_TRIES} times on chunk {w.chunk + 1}; "
                                                    f"giving up (out of memory? try fewer --workers)")
                                pending.appendleft(w.chunk)
                            else:
                                lost += 1
                                if lost >= MAX_TRIES:
                                    raise PeerError(f"{MAX_TRIES} workers died while loading the model; giving up")
                            if pending:
                                pool.append(_Worker(self.ctx, self.spec, self.work))
                            continue
                    if message is None:
                        continue
                    if message[0] == "error":
                        raise message[1]
                    if message[0] == "done":
                        done[message[1]] = message[2]
                        w.chunk = None
                    if pending:
                        w.chunk = pending.popleft()
                        w.conn.send((w.chunk, self.payload(w.chunk)))
                while next_out in done:
                    on_result(next_out, done.pop(next_out))
                    next_out += 1
                if not pool and next_out < n_chunks:
                    raise PeerError("every worker died; giving up")
        finally:
            for w in pool:
                try:
                    w.conn.send(None)
                except (OSError, ValueError):
                    pass
            for w in pool:
                w.process.join(timeout=5)
                if w.process.is_alive():
                    w.process.terminate()
                    w.process.join()
