"""One runner for independent chunks: in this process, or in N local worker processes.

Each worker process loads the model once (the GGUF is memory-mapped, so the page cache is
shared) and then takes chunks one at a time; chunks are handed out in order and the results
reach the caller in chunk order, so a run gives the same numbers with any number of workers.
A worker that dies (killed, out of memory) costs a retry of the chunk it held, on a fresh
worker — whether its death shows as the end of its process or as a send that fails; a chunk
whose worker dies :data:`~llamatrace.corpus.worker.MAX_TRIES` times fails the run. Processes
are started with ``spawn``: a forked copy of a process whose Numba/OpenMP threads are running
can hang. The named points of
:mod:`llamatrace.corpus.faults` let the tests kill each party exactly where they mean to.

Ctrl-C reaches every process of the terminal's group. A worker holds SIGINT until it has set up
its handler (:func:`llamatrace.machine.runtime.catch_interrupts`), so one during its start-up prints no
traceback; then any SIGINT ends it quietly. A run that stops (interrupted, or on an error)
interrupts the workers still computing, so they stop too when only the parent was signalled.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
from collections import deque
from multiprocessing.connection import wait
from typing import Any, Callable

from llamatrace.corpus import faults
from llamatrace.corpus.worker import MAX_TRIES, ModelSpec, RemoteTraceback, Work, failure
from llamatrace.errors import OptionError, WorkerDiedError
from llamatrace.machine.runtime import catch_interrupts, check_interrupt, start_process


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
        ray: run on the Ray cluster at this address (``"local"``: start a local one; ``"auto"``:
            join ``RAY_ADDRESS`` or the one running here), see :mod:`llamatrace.corpus.ray_runner`;
            ``None``: no Ray.

    Raises:
        LlamatraceError: raised by ``work`` or by a worker's model load (re-raised here, chained to
            a :class:`RemoteTraceback` with the worker's traceback); any other exception of a
            worker as a PeerError naming it.
        WorkerDiedError: a chunk's worker died :data:`MAX_TRIES` times (exit code 1).
        PeerError: the Ray cluster is unreachable.
        OptionError: ``workers`` below 1; ``ray`` without Ray installed.
    """
    if workers < 1:
        raise OptionError(f"--workers must be a positive integer, got {workers}")
    if ray is not None:
        from llamatrace.corpus.ray_runner import run_ray
        run_ray(spec, n_chunks, payload, work, on_result, workers, ray or "local")
        return
    if workers == 1:
        model = model if model is not None else spec.load()
        for i in range(n_chunks):
            check_interrupt()
            on_result(i, work(model, payload(i)))
        return
    _Pool(spec, payload, work, min(workers, n_chunks)).run(n_chunks, on_result)


def _worker_main(spec: ModelSpec, work: Work, conn) -> None:
    """A worker process: load the model, then answer ``(i, payload)`` with ``("done", i, result)``
    until ``None``. Its errors are sent back (:func:`failure`); the parent raises them."""
    from llamatrace.machine.runtime import configure_process
    configure_process()             # a process of llamatrace's own: the CLI's settings
    try:
        catch_interrupts(repeat=False)            # a SIGINT held since the start is handled here
        model = spec.load()
        conn.send(("ready",))
        while (job := conn.recv()) is not None:
            i, data = job
            faults.at("compute", i)
            result = work(model, data)
            check_interrupt()
            conn.send(("done", i, result))
    except (EOFError, KeyboardInterrupt, BrokenPipeError):
        pass                                      # the parent is gone or stopping us
    except Exception as exc:      # noqa: BLE001 - reported to the parent, which raises it
        try:
            conn.send(failure(exc, "a worker"))
        except (KeyboardInterrupt, OSError):      # the parent, stopping on another's error, was faster
            pass
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)      # it only exits now


class _Worker:
    def __init__(self, ctx, spec: ModelSpec, work: Work) -> None:
        self.conn, child = ctx.Pipe()
        self.process = ctx.Process(target=_worker_main, args=(spec, work, child), daemon=True)
        start_process(self.process)
        child.close()
        self.chunk: int | None = None         # the chunk it holds
        self.ready = False                    # it has loaded the model

    def kill(self) -> None:
        """SIGKILL it and wait for the end (its pipe is closed then)."""
        self.process.kill()
        self.process.join()

    def interrupt(self) -> None:
        """SIGINT it: it stops its chunk and ends (one still starting, once it has started)."""
        try:
            os.kill(self.process.pid, signal.SIGINT)
        except ProcessLookupError:                    # ended already
            pass


class _Pool:
    def __init__(self, spec: ModelSpec, payload, work: Work, size: int) -> None:
        self.spec, self.payload, self.work, self.size = spec, payload, work, size
        self.ctx = mp.get_context("spawn")

    def run(self, n_chunks: int, on_result) -> None:
        pending = deque(range(n_chunks))
        tries = [0] * n_chunks
        done: dict[int, Any] = {}
        next_out = 0
        lost = 0                                      # workers that died loading the model
        pool = [_Worker(self.ctx, self.spec, self.work) for _ in range(self.size)]

        def died(w: _Worker) -> None:
            """``w`` is dead: its chunk goes first to a fresh worker (or the run fails)."""
            nonlocal lost
            pool.remove(w)
            w.kill()
            if w.chunk is not None:
                tries[w.chunk] += 1
                if tries[w.chunk] >= MAX_TRIES:
                    raise WorkerDiedError(f"a worker died {MAX_TRIES} times on chunk {w.chunk + 1}; "
                                    f"giving up (out of memory? try fewer --workers)")
                pending.appendleft(w.chunk)
            elif not w.ready:
                lost += 1
                if lost >= MAX_TRIES:
                    raise WorkerDiedError(f"{MAX_TRIES} workers died while loading the model; giving up "
                                    f"(out of memory? try fewer --workers)")
            if pending:
                pool.append(_Worker(self.ctx, self.spec, self.work))

        def hand_out(w: _Worker) -> None:
            """The next chunk to ``w``; a send that fails is ``w``'s death."""
            if not pending:
                return
            w.chunk = pending.popleft()
            faults.at("send", w.chunk)
            try:
                w.conn.send((w.chunk, self.payload(w.chunk)))
            except OSError:                               # BrokenPipeError, ConnectionResetError
                died(w)
                return
            faults.at("sent", w.chunk)

        faults.kill_any_worker = lambda: pool[0].kill()
        try:
            while next_out < n_chunks:
                check_interrupt()
                ready = set(wait([w.conn for w in pool] + [w.process.sentinel for w in pool]))
                for w in list(pool):
                    if w.conn not in ready and w.process.sentinel not in ready:
                        continue
                    try:
                        message = w.conn.recv() if w.conn.poll() else None
                    except (EOFError, OSError):
                        message = None
                    if message is None:
                        if not w.process.is_alive():
                            died(w)
                        continue
                    if message[0] == "error":
                        raise message[1] from RemoteTraceback(message[2])
                    w.ready = True
                    if message[0] == "done":
                        done[message[1]] = message[2]
                        w.chunk = None
                        faults.at("done", message[1], w.kill)
                    hand_out(w)
                while next_out in done:
                    on_result(next_out, done.pop(next_out))
                    next_out += 1
                if not pool and next_out < n_chunks:
                    raise WorkerDiedError("every worker died; giving up")
        except BaseException:
            for w in pool:                        # the run is abandoned: so are their chunks
                if w.process.exitcode is None:
                    w.interrupt()
            raise
        finally:
            faults.kill_any_worker = None
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
