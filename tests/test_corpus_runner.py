"""The chunk runner: N worker processes give what one gives; a killed worker costs a retry."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import numpy as np
import pytest

from llamatrace.corpus import perplexity as corpus
from llamatrace.corpus.chunks import make_chunks, read_corpus
from llamatrace.corpus.runner import run_chunks
from llamatrace.corpus.worker import ModelSpec

CORPUS = Path(__file__).parent / "golden" / "corpus.txt"
DIE_ON = 1                                  # the chunk whose first worker exits


def dying_score_chunk(model, payload):
    """score_chunk, but the first worker to get chunk DIE_ON exits at once (marker file)."""
    index, job, marker = payload
    if index == DIE_ON and not marker.exists():
        marker.write_text("died")
        os._exit(1)
    return corpus.score_chunk(model, job)


@pytest.fixture(scope="module")
def chunks(tiny_model):
    text = read_corpus(CORPUS)
    return make_chunks(tiny_model.tokenizer, text, 32, 6, tiny_model.config.max_seq_len)


def run(spec, chunks, workers, work=corpus.score_chunk, wrap=lambda i, job: job, ray=None):
    results = []
    run_chunks(spec, chunks.n_chunk, lambda i: wrap(i, corpus._job(chunks, i)), work,
               lambda i, r: results.append((i, r)), workers, ray=ray)
    return results


def test_two_workers_give_every_digit_of_one(tiny_model_path, chunks):
    spec = ModelSpec(str(tiny_model_path), "f32")
    one = corpus.perplexity(spec, chunks, workers=1)
    two = corpus.perplexity(spec, chunks, workers=2)
    assert one.running == two.running and (one.ppl, one.ppl_error) == (two.ppl, two.ppl_error)
    assert len(one.running) == 6


def test_a_killed_worker_costs_a_retry_not_a_chunk(tiny_model_path, chunks, tmp_path):
    spec = ModelSpec(str(tiny_model_path), "f32")
    want = run(spec, chunks, 1)
    got = run(spec, chunks, 2, dying_score_chunk, wrap=lambda i, job: (i, job, tmp_path / "marker"))
    assert (tmp_path / "marker").exists()                        # a worker did die
    assert [i for i, _ in got] == list(range(chunks.n_chunk))    # each chunk once, in order
    for (_, a), (_, b) in zip(want, got):
        np.testing.assert_array_equal(a, b)


@pytest.fixture(scope="module")
def local_ray():
    """A local Ray cluster for this module; the test module's functions travel by value."""
    import ray
    import ray.cloudpickle
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, logging_level="ERROR")
    yield ray
    ray.shutdown()


def test_ray_actors_give_every_digit_of_one_worker_and_survive_a_killed_actor(tiny_model_path, chunks, tmp_path,
                                                                               local_ray):
    spec = ModelSpec(str(tiny_model_path), "f32")
    one = corpus.perplexity(spec, chunks, workers=1)
    on_ray = corpus.perplexity(spec, chunks, workers=2, ray="local")
    assert one.running == on_ray.running and one.ppl_error == on_ray.ppl_error
    want = run(spec, chunks, 1)
    got = run(spec, chunks, 2, dying_score_chunk, wrap=lambda i, job: (i, job, tmp_path / "marker"), ray="local")
    assert (tmp_path / "marker").exists()                        # an actor did die
    assert [i for i, _ in got] == list(range(chunks.n_chunk))
    for (_, a), (_, b) in zip(want, got):
        np.testing.assert_array_equal(a, b)


class KillAfterDone:
    """A worker's pipe that, once it has read the worker's "done" for chunk 0, SIGKILLs the worker
    and waits for its end: the next send meets a closed pipe (issue 33, finding 1)."""

    def __init__(self, conn, process) -> None:
        self.conn, self.process = conn, process

    def recv(self):
        message = self.conn.recv()
        if message[:2] == ("done", 0):
            self.process.kill()
            self.process.join()
        return message

    def __getattr__(self, name):
        return getattr(self.conn, name)


