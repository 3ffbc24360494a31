"""The chunk runner: N worker processes give what one gives; a killed worker costs a retry."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import numpy as np
import pytest

from llamatrace.corpus import perplexity as corpus
from llamatrace.corpus.chunks import make_chunks, read_corpus
from llamatrace.corpus.runner import ModelSpec, run_chunks

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
