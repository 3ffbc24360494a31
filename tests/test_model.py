"""The forward pass on tiny generated models, checked against tests/reference.py (float64 NumPy
over gguf.quants.dequantize weights)."""

from __future__ import annotations

import numpy as np
import pytest
from gguf_factory import T, write_tiny_llama
from reference import reference_logits

from llamatrace.errors import ModelFormatError, OptionError, UnsupportedModelError
from llamatrace.model.llama import Llama

TOKENS = [5, 40, 77, 260, 3, 150, 268, 99]


@pytest.mark.parametrize("qtype", [T.F32, T.F16, T.BF16, T.Q8_0, T.Q4_0, T.Q4_1])
def test_prefill_logits_match_reference(tmp_path, qtype):
    path = write_tiny_llama(tmp_path / f"tiny-{qtype.name}.gguf", qtype=qtype, seed=int(qtype))
    model = Llama.load(path)
    logits = model.forward(np.array(TOKENS), 0, model.new_cache(16), all_logits=True)
    ref = reference_logits(path, TOKENS)
    assert logits.shape == ref.shape == (len(TOKENS), model.config.vocab_size)
    assert np.abs(logits - ref).max() <= 1e-4 * np.abs(ref).max()


@pytest.mark.parametrize("tied,n_kv_heads", [(True, 2), (False, 4), (True, 1)])
def test_untied_output_and_mha_and_mqa_match_reference(tmp_path, tied, n_kv_heads):
    path = write_tiny_llama(tmp_path / "t.gguf", tied=tied, n_kv_heads=n_kv_heads)
    model = Llama.load(path)
    assert model.weights.tied_output is tied
    logits = model.forward(np.array(TOKENS), 0, model.new_cache(16), all_logits=True)
    ref = reference_logits(path, TOKENS)
    assert np.abs(logits - ref).max() <= 1e-4 * np.abs(ref).max()


def test_decode_step_matches_full_prefill(tiny_model):
    full = tiny_model.forward(np.array(TOKENS), 0, tiny_model.new_cache(16), all_logits=True)
    cache = tiny_model.new_cache(16)
    rows = [tiny_model.forward(np.array([t]), i, cache)[0] for i, t in enumerate(TOKENS)]
    assert np.abs(np.stack(rows) - full).max() <= 1e-4 * np.abs(full).max()


def test_chunked_prefill_matches_full_prefill(tiny_model):
    full = tiny_model.forward(np.array(TOKENS), 0, tiny_model.new_cache(16), all_logits=True)
    cache = tiny_model.new_cache(16)
    a = tiny_model.forward(np.array(TOKENS[:5]), 0, cache, all_logits=True)
    b = tiny_model.forward(np.array(TOKENS[5:]), 5, cache, all_logits=True)
    assert np.abs(np.concatenate([a, b]) - full).max() <= 1e-4 * np.abs(full).max()


def test_last_only_logits_equal_last_row(tiny_model):
    full = tiny_model.forward(np.array(TOKENS), 0, tiny_model.new_cache(16), all_logits=True)
    last = tiny_model.forward(np.array(TOKENS), 0, tiny_model.new_cache(16))
    assert last.shape == (1, tiny_model.config.vocab_size)
    assert np.array_equal(last[0], full[-1])        # the last row is projected alone either way


def test_forward_refuses_tokens_past_the_cache(tiny_model):
    with pytest.raises(OptionError, match="KV cache"):
        tiny_model.forward(np.array(TOKENS), 0, tiny_model.new_cache(4))


def test_ctx_size_beyond_context_length_is_an_option_error(tiny_model):
    with pytest.raises(OptionError, match="context length 64"):
        tiny_model.new_cache(65)


def test_non_llama_architecture_is_unsupported(tmp_path):
    path = write_tiny_llama(tmp_path / "g.gguf", arch="gemma")
    with pytest.raises(UnsupportedModelError, match="architecture 'gemma'"):
        Llama.load(path)


def test_sentencepiece_vocabulary_without_scores_is_a_format_error(tmp_path):
    path = write_tiny_llama(tmp_path / "sp.gguf", tokenizer_model="llama")  # SPM merges need the scores
    with pytest.raises(ModelFormatError, match="tokenizer.ggml.scores"):
        Llama.load(path)


