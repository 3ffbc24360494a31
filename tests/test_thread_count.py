"""The forward pass gives the same bits whatever the thread count.

``AutoThreads`` (llamatrace/machine/threads.py) picks each decode step's thread count by timing,
so on a busy machine the count changes from run to run. Exact-output tests (the README's
answers, golden text) can stay exact only if no kernel's arithmetic depends on the count: work is
split in fixed pieces (rows, tiles, 32-key chunks summed in order), never by the thread count.
"""

from __future__ import annotations

import numba
import numpy as np
import pytest

from gguf_factory import T, write_tiny_llama
from llamatrace.kernels.int8 import act8
from llamatrace.model.llama import Llama

pytestmark = pytest.mark.skipif(numba.config.NUMBA_NUM_THREADS < 2, reason="needs 2 or more Numba threads")

PROMPT = [(7 * i + 3) % 200 + 1 for i in range(70)]      # > 2 attention key chunks of 32
DECODE = [5, 17, 42]


def _logits(model: Llama, threads: int) -> list[np.ndarray]:
    """The prefill's last logits and each decode step's, computed on ``threads`` threads."""
    before = numba.get_num_threads()
    numba.set_num_threads(threads)
    try:
        cache = model.new_cache(len(PROMPT) + len(DECODE))
        out = [model.forward(np.asarray(PROMPT), 0, cache)[-1].copy()]
        for token in DECODE:
            out.append(model.forward(np.asarray([token]), cache.pos, cache)[-1].copy())
        return out
    finally:
        numba.set_num_threads(before)


@pytest.mark.parametrize("qtype, activations, size", [
    (T.Q8_0, "f32", 64), (T.Q8_0, "q8", 64), (T.Q4_K, "q8", 256), (T.Q6_K, "q8", 256), (T.Q6_K, "f32", 256),
])
def test_one_thread_and_all_give_the_same_bits(tmp_path, qtype, activations, size):
    if activations == "q8" and not act8.available():
        pytest.skip("q8 activations need AVX2")
    path = write_tiny_llama(tmp_path / f"{qtype.name}.gguf", qtype=qtype, dim=size, hidden_dim=size,
                            n_heads=4, n_kv_heads=2, context_length=128)
    model = Llama.load(path, activations=activations)
    one = _logits(model, 1)
    every = _logits(model, numba.config.NUMBA_NUM_THREADS)
    for step, (a, b) in enumerate(zip(one, every)):
        assert np.array_equal(a, b), f"step {step}: max difference {np.abs(a - b).max()}"
