"""TransformerLens conventions (``run_with_cache`` / ``run_with_hooks``) against TransformerLens itself.

Golden files: ``tests/golden/make_tl_golden.py`` (TransformerLens 4.3 ``TransformerBridge`` in
compatibility mode, no weight processing, on the same GGUF de-quantized by HF transformers).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest

from llamatrace.errors import HookError, OptionError
from llamatrace.gguf.fetch import cache_dir, sha256_file
from llamatrace.model import tl

GOLDEN = Path(__file__).parent / "golden"
TOLERANCE = 1e-4          # max |ours - TL| / max |TL| per name; measured worst: 5e-6 (f32, Q4_1)
Q4_K_M_SHA256 = "dc0f3a02e821146247a0af6895adf9872124f368682cb110cb9ed09ff2a9f9f1"

pytestmark = pytest.mark.model


def _golden(tag: str) -> dict[str, dict[str, np.ndarray]]:
    data = np.load(GOLDEN / f"tl_{tag}.npz")
    out: dict[str, dict[str, np.ndarray]] = {}
    for key in data.files:
        prompt, name = key.split("/", 1)
        out.setdefault(prompt, {})[name] = data[key]
    return out


def _rel(ours: np.ndarray, ref: np.ndarray) -> float:
    finite = np.isfinite(ref)
    assert np.array_equal(np.isfinite(ours), finite), "masked (-inf) entries differ"
    return float(np.abs(ours[finite] - ref[finite]).max() / np.abs(ref[finite]).max())


def _check_against_golden(model, golden) -> None:
    for prompt, ref in golden.items():
        names = [n for n in ref if n not in ("tokens", "logits")]
        logits, cache = model.run_with_cache(ref["tokens"], names_filter=names)
        assert _rel(logits[:, -1:], ref["logits"]) < TOLERANCE
        for name in names:
            assert cache[name].shape == ref[name].shape, name
            assert cache[name].dtype == np.float32
            assert _rel(cache[name], ref[name]) < TOLERANCE, (prompt, name, _rel(cache[name], ref[name]))


def test_every_served_name_is_in_the_golden_file():
    golden = _golden("smollm2")["france"]
    layer_names = {n.split(".", 2)[2] for n in golden if n.startswith("blocks.")}
    assert layer_names == set(tl.LAYER_HOOKS)
    assert set(tl.MODEL_HOOKS) <= set(golden)


def test_run_with_cache_matches_transformer_lens(smollm2):
    _check_against_golden(smollm2, _golden("smollm2"))


def test_run_with_cache_matches_transformer_lens_on_a_k_quant_file(smollm2_path):
    from kquant_files import rebuild
    from llamatrace.model.llama import Llama

    path = cache_dir() / "SmolLM2-135M-Instruct.Q4_K_M.gguf"
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        rebuild("Q4_K_M", smollm2_path, path)
    assert sha256_file(path) == Q4_K_M_SHA256
    _check_against_golden(Llama.load(path), _golden("smollm2_Q4_K_M"))


def test_text_input_and_short_names(smollm2):
    ref = _golden("smollm2")["france"]
    logits, cache = smollm2.run_with_cache("The capital of France is", names_filter=lambda n: "resid_post" in n)
    assert np.array_equal(cache.tokens[0], ref["tokens"])
    assert len(cache) == smollm2.config.n_layers
    assert cache["resid_post", 15] is cache["blocks.15.hook_resid_post"]
    assert logits.shape == (1, len(ref["tokens"]), smollm2.config.vocab_size)


def test_a_batch_is_padded_as_transformer_lens_pads_it(smollm2):
    golden = _golden("smollm2")
    france, hi = golden["france"]["tokens"], golden["hi"]["tokens"]
    assert len(hi) < len(france)
    names = ["blocks.0.hook_resid_post", "blocks.0.attn.hook_attn_scores", "blocks.0.attn.hook_pattern"]
    for side in ("right", "left"):
        logits, cache = smollm2.run_with_cache([list(france), list(hi)], names_filter=names, padding_side=side)
        n, k = len(france), len(hi)
        real = slice(0, k) if side == "right" else slice(n - k, n)
        pad = slice(k, n) if side == "right" else slice(0, n - k)
        assert cache.attention_mask.tolist() == [[1] * n, [1 if i in range(n)[real] else 0 for i in range(n)]]
        assert _rel(cache["blocks.0.hook_resid_post"][1:, real], golden["hi"]["blocks.0.hook_resid_post"]) < TOLERANCE
        assert _rel(cache["blocks.0.hook_resid_post"][:1], golden["france"]["blocks.0.hook_resid_post"]) < TOLERANCE
        assert not cache["blocks.0.hook_resid_post"][1, pad].any()
        scores = cache["blocks.0.attn.hook_attn_scores"]
        assert _rel(scores[1:, :, real, real], golden["hi"]["blocks.0.attn.hook_attn_scores"]) < TOLERANCE
        assert np.isneginf(scores[1, :, pad]).all() and np.isneginf(scores[1, :, :, pad]).all()
        assert not cache["blocks.0.attn.hook_pattern"][1, :, :, pad].any()
        assert _rel(logits[1:, real][:, -1:], golden["hi"]["logits"]) < TOLERANCE


def test_a_one_token_sequence_serves_unmasked_scores(smollm2):
    _, cache = smollm2.run_with_cache([[504]], names_filter=["blocks.0.attn.hook_attn_scores",
                                                             "blocks.0.attn.hook_pattern"])
    assert cache["blocks.0.attn.hook_attn_scores"].shape == (1, smollm2.config.n_heads, 1, 1)
    assert np.allclose(cache["blocks.0.attn.hook_pattern"], 1.0)


def test_stop_at_layer_returns_the_residual_there(smollm2):
    ids = _golden("smollm2")["france"]["tokens"]
    resid, cache = smollm2.run_with_cache(ids, names_filter=["blocks.2.hook_resid_post"], stop_at_layer=3)
    assert np.array_equal(resid, cache["blocks.2.hook_resid_post"])
    with pytest.raises(OptionError, match="after stop_at_layer"):
        smollm2.run_with_cache(ids, names_filter=["blocks.5.hook_resid_post"], stop_at_layer=3)
    # no filter, or a predicate: the hooks that ran, as TL (it used to refuse the later ones)
    _, every = smollm2.run_with_cache(ids, stop_at_layer=3)
    assert "blocks.2.hook_resid_post" in every and "blocks.4.hook_resid_post" not in every
    assert "ln_final.hook_normalized" not in every and "hook_embed" in every
    _, picked = smollm2.run_with_cache(ids, names_filter=lambda n: n.endswith("hook_resid_post"), stop_at_layer=3)
    assert sorted(picked) == [f"blocks.{i}.hook_resid_post" for i in range(3)]
    np.testing.assert_array_equal(picked["blocks.2.hook_resid_post"], resid)


def test_hooks_that_return_nothing_or_their_input_change_nothing(smollm2):
    ids = _golden("smollm2")["france"]["tokens"]
    base, _ = smollm2.run_with_cache(ids, names_filter="hook_embed")
    seen = []
    every = [(name, lambda a, hook: seen.append(hook.name)) for name in tl.served_names(2)]
    assert np.array_equal(smollm2.run_with_hooks(ids, fwd_hooks=every), base)
    assert len(seen) == len(every)
    # a replacement equal to the input goes back through every layout conversion exactly
    same = [(lambda n: n.startswith("blocks.1.") and "scale" not in n, lambda a, hook: a.copy())]
    assert np.allclose(smollm2.run_with_hooks(ids, fwd_hooks=same), base, rtol=0, atol=1e-4)


def test_a_tl_hook_equals_the_same_intervention_on_our_stage(smollm2):
    """Zeroing head 3's attention output through TL's hook_z [batch, pos, head, d_head] gives
    the logits of zeroing it on our kqv stage [n_heads, seq_len, head_dim], bit for bit."""
    ids = _golden("smollm2")["france"]["tokens"]

    def zero_tl(z, hook):              # in place, returning None, as TL hooks often do
        z[:, :, 3] = 0

    def zero_ours(kqv, event):
        kqv[3] = 0
        return kqv

    ours_tl = smollm2.run_with_hooks(ids, fwd_hooks=[("blocks.4.attn.hook_z", zero_tl)])
    with smollm2.hooks({"kqv": zero_ours}, layers=[4]):
        expected, _ = smollm2.run_with_cache(ids, names_filter="hook_embed")
    base, _ = smollm2.run_with_cache(ids, names_filter="hook_embed")
    assert np.array_equal(ours_tl, expected)
    assert not np.array_equal(ours_tl, base)


def test_patching_the_normalized_stream_uses_tl_s_definition(smollm2):
    """ln1.hook_normalized is x/rms(x) before the weight: doubling it doubles attn_norm."""
    ids = _golden("smollm2")["france"]["tokens"]
    got = {}
    with smollm2.trace(stages=["attn_norm"], layers=[2], keep_arrays=True) as rec:
        smollm2.run_with_hooks(ids, fwd_hooks=[("blocks.2.ln1.hook_normalized", lambda a, h: 2 * a)])
    got["hooked"] = rec.arrays()["step0.layer2.attn_norm"]
    with smollm2.trace(stages=["attn_norm"], layers=[2], keep_arrays=True) as rec:
        smollm2.run_with_hooks(ids)
    assert np.allclose(got["hooked"], 2 * rec.arrays()["step0.layer2.attn_norm"], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("name, message", [
    ("blocks.0.hook_resid_psot", "did you mean blocks.0.hook_resid_post"),
    ("blocks.99.hook_resid_post", "has 30 layers"),
    ("hook_pos_embed", "no positional embedding"),
    ("blocks.3.attn.hook_result", "not served"),
    ("keys@0", "view or lazy copy"),
    ("l_out", "per layer"),
    ("blocks.0.attn.hook_patern", "did you mean blocks.0.attn.hook_pattern"),    # not "a softmax attention layer"
    ("blocks.0.linear_attn.hook_q", "no gated DeltaNet layers"),
])
def test_bad_names_get_one_clear_message(smollm2, name, message):
    with pytest.raises(OptionError, match=message):
        smollm2.run_with_cache([1, 2], names_filter=[name])


def test_stage_ids_are_served_in_our_layout(smollm2):
    ids = _golden("smollm2")["france"]["tokens"]
    _, cache = smollm2.run_with_cache(ids, names_filter=["l_out@3", "blocks.3.hook_resid_post", "kqv@3",
                                                         "blocks.3.attn.hook_z"])
    assert np.array_equal(cache["l_out@3"], cache["blocks.3.hook_resid_post"])
    assert np.array_equal(cache["kqv@3"].transpose(0, 2, 1, 3), cache["blocks.3.attn.hook_z"])


def test_a_hook_returning_the_wrong_shape_is_an_error(smollm2):
    with pytest.raises(HookError, match="blocks.0.hook_resid_post"):
        smollm2.run_with_hooks([1, 2, 3], fwd_hooks=[("blocks.0.hook_resid_post", lambda a, h: a[:, :1])])
    for wrong in ("zeros", {"a": 1}):          # not arrays of numbers: a HookError too, not numpy's ValueError
        with pytest.raises(HookError, match=f"returned {type(wrong).__name__}, not an array of numbers"):
            smollm2.run_with_hooks([1, 2, 3], fwd_hooks=[("blocks.0.hook_resid_post", lambda a, h, w=wrong: w)])


def test_the_python_api_speaks_of_its_own_arguments(smollm2):
    """A known model's name loads as -m takes it; too many tokens name the context, not --ctx-size."""
    from llamatrace import Llama
    with Llama.load("smollm2-135m", fetch=False) as by_name:
        assert by_name.path == smollm2.path
    with pytest.raises(OptionError, match="9000 tokens do not fit the model's context length 8192") as info:
        smollm2.run_with_cache([5] * 9000)
    assert "--ctx-size" not in str(info.value)


