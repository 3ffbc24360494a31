"""The chunk runner on a Ray cluster: the same chunks as Ray actors, each loading the model once.

Imported only for ``--ray`` (Ray is the optional extra ``llamatrace[ray]``). Chunks are handed out
in order to ``workers`` actors (``SPREAD`` over the nodes), the results reach the caller in chunk
order; an actor that dies costs a retry of its chunk on a new actor,
:data:`~llamatrace.corpus.worker.MAX_TRIES` deaths on one chunk fail the run. Each actor reserves
``spec.threads`` CPUs (1 if not given) and runs as many kernel threads as it was given: the
driver's core count says nothing about the nodes. Every node must find the model at
``spec.path`` (docs/perplexity.md); an actor that cannot load it, or fails otherwise, stops the
run with an error naming its node and the cause (its traceback chained, for ``--debug``).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import socket
from collections import deque
from typing import Any, Callable

from llamatrace.corpus import faults
from llamatrace.corpus.worker import MAX_TRIES, ModelSpec, RemoteTraceback, Work, failure
from llamatrace.errors import OptionError, PeerError, WorkerDiedError


class ChunkActor:
    """One Ray actor: :meth:`start` loads the model once, :meth:`run` does one chunk. Both return
    ``("error", error, traceback)`` (:func:`~llamatrace.corpus.worker.failure`) rather than raise,
    so the driver gets our own error and its traceback whatever Ray does with exceptions."""

    def __init__(self, spec: ModelSpec, work: Work, fault_env: dict[str, str]) -> None:
        from llamatrace.machine.runtime import configure_process
        configure_process()         # a process of llamatrace's own: the CLI's settings
        self.spec, self.work, self.model = spec, work, None
        os.environ.update(fault_env)              # test-only (llamatrace.corpus.faults)

    def start(self) -> tuple:
        """Load the model with as many kernel threads as CPUs Ray gave this actor; returns
        ``("ready", node, threads)``."""
        import ray
        node = f"{socket.gethostname()} ({ray.util.get_node_ip_address()})"
        try:
            threads = max(1, int(ray.get_runtime_context().get_assigned_resources().get("CPU", 1)))
            self.model = dataclasses.replace(self.spec, threads=threads).load()
        except Exception as exc:  # noqa: BLE001 - reported to the driver, which raises it
            return (*failure(exc, "a Ray actor"), node)
        return "ready", node, threads

    def run(self, i: int, data) -> tuple:
        try:
            faults.at("compute", i)
            return "done", self.work(self.model, data)
        except Exception as exc:  # noqa: BLE001 - reported to the driver, which raises it
            return failure(exc, "a Ray actor")


def _check_reachable(address: str, given: str) -> None:
    """Fail fast on a ``host:port`` that does not answer (``ray.init`` would retry for minutes);
    ``given`` is how the user named it."""
    host, _, port = address.rpartition(":")
    if address.startswith("ray://") or not host or not port.isdecimal():
        return
    try:
        socket.create_connection((host, int(port)), timeout=3).close()
    except OSError as exc:
        raise PeerError(f"{given}: cannot reach a Ray cluster at {address} ({exc.strerror or exc}); "
                        f"start one with `ray start --head` or give its address") from None


def connect(address: str):
    """``ray.init`` unless already initialised; returns ``(ray, started)``. ``address``:
    ``"local"`` starts a cluster here; ``"auto"`` joins ``RAY_ADDRESS`` if set, else the cluster
    ``ray start`` started on this machine (as Ray reads them); else ``host:port`` or ``ray://…``.

    Raises:
        OptionError: Ray is not installed.
        PeerError: the cluster cannot be reached (none running, for ``"auto"``).
    """
    try:
        import ray
    except ImportError:
        raise OptionError("--ray needs Ray: pip install 'llamatrace[ray]'") from None
    if ray.is_initialized():
        return ray, False
    given = f"--ray {address}"
    if address == "auto" and os.environ.get("RAY_ADDRESS"):
        given += f" (RAY_ADDRESS={os.environ['RAY_ADDRESS']})"
        _check_reachable(os.environ["RAY_ADDRESS"], given)
    elif address not in ("auto", "local"):
        _check_reachable(address, given)
    if address == "local":
        # Ray starts its workers at nice 15: on a busy machine the actors of a cluster started for
        # this one run would starve. They run at the run's own priority, as Ray's job manager
        # gives submitted jobs (RAY_worker_niceness, read by the raylet it starts).
        os.environ.setdefault("RAY_worker_niceness", "0")
    try:
        ray.init(address=address, include_dashboard=False, log_to_driver=False,
                 logging_level="ERROR", configure_logging=False)
    except Exception as exc:       # noqa: BLE001 - Ray raises ConnectionError, RuntimeError, ValueError…
        hint = "; start one with `ray start --head`, or give --ray local" if address == "auto" else ""
        raise PeerError(f"{given}: cannot start or join a Ray cluster ({exc}){hint}") from None
    return ray, True


def quiet_error_listener() -> Callable[[], None]:
    """Ray's driver prints each worker death it hears of on stdout (ray 2.x,
    ``worker.listen_error_messages``, whatever ``log_to_driver`` says), where our data goes; our
    own error names the cause, so those lines go to the ``llamatrace.ray`` logger (debug level)
    instead. For a Ray this process started; returns the undo."""
    try:
        from ray._private import worker as ray_worker
        original = ray_worker.print_to_stdstream
    except (ImportError, AttributeError):          # another Ray: nothing to quiet
        return lambda: None
    log = logging.getLogger("llamatrace.ray")

    def to_log(data: dict, ignore_prefix: bool) -> None:
        for line in data.get("lines", []):
            log.debug("(%s) %s", data.get("pid"), line)

    ray_worker.print_to_stdstream = to_log
    return lambda: setattr(ray_worker, "print_to_stdstream", original)


def run_ray(spec: ModelSpec, n_chunks: int, payload: Callable[[int], Any], work: Work,
            on_result: Callable[[int, Any], None], workers: int, address: str) -> None:
    """:func:`llamatrace.corpus.runner.run_chunks` on Ray actors (see the module docstring)."""
    ray, started = connect(address)
    undo_quiet = quiet_error_listener() if started else (lambda: None)
    cpus = spec.threads or 1
    largest = max((n["Resources"].get("CPU", 0) for n in ray.nodes() if n["Alive"]), default=0)
    if cpus > largest:                  # Ray would wait for such a node for ever
        if started:
            ray.shutdown()
            undo_quiet()
        raise OptionError(f"--threads {cpus}: each Ray actor reserves that many CPUs, and no node of the "
                          f"cluster has more than {largest:g}; give at most --threads {int(largest)}")
    actor_class = ray.remote(num_cpus=cpus, scheduling_strategy="SPREAD")(ChunkActor)
    fault_env = faults.environment()
    pending = deque(range(n_chunks))
    tries = [0] * n_chunks
    lost = 0                                        # actors that died loading the model
    starting: dict[Any, Any] = {}                   # start() ref -> actor
    running: dict[Any, tuple[Any, int]] = {}        # run() ref -> (actor, chunk)
    done: dict[int, Any] = {}
    next_out = 0
    actors: list = []

    def new_actor() -> None:
        actor = actor_class.remote(spec, work, fault_env)
        actors.append(actor)
        starting[actor.start.remote()] = actor

    def hand_out(actor) -> None:
        if pending:
            i = pending.popleft()
            faults.at("send", i)
            running[actor.run.remote(i, payload(i))] = (actor, i)
            faults.at("sent", i)

    def raise_error(reply) -> None:
        _, error, remote, *node = reply
        if node:                                    # name the node: the model may be missing on that one
            error = type(error)(f"Ray node {node[0]}: {error}")
        raise error from RemoteTraceback(remote)

    def died(actor) -> None:
        """``actor`` is dead: a new one takes its place while there is work."""
        ray.kill(actor)
        actors.remove(actor)
        if pending or running:
            new_actor()

    faults.kill_any_worker = lambda: ray.kill(next(iter(running.values()))[0] if running else actors[0])
    try:
        for _ in range(min(workers, n_chunks)):
            new_actor()
        while next_out < n_chunks:
            if not running and not starting:
                raise WorkerDiedError("every Ray actor died; giving up")
            ref = ray.wait([*starting, *running], num_returns=1)[0][0]
            if ref in starting:
                actor = starting.pop(ref)
                try:
                    reply = ray.get(ref)
                except ray.exceptions.RayActorError as exc:
                    lost += 1
                    if lost >= MAX_TRIES:
                        raise WorkerDiedError(f"{MAX_TRIES} Ray actors died while loading the model; giving up "
                                        f"({_why(exc)})") from exc
                    died(actor)
                    continue
                if reply[0] == "error":
                    raise_error(reply)
                hand_out(actor)
                continue
            actor, i = running.pop(ref)
            try:
                reply = ray.get(ref)
            except ray.exceptions.RayActorError as exc:
                tries[i] += 1
                if tries[i] >= MAX_TRIES:
                    raise WorkerDiedError(f"a Ray actor died {MAX_TRIES} times on chunk {i + 1}; giving up "
                                    f"({_why(exc)})") from exc
                pending.appendleft(i)
                died(actor)
                continue
            if reply[0] == "error":
                raise_error(reply)
            done[i] = reply[1]
            faults.at("done", i, lambda: ray.kill(actor))
            hand_out(actor)
            while next_out in done:
                on_result(next_out, done.pop(next_out))
                next_out += 1
    finally:
        faults.kill_any_worker = None
        for actor in actors:
            ray.kill(actor)
        if started:
            ray.shutdown()
            undo_quiet()


def _why(exc: Exception) -> str:
    """Ray's reason for an actor's death: the line of its account that says "because" (killed,
    out of memory, node lost…), else its first line."""
    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
    return next((ln for ln in lines if "because" in ln), lines[0] if lines else type(exc).__name__)
