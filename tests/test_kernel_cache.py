"""Numba's kernel cache sees a change to a callee in another file (llamatrace.machine.jit's locators).

Numba keys a cached kernel by its own file's content; a kernel whose callee lives in another
file kept the callee's old machine code after that file changed. These tests run a cached
kernel in fresh processes around such a change, with llamatrace's locators pointed at a package
of two files in ``tmp_path``.
"""

from __future__ import annotations

import subprocess
import sys

from llamatrace.machine import jit

CALLER = """\
from numba import njit
from callee import g


@njit(cache=True)
def f(x):
    return g(x) + 1
"""

CALLEE = """\
from numba import njit


@njit(cache=True)
def g(x):
    return x * {factor}
"""

RUN = """\
import sys
from pathlib import Path
sys.path.insert(0, {root!r})
import llamatrace.machine.jit as jit
jit._PACKAGE = Path({root!r})
import caller
print(caller.f(10), sum(caller.f.stats.cache_hits.values()))
"""


def _run(root) -> tuple[int, int]:
    out = subprocess.run([sys.executable, "-c", RUN.format(root=str(root))], capture_output=True, text=True,
                         check=True).stdout.split()
    return int(out[0]), int(out[1])


def test_a_callee_change_in_another_file_recompiles_the_caller(tmp_path):
    (tmp_path / "caller.py").write_text(CALLER)
    (tmp_path / "callee.py").write_text(CALLEE.format(factor=2))
    assert _run(tmp_path) == (21, 0)                 # compiled, cached
    assert _run(tmp_path) == (21, 1)                 # from the cache
    (tmp_path / "callee.py").write_text(CALLEE.format(factor=3))
    assert _run(tmp_path) == (31, 0)                 # the caller's file is unchanged, its kernel is not


def test_digest_covers_kernels_and_modules_importing_numba_only(tmp_path, monkeypatch):
    (tmp_path / "kernels").mkdir()
    files = {"kernels/tables.py": "TR = 16\n", "callee.py": CALLEE.format(factor=2), "cli.py": "HELP = 'a'\n"}
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    monkeypatch.setattr(jit, "_PACKAGE", tmp_path)

    def digest() -> str:
        jit.kernel_sources_digest.cache_clear()
        return jit.kernel_sources_digest()

    before = digest()
    (tmp_path / "cli.py").write_text("HELP = 'b'\n")              # no kernel reads it
    assert digest() == before
    for name, text in (("kernels/tables.py", "TR = 8\n"), ("callee.py", CALLEE.format(factor=3))):
        (tmp_path / name).write_text(text)
        assert digest() != before
        before = digest()
    jit.kernel_sources_digest.cache_clear()
