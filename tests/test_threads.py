"""The kernels' thread policy (one thread per core other processes leave free), the busy loops
that make a machine busy on purpose, and what importing llamatrace does to a process's Numba.
No outcome here depends on timing: the load signal is injected, or made of processes known to
be running."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time

import pytest

from cli_helpers import assert_one_line_error, run
from llamatrace.analysis.busy import busy_loops
from llamatrace.machine import threads

LINUX = sys.platform.startswith("linux")


@pytest.mark.parametrize("cores, cpus, elsewhere, expected", [
    (2, 2, None, 2),     # no signal (not Linux): every core, as Numba would
    (2, 2, 0, 2),        # the cores are free
    (2, 2, 1, 1),        # one busy task: a second thread would wait for its slices; the free core's
    (2, 2, 2, 1),        # no core free: one thread for a model of short regions (large ones: below)
    (2, 2, 3, 1),        # oversubscribed: one thread, which never waits for another
    (2, 2, 12, 1),
    (1, 2, 0, 1),        # never more than this process may use
    (2, 8, 6, 2),        # pinned to 2 of 8 cores: counted against the machine's 8
    (2, 8, 7, 1),
    (4, 8, 6, 2),        # two cores free: two threads
    (2, 8, 9, 1),
])
def test_threads_for_takes_the_cores_other_processes_leave_free(cores, cpus, elsewhere, expected):
    assert threads.threads_for(cores, cpus, elsewhere) == expected
    assert threads.threads_for(cores, cpus, elsewhere, 576 * 1536) == expected     # SmolLM2-135M


@pytest.mark.parametrize("dim, hidden_dim, expected", [
    (576, 1536, 1),      # SmolLM2-135M: regions of ~40 µs, one thread on a crowded machine
    (960, 2560, 1),      # SmolLM2-360M
    (896, 4864, 2),      # Qwen2.5-0.5B
    (2048, 8192, 2),     # Llama-3.2-1B
    (4096, 14336, 2),    # Llama-3.1-8B: regions of milliseconds, every core
])
def test_a_crowded_machine_gives_one_thread_only_to_small_models(dim, hidden_dim, expected):
    assert threads.threads_for(2, 2, 12, dim * hidden_dim) == expected
    assert threads.threads_for(2, 2, 2, dim * hidden_dim) == expected   # no core free: the same
    assert threads.threads_for(2, 2, 1, dim * hidden_dim) == 1          # one free: every model takes it
    assert threads.threads_for(2, 2, 0, dim * hidden_dim) == 2


def test_running_count_reads_the_fourth_field_of_loadavg():
    assert threads.running_count("0.52 0.58 0.59 3/467 12345\n") == 3
    assert threads.running_count("10.03 7.23 3.48 11/150 20040") == 11
    with pytest.raises(ValueError):
        threads.running_count("0.52 0.58 0.59")


def test_running_threads_counts_state_r_whatever_the_command_name():
    stats = [
        "4242 (python3) R 1 4242 4242 0 -1 4194560 5000 0 0 0 120 30 0 0 20 0 5 0",
        "4243 (numba (omp) 1) S 1 4242 4242 0 -1 4194624 10 0 0 0 0 0 0 0 20 0 5 0",   # spaces, parentheses
        "4244 (a) R) S 1 4242 4242 0 -1 0 0 0 0 0 0 0 0 0 20 0 5 0",                    # ") R" inside the name
        "4245 (OMP worker) R 1 4242 4242 0 -1 0 0 0 0 0 0 0 0 0 20 0 5 0",
        "4246 (x) D 1 4242 4242 0 -1 0 0 0 0 0 0 0 0 0 20 0 5 0",
    ]
    assert threads.running_threads(stats) == 2


@pytest.mark.skipif(not LINUX, reason="/proc")
def test_runnable_elsewhere_sees_busy_loops():
    # each loop never sleeps once it has said it is ready, so the kernel counts it runnable
    with busy_loops(2):
        assert threads.runnable_elsewhere() >= 2


@pytest.mark.skipif(not LINUX, reason="/proc")
def test_task_stats_follow_the_threads_and_a_fork():
    import os
    import select
    import signal
    import threading
    started, stop = threading.Event(), threading.Event()
    t = threading.Thread(target=lambda: (started.set(), stop.wait()))
    t.start()
    started.wait()
    try:
        assert str(t.native_id) in threads._task_stats()         # a new thread's file opened
    finally:
        stop.set()
        t.join()
    stats = threads._task_stats()
    assert str(t.native_id) not in stats                        # an ended thread's file closed
    assert f"/proc/self/task/{t.native_id}/stat" not in threads._PROC.paths()
    assert set(stats) == set(os.listdir("/proc/self/task"))
    read, write = os.pipe()
    held, release = threading.Event(), threading.Event()       # forked while another thread reads /proc:
    reader = threading.Thread(target=lambda: (threads._PROC_LOCK.acquire(), held.set(), release.wait(),
                                              threads._PROC_LOCK.release()))
    reader.start()
    held.wait()
    pid = os.fork()                                             # the child has no such thread, yet reads too
    if pid == 0:                                                # the child: its own tasks, not the parent's
        os.close(read)
        ok = set(threads._task_stats()) == set(os.listdir("/proc/self/task")) == {str(os.getpid())}
        ok = ok and threads.runnable_elsewhere() is not None
        os.write(write, b"1" if ok else b"0")
        os._exit(0)
    os.close(write)
    release.set()
    reader.join()
    ready, _, _ = select.select([read], [], [], 30)            # a child stuck on the parent's lock never answers
    answer = os.read(read, 1) if ready else b""
    os.close(read)
    if not ready:
        os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    assert answer == b"1"
    assert set(threads._task_stats()) == set(os.listdir("/proc/self/task"))   # the parent's, still


class Signal:
    """An injected load signal and clock: ``values`` are what each read returns."""

    def __init__(self, values):
        self.values, self.reads, self.now = list(values), 0, 0.0

    def __call__(self):
        self.reads += 1
        return self.values.pop(0)


@pytest.fixture
def set_calls(monkeypatch):
    import numba
    calls = []
    monkeypatch.setattr(threads, "_fixed_threads", None)
    monkeypatch.setattr(numba, "set_num_threads", calls.append)
    return calls


def test_auto_threads_follow_the_signal_and_remember_a_burst(set_calls):
    sig = Signal([0, 5, 0, 0, 0, 3])
    auto = threads.AutoThreads(cores=2, cpus=2, elsewhere=sig, clock=lambda: sig.now, every=1.0, window=3)
    picks = []
    for _ in range(6):
        picks.append(auto.pick())
        sig.now += 1.0
    # free; oversubscribed; then free again, but the burst is remembered for 3 reads; then oversubscribed
    assert picks == [2, 1, 1, 1, 2, 1]
    assert set_calls == picks and sig.reads == 6


def test_auto_threads_leave_a_free_core_only_for_a_task_seen_in_every_read(set_calls):
    """One busy task elsewhere on 2 cores gives one thread, but only when the last reads all saw
    it: a single read of 1 is as often one of our own threads caught between its two files."""
    sig = Signal([0, 1, 0, 1, 1, 1, 0])
    auto = threads.AutoThreads(cores=2, cpus=2, elsewhere=sig, clock=lambda: sig.now, every=1.0, window=3)
    picks = []
    for _ in range(7):
        picks.append(auto.pick(threads.SMALL_MATRIX))
        sig.now += 1.0
    assert picks == [2, 2, 2, 2, 2, 1, 2] and set_calls == picks


def test_auto_threads_read_the_signal_at_most_every_interval(set_calls):
    sig = Signal([3, 0])
    auto = threads.AutoThreads(cores=2, cpus=2, elsewhere=sig, clock=lambda: sig.now, every=1.0, window=1)
    assert [auto.pick() for _ in range(5)] == [1] * 5        # the clock stands still: one read
    sig.now = 0.5
    assert auto.pick() == 1 and sig.reads == 1
    sig.now = 1.0
    assert auto.pick() == 2 and sig.reads == 2


def test_auto_threads_without_a_signal_use_every_core(set_calls):
    auto = threads.AutoThreads(cores=2, cpus=2, elsewhere=lambda: None)
    assert auto.pick() == 2


def test_auto_threads_pass_the_model_size_on(set_calls):
    auto = threads.AutoThreads(cores=2, cpus=2, elsewhere=lambda: 5)
    assert auto.pick(4096 * 14336) == 2 and auto.pick(576 * 1536) == 1 and auto.pick() == 1


def test_a_mixtures_region_is_its_chosen_experts(set_calls):
    """Qwen3-30B-A3B: an expert is 2048 x 768 (1.6 M weights, small), but a decode step runs its
    8 chosen experts' gate|up in one region; SmolLM2-135M's regions stay small."""
    from llamatrace.model.config import ModelConfig
    base = dict(n_layers=1, vocab_size=10, norm_eps=1e-6, rope_theta=1e4, max_seq_len=64)
    moe = ModelConfig(dim=2048, n_heads=32, n_kv_heads=4, head_dim=128, hidden_dim=768, rope_dim=128,
                      arch="qwen3moe", n_expert=128, n_expert_used=8, expert_hidden_dim=768, **base)
    smol = ModelConfig(dim=576, n_heads=9, n_kv_heads=3, head_dim=64, hidden_dim=1536, rope_dim=64, **base)
    assert moe.region_weights == 8 * 2048 * 768 >= threads.SMALL_MATRIX > 2048 * 768
    assert smol.region_weights == 576 * 1536 < threads.SMALL_MATRIX
    auto = threads.AutoThreads(cores=2, cpus=2, elsewhere=lambda: 5)
    assert auto.pick(moe.region_weights) == 2 and auto.pick(smol.region_weights) == 1


def test_fixed_threads_are_not_overridden(set_calls, monkeypatch):
    import numba
    threads.set_threads(1)
    try:
        auto = threads.AutoThreads(cores=2, cpus=2, elsewhere=lambda: 0)
        assert {auto.pick() for _ in range(5)} == {1}
        assert auto.describe() == "1 thread"
    finally:
        monkeypatch.setattr(threads, "_fixed_threads", None)
        numba.set_num_threads(numba.config.NUMBA_NUM_THREADS)


def test_busy_loops_stop_when_the_block_raises():
    with pytest.raises(RuntimeError):
        with busy_loops(2) as procs:
            assert all(p.poll() is None for p in procs)
            raise RuntimeError("boom")
    assert all(p.returncode is not None for p in procs)


@pytest.mark.skipif(not LINUX, reason="/proc, SIGKILL")
def test_busy_loops_outlive_no_killed_parent():
    """A parent killed with SIGKILL (no clean-up runs) leaves no loop spinning."""
    parent = subprocess.Popen([sys.executable, "-c", textwrap.dedent("""
        import signal, sys
        from llamatrace.analysis.busy import busy_loops
        with busy_loops(2) as procs:
            print(" ".join(str(p.pid) for p in procs), flush=True)
            signal.pause()
        """)], stdout=subprocess.PIPE, text=True)
    pids = [int(p) for p in parent.stdout.readline().split()]
    assert len(pids) == 2
    parent.kill()
    parent.wait()
    for pid in pids:            # each notices within ~10 ms; the deadline only guards a hang
        deadline = time.monotonic() + 60
        while _alive(pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _alive(pid), f"busy loop {pid} outlived its parent"


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_bench_background_load(capsys, tiny_model_path, monkeypatch):
    monkeypatch.setattr(threads, "_fixed_threads", None)   # an earlier test's --threads (process-wide) is not bench's
    code, out, err = run(capsys, "bench", "--model", str(tiny_model_path), "--prompt-tokens", "4",
                         "--decode-tokens", "2", "--repeats", "1", "--background-load", "1", "--json")
    assert code == 0, err
    report = json.loads(out)
    assert report["background_load"] == 1
    assert report["results"][0]["threading"].endswith(threads.AUTO_THREADS.describe())
    for n in ("-1", "999"):                      # 999 started 999 busy loops on 2 cores
        assert_one_line_error(*run(capsys, "bench", "-m", str(tiny_model_path), "--background-load", n),
                              "--background-load", n)


# ---------------------------------------------------------------------------------------------
# importing llamatrace leaves the host's Numba alone; llamatrace's own entry points configure it

_SNAPSHOT = """
import json, os, sys
import numba
def snapshot():
    with open("/proc/self/maps") as fh:
        tbb = "libtbb" in fh.read()
    c = numba.config
    return {"env": dict(os.environ), "priority": list(c.THREADING_LAYER_PRIORITY),
            "layer": c.THREADING_LAYER, "cache": c.CACHE_DIR, "threads": c.NUMBA_NUM_THREADS, "tbb": tbb}
