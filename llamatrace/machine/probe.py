"""The machine's limits for ``bench``'s roofline: memory read bandwidth, int8 and float32 multiply-add peaks.

- :func:`read_words`: every thread sums its share of a large uint64 array, a STREAM-like read
  (decode streams the weights once a token, so read bandwidth is its limit). NumPy twin:
  :func:`read_words_np`.
- :func:`dot_peak`: on each thread, independent chains of the int8 multiply-add that prefill's
  8-bit kernels are made of, with no memory traffic: 512-bit ``vpdpbusd`` on AVX-512 VNNI (64
  multiply-adds an instruction), 256-bit ``vpdpbusd`` on AVX-VNNI, else AVX2's ``vpmaddubsw`` +
  ``vpmaddwd`` + ``vpaddd`` (32). Inline asm, so LLVM can neither fold nor reorder the chains.
  NumPy twin: :func:`dot_peak_np` (the same int32 checksum).
- :func:`fma_peak`: the same for float32 multiply-adds, the ``f32`` mode's arithmetic (its kernels
  make each weight a float and multiply-add it): ``vfmadd231ps`` on zmm where AVX-512 is, else on
  ymm (16 or 8 multiply-adds an instruction). NumPy twin: :func:`fma_peak_np`.

The AMX int8 peak (``tdpbssd`` chains on the tiles) is :func:`llamatrace.kernels.int8.amx.make_dot_peak`,
written once against the tile operations like the AMX kernels, and measured only where
:func:`llamatrace.kernels.int8.amx.status` is on.
"""

from __future__ import annotations

import numpy as np
from llvmlite import binding as llvm_binding
from llvmlite import ir
from numba import njit, prange, types
from numba.extending import intrinsic

from llamatrace.machine.jit import JIT_EXACT_PARALLEL, target_features

_I32, _I64 = ir.IntType(32), ir.IntType(64)
llvm_binding.initialize_native_asmparser()    # Numba sets up no assembler for inline asm text
CHAINS = 8
"""Independent accumulators per thread: enough to cover the instruction's latency (4-5 cycles at
two a cycle), few enough for AVX2's 16 registers."""


def dot_isa() -> str:
    """The multiply-add :func:`dot_peak` runs on this CPU: ``"vpdpbusd zmm"``, ``"vpdpbusd ymm"``
    or ``"vpmaddubsw ymm"`` (``""``: no AVX2, no probe)."""
    f = target_features()
    if {"avx512vnni", "avx512f"} <= f:
        return "vpdpbusd zmm"
    if "avxvnni" in f or {"avx512vnni", "avx512vl"} <= f:
        return "vpdpbusd ymm"
    return "vpmaddubsw ymm" if "avx2" in f else ""


def macs_per_step(isa: str) -> int:
    """int8 multiply-adds in one step of one chain: 64 for a zmm register, 32 for a ymm one."""
    return 64 if "zmm" in isa else 32


