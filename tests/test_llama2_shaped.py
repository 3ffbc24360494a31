"""Seed 003's shapes: a Llama-2-7B-shaped GGUF (real Llama 2 vocabulary, random Q4_0 weights) traced
with a 32-token prompt prints the chapter's stage lines.

The file is written by the committed benchmarks/make_llama2_shaped.py with 2 layers of the full
width (~0.38 GB in tmp_path); the 32-layer file (~3.8 GB) is made and traced by that script only.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
from pathlib import Path

import pytest

from llamacpp_sdist import vocab_test_file
from llamatrace.gguf.reader import open_gguf
from llamatrace.text.tokenizer import Tokenizer

SCRIPT = Path(__file__).parent.parent / "benchmarks" / "make_llama2_shaped.py"


def load_script():
    spec = importlib.util.spec_from_file_location("make_llama2_shaped", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def llama2_trace(tmp_path_factory) -> str:
    make = load_script()
    path = tmp_path_factory.mktemp("llama2") / "llama2-shaped-2-layers.gguf"
    make.write(path, vocab_test_file("llama-spm"), n_layers=2)
    try:
        result = subprocess.run(make.trace_command(path), capture_output=True, text=True,
                                env={**os.environ, "COLUMNS": "200"})
    finally:
        path.unlink()
    assert result.returncode == 0, result.stderr[-2000:]
    return result.stdout + result.stderr


def test_prompt_is_32_llama2_tokens() -> None:
    path = vocab_test_file("llama-spm")
    tok = Tokenizer.from_reader(open_gguf(path), str(path))
    ids = tok.encode(load_script().PROMPT_32)
    assert len(ids) == 32 and ids[0] == tok.bos_id


@pytest.mark.parametrize("line", [
    "Calling Embedding for tokens shape([32]) and LlamaTransformer.tok_embd weights shape([32000 4096]) "
    "-> tensor inputTensor shape([32 4096])",
    "Calling LlamaTransformerBlock.Forward for layer: 1 / 2, startPos: 0 -> tensor currentTensor",
    "LlamaTransformerBlock.Forward started for x: shape([32 4096]), startPos: 0, freqsCis: shape([32 64]), "
    "mask: shape([32 32])",
    "Calling ml.LinearTransformation for x shape([32 4096]) and LlamaAttention.attn_wq weights "
    "shape([4096 4096]) -> tensor xq",
    "Calling ml.LinearTransformation for x shape([32 4096]) and LlamaAttention.attn_wk weights "
    "shape([4096 4096]) -> tensor xk",  # 32 KV heads: no GQA
    "Calling ml.Reshape for xq shape([32 4096]) -> tensor xq shape([32 32 128])",
    "Calling ml.Softmax for scores shape([32 32 32]) and dim 2 -> tensor scores",
    "Calling ml.LinearTransformation for x shape([32 4096]) and LlamaFeedForward.ffn_gate weights "
    "shape([11008 4096]) -> tensor h",
    "Calling ml.Silu for h shape([32 11008]) -> tensor h",
    "Calling ml.LinearTransformation for h shape([32 11008]) and LlamaFeedForward.ffn_down weights "
    "shape([4096 11008]) -> tensor output",
    "Returning tensor output: shape([32 32000])",
])
def test_trace_prints_the_chapters_stage_lines(llama2_trace: str, line: str) -> None:
    assert line in llama2_trace
