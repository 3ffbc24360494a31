"""The AMX int8 prefill (llamatrace.kernels.int8.amx), checked on any x86 machine.

The kernel is written once against six tile operations. Here: the emulated operations against
NumPy integer matmuls (the SDM's semantics, int32 wrap-around) and against the faults the hardware
raises; the emulated kernel against the VNNI kernel (bit for bit), its NumPy twin and float64 sums
over gguf-py's dequantized weights; the hardware kernel and peak probe compiled, their machine
code holding the tile instructions with the operands in Intel's order (held against LLVM's own
reading of Intel-syntax text); the availability decision, for real on this machine (no AMX here:
the fallback and its reason; with AMX: the permission granted). Where the CPU has AMX and the OS
grants it, the hardware kernel and probe run against the same references; elsewhere only those
tests skip. Nothing is timed."""

from __future__ import annotations

import collections
import os
import re
import subprocess
import sys

import gguf
import numpy as np
import pytest
from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic
from cli_helpers import run
from test_act8 import _dequantized_activations, _rows, _weight

from llamatrace.kernels.int8 import act8, amx
from llamatrace.kernels.types import packing
from llamatrace.kernels.types.registry import matmul

T = gguf.GGMLQuantizationType
TR = packing.TR
AVAILABLE = amx.available().on
needs_amx = pytest.mark.skipif(not AVAILABLE, reason=f"AMX is not available here: {amx.available().reason}")
DECIDE_AVAILABLE = amx.available.__wrapped__          # available() without its once-per-process cache

EMULATED_PREFILL = amx.make_prefill(amx.EMULATED, cache=False)
EMULATED_PEAK = amx.make_dot_peak(amx.EMULATED, cache=False)
KINDS = {T.Q4_0: amx.KIND_Q4_0, T.Q8_0: amx.KIND_Q8_0, T.Q4_K: amx.KIND_Q4_K, T.Q6_K: amx.KIND_Q6_K}
KQUANTS = (T.Q4_K, T.Q6_K)


def _cpu_flags() -> set[str]:
    with open("/proc/cpuinfo") as fh:
        return next(set(line.split(":", 1)[1].split()) for line in fh if line.startswith("flags"))


# --------------------------------------------------------------------------------------------
# the emulated tile operations


E = amx.EMULATED


@njit
def _emulated_product(shapes, a, b, c, signed_b):
    """C (tmm2) += A (tmm0) x B (tmm1) by the emulated ops, the shapes [3, 2] (rows, colsb) of A,
    B, C; a, b uint8 [16 * 64] (rows 64 bytes apart), c int32 [256] in and out."""
    state = np.zeros(amx.STATE_BYTES, np.uint8)
    state[0] = 1
    for reg in range(3):
        amx.set_config(state, reg, shapes[reg, 0], shapes[reg, 1])
    E.config(state)
    E.load(state, 0, a, 0, 64)
    E.load(state, 1, b, 0, 64)
    E.load(state, 2, c, 0, 64)
    if signed_b:
        E.dpbssd(state, 2, 0, 1)
    else:
        E.dpbsud(state, 2, 0, 1)
    out = np.full(256, 7, np.int32)                   # 7: what tilestored must not touch
    E.store(state, 2, out, 0, 64)
    E.release(state)
    return out


@pytest.mark.parametrize("m, k, n", [(16, 16, 16), (16, 8, 16), (5, 3, 7), (1, 1, 1)])
@pytest.mark.parametrize("signed_b", [True, False])
def test_emulated_tdpb_is_an_integer_matmul_that_wraps(m, k, n, signed_b):
    rng = np.random.default_rng(m * 100 + k * 10 + n)
    a = rng.integers(0, 256, 1024, dtype=np.uint8)
    b = rng.integers(0, 256, 1024, dtype=np.uint8)
    c = rng.integers(-2**31, 2**31, 256, dtype=np.int64).astype(np.int32)    # near the int32 limits: wraps
    got = _emulated_product(np.array([[m, 4 * k], [k, 4 * n], [m, 4 * n]]), a, b, c, signed_b)
    # NumPy: A [m, 4k] int8, B [k, 4n] (int8 | uint8) regrouped to [4k, n], C [m, n]
    A = a.view(np.int8).reshape(16, 64)[:m, :4 * k].astype(np.int64)
    Bb = (b.view(np.int8) if signed_b else b).reshape(16, 64)[:k, :4 * n].astype(np.int64)
    B = Bb.reshape(k, n, 4).transpose(0, 2, 1).reshape(4 * k, n)
    want = np.full((16, 16), 7, np.int64)            # tilestored writes C's rows x colsb only
    want[:m, :n] = c.reshape(16, 16)[:m, :n] + A @ B
    np.testing.assert_array_equal(got.reshape(16, 16), ((want + 2**31) % 2**32 - 2**31).astype(np.int32))