"""


def _without_numba_env() -> dict:
    return {k: v for k, v in os.environ.items() if not k.startswith(("NUMBA_", "OMP_", "GOMP_"))}


@pytest.mark.skipif(not LINUX, reason="/proc/self/maps")
def test_importing_llamatrace_changes_no_numba_setting():
    code = _SNAPSHOT + textwrap.dedent("""
        before = snapshot()
        import llamatrace, llamatrace.model.llama, llamatrace.machine.threads
        llamatrace.Llama
        print(json.dumps([before, snapshot()]))
        """)
    done = subprocess.run([sys.executable, "-c", code], env=_without_numba_env(), capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    before, after = json.loads(done.stdout)
    assert after == before


def test_the_cli_runs_openmp_first_even_when_numba_was_imported_first():
    code = textwrap.dedent("""
        import numba
        from llamatrace.cli import main
        from llamatrace.machine import threads
        try:
            import numba.np.ufunc.omppool
            has_omp = True
        except ImportError:
            has_omp = False
        print(" ".join(numba.config.THREADING_LAYER_PRIORITY), has_omp, threads.threading_layer())
        """)
    done = subprocess.run([sys.executable, "-c", code], env=_without_numba_env(), capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    *priority, has_omp, layer = done.stdout.split()
    assert priority == ["omp", "tbb", "workqueue"]
    if has_omp == "True":
        assert layer == "omp"


def test_the_cli_command_reports_openmp(tiny_model_path):
    env = _without_numba_env()
    done = subprocess.run([sys.executable, "-m", "llamatrace", "info", "--model", str(tiny_model_path)],
                          env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    try:
        import numba.np.ufunc.omppool  # noqa: F401
    except ImportError:
        pytest.skip("this Numba has no OpenMP layer")
    assert "threading layer 'omp'" in " ".join(done.stdout.split())


def test_every_forward_call_asks_the_policy_first(tiny_model, monkeypatch):
    """The prefill too: the thread count is chosen before the first call, not after a measurement."""
    from types import SimpleNamespace

    from llamatrace.model import llama
    from llamatrace.model.generate import generate
    asked = []
    monkeypatch.setattr(llama, "AUTO_THREADS", SimpleNamespace(pick=lambda weights=None: asked.append(weights)))
    tokens = list(generate(tiny_model, [1, 2, 3], max_tokens=3, stop_ids=frozenset()))
    c = tiny_model.config
    assert len(tokens) == 3 and asked == [c.dim * c.hidden_dim] * 3      # prefill + 2 decode steps


def test_auto_threads_tell_the_kernels_when_the_machine_is_crowded(set_calls, monkeypatch):
    """Whatever the count (a large model's, a fixed one), each forward call's pick notes whether
    other processes' tasks and its threads crowd the cores, for the kernels' short regions
    (threads.crowded): on 2 cores one busy task elsewhere is enough at 2 threads, not at 1."""
    sig = Signal([5, 0, 1, 1, 1, 3])
    auto = threads.AutoThreads(cores=2, cpus=2, elsewhere=sig, clock=lambda: sig.now, every=1.0, window=1)
    seen = []
    for fixed in (None, None, None, 2, 1, 1):
        monkeypatch.setattr(threads, "_fixed_threads", fixed)
        auto.pick(threads.SMALL_MATRIX)
        seen.append(threads.crowded())
        sig.now += 1.0
    # one busy task: the policy's one thread fits beside it, two fixed threads do not
    assert seen == [True, False, False, True, False, True] and sig.reads == 6
    assert set_calls == [2, 2, 1]
