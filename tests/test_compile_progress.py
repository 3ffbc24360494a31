"""The kernel warm-up's status line counts the kernels Numba compiles (issue 38: a cold compile
takes minutes on a busy machine, and a fixed "~30 s" was wrong)."""

from __future__ import annotations

import io

import numba
from rich.console import Console

from llamatrace.cli import options


def _fresh_kernels():
    """Three new jitted functions, never compiled (no disk cache): ``outer`` calls ``inner``."""
    @numba.njit
    def inner(x):
        return x + 1

    @numba.njit
    def outer(x):
        return inner(x) * 2

    @numba.njit
    def other(x):
        return x - 1

    return outer, other


def test_counting_compiles_counts_each_kernel_compiled_in_the_block():
    outer, other = _fresh_kernels()
    seen = []
    with options.counting_compiles(seen.append):
        outer(1)            # compiles outer, and inner inside it: one kernel
        outer(2)            # the same signature: nothing compiled
        other(1.0)
    other(1)                # after the block: not counted
    assert seen == [1, 2]
    # Numba's own count of what it compiled in the block: one signature each
    assert [len(f.signatures) for f in (outer, other)] == [1, 2]


class _Status:
    """Stands in for rich's spinner: records the texts it is given."""

    def __init__(self, text: str) -> None:
        self.texts = [text]

    def update(self, status: str) -> None:
        self.texts.append(status)

    def __enter__(self) -> "_Status":
        return self

    def __exit__(self, *exc) -> None:
        pass


def test_the_warmup_status_says_how_many_kernels_were_compiled(monkeypatch, tiny_model_path):
    from llamatrace.model.llama import Llama

    terminal = Console(file=io.StringIO(), force_terminal=True)
    statuses: list[_Status] = []
    monkeypatch.setattr(options, "err", terminal)
    monkeypatch.setattr(options, "status_spinner", lambda text: statuses.append(_Status(text)) or statuses[-1])
    outer, other = _fresh_kernels()
    monkeypatch.setattr(Llama, "warmup", lambda self: (outer(1), other(1)))
    monkeypatch.setattr(options, "numba_cache_is_cold", lambda: True)
    options.load_model(tiny_model_path, None, "f32")
    doing = "Compiling kernels (first run only, 1-3 min; cached afterwards)"
    assert [s.texts for s in statuses] == [[f"{doing} …", f"{doing}: 1 compiled …", f"{doing}: 2 compiled …"]]


def test_the_kernel_cache_is_warm_once_a_forward_pass_has_run(tiny_model):
    """What decides the 'compiling' status line finds fp32's cached kernels where Numba writes
    them (beside ``kernels/ops/fp32.py``, or under ``$NUMBA_CACHE_DIR``) once they have run."""
    import numpy as np
    tiny_model.forward(np.array([1, 2, 3]), 0, tiny_model.new_cache(8))
    assert not options.numba_cache_is_cold()