@pytest.mark.parametrize("shapes, error", [
    ([[16, 64], [8, 64], [16, 64]], "do not chain"),      # A's K = 16 groups, B has 8 rows
    ([[16, 32], [8, 64], [8, 64]], "do not chain"),       # C's rows != A's rows
    ([[16, 32], [8, 64], [16, 32]], "do not chain"),      # C's colsb != B's colsb
])
def test_emulator_faults_on_shapes_the_hardware_rejects(shapes, error):
    z = np.zeros(1024, np.uint8)
    with pytest.raises(RuntimeError, match=error):
        _emulated_product(np.array(shapes), z, z, np.zeros(256, np.int32), True)


@njit
def _misuse(case):
    state = np.zeros(amx.STATE_BYTES, np.uint8)
    amx.set_config(state, 0, 16, 64)
    arr = np.zeros(16 * 64, np.uint8)
    if case == 0:
        E.load(state, 0, arr, 0, 64)                    # no ldtilecfg yet
    E.config(state)
    if case == 1:
        E.load(state, 0, arr, 64, 64)                   # the last row ends past the array
    if case == 2:
        E.dpbssd(state, 0, 0, 0)                        # registers not distinct
    E.release(state)
    if case == 3:
        E.zero(state, 0)                                # after tilerelease


@pytest.mark.parametrize("case, error", [(0, "without a loaded tile config"), (1, "outside its array"),
                                         (2, "not distinct"), (3, "without a loaded tile config")])
def test_emulator_faults_on_misuse(case, error):
    with pytest.raises((RuntimeError, IndexError), match=error):
        _misuse(case)


def test_emulator_rejects_configs_ldtilecfg_rejects():
    state = np.zeros(amx.STATE_BYTES, np.uint8)
    amx.set_config(state, 0, 17, 64)                    # 17 rows
    with pytest.raises(RuntimeError, match="rows > 16"):
        njit(lambda s: E.config(s))(state)


# --------------------------------------------------------------------------------------------
# the prefill kernel, emulated


def _run(kernel, qtype, x, w):
    out = np.full((x.shape[0], w.n_out), np.nan, np.float32)
    amx.run(kernel, KINDS[qtype], x, w.qs, w.d, w.m if qtype == T.Q4_K else w.d, out, 2)
    return out


def _vnni(qtype, x, w):
    """The VNNI kernel that the AMX one must equal bit for bit (the per-row kernels, any row count)."""
    out = np.empty((x.shape[0], w.n_out), np.float32)
    if qtype == T.Q4_K:
        act8._matmul_q4k(x, w.qs, w.d, w.m, out)
    elif qtype == T.Q6_K:
        act8._matmul_q6k(x, w.qs, w.d, out)
    else:
        act8._matmul_q4(x, w.qs, w.d, w.d, np.float32(-8.0 if qtype == T.Q4_0 else 0.0), qtype == T.Q8_0, out)
    return out


def _twin(qtype, x, w):
    twin = {T.Q4_0: lambda: act8.matmul_q4_np(x, w.qs, w.d, w.d, -8.0), T.Q8_0: lambda: act8.matmul_q8_np(x, w.qs, w.d),
            T.Q4_K: lambda: act8.matmul_q4k_np(x, w.qs, w.d, w.m), T.Q6_K: lambda: act8.matmul_q6k_np(x, w.qs, w.d)}[qtype]()
    return twin[:, :w.n_out]


def _vnni_prefill(qtype, x, w):
    out = np.empty((x.shape[0], w.n_out), np.float32)
    if qtype == T.Q6_K:
        act8._prefill_q6k(x, w.qs, w.d, out, 2)
        return out
    kind = {T.Q4_0: act8.PREFILL_Q4, T.Q8_0: act8.PREFILL_Q8, T.Q4_K: act8.PREFILL_Q4K}[qtype]
    act8._prefill(x, w.qs, w.d, w.m if qtype == T.Q4_K else w.d, np.float32(-8.0 if qtype == T.Q4_0 else 0.0),
                  kind, out)
    return out


