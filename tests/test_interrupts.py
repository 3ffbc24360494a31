"""Ctrl-C at any moment of a command ends with ``interrupted`` and exit 130, no traceback; and
the environment's thread settings (``$NUMBA_NUM_THREADS``, CPU affinity) give one error line
or a working run.

Each Ctrl-C is a real SIGINT sent to a subprocess held at a known moment (an import, a function,
a chunk), never after a sleep: the subprocess says ``held`` and waits for the signal."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import textwrap
import tomllib
from pathlib import Path

import pytest

from llamatrace.corpus import runner, worker
from llamatrace.machine import runtime

REPO = Path(__file__).resolve().parents[1]
CORPUS = REPO / "tests" / "golden" / "corpus.txt"
CPUS = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
ENTRY = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]["llamatrace"]

# What the `llamatrace` script that pip writes does, after the test's set-up; `hold()` says
# "held" and waits for the test's SIGINT, however late it comes.
SCRIPT = """
import os, signal, sys
def hold(*args, **kwargs):
    os.write(2, b"held\\n")
    signal.pause()
{setup}
from {module} import {function}
sys.argv = ["llamatrace", *{args!r}]
sys.exit({function}())
"""

# the import of MODULE holds (a finder asked first, before the module runs)
HOLD_IMPORT = """
class HoldImport:
    def find_spec(self, name, path=None, target=None):
        if name == {name!r}:
            hold()