def test_other_tokenizer_models_are_unsupported(tmp_path):
    path = write_tiny_llama(tmp_path / "wp.gguf", tokenizer_model="bert")
    with pytest.raises(UnsupportedModelError, match="'bert'"):
        Llama.load(path)


def test_missing_tensor_is_named(tmp_path):
    path = write_tiny_llama(tmp_path / "m.gguf", skip_tensors=("blk.1.ffn_up.weight",))
    with pytest.raises(ModelFormatError, match="blk.1.ffn_up.weight"):
        Llama.load(path)


def test_tensors_the_forward_pass_never_reads_are_refused(tmp_path):
    """FFN biases in a ``llama`` file (llama.cpp adds them; its attention biases we add too:
    tests/test_layouts.py) would be left out of the arithmetic in silence: refused, naming the
    first and the kinds of the rest."""
    biases = {f"blk.{i}.ffn_{x}.bias": np.ones(64 if x == "down" else 96) for i in range(2) for x in ("gate", "up", "down")}
    path = write_tiny_llama(tmp_path / "b.gguf", extra_tensors=biases)
    with pytest.raises(UnsupportedModelError) as err:
        Llama.load(path, cache=False)
    assert str(err.value).startswith("b.gguf: tensor 'blk.0.ffn_gate.bias' is not part of the llama forward pass")
    assert "(3 such tensors: blk.N.ffn_down.bias, blk.N.ffn_gate.bias, blk.N.ffn_up.bias)" in str(err.value)
    # a stray tensor outside the blocks is found once every tensor has been read
    path = write_tiny_llama(tmp_path / "o.gguf", extra_tensors={"output.bias": np.ones(8)})
    with pytest.raises(UnsupportedModelError, match=r"'output.bias' is not part .*\(1 such tensor: output.bias\)"):
        Llama.load(path, cache=False)
    # every tensor of a supported file is read (the check can fail only on leftovers)
    model = Llama.load(write_tiny_llama(tmp_path / "ok.gguf", rope_freqs=np.ones(8)), cache=False)
    assert model.file.read == set(model.file.tensors)


def test_resident_weights_stay_close_to_file_size(tiny_model_path, tiny_model):
    tensor_bytes = sum(int(t.n_bytes) for t in tiny_model.file.tensors.values())
    assert tiny_model.weights.nbytes <= 1.3 * tensor_bytes


def test_llama3_style_model_with_rope_freqs_and_bos(tmp_path):
    factors = np.linspace(1.0, 8.0, 8)
    path = write_tiny_llama(tmp_path / "l3.gguf", pre="llama-bpe", rope_theta=500000.0, rope_freqs=factors,
                            add_bos=True, n_heads=4, n_kv_heads=1)
    model = Llama.load(path)
    ids = model.tokenizer.encode("the cat")
    assert ids[0] == model.tokenizer.bos_id
    logits = model.forward(np.array(TOKENS), 0, model.new_cache(16), all_logits=True)
    ref = reference_logits(path, TOKENS)
    assert np.abs(logits - ref).max() <= 1e-4 * np.abs(ref).max()
    # the factors really change the result (the test would not notice a model that ignored them)
    plain = write_tiny_llama(tmp_path / "plain.gguf", pre="llama-bpe", rope_theta=500000.0, add_bos=True,
                             n_heads=4, n_kv_heads=1)
    assert np.abs(reference_logits(plain, TOKENS) - ref).max() > 1e-3


def test_load_reports_progress_by_bytes(tiny_model_path):
    from llamatrace.gguf.reader import open_gguf
    calls = []
    Llama.load(tiny_model_path, progress=lambda done, total: calls.append((done, total)))
    total = sum(t.n_bytes for t in open_gguf(tiny_model_path).tensors.values())
    assert calls and all(t == total for _, t in calls)
    done = [d for d, _ in calls]
    assert done == sorted(done) and done[0] > 0
    assert done[-1] <= total and done[-1] >= 0.9 * total   # every matrix; norms and rope_freqs are tiny