@pytest.mark.skipif(any(importlib.util.find_spec(m) is None for m in ("torch", "transformers", "accelerate")),
                    reason="torch, transformers or accelerate is not installed")
def test_gemma_post_norm_names_against_hf_modules(gemma3_path):
    """Gemma's TL names on the real Gemma 3 file, against HF transformers' modules on it (which
    agree with our f32 mode to ~3e-6): ``hook_embed`` is the scaled embedding (TL folds √d_model
    into W_E), ``hook_attn_out`` / ``hook_mlp_out`` are what the residual adds (after the
    post-norms: TL's use_normalization_before_and_after), and ``ln1_post`` / ``ln2_post`` are TL's
    RMSNorm hooks of the attention and MLP outputs: ``hook_scale`` = sqrt(mean(x²) + eps),
    ``hook_normalized`` = x / hook_scale."""
    from llamatrace.model.llama import Llama
    from llamatrace.peers.hf import HFModel
    model = Llama.load(gemma3_path)
    ids = model.tokenizer.encode("The capital of France is")
    hf = HFModel(str(gemma3_path), model.config)
    hf.eval(ids)
    layers = (0, model.config.n_layers - 1)
    _, cache = model.run_with_cache(ids, names_filter=lambda n: n == "hook_embed" or any(
        n.startswith(f"blocks.{L}.") for L in layers))
    assert _rel(cache["hook_embed"][0], hf.captured[None, "inp_scaled"]) < 1e-5
    for L in layers:
        for ln, x, post, tl_out in (("ln1_post", "attn_out", "attn_post_norm", "hook_attn_out"),
                                    ("ln2_post", "ffn_out", "ffn_post_norm", "hook_mlp_out")):
            x = hf.captured[L, x].astype(np.float64)
            scale = np.sqrt(np.mean(x ** 2, axis=-1, keepdims=True) + model.config.norm_eps)
            assert _rel(cache[f"blocks.{L}.{tl_out}"][0], hf.captured[L, post]) < 1e-4, (L, tl_out)
            assert _rel(cache[f"blocks.{L}.{ln}.hook_scale"][0], scale) < 1e-4, (L, ln)
            assert _rel(cache[f"blocks.{L}.{ln}.hook_normalized"][0], x / scale) < 1e-4, (L, ln)