sys.meta_path.insert(0, HoldImport())
"""


def _start(setup: str, args: list[str], **popen) -> subprocess.Popen:
    module, function = ENTRY.split(":")
    code = SCRIPT.format(setup=setup, module=module, function=function, args=[str(a) for a in args])
    return subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env={**os.environ, "PYTHONPATH": str(REPO)}, **popen)


def _interrupt_when_held(proc: subprocess.Popen, group: bool = False) -> tuple[int, str, str]:
    """SIGINT ``proc`` (its whole process group, as a terminal's Ctrl-C, if ``group``) once it
    says ``held``; returns its exit code, stdout and the rest of its stderr."""
    try:
        line = proc.stderr.readline()
        if line.strip() != "held":
            os.killpg(proc.pid, signal.SIGKILL) if group else proc.kill()
            pytest.fail(line + proc.stderr.read())
        if group:
            os.killpg(proc.pid, signal.SIGINT)
        else:
            proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=300)        # a hang guard, not a speed check
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL) if group else proc.kill()
    return proc.returncode, out, err


def _assert_interrupted(code: int, err: str, last_line: str = "interrupted") -> None:
    assert code == 130, err
    assert "Traceback" not in err and "Exception ignored" not in err and "warning" not in err, err
    assert err.strip().splitlines() == [last_line], err


# ---- start-up: imports, options, model, load, compile ----------------------------------------------
@pytest.mark.parametrize("module", ["llamatrace.cli", "typer", "numpy", "llamatrace.kernels.int8.act8", "numba"])
def test_ctrl_c_during_the_imports_of_start_up_exits_130_quietly(tiny_model_path, module):
    proc = _start(HOLD_IMPORT.format(name=module), ["generate", "--raw", "-n", "2", "-m", tiny_model_path, "hi"])
    _assert_interrupted(*_interrupt_when_held(proc)[::2])


# after the imports: the function that holds is replaced once the app is imported
HOLD_CALL = """
import importlib
setattr(importlib.import_module({module!r}), {name!r}, hold)
"""
HOLD_COMPILE = """
from numba.core.dispatcher import Dispatcher
Dispatcher.compile = hold              # the first kernel's compile (or its load from the cache)
"""


@pytest.mark.parametrize("setup", [
    HOLD_CALL.format(module="llamatrace.cli.app", name="_take_global_flags"),      # options
    HOLD_CALL.format(module="llamatrace.gguf.fetch", name="resolve_model"),        # which model
    HOLD_CALL.format(module="llamatrace.cli.options", name="load_model"),          # load
    HOLD_COMPILE,
], ids=["options", "model", "load", "compile"])
def test_ctrl_c_at_each_later_moment_of_start_up_exits_130_quietly(tiny_model_path, setup):
    proc = _start(setup, ["generate", "--raw", "-n", "2", "-m", tiny_model_path, "hi"])
    _assert_interrupted(*_interrupt_when_held(proc)[::2])


# ---- a Ctrl-C cannot be lost -------------------------------------------------------------------------
# the SIGINT lands in a finalizer (as in llvmlite's ObjectRef.__del__ while Numba compiles): Python
# prints "Exception ignored in" and drops the KeyboardInterrupt raised there
LOST_IN_A_FINALIZER = """
import llamatrace.corpus.perplexity as corpus
score_chunk = corpus.score_chunk
class Finalized:
    def __del__(self):
        signal.raise_signal(signal.SIGINT)
def lose_an_interrupt(model, job):
    Finalized()                        # collected at once: its __del__ runs here
    return score_chunk(model, job)
corpus.score_chunk = lose_an_interrupt
"""
HOLD_IN_A_CHUNK = """
import llamatrace.corpus.perplexity as corpus
score_chunk = corpus.score_chunk
def hold_in_chunk_2(model, job):
    hold_in_chunk_2.calls += 1
    if hold_in_chunk_2.calls == 2:
        hold()
    return score_chunk(model, job)
hold_in_chunk_2.calls = 0
corpus.score_chunk = hold_in_chunk_2
"""


HOLD_IN_A_KLD_CHUNK = """
import llamatrace.corpus.perplexity as corpus
score_chunk = corpus.score_chunk
def hold_in_kld(model, job):
    if job.mode == "kld":
        hold()
    return score_chunk(model, job)
corpus.score_chunk = hold_in_kld
"""


def test_ctrl_c_after_the_base_pass_says_the_saved_base_is_complete(tiny_model_path, tmp_path):
    """It said 'nothing written' while --save-base's file was whole (and had replaced an old one)."""
    saved = tmp_path / "b.base"
    proc = _start(HOLD_IN_A_KLD_CHUNK, ["perplexity", "-f", CORPUS, "-m", tiny_model_path, "-c", "32",
                                        "--base", tiny_model_path, "--save-base", saved])
    code, out, err = _interrupt_when_held(proc)
    _assert_interrupted(code, err, f"interrupted: the base file {saved} is complete (reuse it: --base {saved}); "
                                   f"nothing else written")
    assert saved.is_file()


def test_a_ctrl_c_lost_in_a_finalizer_still_stops_perplexity(tiny_model_path):
    proc = _start(LOST_IN_A_FINALIZER, ["perplexity", "-f", CORPUS, "-m", tiny_model_path, "-c", "32"])
    out, err = proc.communicate(timeout=300)
    _assert_interrupted(proc.returncode, err, "interrupted: nothing written")
    assert "[1]" not in out                  # stopped in its first chunk, not run to the end


def test_ctrl_c_while_perplexity_computes_a_chunk_exits_130_quietly(tiny_model_path):
    proc = _start(HOLD_IN_A_CHUNK, ["perplexity", "-f", CORPUS, "-m", tiny_model_path, "-c", "32"])
    code, out, err = _interrupt_when_held(proc)
    _assert_interrupted(code, err, "interrupted: nothing written")
    assert out.startswith("[1]") and "[2]" not in out


def test_a_lost_interrupt_is_raised_at_the_next_safe_point(monkeypatch):
    monkeypatch.setattr(runtime, "_interrupted", False)
    runtime.check_interrupt()                         # nothing came: nothing raised
    monkeypatch.setattr(runtime, "_interrupted", True)    # what the handler records before it raises
    with pytest.raises(KeyboardInterrupt):
        runner.run_chunks(runner.ModelSpec("unused"), 3, lambda i: i, pow, lambda i, r: None, model=2)


@pytest.mark.skipif(not hasattr(os, "killpg"), reason="process groups")
def test_ctrl_c_to_the_group_while_a_worker_starts_exits_130_quietly(tiny_model_path, tmp_path):
    """A terminal's Ctrl-C reaches the workers too, here while one imports the chunk's work."""
    (tmp_path / "sitecustomize.py").write_text(textwrap.dedent("""
        import os, signal, sys
        if os.environ.get("HOLD_WORKER_IMPORT") and sys.argv[-1:] == ["--multiprocessing-fork"]:
            class HoldImport:
                def find_spec(self, name, path=None, target=None):
                    if name != os.environ["HOLD_WORKER_IMPORT"]:
                        return None
                    os.write(2, b"held\\n")     # one write: the other worker may write it too
                    if signal.SIGINT in signal.pthread_sigmask(signal.SIG_BLOCK, []):
                        signal.sigwait({signal.SIGINT})     # it came: held again, as it was
                        signal.raise_signal(signal.SIGINT)
                    else:
                        signal.pause()
            sys.meta_path.insert(0, HoldImport())
    """))
    module, function = ENTRY.split(":")
    code = f"import sys; from {module} import {function}; sys.exit({function}())"
    proc = subprocess.Popen(
        [sys.executable, "-c", code, "perplexity", "-f", str(CORPUS), "-m", str(tiny_model_path), "-c", "32",
         "--workers", "2"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
        env={**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{REPO}",
             "HOLD_WORKER_IMPORT": "llamatrace.corpus.perplexity"})
    code, out, err = _interrupt_when_held(proc, group=True)
    assert code == 130 and "Traceback" not in err and "Exception ignored" not in err, err
    assert [ln for ln in err.splitlines() if ln.strip() and ln != "held"] == ["interrupted: nothing written"], err


# ---- $NUMBA_NUM_THREADS and CPU affinity ---------------------------------------------------------------
@pytest.mark.parametrize("value", ["0", "-1", "two", "1.5", str(CPUS + 1)])
def test_a_bad_numba_num_threads_is_one_error_line(tiny_model_path, value):
    result = subprocess.run([sys.executable, "-m", "llamatrace", "generate", "--raw", "-n", "1", "-m",
                             str(tiny_model_path), "hi"], capture_output=True, text=True, timeout=300,
                            env={**os.environ, "PYTHONPATH": str(REPO), "NUMBA_NUM_THREADS": value})
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1, result.stderr
    assert lines[0].startswith("error: NUMBA_NUM_THREADS=") and f"from 1 to {CPUS}" in lines[0]


def test_threads_per_worker_split_the_cpus_of_the_affinity(monkeypatch):
    """4 of 64 cores (taskset, a container): the workers share the 4, which Numba's pool holds."""
    monkeypatch.setattr(os, "cpu_count", lambda: 64)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3}, raising=False)
    monkeypatch.delenv("NUMBA_NUM_THREADS", raising=False)
    assert runtime.usable_cpus() == 4
    assert [worker.threads_per_worker(w, None) for w in (1, 2, 3, 4, 8)] == [4, 2, 1, 1, 1]
    assert worker.threads_per_worker(2, 3) == 3                    # --threads as given
    monkeypatch.setenv("NUMBA_NUM_THREADS", "2")
    assert worker.threads_per_worker(1, None) == 2


@pytest.mark.skipif(shutil.which("taskset") is None, reason="needs taskset")
def test_perplexity_in_a_worker_under_taskset_runs(tiny_model_path):
    """One CPU of the machine's: the worker's threads fit Numba's pool (it refused them before)."""
    result = subprocess.run(["taskset", "-c", "0", sys.executable, "-m", "llamatrace", "perplexity", "-f", str(CORPUS),
                             "-m", str(tiny_model_path), "--base", str(tiny_model_path), "--stages", "-c", "32",
                             "--chunks", "2", "--json"], capture_output=True, text=True, timeout=600,
                            env={**os.environ, "PYTHONPATH": str(REPO)})
    assert result.returncode == 0, result.stderr