@pytest.mark.parametrize("qtype", KINDS, ids=lambda q: q.name)
@pytest.mark.parametrize("n_seq", [5, 16, 37])
def test_emulated_prefill_is_the_vnni_kernels_bits_and_the_references(qtype, n_seq):
    # 70 weight rows: three tiles, the last padded; 37 rows: two full A tiles and 5 rows
    raw, w = _weight(qtype, 70, (256 if qtype in KQUANTS else 32) * 5)
    x = _rows(np.random.default_rng(n_seq), n_seq, w.n_in)
    got = _run(EMULATED_PREFILL, qtype, x, w)
    np.testing.assert_array_equal(got.view(np.uint32), _vnni(qtype, x, w).view(np.uint32))
    twin = _twin(qtype, x, w)
    np.testing.assert_allclose(got, twin, rtol=0, atol=1e-6 * np.abs(twin).max())
    # independent: float64 sums of gguf-py's dequantized weights and the 8-bit activations
    ours_x = _dequantized_activations(qtype, x)
    W = gguf.quants.dequantize(raw, qtype).astype(np.float64)
    assert np.all(np.abs(got - ours_x @ W.T) <= 1e-6 * (np.abs(ours_x) @ np.abs(W).T) + 1e-30)
    # the VNNI prefill kernel too, within 1e-6 (Q8_0's adds one FMA a block, Q4_K's contracts
    # otherwise, Q6_K's scales each group's sum in float32; Q4_0's gives these bits)
    vnni_prefill = _vnni_prefill(qtype, x, w)
    np.testing.assert_allclose(got, vnni_prefill, rtol=0, atol=1e-6 * np.abs(vnni_prefill).max())


