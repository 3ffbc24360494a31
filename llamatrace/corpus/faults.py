"""Test-only fault injection at named points of a corpus run (docs/development.md).

``LLAMATRACE_FAULT=POINT:CHUNK:ACTION`` makes the process that reaches ``POINT`` for chunk
``CHUNK`` (``*``: any) do ``ACTION``; with ``LLAMATRACE_FAULT_ONCE=FILE`` only the first
process to get there does (it creates ``FILE``), so a retried chunk or a rerun goes through.
Unset (the normal case), :func:`at` is one dictionary lookup.

Points, in the life of a chunk (``CHUNK`` is the runner's chunk index, or for ``manifest`` the
number of shards it lists):

==========  ======================  ================================================================
point       reached by              where
==========  ======================  ================================================================
``load``    a worker / Ray actor    starting, before it loads the model (and gets a chunk)
``send``    the driver              before handing chunk ``CHUNK`` out (``send:0``: before any)
``sent``    the driver              chunk ``CHUNK`` handed out, not yet done (it is computing)
``compute`` a worker / Ray actor    starting chunk ``CHUNK``
``done``    the driver              chunk ``CHUNK``'s result read, before the next send
``shard``   a worker / Ray actor    ``collect``: shard ``CHUNK``'s temporary file written, not renamed
``manifest`` the driver             ``collect``: the manifest's temporary file written, not renamed
==========  ======================  ================================================================

Actions: ``kill`` (SIGKILL the process itself), ``kill-worker`` (at ``done``: SIGKILL the
worker that sent the result; at ``manifest``: one running worker), ``enospc`` (raise
``OSError(ENOSPC)``), ``missing`` (at ``load``: the model file is not there for this worker,
as on a node without it).
"""

from __future__ import annotations

import errno
import os
import signal
from typing import Callable

ENV, ONCE_ENV = "LLAMATRACE_FAULT", "LLAMATRACE_FAULT_ONCE"

# the runner in charge registers how to kill one of its workers (for ``manifest:N:kill-worker``)
kill_any_worker: Callable[[], None] | None = None


def environment() -> dict[str, str]:
    """The fault settings of this process, for a worker that does not inherit its environment (Ray)."""
    return {k: os.environ[k] for k in (ENV, ONCE_ENV) if k in os.environ}


def at(point: str, chunk: int | None = None, kill_worker: Callable[[], None] | None = None) -> str | None:
    """Act if ``LLAMATRACE_FAULT`` names this point; returns the action it left to the caller
    (``"missing"``), else ``None``.

    Raises:
        OSError: ``ENOSPC``, for the action ``enospc``.
    """
    spec = os.environ.get(ENV)
    if not spec:
        return None
    want_point, want_chunk, action = spec.split(":")
    if want_point != point or want_chunk not in ("*", str(chunk)) or not _first():
        return None
    if action == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif action == "kill-worker":
        (kill_worker or kill_any_worker)()
    elif action == "enospc":
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    return action


def _first() -> bool:
    once = os.environ.get(ONCE_ENV)
    if not once:
        return True
    try:
        os.close(os.open(once, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return False
    return True
