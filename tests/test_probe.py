"""The machine probes behind bench's roofline (kernels against their NumPy twins) and the per-token
cost they are divided by (against gguf-py's own reading of the file). No timing is asserted."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
from gguf_factory import T, write_tiny_llama

from llamatrace.analysis import roofline
from llamatrace.gguf.reader import open_gguf
from llamatrace.kernels.int8 import act8
from llamatrace.machine import probe

needs_avx2 = pytest.mark.skipif(not act8.available(), reason="the int8 probe needs AVX2")


@pytest.mark.parametrize("n", [0, 1, 7, 1000, 12345])
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_read_words_sums_every_word_whatever_the_split(n, threads):
    words = np.random.default_rng(n).integers(0, 2**64, size=n, dtype=np.uint64)   # sums wrap mod 2**64
    assert int(probe.read_words(words, threads)) == probe.read_words_np(words, threads)


@needs_avx2
@pytest.mark.parametrize("steps", [0, 1, 5, 1000])
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("a, b", [(0x04030201, 0x01FE0302), (0x7F7F7F7F, 0x7F7F7F7F), (0x01010101, -1)])
def test_dot_peak_gives_its_twins_checksum(steps, threads, a, b):
    isa = probe.dot_isa()
    got = probe.dot_peak(steps, threads, a, b)
    np.testing.assert_array_equal(got, probe.dot_peak_np(steps, threads, a, b, isa))
    assert (got != 0).all() == (steps > 0)


@pytest.mark.skipif(not probe.fma_isa(), reason="the float32 probe needs FMA3")
@pytest.mark.parametrize("steps", [0, 1, 5, 1000, 100_000])
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("a, b", [(1.0, 2.0 ** -20), (0.5, 0.25), (-3.0, 2.0 ** -30)])
def test_fma_peak_gives_its_twins_checksum(steps, threads, a, b):
    isa = probe.fma_isa()
    got = probe.fma_peak(steps, threads, np.float32(a), np.float32(b))
    assert got.dtype == np.float32 and got.shape == (threads,)
    np.testing.assert_array_equal(got, probe.fma_peak_np(steps, threads, a, b, isa))
    # every step adds a * b to each of the chains' lanes: the checksum counts the multiply-adds done
    assert (got == np.float32(steps * probe.CHAINS * probe.fma_lanes(isa) * a * b)).all()


def test_fma_isa_matches_the_widths_it_claims():
    isa = probe.fma_isa()
    assert isa in ("vfmadd231ps zmm", "vfmadd231ps ymm", "")
    assert probe.fma_lanes("vfmadd231ps zmm") == 2 * probe.fma_lanes("vfmadd231ps ymm") == 16


def test_dot_isa_matches_the_widths_it_claims():
    isa = probe.dot_isa()
    assert isa in ("vpdpbusd zmm", "vpdpbusd ymm", "vpmaddubsw ymm", "")
    assert (isa != "") == act8.available()
    assert probe.macs_per_step("vpdpbusd zmm") == 2 * probe.macs_per_step("vpmaddubsw ymm") == 64


@pytest.mark.parametrize("tied", [True, False])
def test_token_cost_counts_every_matrix_a_token_goes_through(tmp_path, tied):
    path = write_tiny_llama(tmp_path / "m.gguf", qtype=T.Q8_0, tied=tied)
    reader = gguf.GGUFReader(path)                        # gguf-py's reading, not ours
    mats = [t for t in reader.tensors if len(t.shape) == 2 and (t.name != "token_embd.weight" or tied)]
    cost = roofline.token_cost(open_gguf(path))
    assert cost.weight_bytes == sum(int(t.n_bytes) for t in mats)
    assert cost.macs == sum(int(t.n_elements) for t in mats)
    embd = next(t for t in reader.tensors if t.name == "token_embd.weight")
    output = next(t for t in mats if t.name == ("token_embd.weight" if tied else "output.weight"))
    assert cost.prefill_macs == cost.macs - int(output.n_elements) > 0          # a prefill's logits: the last token's
    assert (cost.macs >= int(embd.n_elements)) and any(t.name == "output.weight" for t in mats) != tied


def test_fractions_divide_by_the_measured_limits():
    cost = roofline.TokenCost(weight_bytes=2_000_000_000, macs=4_000_000_000)
    machine = roofline.Machine(threads=2, read_gb_s=40.0, int8_gmac_s=400.0, isa="vpdpbusd zmm")
    f = roofline.fractions(cost, machine, prefill_tok_s=20.0, decode_tok_s=5.0)
    assert np.isnan(f.pop("prefill_of_amx_peak"))                       # no AMX peak measured
    assert np.isnan(f.pop("prefill_of_f32_peak"))                       # nor a float32 one
    assert f == {"prefill_gmac_s": 80.0, "prefill_of_int8_peak": 0.2, "decode_gb_s": 10.0, "decode_of_read_bw": 0.25}
    without_output = roofline.TokenCost(weight_bytes=2_000_000_000, macs=4_000_000_000, prefill_macs=3_000_000_000)
    assert roofline.fractions(without_output, machine, 20.0, 5.0)["prefill_gmac_s"] == 60.0
    with_amx = roofline.Machine(2, 40.0, 400.0, "vpdpbusd zmm", amx_gmac_s=1600.0, amx="on")
    assert roofline.fractions(cost, with_amx, 20.0, 5.0)["prefill_of_amx_peak"] == 0.05
    with_f32 = roofline.Machine(2, 40.0, 400.0, "vpdpbusd zmm", f32_gmac_s=100.0, f32_isa="vfmadd231ps zmm")
    assert roofline.fractions(cost, with_f32, 20.0, 5.0)["prefill_of_f32_peak"] == 0.8
    no_avx2 = roofline.fractions(cost, roofline.Machine(2, 40.0, 0.0, ""), 20.0, 5.0)
    assert np.isnan(no_avx2["prefill_of_int8_peak"]) and no_avx2["decode_of_read_bw"] == 0.25


def test_measure_machine_reports_positive_limits():
    m = roofline.measure_machine(threads=1, repeats=1)
    assert m.read_gb_s > 0 and m.read_small_pages_gb_s > 0 and m.threads == 1 and m.isa == probe.dot_isa()
    assert (m.int8_gmac_s > 0) == bool(m.isa)
    assert (m.f32_gmac_s > 0) == bool(m.f32_isa) and m.f32_isa == probe.fma_isa()