@njit(**JIT_EXACT_PARALLEL)
def read_words(words, n_threads):
    """Sum (mod 2**64) of ``words`` (uint64 [n]), each of ``n_threads`` threads reading a
    contiguous share.

    Each thread sums a slice from index 0: indexing ``words`` from a computed start instead
    keeps Numba's negative-index check in the loop, which LLVM then does not vectorize, and the
    probe read 9.5 GB/s a thread where this loop reads 14-15 (Xeon VM, 2026-11-27)."""
    parts = np.zeros(n_threads, np.uint64)
    n = words.size
    for t in prange(n_threads):
        s = np.uint64(0)
        share = words[t * n // n_threads:(t + 1) * n // n_threads]
        for i in range(share.shape[0]):
            s += share[i]
        parts[t] = s
    total = np.uint64(0)
    for t in range(n_threads):
        total += parts[t]
    return total


def read_words_np(words: np.ndarray, n_threads: int) -> int:
    """NumPy twin of :func:`read_words` (its result does not depend on ``n_threads``)."""
    return int(words.sum(dtype=np.uint64))


def _chain_ir(builder, isa: str, vec, acc, a, b, ones):
    """One step of one chain: ``acc`` plus the 4-byte dot products of unsigned ``a`` and signed
    ``b`` per int32 lane (AT&T operand order: sources first, destination last)."""
    if isa == "vpdpbusd zmm":
        fn = ir.InlineAsm(ir.FunctionType(vec, [vec, vec, vec]), "vpdpbusd $3, $2, $0", "=v,0,v,v")
        return builder.call(fn, [acc, a, b])
    if isa == "vpdpbusd ymm":                # AVX-VNNI: the VEX encoding
        fn = ir.InlineAsm(ir.FunctionType(vec, [vec, vec, vec]), "{vex} vpdpbusd $3, $2, $0", "=x,0,x,x")
        return builder.call(fn, [acc, a, b])
    # AVX2: products to int16 pairs in a scratch register ($1), pairs to int32, add
    fn = ir.InlineAsm(ir.FunctionType(ir.LiteralStructType([vec, vec]), [vec, vec, vec, vec]),
                      "vpmaddubsw $4, $3, $1\n\tvpmaddwd $5, $1, $1\n\tvpaddd $1, $0, $0",
                      "=x,=&x,0,x,x,x")
    return builder.extract_value(builder.call(fn, [acc, a, b, ones]), 0)


def _splat(builder, vec, x):
    """``x`` in every lane of ``vec``."""
    v = builder.insert_element(ir.Constant(vec, None), x, ir.Constant(_I32, 0))
    lane0 = ir.Constant(ir.VectorType(_I32, vec.count), [0] * vec.count)
    return builder.shuffle_vector(v, ir.Constant(vec, None), lane0)


def _chains_sum(builder, n, vec, step, add):
    """The loop of :data:`CHAINS` accumulators of type ``vec`` (zeros), each ``acc = step(acc)``
    ``n`` times (int64; none when ``n <= 0``), then their sum over chains and lanes by ``add``
    (``builder.add`` or ``builder.fadd``)."""
    zero = ir.Constant(vec, None)
    entry = builder.basic_block
    loop = builder.append_basic_block("chains_loop")
    done = builder.append_basic_block("chains_done")
    builder.cbranch(builder.icmp_signed(">", n, ir.Constant(_I64, 0)), loop, done)
    builder.position_at_end(loop)
    i = builder.phi(_I64)
    accs = [builder.phi(vec) for _ in range(CHAINS)]
    new = [step(acc) for acc in accs]
    i_next = builder.add(i, ir.Constant(_I64, 1))
    i.add_incoming(ir.Constant(_I64, 0), entry)
    i.add_incoming(i_next, loop)
    for acc, nxt in zip(accs, new):
        acc.add_incoming(zero, entry)
        acc.add_incoming(nxt, loop)
    builder.cbranch(builder.icmp_signed("<", i_next, n), loop, done)
    builder.position_at_end(done)
    outs = [builder.phi(vec) for _ in range(CHAINS)]
    for out, nxt in zip(outs, new):
        out.add_incoming(zero, entry)
        out.add_incoming(nxt, loop)
    total = outs[0]
    for out in outs[1:]:
        total = add(total, out)
    s = builder.extract_element(total, ir.Constant(_I32, 0))
    for lane in range(1, vec.count):
        s = add(s, builder.extract_element(total, ir.Constant(_I32, lane)))
    return s


@intrinsic
def _dot_chains(typingctx, n_steps, a_word, b_word):
    """int32: the sum over lanes and chains of :data:`CHAINS` accumulators, each given
    ``n_steps`` multiply-add steps of the bytes of ``a_word`` (unsigned) by those of ``b_word``
    (signed), the low 32 bits of each broadcast to every lane. On AVX2 a pair of products must fit int16
    (``vpmaddubsw`` saturates), so keep the bytes small."""
    if not all(isinstance(x, types.Integer) for x in (n_steps, a_word, b_word)):
        return None
    isa = dot_isa()
    lanes = macs_per_step(isa) // 4
    vec = ir.VectorType(_I32, lanes)

    def codegen(context, builder, signature, args):
        n = builder.sext(args[0], _I64) if args[0].type.width < 64 else args[0]
        a, b = (_splat(builder, vec, builder.trunc(x, _I32) if x.type.width > 32 else x) for x in args[1:])
        ones = ir.Constant(vec, [0x00010001] * lanes)       # int16 ones for vpmaddwd
        return _chains_sum(builder, n, vec, lambda acc: _chain_ir(builder, isa, vec, acc, a, b, ones), builder.add)

    return types.int32(n_steps, a_word, b_word), codegen


def fma_isa() -> str:
    """The float32 multiply-add :func:`fma_peak` runs on this CPU: ``"vfmadd231ps zmm"``,
    ``"vfmadd231ps ymm"`` (``""``: no FMA3, no probe)."""
    f = target_features()
    if "avx512f" in f:
        return "vfmadd231ps zmm"
    return "vfmadd231ps ymm" if {"fma", "avx2"} <= f else ""


def fma_lanes(isa: str) -> int:
    """float32 multiply-adds in one step of one :func:`fma_peak` chain: 16 for zmm, 8 for ymm."""
    return 16 if "zmm" in isa else 8


@intrinsic
def _fma_chains(typingctx, n_steps, a, b):
    """float32: the sum over lanes and chains of :data:`CHAINS` accumulators, each given ``n_steps``
    ``acc += a * b`` (``a``, ``b`` float32 broadcast to every lane), one ``vfmadd231ps`` a step."""
    if not (isinstance(n_steps, types.Integer) and a == types.float32 and b == types.float32):
        return None
    isa = fma_isa()
    lanes = fma_lanes(isa)
    vec = ir.VectorType(ir.FloatType(), lanes)
    reg = "v" if "zmm" in isa else "x"

    def codegen(context, builder, signature, args):
        n = builder.sext(args[0], _I64) if args[0].type.width < 64 else args[0]
        va, vb = _splat(builder, vec, args[1]), _splat(builder, vec, args[2])
        fma = ir.InlineAsm(ir.FunctionType(vec, [vec, vec, vec]), "vfmadd231ps $3, $2, $0", f"={reg},0,{reg},{reg}")
        return _chains_sum(builder, n, vec, lambda acc: builder.call(fma, [acc, va, vb]), builder.fadd)

    return types.float32(n_steps, a, b), codegen


@njit(**JIT_EXACT_PARALLEL)
def fma_peak(n_steps, n_threads, a, b):
    """float32 [n_threads]: each thread's :func:`_fma_chains` checksum after ``n_steps`` steps of
    :data:`CHAINS` chains (``n_steps * CHAINS * fma_lanes`` multiply-adds a thread); ``a``, ``b``
    float32."""
    out = np.zeros(n_threads, np.float32)
    for t in prange(n_threads):
        out[t] = _fma_chains(n_steps, a, b)
    return out


def fma_peak_np(n_steps: int, n_threads: int, a: float, b: float, isa: str) -> np.ndarray:
    """NumPy twin of :func:`fma_peak` where every partial sum is a float32 exactly (``a * b`` a power
    of two, ``n_steps * a * b`` below 2**24 of it): ``n_steps * a * b`` per lane and chain, summed."""
    per_lane = np.float64(n_steps) * np.float64(np.float32(a)) * np.float64(np.float32(b))
    return np.full(n_threads, per_lane * CHAINS * fma_lanes(isa), np.float32)


@njit(**JIT_EXACT_PARALLEL)
def dot_peak(n_steps, n_threads, a_word, b_word):
    """int32 [n_threads]: each thread's :func:`_dot_chains` checksum after ``n_steps`` steps of
    :data:`CHAINS` chains (``n_steps * CHAINS * macs_per_step`` multiply-adds a thread)."""
    out = np.zeros(n_threads, np.int32)
    for t in prange(n_threads):
        out[t] = _dot_chains(n_steps, a_word, b_word)
    return out


def dot_peak_np(n_steps: int, n_threads: int, a_word: int, b_word: int, isa: str) -> np.ndarray:
    """NumPy twin of :func:`dot_peak`: the same int32 checksums (wrapping as the lanes do)."""
    a = np.array([a_word], np.int32).view(np.uint8).astype(np.int64)
    b = np.array([b_word], np.int32).view(np.int8).astype(np.int64)
    lane = int((a * b).sum())                         # one step's addition to one int32 lane
    lanes = macs_per_step(isa) // 4
    total = (lane * n_steps * CHAINS * lanes) % 2**32
    return np.full(n_threads, total, np.uint32).view(np.int32)