def test_a_worker_dead_between_its_result_and_the_next_send_costs_a_retry(tiny_model_path, chunks, monkeypatch):
    from llamatrace.corpus import runner
    original = runner._Worker.__init__

    def init(self, *args):
        original(self, *args)
        self.conn = KillAfterDone(self.conn, self.process)

    monkeypatch.setattr(runner._Worker, "__init__", init)
    spec = ModelSpec(str(tiny_model_path), "f32")
    want = run(spec, chunks, 1)
    got = run(spec, chunks, 2)
    assert [i for i, _ in got] == list(range(chunks.n_chunk))    # each chunk once, in order
    for (_, a), (_, b) in zip(want, got):
        np.testing.assert_array_equal(a, b)


def failing_work(model, payload):
    """Fails as a bug would: not one of our errors."""
    raise ValueError(f"no such thing as {payload!r}")


def kernel_threads(model, payload):
    import numba
    return numba.get_num_threads()


@pytest.mark.parametrize("where", ["workers", "ray"])
def test_an_unexpected_worker_error_names_its_cause_and_keeps_its_traceback(tiny_model_path, where, request):
    from llamatrace.corpus.worker import RemoteTraceback
    from llamatrace.errors import PeerError
    ray = None
    if where == "ray":
        request.getfixturevalue("local_ray")
        ray = "local"
    with pytest.raises(PeerError, match="ValueError: no such thing as 7") as caught:
        run_chunks(ModelSpec(str(tiny_model_path), "f32"), 2, lambda i: 7, failing_work, lambda i, r: None, 2,
                   ray=ray)
    remote = caught.value.__cause__                 # what --debug prints above the error line
    assert isinstance(remote, RemoteTraceback) and "in failing_work" in str(remote), remote


def test_a_ray_actor_without_the_model_names_its_node_and_the_cause(tmp_path, local_ray):
    import socket

    from llamatrace.errors import ModelNotFoundError
    missing = tmp_path / "not-on-this-node.gguf"
    with pytest.raises(ModelNotFoundError) as caught:
        run_chunks(ModelSpec(str(missing), "f32"), 2, lambda i: i, kernel_threads, lambda i, r: None, 2,
                   ray="local")
    message = str(caught.value)
    assert message.startswith(f"Ray node {socket.gethostname()} (") and str(missing) in message, message


def test_a_ray_actor_runs_the_threads_it_reserved(tiny_model_path, local_ray):
    from llamatrace.errors import OptionError
    got = {}
    for threads in (None, 2):                       # the cluster has 2 CPUs (local_ray)
        results = []
        run_chunks(ModelSpec(str(tiny_model_path), "f32", threads), 2, lambda i: i, kernel_threads,
                   lambda i, r: results.append(r), 2, ray="local")
        got[threads] = results
    assert got == {None: [1, 1], 2: [2, 2]}
    with pytest.raises(OptionError, match="--threads 3: each Ray actor reserves"):
        run_chunks(ModelSpec(str(tiny_model_path), "f32", 3), 2, lambda i: i, kernel_threads, lambda i, r: None, 2,
                   ray="local")


def test_ray_local_actors_run_at_the_run_priority(monkeypatch):
    """`--ray local` starts its cluster with RAY_worker_niceness=0 (Ray's default is nice 15, which
    a busy machine starves); a value the user set is kept; joining a cluster changes nothing."""
    import ray

    from llamatrace.corpus import ray_runner
    seen = []
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", lambda **kw: seen.append((kw["address"], os.environ.get("RAY_worker_niceness"))))
    monkeypatch.delenv("RAY_worker_niceness", raising=False)
    ray_runner.connect("local")
    monkeypatch.setenv("RAY_worker_niceness", "5")
    ray_runner.connect("local")
    monkeypatch.delenv("RAY_worker_niceness")
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    ray_runner.connect("auto")
    assert seen == [("local", "0"), ("local", "5"), ("auto", None)]