@pytest.mark.parametrize("arch", ["gemma2", "gemma3"])
def test_gemma_post_norm_hooks_are_the_norms_of_the_attention_and_mlp_outputs(arch, tmp_path):
    """Without torch (the HF test above skips in CI): each post-norm hook against TL's RMSNorm
    formula on the stage it normalises, recorded in the same forward pass — ``ln1_post`` on the
    attention output, ``ln2_post`` on the MLP's, never the other's (``hook_scale`` = sqrt(mean(x²)
    + eps), ``hook_normalized`` = x / hook_scale); ``hook_attn_out`` / ``hook_mlp_out`` after them."""
    from arch_files import write_arch_file

    from llamatrace.model.llama import Llama
    model = Llama.load(write_arch_file(tmp_path / f"{arch}.gguf", arch))
    ids = [3, 17, 42, 5, 9, 11]
    with model.trace(stages=["attn_out", "attn_post_norm", "ffn_out", "ffn_post_norm"], keep_arrays=True) as rec:
        _, cache = model.run_with_cache(ids)
    arrays = rec.arrays()
    for L in range(model.config.n_layers):
        for ln, stage, post, tl_out in (("ln1_post", "attn_out", "attn_post_norm", "hook_attn_out"),
                                        ("ln2_post", "ffn_out", "ffn_post_norm", "hook_mlp_out")):
            x = arrays[f"step0.layer{L}.{stage}"].astype(np.float64)
            scale = np.sqrt(np.mean(x ** 2, axis=-1, keepdims=True) + model.config.norm_eps)
            assert _rel(cache[f"blocks.{L}.{ln}.hook_scale"][0], scale) < 1e-5, (L, ln)
            assert _rel(cache[f"blocks.{L}.{ln}.hook_normalized"][0], x / scale) < 1e-5, (L, ln)
            assert np.array_equal(cache[f"blocks.{L}.{tl_out}"][0], arrays[f"step0.layer{L}.{post}"]), (L, tl_out)


def test_post_norm_names_are_refused_without_post_norms(smollm2):
    with pytest.raises(OptionError, match="ln1_post / ln2_post are Gemma 2 and 3's"):
        smollm2.run_with_cache("Hi", names_filter="blocks.0.ln1_post.hook_scale")