@pytest.mark.parametrize("qtype", KINDS, ids=lambda q: q.name)
def test_emulated_prefill_extreme_quants_do_not_overflow(qtype):
    # every weight and activation at its largest magnitude: the int32 sums are exact
    n_out, n_in = 32, 512 if qtype in KQUANTS else 64
    size = gguf.GGML_QUANT_SIZES[qtype][1]
    blocks = np.zeros((n_out, n_in // gguf.GGML_QUANT_SIZES[qtype][0], size), np.uint8)
    blocks[:, :, :2] = np.frombuffer(np.float16(1.0).tobytes(), np.uint8)
    if qtype == T.Q4_K:                              # d 1, dmin 0, every 6-bit scale and min 63, q 15 or 0
        blocks[:, :, 4:] = 0xFF
        blocks[::2, :, 16:] = 0x00
    elif qtype == T.Q6_K:                            # q 31 or -32, scales 127 or -128, d 1 (last)
        blocks[:, :, :] = 0
        blocks[:, :, :192] = 0xFF
        blocks[::2, :, :192] = 0x00
        blocks[:, :, 192:208] = 0x7F
        blocks[1::4, :, 192:208] = 0x80
        blocks[:, :, 208:] = np.frombuffer(np.float16(1.0).tobytes(), np.uint8)
    else:
        blocks[:, :, 2:] = np.uint8(0x80) if qtype == T.Q8_0 else np.uint8(0xFF)   # -128 / q - 8 = 7
        blocks[::2, :, 2:] = 127 if qtype == T.Q8_0 else 0
    raw = blocks.reshape(n_out, -1)
    w = packing.pack("w", qtype, raw, n_out, n_in, activations="q8")
    x = np.full((17, n_in), 127.0, np.float32)
    x[1::2] = -127.0
    want = x.astype(np.float64) @ gguf.quants.dequantize(raw, qtype).astype(np.float64).T
    np.testing.assert_allclose(_run(EMULATED_PREFILL, qtype, x, w), want, rtol=1e-6, atol=0)


def test_self_check_passes_the_emulated_kernel_and_catches_a_wrong_one():
    assert amx.self_check(EMULATED_PREFILL) == ""

    def off_by_one(*args):                             # a kernel whose sums are wrong
        EMULATED_PREFILL(*args)
        args[-1][0, 0] += 1.0
    assert amx.self_check(off_by_one).startswith("Q4_0: 1 of ")


# --------------------------------------------------------------------------------------------
# the hardware kernel and probe: machine code here, runs where AMX is

PREFILL_SIG_TEXT = ("(types.int8[:, ::1], types.float32[:, ::1], types.float32[:, ::1], types.uint8[::1], "
                    "types.uint16[:, :, ::1], types.uint16[:, :, ::1], types.float32, types.int64, types.int64, "
                    "types.float32[:, ::1])")
"""The argument types amx.run passes the prefill kernel (as text too, for a fresh process)."""
PREFILL_SIG = eval(PREFILL_SIG_TEXT, {"types": types})


def _tile_lines(dispatcher, sig) -> list[str]:
    """The tile instructions in ``dispatcher``'s machine code for ``sig``, as LLVM prints them."""
    dispatcher.compile(sig)
    lines = (" ".join(line.split()) for line in dispatcher.inspect_asm(sig).splitlines())
    return [line for line in lines if re.match(r"(ldtilecfg|tile[a-z]+|tdpb[su]{2}d)\b", line)]


@intrinsic
def _intel_syntax(typingctx):
    """Three of the prefill kernel's products written in Intel syntax (C, A, B), as LLVM reads it."""
    def codegen(context, builder, sig, args):
        for text in ("tdpbsud tmm4, tmm0, tmm1", "tdpbssd tmm5, tmm0, tmm2", "tdpbsud tmm5, tmm3, tmm7"):
            fn = ir.InlineAsm(ir.FunctionType(ir.VoidType(), []), f".intel_syntax noprefix\n\t{text}\n\t.att_syntax",
                              "", side_effect=True)
            builder.call(fn, [])
        return context.get_dummy_value()
    return types.void(), codegen


def test_hardware_prefill_compiles_to_tile_instructions_in_intels_operand_order():
    lines = _tile_lines(amx.make_prefill(amx.HW, cache=False), PREFILL_SIG)    # not from the cache: its asm
    count = collections.Counter(line.split()[0] for line in lines)
    assert count["tdpbssd"] >= 2 and count["tdpbsud"] >= 4          # Q8_0; Q4_0 and Q4_K, Q6_K: two C tiles each
    assert count["tileloadd"] >= 3 and count["tilestored"] >= 2 and count["tilezero"] >= 2
    assert count["ldtilecfg"] >= 1 and count["tilerelease"] >= 1
    # C tmm4 = A tmm0 x B tmm1: LLVM prints our AT&T text as it prints the Intel-syntax one
    intel = _tile_lines(njit(lambda: _intel_syntax()), ())
    assert set(intel) <= set(lines), (intel, lines)
    assert "tileloadd" in " ".join(lines) and not any("tdpbusd" in line for line in lines)


def test_hardware_peak_probe_compiles_to_tdpbssd_chains():
    sig = (types.int64,) * 4
    lines = _tile_lines(amx.make_dot_peak(amx.HW, cache=False), sig)
    dots = [line for line in lines if line.startswith("tdpbssd")]
    assert sorted(dots) == [f"tdpbssd %tmm5, %tmm4, %tmm{c}" for c in range(amx.PEAK_CHAINS)]


@pytest.mark.parametrize("steps, a, b", [(0, 1, 1), (3, 0x04030201, 0x01FE0302), (2100, -0x7F7F7F80, -0x7F7F7F80)])
def test_emulated_peak_probe_gives_its_twins_checksum(steps, a, b):
    # 2100 steps of 16 * 4 * 128 * 128 per element: past 2**31, wraps as int32 does
    np.testing.assert_array_equal(EMULATED_PEAK(steps, 2, a, b), amx.dot_peak_np(steps, 2, a, b))


@needs_amx
@pytest.mark.parametrize("qtype", KINDS, ids=lambda q: q.name)
@pytest.mark.parametrize("n_seq", [5, 37])
def test_hardware_prefill_is_the_emulated_and_vnni_kernels_bits(qtype, n_seq):
    _, w = _weight(qtype, 70, (256 if qtype in KQUANTS else 32) * 5)
    x = _rows(np.random.default_rng(n_seq), n_seq, w.n_in)
    got = _run(amx.hw_prefill(), qtype, x, w)
    np.testing.assert_array_equal(got.view(np.uint32), _run(EMULATED_PREFILL, qtype, x, w).view(np.uint32))
    np.testing.assert_array_equal(got.view(np.uint32), _vnni(qtype, x, w).view(np.uint32))


@needs_amx
def test_hardware_peak_probe_gives_its_twins_checksum():
    np.testing.assert_array_equal(amx.hw_dot_peak()(1000, 2, 0x04030201, 0x01FE0302),
                                  amx.dot_peak_np(1000, 2, 0x04030201, 0x01FE0302))


# --------------------------------------------------------------------------------------------
# availability, for real


def test_status_follows_the_cpu_and_the_os_here():
    has = {"amx_tile", "amx_int8"} <= _cpu_flags()
    refused = amx.request_permission()               # the real syscall, on this machine
    if not has:
        assert not AVAILABLE and amx.available().reason == "not available: no amx_int8"
        assert refused.startswith("the OS refused the AMX tile state") and "errno" in refused
        assert amx.decision(amx.KIND_Q4_0) == amx.available() and not amx.use(amx.KIND_Q4_0, 128)
    else:                                            # an AMX machine: granted, and the self-check passed
        assert refused == "" and AVAILABLE, amx.available().reason


def test_switches_in_a_fresh_process():
    code = "from llamatrace.kernels.int8 import amx; print(amx.available(), amx.decision(amx.KIND_Q4_K))"
    for value, want in (("0", "off: forced by LLAMATRACE_AMX=0"),
                        ("1", "on: forced by LLAMATRACE_AMX=1" if AVAILABLE else amx.available().reason)):
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                             env={**os.environ, amx.ENV: value}).stdout
        assert out.count(f"reason='{want}'") == 2 - (value == "1" and AVAILABLE), out


def test_hardware_kernels_load_from_numbas_cache_in_a_new_process():
    # bound as globals, not closed over: a closure's cells pickle differently in every process,
    # and Numba's cache missed each time (17-22 s of compiling at the first prefill on AMX)
    code = ("from numba import types; from llamatrace.kernels.int8 import amx\n"
            f"k = amx.hw_prefill(); k.compile({PREFILL_SIG_TEXT})\n"
            "p = amx.hw_dot_peak(); p.compile((types.int64,) * 4)\n"
            "print(sum(k.stats.cache_hits.values()), sum(p.stats.cache_hits.values()))")
    runs = [subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
            for _ in range(2)]
    assert runs[1].split() == ["1", "1"], runs


def test_compiles_for_a_sapphire_rapids_target_and_runs_only_on_the_host_it_has():
    # Numba compiling for an AMX CPU (NUMBA_CPU_NAME / NUMBA_CPU_FEATURES, as a cross build does):
    # the kernel's machine code for that target holds the tile instructions, and AMX still runs only
    # where the host has it too
    from llvmlite import binding
    host = binding.get_host_cpu_features()
    features = ",".join(("+" if on else "-") + name for name, on in host.items() if not name.startswith("amx"))
    env = {**os.environ, "NUMBA_CPU_NAME": "sapphirerapids", "NUMBA_CPU_FEATURES": features + ",+amx-tile,+amx-int8"}
    code = ("import re; from numba import types; from llamatrace.kernels.int8 import amx\n"
            "from llamatrace.machine.jit import target_features\n"
            f"k = amx.make_prefill(amx.HW, cache=False); sig = {PREFILL_SIG_TEXT}; k.compile(sig)\n"
            "tile = [l.split()[0] for l in k.inspect_asm(sig).splitlines()"
            " if re.match(r'\\s*(ldtilecfg|tile[a-z]+|tdpb[su]{2}d)\\b', l)]\n"
            "print({'amx-tile', 'amx-int8'} <= target_features(), amx.has_amx(), sorted(set(tile)))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True).stdout
    host_amx = bool(host.get("amx-tile") and host.get("amx-int8"))
    assert out.split(" ", 2)[:2] == ["True", str(host_amx)], out
    assert all(op in out for op in ("ldtilecfg", "tileloadd", "tdpbssd", "tdpbsud", "tilestored", "tilerelease")), out


def test_status_on_an_amx_machine_decides_by_permission_and_self_check(monkeypatch, caplog):
    # the decision as on an AMX machine, the hardware replaced by the emulator: permission granted
    # and the self-check passed -> on; refused -> off with the OS's reason; a kernel with a wrong
    # sum -> off, with one warning line
    monkeypatch.delenv(amx.ENV, raising=False)
    monkeypatch.setattr(amx, "has_amx", lambda: True)
    monkeypatch.setattr(amx, "request_permission", lambda: "")
    monkeypatch.setattr(amx, "hw_prefill", lambda: EMULATED_PREFILL)
    decide = DECIDE_AVAILABLE
    assert decide().on
    monkeypatch.setattr(amx, "request_permission", lambda: "the OS refused the AMX tile state (...)")
    assert decide() == amx.Status(False, "not available: the OS refused the AMX tile state (...)")

    def wrong(*args):
        EMULATED_PREFILL(*args)
        args[-1][3, 5] = -args[-1][3, 5] - 1.0
    monkeypatch.setattr(amx, "request_permission", lambda: "")
    monkeypatch.setattr(amx, "hw_prefill", lambda: wrong)
    with caplog.at_level("WARNING", logger="llamatrace"):
        st = decide()
    assert not st.on and st.reason.startswith("not available: self-check failed: Q4_0: 1 of ")
    assert [r.getMessage().count("\n") for r in caplog.records] == [0] and "VNNI" in caplog.text


# --------------------------------------------------------------------------------------------
# the default: AMX only where it was measured faster, with the same bits (issue 51)


@pytest.fixture
def amx_machine(monkeypatch, tmp_path):
    """This process as on an AMX machine, the tiles replaced by the emulator: available, the
    decisions kept under ``tmp_path``, none taken yet, and nothing timed (``measure`` raises).
    Returns the list the prefill kernel appends to on each call."""
    calls = []

    def kernel(*args):
        calls.append(args[0].shape[0])
        EMULATED_PREFILL(*args)

    def no_timing(*args, **kwargs):
        raise AssertionError("measured: the tests decide through the kept entry")

    monkeypatch.setenv("LLAMATRACE_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv(amx.ENV, raising=False)
    monkeypatch.setattr(amx, "available", lambda: amx.Status(True, "amx_int8 (emulated)"))
    monkeypatch.setattr(amx, "hw_prefill", lambda: kernel)
    monkeypatch.setattr(amx, "measure", no_timing)
    monkeypatch.setattr(amx, "_DECIDED", {})
    return calls


def _kept(qtype, amx_s, vnni_s, same_bits=True):
    amx.remember(KINDS[qtype], amx.Measurement(qtype.name, 128, 4096, 4096, 2, amx_s, vnni_s, same_bits))


@pytest.mark.parametrize("qtype", KINDS, ids=lambda q: q.name)
def test_the_registry_runs_amx_only_where_it_was_measured_faster(qtype, amx_machine, tmp_path):
    _, w = _weight(qtype, 70, (256 if qtype in KQUANTS else 32) * 5)
    x = _rows(np.random.default_rng(1), 17, w.n_in)
    kind = KINDS[qtype]
    _kept(qtype, 1.0, 2.3)
    np.testing.assert_array_equal(matmul(x, w), _vnni(qtype, x, w))           # the AMX kernel's bits
    assert amx_machine == [32]                                                 # 17 rows, padded
    assert amx.decision(kind).reason == f"on: measured 2.30x VNNI on this CPU (cache {tmp_path / 'amx.json'})"
    for amx_s, vnni_s, same, why in ((2.0, 1.0, True, "off: measured 0.50x VNNI on this CPU, under the 1.2x it needs"),
                                     (1.0, 1.1, True, "off: measured 1.10x VNNI on this CPU, under the 1.2x it needs"),
                                     (1.0, 3.0, False, "off: measured 3.00x VNNI on this CPU, but not the VNNI prefill's bits")):
        amx._DECIDED.clear()                                                   # a new process
        _kept(qtype, amx_s, vnni_s, same)
        np.testing.assert_array_equal(matmul(x, w), _vnni_prefill(qtype, x, w))
        assert amx_machine == [32] and amx.decision(kind).reason.startswith(why + " (cache ")


def test_forced_on_and_off_whatever_was_measured(amx_machine, monkeypatch):
    _, w = _weight(T.Q4_0, 64, 256)
    x = _rows(np.random.default_rng(2), 16, w.n_in)
    _kept(T.Q4_0, 2.0, 1.0)                                                    # measured slower
    monkeypatch.setenv(amx.ENV, "1")
    matmul(x, w)
    assert amx_machine == [16] and amx.decision(amx.KIND_Q4_0) == amx.Status(True, "on: forced by LLAMATRACE_AMX=1")
    monkeypatch.setenv(amx.ENV, "0")
    monkeypatch.setattr(amx, "available", DECIDE_AVAILABLE)                   # decided anew: nothing AMX is touched
    monkeypatch.setattr(amx, "has_amx", lambda: pytest.fail("looked for AMX under LLAMATRACE_AMX=0"))
    matmul(x, w)
    assert amx_machine == [16] and amx.decision(amx.KIND_Q4_0) == amx.Status(False, "off: forced by LLAMATRACE_AMX=0")


def test_short_prefills_keep_vnni_on_amx(amx_machine, monkeypatch):
    # generate's warm-up runs a 5-token prefill through every weight at load: on the tiles it took
    # ~15 s at 8B (issue 51), a 16-row tile of which 11 rows are padding
    monkeypatch.setenv(amx.ENV, "1")
    for qtype in KINDS:
        _, w = _weight(qtype, 32, 256)
        for n in (5, amx.MIN_ROWS - 1, amx.MIN_ROWS):
            matmul(_rows(np.random.default_rng(n), n, w.n_in), w)
    assert amx_machine == [amx.MIN_ROWS] * 4


def test_unmeasured_is_off_until_measured_once_per_cpu(amx_machine, monkeypatch, tmp_path):
    timed = []

    def fake_measure(kind):
        timed.append(kind)
        return amx.Measurement(amx.KIND_NAMES[kind], 128, 4096, 4096, 2, 1.0, 1.5, True)

    assert amx.decision(amx.KIND_Q4_0, measure_now=False) == amx.Status(False, "off (default until measured faster)")
    assert amx.describe(("F32", "Q4_0", "Q6_K")) == "off (default until measured faster)"
    monkeypatch.setattr(amx, "measure", fake_measure)
    assert amx.decision(amx.KIND_Q4_0).on and timed == [amx.KIND_Q4_0]
    amx._DECIDED.clear()                                                       # a new process: read, not timed
    assert amx.decision(amx.KIND_Q4_0).on and timed == [amx.KIND_Q4_0]
    assert amx.describe(("Q4_0", "Q6_K")).startswith("Q4_0 on: measured 1.50x VNNI on this CPU (cache ")
    assert amx.describe(("Q4_0", "Q6_K")).endswith("; Q6_K off (default until measured faster)")
    # another CPU model, or changed kernels: their own entry, measured again; a broken file too
    key = amx.cpu_key()
    monkeypatch.setattr(amx, "cpu_key", lambda: {**key, "kernels": "0" * 16})
    amx._DECIDED.clear()
    assert amx.recalled(amx.KIND_Q4_0) is None
    (tmp_path / "amx.json").write_text("{not json")
    monkeypatch.setattr(amx, "cpu_key", lambda: key)
    assert amx.recalled(amx.KIND_Q4_0) is None
    assert amx.decision(amx.KIND_Q4_0).on and timed == [amx.KIND_Q4_0] * 2
    assert amx.recalled(amx.KIND_Q4_0) == fake_measure(amx.KIND_Q4_0)


@pytest.mark.parametrize("qtype", KINDS, ids=lambda q: q.name)
def test_measure_compares_the_bits_of_the_two_prefills(qtype):
    # the emulated kernel, timed for nothing: what counts is the comparison. Q4_K's and Q6_K's VNNI
    # prefill adds in another order than the per-row kernels (whose bits AMX gives), so they are
    # never chosen by measurement; Q4_0's and Q8_0's are the same bits
    shape = (16, 32, 256 if qtype in KQUANTS else 64)
    m = amx.measure(KINDS[qtype], shape, rounds=1, kernel=EMULATED_PREFILL)
    assert (m.type, m.rows, m.n_out, m.n_in) == (qtype.name, *shape) and m.amx_s > 0 and m.vnni_s > 0
    assert m.same_bits == (qtype in (T.Q4_0, T.Q8_0))


def test_a_second_process_compiles_nothing(tmp_path):
    # what an AMX process compiles or loads: the hardware prefill for the arguments a model's
    # weights give it and the peak probe (compiled here too, for this CPU), the VNNI prefill and
    # per-row kernels; in a second process Numba's cache serves every one of them. A cache of its
    # own: the first process compiles them all (minutes)
    code = (
        "import gguf, numba, numpy as np\n"
        "from numba.core import event\n"
        "from llamatrace.kernels.int8 import amx; from llamatrace.kernels.types import packing\n"
        "from llamatrace.kernels.types.registry import matmul\n"
        "compiled = []\n"
        "class Count(event.Listener):\n"
        "    def on_start(self, ev): pass\n"
        "    def on_end(self, ev): compiled.append(ev.data['dispatcher'].py_func.__name__)\n"
        "rng = np.random.default_rng(0)\n"
        "with event.install_listener('numba:compile', Count()):\n"
        "    for name, kind in amx.KINDS.items():\n"
        "        qtype = gguf.GGMLQuantizationType[name]\n"
        "        block, size = gguf.GGML_QUANT_SIZES[qtype]\n"
        "        raw = rng.integers(0, 256, (32, 256 // block * size), dtype=np.uint8)\n"
        "        w = packing.pack('w', qtype, raw, 32, 256, activations='q8')\n"
        "        x = np.ones((amx.MIN_ROWS, 256), np.float32)\n"
        "        out = np.empty((amx.MIN_ROWS, 32), np.float32)\n"
        "        m = w.m if name == 'Q4_K' else w.d\n"
        "        amx.hw_prefill().compile(tuple(numba.typeof(a) for a in amx.arguments(kind, x, w.qs, w.d, m, out)))\n"
        "        matmul(x, w); matmul(x[:1], w)\n"
        "    amx.hw_dot_peak().compile((numba.types.int64,) * 4)\n"
        "print(sorted(set(compiled)))\n")
    env = {**os.environ, "NUMBA_CACHE_DIR": str(tmp_path)}
    runs = [subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env).stdout
            for _ in range(2)]
    assert "_prefill_hw" in runs[0] and "_dot_peak_hw" in runs[0] and "_prefill" in runs[0], runs
    assert runs[1].strip() == "[]", runs


def test_info_and_bench_say_which_prefill_runs_and_why(amx_machine, capsys, monkeypatch, tiny_model_path, tmp_path):
    from llamatrace.analysis import bench
    from llamatrace.analysis.roofline import Machine, TokenCost

    def int8_line():
        code, out, err = run(capsys, "info", "-m", tiny_model_path)
        assert code == 0, err
        return next(line for line in out.splitlines() if line.startswith("q8 int8 products:"))

    assert int8_line().endswith("; AMX prefill: off (default until measured faster)")        # a Q8_0 file
    _kept(T.Q8_0, 1.0, 2.3)
    amx._DECIDED.clear()
    assert int8_line().endswith(f"; AMX prefill: on: measured 2.30x VNNI on this CPU (cache {tmp_path / 'amx.json'})")
    monkeypatch.setenv(amx.ENV, "1")
    assert int8_line().endswith("; AMX prefill: on: forced by LLAMATRACE_AMX=1")
    # bench: the reason, and both kernels' speed on the same matmul (a report made here, not timed)
    measured = amx.Measurement("Q4_0", 128, 4096, 4096, 2, 0.003, 0.0013, True)
    machine = Machine(2, 20.0, 400.0, "vpdpbusd zmm", amx_gmac_s=1600.0, amx="Q4_0 off: measured 0.43x VNNI (…)",
                      amx_matmuls=[measured.row()], read_small_pages_gb_s=19.0, read_between_runs_gb_s=[20.0])
    report = bench.BenchReport(str(tiny_model_path), 1, "cpu", 2, 128, 8, 1, 0,
                               [bench.EngineResult("llamatrace q8", "0", 1.0, [10.0], [5.0], 2**30, "numba omp")],
                               machine, TokenCost(10**9, 10**9))
    monkeypatch.setattr(bench, "run_bench", lambda *a, **k: report)
    code, out, err = run(capsys, "bench", "-m", tiny_model_path)
    assert code == 0, err
    out = " ".join(out.split())
    assert "AMX int8 1600 G/s (tdpbssd)" in out and "AMX prefill: Q4_0 off: measured 0.43x VNNI (…)" in out
    assert ("Q4_0 [128, 4096] x [4096, 4096]^T: AMX 716 G/s, VNNI 1652 G/s (0.43x; same bits; best of 3 "
            "alternated rounds)") in out
