"""Rope scaling as llama.cpp applies it: linear, YaRN and LongRoPE, on the layers the architecture
scales, and the rope metadata llamatrace refuses (one error line naming the key and the value).

The scaled random-weight files are ``tests/arch_files.py``'s :data:`ROPE_VARIANTS` and
:data:`LONGROPE_VARIANTS`; llama.cpp's float32 logits on them are ``tests/golden/rope_llamacpp.npz``
and ``longrope_llamacpp.npz``, made by ``tests/golden/make_rope_golden.py``. The RoPE tables are checked against ggml's ``rope_yarn``
written out below element by element, in float32 as ggml-cpu computes its cache.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from arch_files import (CONTEXT, LONGROPE_CONTEXT, LONGROPE_VARIANTS, ROPE_VARIANTS, golden_arrays, longrope_factors,
                        relative, run_positions, write_arch_file, write_longrope)
from cli_helpers import assert_one_line_error, run

from llamatrace.errors import ModelFormatError, PeerError, UnsupportedModelError
from llamatrace.gguf.reader import open_gguf
from llamatrace.kernels.ops import fp32 as K
from llamatrace.model.config import ModelConfig, RopeScaling
from llamatrace.model.llama import Llama

PREFILL = 32                 # make_rope_golden.py's decode run: 32 tokens in one batch, then one a step
F32_RTOL = 1e-4              # relative L2 distance per position, the bar
GELU_TABLE_RTOL = 3e-4       # Gemma in the f32 mode: llama.cpp's fp16 GELU table (see test_arch.py)
# The q8 mode on F32 weights is llama.cpp's arithmetic (its GELU table too). Over 40 tokens Gemma 3
# has single positions at 2e-5..6e-5 (median 1e-6), as much on the unscaled file (5.6e-5 at the
# same position 15, measured): an fp16 GELU input rounded the other way, not the rope.
LLAMACPP_ARITHMETIC_RTOL = 1e-4


# ---- the tables, against ggml's rope_yarn --------------------------------------------------------
def ggml_rope_cache(pos: int, n_dims: int, base: float, freq_scale: float, ext_factor: float,
                    attn_factor: float, corr_dims: tuple[float, float]) -> np.ndarray:
    """ggml-cpu's cos/sin cache of one position (``ggml_rope_cache_init`` → ``rope_yarn``), float32:
    complex64 ``[n_dims/2]``. theta starts at the position and is multiplied by
    ``base^(-2/n_dims)`` pair after pair; YaRN mixes the interpolated (× freq_scale) and the
    extrapolated angle by the ramp and corrects the magnitude by ``1 + 0.1 ln(1/freq_scale)``."""
    f = np.float32
    theta_scale = f(base) ** (f(-2.0) / f(n_dims))
    theta = f(pos)
    out = np.empty(n_dims // 2, dtype=np.complex64)
    for i0 in range(0, n_dims, 2):
        theta_extrap = theta
        theta_interp = f(freq_scale) * theta_extrap
        angle, mscale = theta_interp, f(attn_factor)
        if ext_factor != 0.0:
            y = (f(i0 // 2) - f(corr_dims[0])) / max(f(0.001), f(corr_dims[1]) - f(corr_dims[0]))
            ramp_mix = (f(1) - min(f(1), max(f(0), y))) * f(ext_factor)
            angle = theta_interp * (f(1) - ramp_mix) + theta_extrap * ramp_mix
            mscale = mscale * (f(1) + f(0.1) * np.log(f(1) / f(freq_scale)))
        out[i0 // 2] = complex(np.cos(angle) * mscale, np.sin(angle) * mscale)
        theta = theta * theta_scale
    return out


def corr_dims_f64(n_dims: int, n_ctx_orig: int, base: float, beta_fast: float, beta_slow: float):
    """YaRN's ramp ends from the formula (bloc97's ``find_correction_range``), in float64."""
    def dim(n_rot):
        return n_dims * math.log(n_ctx_orig / (n_rot * 2 * math.pi)) / (2 * math.log(base))
    return max(0.0, math.floor(dim(beta_fast))), min(n_dims - 1.0, math.ceil(dim(beta_slow)))


@pytest.mark.parametrize("n_dims, n_ctx_orig, base, expect", [
    (16, 32, 1e4, (0.0, 2.0)), (32, 32, 1e4, (0.0, 3.0)), (128, 4096, 1e4, (20.0, 46.0)),
    (64, 8192, 1e6, (8.0, 17.0)), (16, 100000, 10.0, (21.0, 15.0))])   # the last: ggml lets low pass high
def test_yarn_corr_dims_are_ggmls(n_dims, n_ctx_orig, base, expect):
    assert corr_dims_f64(n_dims, n_ctx_orig, base, 32.0, 1.0) == expect
    assert K.rope_yarn_corr_dims(n_dims, n_ctx_orig, base, 32.0, 1.0) == expect


@pytest.mark.parametrize("n_dims, base, freq_scale, ext_factor, attn_factor, n_ctx_orig", [
    (16, 1e4, 0.125, 0.0, 1.0, 0),             # linear ×8
    (32, 1e6, 0.125, 0.0, 1.3, 0),             # linear with an attention factor (no YaRN correction)
    (16, 1e4, 0.25, 1.0, 0.8, 32),             # qwen2_yarn: the ramp from pair 0 to 2
    (32, 1e4, 0.125, 1.0, 1.25, 32),           # gemma3_yarn's global layers
    (32, 500.0, 1.0, 1.0, 1.25, 32),           # gemma3_yarn's local ones: not scaled, the factor only
    (64, 1e4, 1 / 3, 0.5, 1.0, 24),            # half-strength extrapolation
])
def test_scaled_rope_tables_are_ggmls_rope_yarn(n_dims, base, freq_scale, ext_factor, attn_factor, n_ctx_orig):
    corr = K.rope_yarn_corr_dims(n_dims, n_ctx_orig, base, 32.0, 1.0) if ext_factor else (0.0, 0.0)
    inv = K.rope_frequencies(n_dims, base, freq_scale=freq_scale, ext_factor=ext_factor, corr_dims=corr)
    ours = K.precompute_freqs_cis(inv, 0, 48, K.rope_mscale(freq_scale, ext_factor, attn_factor))
    ref = np.stack([ggml_rope_cache(p, n_dims, base, freq_scale, ext_factor, attn_factor, corr) for p in range(48)])
    # ggml's float32 theta, multiplied pair after pair, drifts by ~1e-6 relative: 5e-5 at 47 rad
    np.testing.assert_allclose(ours.real, ref.real, atol=1e-4)
    np.testing.assert_allclose(ours.imag, ref.imag, atol=1e-4)
    plain = K.precompute_freqs_cis(K.rope_frequencies(n_dims, base), 0, 48)
    assert np.abs(ours - plain).max() > 0.1                     # and the scaling shows


def test_unscaled_tables_are_the_plain_formula_bit_for_bit():
    inv = K.rope_frequencies(32, 10000.0, freq_scale=1.0, ext_factor=0.0, corr_dims=(3.0, 9.0))
    np.testing.assert_array_equal(inv, 1.0 / (10000.0 ** (np.arange(0, 32, 2, dtype=np.float64) / 32)))
    fc = K.precompute_freqs_cis(inv, 5, 7, mscale=1.0)
    np.testing.assert_array_equal(fc, np.exp(1j * np.outer(np.arange(5, 12.0), inv)).astype(np.complex64))


@pytest.mark.parametrize("rope, rope_ref, pair", [(K.rope, K.rope_ref, lambda y: y.reshape(*y.shape[:2], -1, 2)),
                                                  (K.rope_neox, K.rope_neox_ref,
                                                   lambda y: np.stack([y[..., :12], y[..., 12:24]], -1))])
def test_rope_kernels_and_twins_carry_the_magnitude(rope, rope_ref, pair):
    inv = K.rope_frequencies(24, 1e4, freq_scale=0.25, ext_factor=1.0, corr_dims=(1.0, 4.0))
    mscale = K.rope_mscale(0.25, 1.0, 0.9)
    fc = K.precompute_freqs_cis(inv, 30, 5, mscale)
    x = np.random.default_rng(3).normal(size=(5, 3, 32)).astype(np.float32)
    y = rope(x, np.ascontiguousarray(fc.real), np.ascontiguousarray(fc.imag))
    np.testing.assert_allclose(y, rope_ref(x, fc), rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(y[..., 24:], x[..., 24:])
    np.testing.assert_allclose(np.linalg.norm(pair(y[..., :24]), axis=-1),
                               mscale * np.linalg.norm(pair(x[..., :24]), axis=-1), rtol=1e-5)
    assert mscale == pytest.approx(0.9 * (1 + 0.1 * math.log(4)), rel=1e-6)


# ---- the config, as llama.cpp resolves it --------------------------------------------------------
def config_of(tmp_path, arch: str, rope: dict) -> ModelConfig:
    path = write_arch_file(tmp_path / f"{arch}.gguf", arch, rope=rope)
    with open_gguf(path) as f:
        return ModelConfig.from_gguf(f)


YARN_ATTN = float(np.float32(1.0) * np.float32(0.8))            # get_mscale(4) / (1 + 0.1 ln 4) is 1 in float32


@pytest.mark.parametrize("arch, rope, expect", [
    # Gemma 3: the global layers only (rope_freq_scale_train_swa stays 1); Gemma 2 copies the scale
    ("gemma3", ROPE_VARIANTS["gemma3_linear8"][1], RopeScaling("linear", 0.125, 1.0)),
    ("gemma2", {"scaling.type": "linear", "scaling.factor": 4.0}, RopeScaling("linear", 0.25, 0.25)),
    # the file's yarn_beta_* are not read for qwen2 (llama.cpp: grok and mistral3 only)
    ("qwen2", ROPE_VARIANTS["qwen2_yarn"][1], RopeScaling("yarn", 0.25, ext_factor=1.0, attn_factor=YARN_ATTN,
                                                          n_ctx_orig=32)),
    ("qwen2", {"scaling.type": "yarn", "scaling.factor": 4.0}, RopeScaling("yarn", 0.25, ext_factor=1.0,
                                                                          n_ctx_orig=CONTEXT)),
    ("gemma3", ROPE_VARIANTS["gemma3_yarn"][1], RopeScaling("yarn", 0.125, 1.0, ext_factor=1.0, attn_factor=1.25,
                                                            n_ctx_orig=32)),
    ("qwen2", {"scaling.factor": 2.0}, RopeScaling("linear", 0.5)),          # no type: llama.cpp's "linear"
    ("qwen2", {"scale_linear": 2.0}, RopeScaling("linear", 0.5)),            # the older key
    ("qwen2", {"scaling.type": "none", "scaling.factor": 4.0}, RopeScaling()),  # "none" never scales
    ("qwen2", {"scaling.type": "linear", "scaling.factor": 0.0}, RopeScaling()),
    ("qwen2", {"scaling.type": "linear"}, RopeScaling()),
    ("qwen2", {"scaling.attn_factor": 1.5}, RopeScaling("linear", attn_factor=1.5)),   # read for any type
    # the type key alone: not YaRN, so linear (LongRoPE is the factor tensors, below)
    ("qwen2", {"scaling.type": "longrope", "scaling.factor": 2.0}, RopeScaling("linear", 0.5)),
])
def test_config_reads_the_scaling_as_llamacpp_resolves_it(arch, rope, expect, tmp_path):
    assert config_of(tmp_path, arch, rope).rope_scaling == expect


def test_an_unscaled_config_reads_as_before_and_info_shows_the_scaling(tmp_path, capsys):
    assert "rope_scaling" not in config_of(tmp_path, "qwen2", {}).to_dict()
    path = write_arch_file(tmp_path / "g.gguf", "gemma3", rope=ROPE_VARIANTS["gemma3_linear8"][1])
    code, out, err = run(capsys, "info", "-m", path)
    assert code == 0, err
    assert "rope_scaling" in out and "'linear'" in out and "0.125" in out


@pytest.mark.parametrize("arch, key, value, shown, error", [
    ("qwen2", "freq_base", math.inf, "inf", ModelFormatError),
    ("qwen2", "freq_base", -10000.0, "-10000.0", ModelFormatError),
    ("qwen2", "freq_base", 0.0, "0.0", ModelFormatError),
    ("qwen2", "freq_base", "1e6", "'1e6'", ModelFormatError),
    ("gemma3", "freq_base_swa", math.nan, "nan", ModelFormatError),
    ("qwen2", "scaling.type", "dynamic", "'dynamic'", ModelFormatError),
    ("qwen2", "scaling.factor", -8.0, "-8.0", ModelFormatError),
    ("qwen2", "scaling.factor", math.inf, "inf", ModelFormatError),
    ("qwen2", "scaling.attn_factor", 0.0, "0.0", ModelFormatError),
])
def test_bad_rope_metadata_is_one_error_line_naming_key_and_value(arch, key, value, shown, error, tmp_path, capsys):
    path = write_arch_file(tmp_path / "bad.gguf", arch, rope={key: value})
    with pytest.raises(error):
        Llama.load(path)
    assert_one_line_error(*run(capsys, "generate", "-m", path, "--raw", "hi", "-n", "1"),
                          f"{arch}.rope.{key}", shown)


def test_a_yarn_original_context_that_is_not_an_integer_is_named(tmp_path, capsys):
    path = write_arch_file(tmp_path / "bad.gguf", "qwen2",
                           rope={"scaling.type": "yarn", "scaling.factor": 4.0, "scaling.original_context_length": 32.5})
    assert_one_line_error(*run(capsys, "generate", "-m", path, "--raw", "hi", "-n", "1"),
                          "qwen2.rope.scaling.original_context_length", "32.5")


# ---- the scaled files against llama.cpp ------------------------------------------------------------
@pytest.fixture(scope="module")
def llamacpp():
    return golden_arrays("rope_llamacpp.npz")


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    d = tmp_path_factory.mktemp("rope")
    out = {}
    for name, (arch, rope) in ROPE_VARIANTS.items():
        out[name] = write_arch_file(d / f"{name}.gguf", arch, rope=rope)
        # the same file without its scaling keys (the same rope bases)
        out[f"{name}_unscaled"] = write_arch_file(d / f"{name}_unscaled.gguf", arch,
                                                  rope={k: v for k, v in rope.items() if not k.startswith("scaling.")})
    return out



@pytest.mark.parametrize("name", ROPE_VARIANTS)
@pytest.mark.parametrize("activations", ["f32", "q8"])
def test_scaled_files_give_llamacpps_logits_in_one_batch_and_in_decode_steps(name, activations, paths, llamacpp):
    bar = (LLAMACPP_ARITHMETIC_RTOL if activations == "q8"
           else GELU_TABLE_RTOL if name.startswith("gemma") else F32_RTOL)
    model = Llama.load(paths[name], activations=activations)
    ids = llamacpp[f"{name}_ids"]
    for prefill, ref in ((len(ids), llamacpp[f"{name}_prefill"]), (PREFILL, llamacpp[f"{name}_decode"])):
        ours = run_positions(model, ids, prefill)[len(ids) - len(ref):]
        assert relative(ours, ref).max() <= bar, (prefill, relative(ours, ref))
        assert (ours.argmax(1) == ref.argmax(1)).all()


@pytest.mark.parametrize("name", ROPE_VARIANTS)
def test_scaling_changes_the_logits(name, paths, llamacpp):
    ids = llamacpp[f"{name}_ids"]
    plain = run_positions(Llama.load(paths[f"{name}_unscaled"]), ids, len(ids))
    scaled = run_positions(Llama.load(paths[name]), ids, len(ids))
    assert relative(scaled, plain)[1:].min() > 1e-3 and relative(scaled, plain).max() > 0.05
    assert relative(llamacpp[f"{name}_prefill"], plain).max() > 0.05


def test_gemma3_scales_its_global_layers_only(paths):
    model = Llama.load(paths["gemma3_linear8"])
    plain = Llama.load(paths["gemma3_linear8_unscaled"])
    assert model.config.local_layers == (0, 1, 2, 3, 4, 6)
    np.testing.assert_array_equal(model.inv_freq_local, plain.inv_freq_local)     # base 10000, unscaled
    np.testing.assert_allclose(model.inv_freq, plain.inv_freq / 8, rtol=1e-15)


# ---- LongRoPE: Phi-3's factor tensors, short or long by the context size ---------------------------
LONGROPE_CTX = {"short": 40, "long": 512}
"""Our KV cache for each table: 40 positions (≤ the original 256: short factors) and 512 (long);
make_rope_golden.py gave llama.cpp 64 (padded to 256) and 512."""


@pytest.fixture(scope="module")
def longrope_golden():
    return golden_arrays("longrope_llamacpp.npz")


@pytest.fixture(scope="module")
def longrope_paths(tmp_path_factory):
    d = tmp_path_factory.mktemp("longrope")
    return {name: write_longrope(d, name) for name in LONGROPE_VARIANTS}


def test_longrope_config_comes_from_the_factor_tensors(tmp_path):
    # Phi-3's converter writes the two tensors and the attention factor, no scaling type
    c = ModelConfig.from_gguf(open_gguf(write_longrope(tmp_path, "phi3_longrope")))
    assert c.rope_scaling == RopeScaling("longrope", attn_factor=float(np.float32(1.1902381)), longrope_ctx=256)
    assert c.to_dict()["rope_scaling"] == {"type": "longrope", "attn_factor": pytest.approx(1.1902381),
                                           "longrope_ctx": 256}
    # without original_context_length, llama.cpp's n_ctx_orig_yarn is the training context
    path = write_arch_file(tmp_path / "no-orig.gguf", "phi3", context=LONGROPE_CONTEXT, extra=longrope_factors(16))
    assert ModelConfig.from_gguf(open_gguf(path)).rope_scaling == RopeScaling("longrope", longrope_ctx=LONGROPE_CONTEXT)


@pytest.mark.parametrize("name", LONGROPE_VARIANTS)
@pytest.mark.parametrize("activations", ["f32", "q8"])
@pytest.mark.parametrize("table", LONGROPE_CTX)
def test_longrope_files_give_llamacpps_logits_at_both_context_sizes(name, activations, table, longrope_paths,
                                                                  longrope_golden):
    model = Llama.load(longrope_paths[name], activations=activations)
    ids = longrope_golden[f"{name}_ids"]
    for prefill, ref in ((len(ids), longrope_golden[f"{name}_{table}_prefill"]),
                         (PREFILL, longrope_golden[f"{name}_{table}_decode"])):
        ours = run_positions(model, ids, prefill, ctx=LONGROPE_CTX[table])[len(ids) - len(ref):]
        assert relative(ours, ref).max() <= F32_RTOL, (prefill, relative(ours, ref))
        assert (ours.argmax(1) == ref.argmax(1)).all()


@pytest.mark.parametrize("name", LONGROPE_VARIANTS)
def test_longrope_factors_change_the_logits(name, longrope_paths, longrope_golden, tmp_path):
    # the two tables differ, and so does the file without its factors: a run that ignored the
    # context size or the tensors could not pass the test above
    ids = longrope_golden[f"{name}_ids"]
    short, long = longrope_golden[f"{name}_short_prefill"], longrope_golden[f"{name}_long_prefill"]
    assert relative(long, short).max() > 0.1
    plain = Llama.load(write_longrope(tmp_path, name, factors={}))
    assert relative(short, run_positions(plain, ids, len(ids))).max() > 5e-3            # 50x the bar
    model = Llama.load(longrope_paths[name])
    factors = longrope_factors(model.config.rope_dim)
    # each table is the plain one divided by its factors, pair by pair
    np.testing.assert_allclose(model.inv_freq * factors["rope_factors_short.weight"], plain.inv_freq, rtol=1e-7)
    np.testing.assert_allclose(model.inv_freq_long * factors["rope_factors_long.weight"], plain.inv_freq, rtol=1e-7)


@pytest.mark.parametrize("factors, named", [
    ({"rope_factors_long.weight": np.ones(5), "rope_factors_short.weight": np.ones(5)},
     "'rope_factors_short.weight' holds 5 values where rope_dim/2 = 8"),
    ({"rope_factors_long.weight": np.r_[np.ones(7), 0.0], "rope_factors_short.weight": np.ones(8)},
     "'rope_factors_long.weight' holds a value that is not a positive finite number"),
])
def test_bad_longrope_factors_are_one_error_line(factors, named, tmp_path, capsys):
    path = write_longrope(tmp_path, "phi3_longrope", factors=factors)
    with pytest.raises(ModelFormatError):
        Llama.load(path)
    assert_one_line_error(*run(capsys, "generate", "-m", path, "--raw", "hi", "-n", "1"), named)


def test_longrope_factors_llamacpp_does_not_read_are_refused(tmp_path, capsys):
    # llama.cpp's qwen2 graph never reads them: running without them would be silent
    path = write_arch_file(tmp_path / "q.gguf", "qwen2", extra=longrope_factors(16))
    with pytest.raises(UnsupportedModelError):
        Llama.load(path)
    assert_one_line_error(*run(capsys, "generate", "-m", path, "--raw", "hi", "-n", "1"),
                          "'rope_factors_long.weight'", "llama and phi3", "qwen2")
    # llama.cpp's llama graph reads them only with the type key longrope (else it refuses the file)
    path = write_longrope(tmp_path, "llama_longrope", **{"scaling.type": "linear"})
    assert ModelConfig.from_gguf(open_gguf(path)).rope_scaling == RopeScaling()
    assert_one_line_error(*run(capsys, "generate", "-m", path, "--raw", "hi", "-n", "1"),
                          "'rope_factors_", "not part of the llama forward pass")
    path = write_longrope(tmp_path, "phi3_longrope", **{"scaling.original_context_length": 0})
    assert_one_line_error(*run(capsys, "generate", "-m", path, "--raw", "hi", "-n", "1"),
                          "phi3.rope.scaling.original_context_length", "0")


def test_longrope_runs_from_the_cli_and_info_shows_it(longrope_paths, capsys):
    path = longrope_paths["phi3_longrope"]
    code, out, err = run(capsys, "info", "-m", path)
    assert code == 0, err
    assert "'longrope'" in out and "longrope_ctx" in out
    for ctx in ("64", "512"):
        code, out, err = run(capsys, "generate", "-m", path, "--raw", "hi", "-n", "2", "--ctx-size", ctx)
        assert code == 0, err
        # the trace's RoPE line says which factors a context of this size takes
        code, out, err = run(capsys, "trace", "-m", path, "--raw", "hi", "--layer", "0", "--ctx-size", ctx)
        assert code == 0, err
        assert f"with LongRoPE's factors for a context of {ctx} (the long ones above 256" in out


def test_compare_against_hf_refuses_longrope(longrope_paths):
    from llamatrace.analysis.compare import run_hf
    path = longrope_paths["phi3_longrope"]
    with pytest.raises(PeerError, match="LongRoPE"):
        run_hf(path, ModelConfig.from_gguf(open_gguf(path)), [1, 2], [])
