"""The chunk runner on a Ray cluster: the same chunks as Ray actors, each loading the model once.

Imported only for ``--ray`` (Ray is the optional extra ``llamatrace[ray]``). Chunks are handed out
in order to ``workers`` actors (``SPREAD`` over the nodes, one CPU each reserved), the results
reach the caller in chunk order; an actor that dies costs a retry of its chunk on a new actor,
:data:`~llamatrace.corpus.runner.MAX_TRIES` deaths on one chunk fail the run. Every node must
find the model at ``spec.path`` (docs/perplexity.md).
"""

from __future__ import annotations

import socket
from collections import deque
from typing import Any, Callable

from llamatrace.corpus.runner import MAX_TRIES, ModelSpec, Work
from llamatrace.errors import LlamatraceError, OptionError, PeerError


class ChunkActor:
    """One Ray actor: the model, loaded once; :meth:`run` does one chunk."""

    def __init__(self, spec: ModelSpec, work: Work) -> None:
        from llamatrace.runtime import configure_numba
        configure_numba()         # a process of llamatrace's own: the CLI's Numba settings
        self.model = spec.load()
        self.work = work

    def run(self, data):
        return self.work(self.model, data)


def _check_reachable(address: str) -> None:
    """Fail fast on a ``host:port`` that does not answer (``ray.init`` would retry for minutes)."""
    host, _, port = address.rpartition(":")
    if address.startswith("ray://") or not host or not port.isdigit():
        return
    try:
        socket.create_connection((host, int(port)), timeout=3).close()
    except OSError as exc:
        raise PeerError(f"--ray {address}: cannot reach a Ray cluster there ({exc.strerror or exc}); "
                        f"start one with `ray start --head` or give its address") from None


def connect(address: str | None):
    """``ray.init`` to ``address`` (``None``: a local cluster) unless already initialised; returns
    ``(ray, started)``.

    Raises:
        OptionError: Ray is not installed.
        PeerError: the cluster cannot be reached.
    """
    try:
        import ray
    except ImportError:
        raise OptionError("--ray needs Ray: pip install 'llamatrace[ray]'") from None
    if ray.is_initialized():
        return ray, False
    if address:
        _check_reachable(address)
    try:
        ray.init(address=address or None, include_dashboard=False, log_to_driver=False,
                 logging_level="ERROR", configure_logging=False)
    except Exception as exc:       # noqa: BLE001 - Ray raises ConnectionError, RuntimeError, ValueError…
        raise PeerError(f"--ray {address or '(local)'}: cannot start or join a Ray cluster ({exc})") from None
    return ray, True


def run_ray(spec: ModelSpec, n_chunks: int, payload: Callable[[int], Any], work: Work,
            on_result: Callable[[int, Any], None], workers: int, address: str | None) -> None:
    """:func:`llamatrace.corpus.runner.run_chunks` on Ray actors (see the module docstring)."""
    ray, started = connect(address)
    actor_class = ray.remote(num_cpus=1, scheduling_strategy="SPREAD")(ChunkActor)
    actors = [actor_class.remote(spec, work) for _ in range(min(workers, n_chunks))]
    pending = deque(range(n_chunks))
    tries = [0] * n_chunks
    running: dict[Any, tuple[Any, int]] = {}        # object ref -> (actor, chunk)
    done: dict[int, Any] = {}
    next_out = 0

    def hand_out(actor) -> None:
        if pending:
            i = pending.popleft()
            running[actor.run.remote(payload(i))] = (actor, i)

    try:
        for actor in actors:
            hand_out(actor)
        while next_out < n_chunks:
            if not running:
                raise PeerError("every Ray actor died; giving up")
            ready, _ = ray.wait(list(running), num_returns=1)
            actor, i = running.pop(ready[0])
            try:
                done[i] = ray.get(ready[0])
            except ray.exceptions.RayActorError:
                tries[i] += 1
                if tries[i] >= MAX_TRIES:
                    raise PeerError(f"a Ray actor died {MAX_TRIES} times on chunk {i + 1}; giving up") from None
                pending.appendleft(i)
                actors.remove(actor)
                actor = actor_class.remote(spec, work)
                actors.append(actor)
            except ray.exceptions.RayTaskError as exc:
                cause = getattr(exc, "cause", None)
                if isinstance(cause, LlamatraceError):
                    raise cause from None
                raise PeerError(f"a Ray actor failed on chunk {i + 1}: {cause or exc}") from None
            hand_out(actor)
            while next_out in done:
                on_result(next_out, done.pop(next_out))
                next_out += 1
    finally:
        for actor in actors:
            ray.kill(actor)
        if started:
            ray.shutdown()
