"""Qwen3.5 against HF transformers, the second reference beside llama.cpp (tests/test_qwen35.py).

HF's float32 logits (``Qwen3_5ForCausalLM``, transformers 5.24) on ``tests/qwen35_files.py``'s
random-weight file with every rotary pair rotated are in ``tests/golden/qwen35_hf.npz``, made by
``tests/golden/make_qwen35_hf_golden.py`` (which maps the GGUF tensors back to HF's: the 1 + w
norms, −exp(A_log), the value heads from ggml's tiled order to HF's grouped one). torch and
transformers are needed only to remake that file, never here.
"""

from __future__ import annotations

import pytest

from arch_files import golden_arrays, relative, run_positions
from qwen35_files import write_qwen35_file

from llamatrace.model.llama import Llama

HF_SECTIONS = [2, 1, 1, 0]   # make_qwen35_hf_golden.py's: HF rotates every pair of a text token
F32_RTOL = 1e-4              # relative L2 distance per position, as against llama.cpp


@pytest.fixture(scope="module")
def golden():
    return golden_arrays("qwen35_hf.npz")


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen35hf") / "tiny-qwen35-hf.gguf"
    return Llama.load(write_qwen35_file(path, meta={"rope.dimension_sections": HF_SECTIONS}))


@pytest.mark.parametrize("prefill", [None, 66], ids=["one batch", "66 then one a step"])
def test_f32_logits_match_hf_transformers_at_every_position(model, golden, prefill):
    """80 tokens (past the 64-token chunk of both our prefill and HF's), 2 key heads under 4
    value heads: HF groups a key head's value heads, llama.cpp's files tile them."""
    ids = golden["ids"]
    ours = run_positions(model, ids, prefill or len(ids))
    ref = golden["prefill"]
    assert relative(ours, ref).max() <= F32_RTOL, relative(ours, ref).max()
    assert (ours.argmax(1) == ref.argmax(1)).all()
