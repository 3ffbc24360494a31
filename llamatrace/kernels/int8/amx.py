"""AMX int8 prefill for Q4_0, Q8_0, Q4_K and Q6_K weights (``--activations q8``), written once
against six tile operations that run either on the CPU's tiles or in an emulator.

Intel AMX (Sapphire Rapids and later, ``amx_int8`` in the CPU flags) adds eight tile registers
``tmm0..tmm7`` of up to 16 rows x 64 bytes and ``tdpb[su][su]d``, which multiplies a 16 x 64 int8
tile by a 16 x 64 one into a 16 x 16 int32 tile (16384 multiply-adds) in one instruction.

Tile operations. :class:`TileOps` holds ``config``, ``zero``, ``load``, ``dpbssd`` / ``dpbsud``,
``store``, ``release``; two sets exist:

- :data:`HW` (hardware): each op one instruction in inline asm (``ldtilecfg``, ``tilezero``,
  ``tileloadd``, ``tdpbssd`` / ``tdpbsud``, ``tilestored``, ``tilerelease``), the register numbers
  compile-time literals. Numba assembles them on any x86 machine; they run only where the CPU has
  AMX and the kernel granted the process the tile state (:func:`available`).
- :data:`EMULATED`: the same ops in Numba on a register file kept in the ``state`` array, with the
  semantics of Intel's SDM pseudo-code (``tileloadd`` zeroes the bytes beyond the configured rows
  and columns; ``tdpbssd``: ``C[m][n] += sum_k sum_i A[m][4k+i] * B[k][4n+i]``, the bytes signed
  or unsigned as the mnemonic says, int32 wrap-around) and the SDM's #UD / #GP conditions checked
  (shapes that do not chain, registers not distinct, a tile load or store outside its array, no
  config loaded): a mistake the hardware would fault on raises here.

:func:`make_prefill` builds the kernel around one set, so the kernel the tests run emulated on any
machine is the one that runs on the tiles: the same code, the same loops, only the six ops differ.

Layout: none of its own. The ``q8`` mode's packed weights (:mod:`llamatrace.kernels.int8.act8`) hold a
tile's block as groups of four bytes per row, ``[P/4, TR, 4]``; with ``TR`` = 32 rows a group is
128 bytes, and the 64 bytes of rows 0..15 (then 16..31) of consecutive groups, 128 bytes apart,
are exactly AMX's "VNNI-packed" B tile: row k = inputs 4k..4k+3 of 16 weight rows. Q8_0's block
(8 groups, 32 inputs) is read in place as two B tiles of 8 rows x 64 bytes (stride 128). Q4_0's
nibbles are unpacked a block at a time into such bytes (low nibbles: groups 0..3, inputs 0..15;
high: groups 4..7, inputs 16..31; 1 KB, in L1), Q4_K's four 32-byte chunks a block the same way
(chunk c's low nibbles are sub-block 2c, its high ones 2c + 1; its scale bytes read where they
are), Q6_K's blocks by :func:`llamatrace.kernels.int8.act8_ir.unpack_q6k`, the VNNI prefill's own
unpacker, whose output is already that order (``q + 32`` as bytes, then the int8 scales). So the
packed-weights cache (:mod:`llamatrace.model.packcache`) serves the same bytes to an AMX and a
non-AMX process, and the AMX kernel reads what the VNNI kernel reads.

The product. Tiles: ``A`` = 16 activation rows x 32 int8 of one sub-block of 32 inputs (``tmm0``,
rows 16, colsb 32: K = 32); ``B`` = the sub-block's weights for 16 weight rows (``tmm1``,
``tmm2``: rows 8, colsb 64); ``C`` = 16 x 16 int32 (``tmm4``, ``tmm5``). K is 32, not 64 (the
tile's width): a block's int32 sums must be scaled by that block's ``d * xd`` before blocks are
added, and folding two blocks into one tile would mix two scales into one sum. Loops, per weight
tile of 32 rows: per block, unpack it, load its two B tiles once, then for every 16 activation
rows load A, ``tdpbssd`` (Q8_0) or ``tdpbsud`` (Q4_0, Q4_K: signed activations by unsigned
nibbles; Q8_0 packed as ``q + 128``) into C0, C1, and store them into an int32 array with a row per
activation row; then the vector work over all rows, in Numba code that compiles to AVX-512: per
row, 32 int32 -> float32 and ``y += (d * xd) * isum`` (Q8_0; ``q + 128``: ``isum - 128 sum(xq)``),
``y += (d * xd) * (isum - 8 sum(xq))`` (Q4_0's zero
point in integers, as :func:`llamatrace.kernels.int8.act8._matmul_q4` takes it; Q4_K: two sub-blocks a step with their 6-bit
scales and mins, as :func:`llamatrace.kernels.int8.act8._matmul_q4k`). The B tiles are read once per
block whatever the number of activation rows; A is 512 bytes per 2 tile products. Q6_K has an
int8 scale per 16 weights, so its K is 16 (A ``tmm3`` 16 x 16 bytes, B ``tmm6``, ``tmm7`` 4 x 64):
per 16 inputs the C pairs are stored and added in int32, ``isum += sc * (C - 32 * xsum)`` (Q8_K
activations, as :func:`llamatrace.kernels.int8.act8._matmul_q6k`), and per block of 256 one float32
step.

Where the time beyond ``tdpb*d`` goes (expected from instruction counts, never measured on AMX;
docs/performance.md "AMX" has the fuller budget): per 2 tile products (2 x 16 x 16 x 32 multiply-adds, ~32
cycles of the tile unit at one ``tdpb*d`` per 16 cycles) the vector work is, per activation row,
2 zmm loads of C, 2 conversions, ~4 multiply/FMAs: ~130 vector instructions for the 16 rows, plus
the 2 KB of C through L1 (2 tile stores, 32 loads). At two vector instructions a cycle that is
~65 cycles against ~32: the per-block scales, not ``tdpb*d``, are the expected limit, which is why
the issue aims at 25 % of the AMX peak rather than most of it. Q6_K's K of 16 doubles the vector
work per multiply-add (plus an integer multiply-add per 16 inputs).

Same arithmetic as the VNNI kernel: the int32 sums are the exact block dot products ``sum_j q_j *
xq_j`` (``q`` the nibble 0..15 for Q4_0 and Q4_K, the int8 quant for Q8_0, ``q + 32`` for Q6_K),
and the float32 operations are :func:`llamatrace.kernels.int8.act8._matmul_q4`'s / ``_matmul_q4k``'s /
``_matmul_q6k``'s in the same order, so the outputs are the same bits (the tests check it,
emulated). NumPy twins: :func:`llamatrace.kernels.int8.act8.matmul_q4_np`, ``matmul_q8_np``,
``matmul_q4k_np``, ``matmul_q6k_np`` (the same formulas in float64).

Which prefill runs (issue 51: on an AMX Xeon this kernel was 1.8x to 10x slower than the VNNI
kernels, and on by default): :func:`available` says whether the tiles may run at all (CPU, OS,
self-check, ``LLAMATRACE_AMX=0``); :func:`decision` whether a type's prefill runs on them: forced by
``LLAMATRACE_AMX=1``, else only where this CPU's measurement (:func:`measure`, kept per CPU model,
versions and kernel sources in the user cache: :func:`remember`) found AMX :data:`MARGIN` times as
fast as the VNNI prefill *and* the same bits, so the choice changes speed, never an output;
:func:`use` adds :data:`MIN_ROWS`. docs/performance.md "AMX" has the cycle budget per tile and
the design meant to make it faster.

Threads: the permission (``arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)``) is requested
once per process (:func:`available`); the tile config is per thread, so every parallel chunk loads it
(``ldtilecfg``) before its first tile op and releases the tiles (``tilerelease``) after its last.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import json
import logging
import os
import sys
import time
import types as pytypes
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, NamedTuple

import numba
import numpy as np
from llvmlite import binding as llvm_binding
from llvmlite import ir
from numba import njit, prange, types
from numba.extending import intrinsic

from llamatrace.kernels import tiles
from llamatrace.kernels.int8 import act8
from llamatrace.kernels.int8.act8_ir import Q6K_UNPACKED, QK_K_BYTES, unpack_q6k
from llamatrace.machine.jit import FASTMATH, JIT_INLINE, f16, target_features

_log = logging.getLogger("llamatrace")
llvm_binding.initialize_native_asmparser()    # Numba sets up no assembler for inline asm text

TR = tiles.TR
QK = 32
QK_K = 256
ROWS = 16
"""Activation rows in an A tile (and a C tile): the tile's maximum."""
BLOCK_TILE = 8 * TR * 4
"""Bytes of a sub-block of 32 inputs of a weight tile in the VNNI-packed order: 8 groups x TR rows x 4."""

TMM_A, TMM_B0, TMM_B1, TMM_C0, TMM_C1 = 0, 1, 2, 4, 5
"""The tile registers the prefill kernel uses (literals in the hardware ops)."""
TMM_A16, TMM_B16_0, TMM_B16_1 = 3, 6, 7
"""Q6_K's: A of 16 inputs (K = 16: one int8 scale's group), B of 4 rows."""

CONFIG_BYTES = 64
STATE_BYTES = CONFIG_BYTES + 8 * 1024 + 64
"""A thread's ``state``: the 64-byte tile config (what ``ldtilecfg`` reads), then the emulator's
eight 1 KB registers and its own copy of the loaded config (unused by the hardware ops)."""
_REGS = CONFIG_BYTES
_LOADED = CONFIG_BYTES + 8 * 1024

ARCH_GET_XCOMP_PERM, ARCH_REQ_XCOMP_PERM = 0x1022, 0x1023
XFEATURE_XTILEDATA = 18
SYS_ARCH_PRCTL = 158                          # x86-64


# --------------------------------------------------------------------------------------------
# the tile config


@njit(**JIT_INLINE)
def set_config(state, reg, rows, colsb):
    """Write register ``reg``'s shape (``rows`` <= 16, ``colsb`` bytes a row <= 64) into the
    config at the start of ``state`` (palette 1), as ``ldtilecfg`` reads it: byte 0 the palette,
    bytes 16 + 2*reg the columns in bytes (uint16), byte 48 + reg the rows."""
    state[0] = 1
    state[16 + 2 * reg] = colsb & 0xFF
    state[17 + 2 * reg] = colsb >> 8
    state[48 + reg] = rows


@njit(**JIT_INLINE)
def _prefill_config(state):
    """The prefill kernel's shapes: A 16 x 32 bytes, B 8 x 64, C 16 x 64 (16 x 16 int32); Q6_K's
    A 16 x 16, B 4 x 64."""
    state[:CONFIG_BYTES] = 0
    set_config(state, TMM_A, ROWS, QK)
    set_config(state, TMM_B0, QK // 4, 64)
    set_config(state, TMM_B1, QK // 4, 64)
    set_config(state, TMM_C0, ROWS, 64)
    set_config(state, TMM_C1, ROWS, 64)
    set_config(state, TMM_A16, ROWS, 16)
    set_config(state, TMM_B16_0, 4, 64)
    set_config(state, TMM_B16_1, 4, 64)


# --------------------------------------------------------------------------------------------
# hardware ops: one instruction each


_I64 = ir.IntType(64)


def _address(context, builder, arr_type, arr, offset):
    """i64 address of byte ``offset`` of a C-contiguous array."""
    data = context.make_array(arr_type)(context, builder, arr).data
    i8p = ir.IntType(8).as_pointer()
    off = builder.sext(offset, _I64) if offset.type.width < 64 else offset
    return builder.ptrtoint(builder.gep(builder.bitcast(data, i8p), [off]), _I64)


def _asm(builder, text: str, args=()):
    """Emit ``text`` as an instruction with side effects that may touch memory, its operands
    ``$0..`` the i64 ``args`` in general registers."""
    fn = ir.InlineAsm(ir.FunctionType(ir.VoidType(), [_I64] * len(args)), text,
                      ",".join(["r"] * len(args) + ["~{memory}"]), side_effect=True)
    builder.call(fn, list(args))


def _reg(r) -> int | None:
    """A register number 0..7 given as a compile-time literal, else None (not typed)."""
    if isinstance(r, types.IntegerLiteral) and 0 <= r.literal_value < 8:
        return r.literal_value
    return None


@intrinsic(prefer_literal=True)
def hw_config(typingctx, state):
    """``ldtilecfg``: load the tile config at the start of ``state`` (uint8 [STATE_BYTES])."""
    def codegen(context, builder, sig, args):
        _asm(builder, "ldtilecfg ($0)", [_address(context, builder, sig.args[0], args[0], ir.Constant(_I64, 0))])
        return context.get_dummy_value()
    return types.void(state), codegen


@intrinsic(prefer_literal=True)
def hw_zero(typingctx, state, reg):
    """``tilezero %tmm<reg>``."""
    r = _reg(reg)
    if r is None:
        return None

    def codegen(context, builder, sig, args):
        _asm(builder, f"tilezero %tmm{r}")
        return context.get_dummy_value()
    return types.void(state, reg), codegen


def _memory_op(text: str):
    """A tile load or store: ``text`` with ``{r}`` the register, ``$0`` the address of byte
    ``offset`` of the array, ``$1`` the stride in bytes."""
    def typer(typingctx, state, reg, arr, offset, stride):
        r = _reg(reg)
        if r is None or not isinstance(arr, types.Array) or arr.layout != "C":
            return None

        def codegen(context, builder, sig, args):
            stride_v = builder.sext(args[4], _I64) if args[4].type.width < 64 else args[4]
            _asm(builder, text.format(r=r), [_address(context, builder, sig.args[2], args[2], args[3]), stride_v])
            return context.get_dummy_value()
        return types.void(state, reg, arr, offset, stride), codegen
    return typer


hw_load = intrinsic(prefer_literal=True)(_memory_op("tileloadd ($0,$1,1), %tmm{r}"))
hw_load.__doc__ = """``tileloadd``: register ``reg`` (literal) <- its configured rows of ``arr``
(C-contiguous, any dtype) from byte ``offset``, rows ``stride`` bytes apart."""
hw_store = intrinsic(prefer_literal=True)(_memory_op("tilestored %tmm{r}, ($0,$1,1)"))
hw_store.__doc__ = """``tilestored``: register ``reg``'s configured rows -> ``arr`` from byte
``offset``, rows ``stride`` bytes apart."""


def _dot_op(mnemonic: str):
    def typer(typingctx, state, dst, a, b):
        regs = [_reg(x) for x in (dst, a, b)]
        if None in regs:
            return None
        c, ra, rb = regs

        def codegen(context, builder, sig, args):
            _asm(builder, f"{mnemonic} %tmm{rb}, %tmm{ra}, %tmm{c}")      # AT&T: B, A, C
            return context.get_dummy_value()
        return types.void(state, dst, a, b), codegen
    return typer


hw_dpbssd = intrinsic(prefer_literal=True)(_dot_op("tdpbssd"))
hw_dpbssd.__doc__ = "``tdpbssd``: C ``dst`` += A ``a`` (int8) x B ``b`` (int8), registers literals."
hw_dpbsud = intrinsic(prefer_literal=True)(_dot_op("tdpbsud"))
hw_dpbsud.__doc__ = "``tdpbsud``: C ``dst`` += A ``a`` (int8) x B ``b`` (uint8), registers literals."


@intrinsic(prefer_literal=True)
def hw_release(typingctx, state):
    """``tilerelease``: the tiles back to their initial state (no config)."""
    def codegen(context, builder, sig, args):
        _asm(builder, "tilerelease")
        return context.get_dummy_value()
    return types.void(state), codegen


# --------------------------------------------------------------------------------------------
# emulated ops: the SDM's pseudo-code on a register file in ``state``


@njit(**JIT_INLINE)
def _shape(state, reg):
    """(rows, colsb) of register ``reg`` in the loaded config; raises if none is loaded."""
    if state[_LOADED] != 1:
        raise RuntimeError("AMX #UD: tile instruction without a loaded tile config (ldtilecfg)")
    return np.int64(state[_LOADED + 48 + reg]), np.int64(state[_LOADED + 16 + 2 * reg]) | (np.int64(state[_LOADED + 17 + 2 * reg]) << 8)


@njit(**JIT_INLINE)
def emu_config(state):
    """``ldtilecfg``: checks the config as the SDM's #GP conditions do (palette 1, reserved bytes
    zero, rows <= 16, colsb <= 64, registers 8..15 unused, a register's rows and colsb both zero
    or both not), copies it for the other ops and zeroes every register."""
    if state[0] != 1:
        raise RuntimeError("AMX #GP: ldtilecfg with a palette other than 1")
    for i in range(1, 16):
        if state[i] != 0:
            raise RuntimeError("AMX #GP: ldtilecfg with reserved bytes 1..15 not zero (start_row too)")
    for reg in range(16):
        rows = np.int64(state[48 + reg])
        colsb = np.int64(state[16 + 2 * reg]) | (np.int64(state[17 + 2 * reg]) << 8)
        if reg >= 8 and (rows or colsb):
            raise RuntimeError("AMX #GP: ldtilecfg configures a register beyond tmm7")
        if rows > 16 or colsb > 64 or (rows == 0) != (colsb == 0):
            raise RuntimeError("AMX #GP: ldtilecfg with rows > 16, colsb > 64 or half a shape")
    state[_LOADED:_LOADED + CONFIG_BYTES] = state[:CONFIG_BYTES]
    state[_REGS:_REGS + 8 * 1024] = 0


@njit(**JIT_INLINE)
def emu_zero(state, reg):
    """``tilezero``: every byte of register ``reg`` zero."""
    _shape(state, reg)
    state[_REGS + reg * 1024:_REGS + (reg + 1) * 1024] = 0


@njit(**JIT_INLINE)
def _bytes(arr, offset, rows, colsb, stride):
    """``arr`` (1-D C-contiguous) as uint8, after checking that ``rows`` rows of ``colsb`` bytes
    from byte ``offset``, ``stride`` apart, lie inside it."""
    flat = arr.reshape(arr.size).view(np.uint8)
    if rows and (offset < 0 or stride < 0 or offset + (rows - 1) * stride + colsb > flat.size):
        raise IndexError("AMX tile load/store outside its array")
    return flat


@njit(**JIT_INLINE)
def emu_load(state, reg, arr, offset, stride):
    """``tileloadd``: the configured rows x colsb bytes of ``arr`` from byte ``offset``, rows
    ``stride`` bytes apart, into register ``reg``; the rest of the register zero."""
    rows, colsb = _shape(state, reg)
    src = _bytes(arr, offset, rows, colsb, stride)
    base = _REGS + reg * 1024
    state[base:base + 1024] = 0
    for m in range(rows):
        state[base + 64 * m:base + 64 * m + colsb] = src[offset + m * stride:offset + m * stride + colsb]


@njit(**JIT_INLINE)
def emu_store(state, reg, arr, offset, stride):
    """``tilestored``: register ``reg``'s configured rows x colsb bytes to ``arr`` from byte
    ``offset``, rows ``stride`` bytes apart."""
    rows, colsb = _shape(state, reg)
    dst = _bytes(arr, offset, rows, colsb, stride)
    base = _REGS + reg * 1024
    for m in range(rows):
        dst[offset + m * stride:offset + m * stride + colsb] = state[base + 64 * m:base + 64 * m + colsb]


@njit(**JIT_INLINE)
def _emu_dot(state, dst, a, b, b_signed):
    """``tdpbs[su]d``: C[m][n] += sum_k sum_i A[m][4k+i] * B[k][4n+i] in int32 (wrapping), A's
    bytes signed, B's signed when ``b_signed``; the C rows' bytes beyond colsb and the rows beyond
    its rows zero. Raises as the SDM's #UD conditions: registers not distinct, A's colsb / 4 !=
    B's rows, C's colsb != B's colsb, C's rows != A's rows."""
    c_rows, c_colsb = _shape(state, dst)
    a_rows, a_colsb = _shape(state, a)
    b_rows, b_colsb = _shape(state, b)
    if dst == a or dst == b or a == b:
        raise RuntimeError("AMX #UD: tdpb*d with registers that are not distinct")
    if a_colsb // 4 != b_rows or c_colsb != b_colsb or c_rows != a_rows or a_colsb % 4 or c_colsb % 4:
        raise RuntimeError("AMX #UD: tdpb*d with tile shapes that do not chain (M x K by K x N)")
    regs = state[_REGS:_REGS + 8 * 1024]
    c32 = regs.view(np.int32)
    sa = regs.view(np.int8)
    c0, a0, b0 = dst * 256, a * 1024, b * 1024
    for m in range(c_rows):
        for n in range(c_colsb // 4):
            total = np.int64(c32[c0 + 16 * m + n])
            for k in range(a_colsb // 4):
                for i in range(4):
                    av = np.int64(sa[a0 + 64 * m + 4 * k + i])
                    bv = np.int64(sa[b0 + 64 * k + 4 * n + i]) if b_signed else np.int64(regs[b0 + 64 * k + 4 * n + i])
                    total += av * bv
            c32[c0 + 16 * m + n] = np.int32(((total + 2**31) & 0xFFFFFFFF) - 2**31)
        c32[c0 + 16 * m + c_colsb // 4:c0 + 16 * (m + 1)] = 0
    c32[c0 + 16 * c_rows:c0 + 256] = 0


@njit(**JIT_INLINE)
def emu_dpbssd(state, dst, a, b):
    """``tdpbssd`` emulated: signed A and B."""
    _emu_dot(state, dst, a, b, True)


@njit(**JIT_INLINE)
def emu_dpbsud(state, dst, a, b):
    """``tdpbsud`` emulated: signed A, unsigned B."""
    _emu_dot(state, dst, a, b, False)


@njit(**JIT_INLINE)
def emu_release(state):
    """``tilerelease``: no config loaded any more (a tile op before the next ``ldtilecfg`` raises)."""
    state[_LOADED:_LOADED + CONFIG_BYTES] = 0


class TileOps(NamedTuple):
    """One implementation of the tile operations, all taking the thread's ``state`` (uint8
    [:data:`STATE_BYTES`], the config at its start) first and register numbers as literals."""

    config: Callable
    zero: Callable
    load: Callable
    dpbssd: Callable
    dpbsud: Callable
    store: Callable
    release: Callable


HW = TileOps(hw_config, hw_zero, hw_load, hw_dpbssd, hw_dpbsud, hw_store, hw_release)
EMULATED = TileOps(emu_config, emu_zero, emu_load, emu_dpbssd, emu_dpbsud, emu_store, emu_release)


# --------------------------------------------------------------------------------------------
# the prefill kernel, written once


# The names the kernels below call for their tile operations: bound to one implementation's by
# _bind (as globals, not a closure: Numba's cache keys a closure by its cells, which hold objects
# that pickle differently in every process, so a closure's machine code was compiled anew in each)
config = zero = load = dpbssd = dpbsud = store = release = None


def _bind(template, ops: TileOps, flags: dict, **more):
    """``template`` (a plain function of this module calling ``config``, ``load`` ...) compiled by
    ``njit(**flags)`` with those names bound to ``ops``' operations (and ``more``), under a name of
    its own per implementation (its cache entry)."""
    names = dict(globals(), **ops._asdict(), **more)
    impl = "hw" if ops is HW else "emulated" if ops is EMULATED else f"ops{id(ops):x}"
    fn = pytypes.FunctionType(template.__code__, names, f"{template.__name__}_{impl}")
    fn.__qualname__ = fn.__name__
    fn.__doc__ = template.__doc__
    return njit(**flags)(fn)


KIND_Q4_0, KIND_Q8_0, KIND_Q4_K, KIND_Q6_K = 0, 1, 2, 3
"""The weight types of :func:`make_prefill`'s kernels."""
Q4K_HEAD = act8.Q4K_HEAD
"""Q4_K: the 16 scale bytes per row (sc[8], mn[8], in [P, TR] order) before the grouped nibbles."""


@njit(**JIT_INLINE)
def _unpack_nibbles(qs8, at, n_units, unit, per_block, block, head, buf):
    """Nibbles of a weight tile -> ``buf`` uint8 in the VNNI-packed order, a sub-block of 32 inputs
    every ``BLOCK_TILE`` bytes: unit ``u`` (``unit`` grouped bytes: byte ``4g + i`` of row r at
    ``(g*TR + r)*4 + i``) is block ``u // per_block``'s part ``u % per_block``, from byte ``at +
    (u // per_block) * block + head + (u % per_block) * unit`` of ``qs8``; its low nibbles go to
    ``buf[2u*unit ..]``, its high ones to ``buf[(2u+1)*unit ..]``. Q4_0: units of 512 (a block:
    low nibbles inputs 0..15, high 16..31, one sub-block); Q4_K: four units of 1024 a block (chunk
    c: low nibbles sub-block 2c, high 2c + 1)."""
    for u in range(n_units):
        src = at + (u // per_block) * block + head + (u % per_block) * unit
        dst = 2 * u * unit
        for j in range(unit):
            v = qs8[src + j]
            buf[dst + j] = v & np.uint8(15)
            buf[dst + unit + j] = v >> np.uint8(4)


def _tile_products(state, xflat, n_rows, n_in, x_at, q6k, signed_b, cc, col):
    """For every 16 activation rows ``s0..s0+15``: A <- their bytes from ``x_at`` of each row
    (``q6k``: 16 bytes into ``TMM_A16``, else 32 into ``TMM_A``), C0/C1 = A x the B tiles already
    loaded (``TMM_B16_*`` / ``TMM_B*``; ``tdpbssd`` when ``signed_b``, else ``tdpbsud``), stored to
    those rows of ``cc`` (int32 [n_rows, 2*TR], 256 bytes a row) at columns ``col..col+31``."""
    for s0 in range(0, n_rows, ROWS):
        zero(state, TMM_C0)
        zero(state, TMM_C1)
        if q6k:
            load(state, TMM_A16, xflat, s0 * n_in + x_at, n_in)
            dpbsud(state, TMM_C0, TMM_A16, TMM_B16_0)
            dpbsud(state, TMM_C1, TMM_A16, TMM_B16_1)
        else:
            load(state, TMM_A, xflat, s0 * n_in + x_at, n_in)
            if signed_b:
                dpbssd(state, TMM_C0, TMM_A, TMM_B0)
                dpbssd(state, TMM_C1, TMM_A, TMM_B1)
            else:
                dpbsud(state, TMM_C0, TMM_A, TMM_B0)
                dpbsud(state, TMM_C1, TMM_A, TMM_B1)
        store(state, TMM_C0, cc, (s0 * 2 * TR + col) * 4, 2 * TR * 4)
        store(state, TMM_C1, cc, (s0 * 2 * TR + col + 16) * 4, 2 * TR * 4)


def _prefill(xq, xd, xs, qs8, d, m, m_scale, kind, n_chunks, out):
    """:func:`make_prefill`'s kernel, compiled once per :class:`TileOps` (:func:`_bind`)."""
    n_rows, n_in = xq.shape
    n_tiles, n_blocks = d.shape[0], d.shape[1]
    subs = n_in // QK // n_blocks                             # sub-blocks of 32 inputs a block
    n_seq = out.shape[0]
    xflat = xq.reshape(xq.size)
    block = qs8.size // (n_tiles * n_blocks)                  # packed bytes of a tile's block
    n_chunks = max(1, min(n_chunks, n_tiles))
    for ch in prange(n_chunks):
        state = np.zeros(STATE_BYTES, np.uint8)
        _prefill_config(state)
        config(state)
        blk = np.empty(Q6K_UNPACKED if kind == KIND_Q6_K else subs * BLOCK_TILE, np.uint8)   # a block unpacked
        cc = np.empty((n_rows, 2 * TR), np.int32)             # C tiles per activation row: two sub-blocks
        isum = np.empty((n_rows if kind == KIND_Q6_K else 0, TR), np.int32)   # Q6_K: scaled int32 sums
        acc = np.empty((n_rows, TR), np.float32)
        dv = np.empty(TR, np.float32)
        mv = np.empty(TR, np.float32)
        for t in range(ch * n_tiles // n_chunks, (ch + 1) * n_tiles // n_chunks):
            acc[:] = 0
            for b in range(n_blocks):
                at = (t * n_blocks + b) * block
                if kind == KIND_Q4_0:
                    _unpack_nibbles(qs8, at, 1, BLOCK_TILE // 2, 1, block, 0, blk)
                elif kind == KIND_Q4_K:
                    _unpack_nibbles(qs8, at, 4, BLOCK_TILE, 4, block, Q4K_HEAD * TR, blk)
                elif kind == KIND_Q6_K:
                    unpack_q6k(qs8, at, blk, 0, isum)
                src, base = (qs8, at) if kind == KIND_Q8_0 else (blk, 0)
                for r in range(TR):
                    dv[r] = f16(d[t, b, r])
                    mv[r] = f16(m[t, b, r])
                if kind == KIND_Q6_K:
                    # per 16 inputs (one int8 scale): C = A16 x B16 on the tiles, then in int32
                    # isum += sc * (C - 32 * xsum), act8._matmul_q6k's sums (xs: Q8_K's sums of 16)
                    isum[:] = 0
                    for j in range(16):
                        load(state, TMM_B16_0, blk, 16 * j * TR, 4 * TR)
                        load(state, TMM_B16_1, blk, 16 * j * TR + 64, 4 * TR)
                        _tile_products(state, xflat, n_rows, n_in, b * QK_K + 16 * j, True, False, cc, 0)
                        for s in range(n_rows):
                            xsum = np.int32(xs[s, b * 16 + j])
                            for r in range(TR):
                                sc = np.int32(np.int8(blk[QK_K_BYTES + j * TR + r]))
                                isum[s, r] = np.int32(isum[s, r] + sc * (cc[s, r] - 32 * xsum))
                    for s in range(n_rows):
                        dx = xd[s, b]
                        a = acc[s]
                        for r in range(TR):
                            a[r] += (dv[r] * dx) * np.float32(isum[s, r])
                    continue
                for p in range(subs):
                    k = b * subs + p                              # the sub-block of 32 inputs
                    load(state, TMM_B0, src, base + p * BLOCK_TILE, 4 * TR)
                    load(state, TMM_B1, src, base + p * BLOCK_TILE + 64, 4 * TR)
                    _tile_products(state, xflat, n_rows, n_in, k * QK, False, kind == KIND_Q8_0 and m_scale == 0, cc,
                                   (p % 2) * TR)
                    # the vector work: per row, int32 -> float32, times the scales, summed
                    if kind == KIND_Q4_K:
                        if p % 2 == 0:
                            continue
                        j = p - 1                                 # the pair's first sub-block in its block
                        sc = at                                   # scale bytes: sc[j, r] at sc + j*TR + r
                        for s in range(n_rows):
                            dx0, dx1 = xd[s, k - 1], xd[s, k]
                            xs0, xs1 = xs[s, k - 1], xs[s, k]
                            a = acc[s]
                            for r in range(TR):
                                a[r] += dv[r] * (np.float32(qs8[sc + j * TR + r]) * dx0 * np.float32(cc[s, r])
                                                 + np.float32(qs8[sc + (j + 1) * TR + r]) * dx1 * np.float32(cc[s, TR + r])) \
                                    - mv[r] * (np.float32(qs8[sc + (8 + j) * TR + r]) * xs0
                                               + np.float32(qs8[sc + (9 + j) * TR + r]) * xs1)
                    elif kind == KIND_Q8_0:               # fma(d * dx, isum, acc), as the VNNI kernels
                        for s in range(n_rows):
                            dx = xd[s, k]
                            off = np.int32(xs[s, k]) if m_scale < 0 else np.int32(0)   # q + 128's -128 sum(xq)
                            a = acc[s]
                            for r in range(TR):
                                a[r] += (dv[r] * dx) * np.float32(cc[s, r] + off)
                    elif kind == KIND_Q4_0:               # the zero point in integers: xs the offsets
                        for s in range(n_rows):
                            dx = xd[s, k]
                            off = np.int32(xs[s, k])
                            a = acc[s]
                            for r in range(TR):
                                a[r] += (dv[r] * dx) * np.float32(cc[s, r] + off)
                    else:
                        for s in range(n_rows):
                            dx = xd[s, k]
                            ms = m_scale * xs[s, k]
                            a = acc[s]
                            for r in range(TR):
                                a[r] += (dv[r] * dx) * np.float32(cc[s, r]) + mv[r] * ms
            for s in range(n_seq):
                tiles.store_tile(acc[s], out, s, t)
        release(state)


def make_prefill(ops: TileOps, cache: bool = True):
    """The prefill kernel ``kernel(xq, xd, xs, qs8, d, m, m_scale, kind, n_chunks, out)`` built on
    ``ops`` (:data:`HW` or :data:`EMULATED`).

    ``xq`` int8 [S16, n_in] (S16 the activation rows rounded up to 16, the extra rows zero), ``xd``,
    ``xs`` float32 [S16, n_in/32] (:func:`llamatrace.kernels.int8.act8.quantize`: Q8_0 blocks, Q4_K's
    with float32 scales; Q4_0, and Q8_0 packed as ``q + 128``: the blocks' integer zero-point offsets
    ``-8 sum(xq)``, ``-128 sum(xq)``,
    :func:`llamatrace.kernels.int8.act8._quantized_rows`' offsets, as float32); ``qs8`` the weight's packed bytes as flat uint8 (``Weight.qs`` of a
    ``q8`` weight, [T, B, P, TR]); ``d``, ``m`` fp16 bits uint16 [T, B, TR] (Q4_K: ``d``, ``dmin``);
    ``m_scale`` float32 (Q4_0 -8; Q8_0 -128 for ``q + 128`` bytes, ``tdpbsud``, 0 for int8 ones, ``tdpbssd``;
    else unused); ``kind`` :data:`KIND_Q4_0` / :data:`KIND_Q8_0` /
    :data:`KIND_Q4_K` / :data:`KIND_Q6_K` (Q8_K activations: ``xd`` [S16, n_in/256], ``xs`` their
    int32 sums of 16 as float32 [S16, n_in/16]); ``n_chunks`` runs of weight tiles (one per
    thread, each with its tile state and buffers); ``out`` float32 [S, n_out], its rows the real
    activation rows. Per weight tile, per block: B0/B1 <- the weights of a sub-block of 32 inputs
    for rows 0..15 / 16..31, then for every 16 activation rows A <- their 32 int8, C = A x B stored
    (:func:`_tile_products`), then scaled into float32 sums with :mod:`llamatrace.kernels.int8.act8`'s
    per-row kernels' operations in their order (Q4_K two sub-blocks a step, as
    :func:`llamatrace.kernels.int8.act8._matmul_q4k`; Q6_K per 16 inputs). One source for both
    implementations: ``ops`` are bound by :func:`_bind`."""
    products = _bind(_tile_products, ops, dict(cache=cache, inline="always"))
    # the emulator raises (the SDM's faults), which keeps a prange serial: say so, run it serially
    return _bind(_prefill, ops, dict(parallel=ops is HW, fastmath=FASTMATH, cache=cache), _tile_products=products)


# --------------------------------------------------------------------------------------------
# the peak probe, written once too

PEAK_CHAINS = 4
"""Independent accumulator tiles (tmm0..3) in :func:`make_dot_peak`: four ``tdpbssd`` in flight
cover its latency; each step is ``PEAK_CHAINS * 16 * 16 * 64`` multiply-adds."""
PEAK_MACS_PER_STEP = PEAK_CHAINS * 16 * 16 * 64


def _dot_peak(n_steps, n_threads, a_word, b_word):
    """:func:`make_dot_peak`'s kernel, compiled once per :class:`TileOps` (:func:`_bind`)."""
    out = np.zeros(n_threads, np.int32)
    for t in prange(n_threads):
        state = np.zeros(STATE_BYTES, np.uint8)
        state[0] = 1
        for reg in range(6):                                  # C0..C3, A (tmm4), B (tmm5)
            set_config(state, reg, 16, 64)
        a = np.full(256, a_word, np.int32)
        b = np.full(256, b_word, np.int32)
        c = np.empty(PEAK_CHAINS * 256, np.int32)
        config(state)
        load(state, 4, a, 0, 64)
        load(state, 5, b, 0, 64)
        zero(state, 0)
        zero(state, 1)
        zero(state, 2)
        zero(state, 3)
        for _ in range(n_steps):
            dpbssd(state, 0, 4, 5)
            dpbssd(state, 1, 4, 5)
            dpbssd(state, 2, 4, 5)
            dpbssd(state, 3, 4, 5)
        store(state, 0, c, 0, 64)
        store(state, 1, c, 1024, 64)
        store(state, 2, c, 2048, 64)
        store(state, 3, c, 3072, 64)
        release(state)
        total = np.int64(0)
        for i in range(c.size):
            total += c[i]
        out[t] = np.int32(((total + 2**31) & 0xFFFFFFFF) - 2**31)
    return out


def make_dot_peak(ops: TileOps, cache: bool = True):
    """``peak(n_steps, n_threads, a_word, b_word)`` -> int32 [n_threads] built on ``ops``: on each
    thread, ``n_steps`` steps of :data:`PEAK_CHAINS` independent ``tdpbssd`` of two full 16 x 64
    tiles (every 4 bytes of A ``a_word``'s, of B ``b_word``'s, both signed) into accumulator tiles,
    with no memory traffic in the loop; the checksum is the sum (wrapping) of the accumulators'
    int32 elements. NumPy twin: :func:`dot_peak_np`."""
    return _bind(_dot_peak, ops, dict(parallel=ops is HW, cache=cache))


def dot_peak_np(n_steps: int, n_threads: int, a_word: int, b_word: int) -> np.ndarray:
    """NumPy twin of :func:`make_dot_peak`'s kernels: the same int32 checksums."""
    a = np.array([a_word], np.int32).view(np.int8).astype(np.int64)
    b = np.array([b_word], np.int32).view(np.int8).astype(np.int64)
    element = (16 * int((a * b).sum()) * n_steps) % 2**32           # one int32 of C: K = 64 bytes
    total = (element * PEAK_CHAINS * 256) % 2**32
    return np.full(n_threads, total, np.uint32).view(np.int32)


@functools.lru_cache(maxsize=1)
def hw_dot_peak():
    """The peak probe on the CPU's tiles (run only where :func:`available` is on)."""
    return make_dot_peak(HW)


# --------------------------------------------------------------------------------------------
# availability: CPU, OS permission, off switch, self-check


def request_permission() -> str:
    """Ask the kernel for the AMX tile data state for this process
    (``arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)``, then ``ARCH_GET_XCOMP_PERM`` to
    see it granted). Returns ``""`` when granted, else why not (one line, with errno)."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.syscall(SYS_ARCH_PRCTL, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) != 0:
        err = ctypes.get_errno()
        return f"the OS refused the AMX tile state (arch_prctl ARCH_REQ_XCOMP_PERM: {os.strerror(err)}, errno {err})"
    granted = ctypes.c_uint64(0)
    if libc.syscall(SYS_ARCH_PRCTL, ARCH_GET_XCOMP_PERM, ctypes.byref(granted)) != 0:
        err = ctypes.get_errno()
        return f"arch_prctl ARCH_GET_XCOMP_PERM failed: {os.strerror(err)}, errno {err}"
    if not granted.value >> XFEATURE_XTILEDATA & 1:
        return "the OS did not grant the AMX tile state (ARCH_GET_XCOMP_PERM lacks XTILEDATA)"
    return ""


@dataclass(frozen=True)
class Status:
    """Whether something runs on AMX (``on``), and why (``reason``: one line, as ``llamatrace
    info`` and ``bench`` print it)."""

    on: bool
    reason: str


def has_amx() -> bool:
    """True when both the CPU Numba compiles for and this CPU have AMX int8 (LLVM's
    ``amx-tile`` and ``amx-int8``, which LLVM reports only where the OS enabled the tile state)."""
    need = {"amx-tile", "amx-int8"}
    host = {name for name, on in llvm_binding.get_host_cpu_features().items() if on}
    return need <= target_features() and need <= host


@functools.lru_cache(maxsize=1)
def available() -> Status:
    """Decide once per process whether the tiles may run at all: not when :data:`ENV` is ``0``
    (nothing AMX is touched then), when the CPU lacks ``amx_int8`` (:func:`has_amx`), when the OS
    refuses the permission (:func:`request_permission`), or when the hardware kernel's first
    products differ from the VNNI kernel's (:func:`self_check`; then one warning line). Whether a
    type's prefill then runs on them is :func:`decision`'s."""
    if os.environ.get(ENV) == "0":
        return Status(False, f"off: forced by {ENV}=0")
    if not has_amx():
        return Status(False, "not available: no amx_int8")
    refused = request_permission()
    if refused:
        return Status(False, f"not available: {refused}")
    wrong = self_check(hw_prefill())
    if wrong:
        _log.warning("AMX self-check failed, prefill keeps the VNNI kernels: %s", wrong)
        return Status(False, f"not available: self-check failed: {wrong}")
    return Status(True, "amx_int8 (tdpbssd/tdpbsud prefill for Q4_0, Q8_0, Q4_K, Q6_K)")


@functools.lru_cache(maxsize=1)
def hw_prefill():
    """The prefill kernel on the CPU's tiles (compiled, or loaded from Numba's cache, on first
    call; runs only where :func:`available` is on)."""
    return make_prefill(HW)


_BLOCK_BYTES = {KIND_Q4_0: (QK, 16), KIND_Q8_0: (QK, 32), KIND_Q4_K: (QK_K, 144), KIND_Q6_K: (QK_K, 208)}
"""Per kind: (inputs a block, packed bytes a block row: ``P`` of ``qs [T, B, P, TR]``)."""


def random_weight(rng, kind: int, n_out: int, n_in: int):
    """Random packed arrays ``(qs, d, m)`` of a ``q8`` weight of ``kind``, typed as
    :func:`llamatrace.kernels.types.packing.pack` types them on this host (``qs`` uint8 [T, B, P, TR],
    int8 for Q8_0 without VNNI; ``d``, ``m`` fp16 bits uint16 [T, B, TR], small positive scales), so
    that a kernel compiled for them serves a model's weights too. ``n_out`` a multiple of TR,
    ``n_in`` of the block."""
    per_block, n_bytes = _BLOCK_BYTES[kind]
    shape = (n_out // TR, n_in // per_block)
    qs = rng.integers(0, 256, (*shape, n_bytes, TR), dtype=np.uint8)
    if kind == KIND_Q4_K:
        qs[:, :, :Q4K_HEAD] &= 63                           # 6-bit scales and mins
    d, m = (np.float16(rng.uniform(1e-3, 2e-2, (*shape, TR))).view(np.uint16) for _ in range(2))
    q8 = qs if act8.Q8_0_UNSIGNED else qs.view(np.int8)            # Q8_0 as the load packs it here
    return (q8 if kind == KIND_Q8_0 else qs), d, (m if kind == KIND_Q4_K else d)


def self_check(kernel) -> str:
    """Run ``kernel`` (a :func:`make_prefill` kernel) on small Q4_0, Q8_0, Q4_K and Q6_K products
    (37 rows of x: two full A tiles and a part one; 64 weight rows, 256 inputs) and compare with
    the per-row VNNI kernels (:func:`llamatrace.kernels.int8.act8._matmul_q4`, ``_matmul_q4k``,
    ``_matmul_q6k``), whose bits it is written to give. Returns ``""`` when every output is the
    same float32, else what differed."""
    rng = np.random.default_rng(36)
    x = rng.standard_normal((37, 256)).astype(np.float32)
    for kind, name in KIND_NAMES.items():
        qs, d, m = random_weight(rng, kind, 64, 256)
        want = np.empty((37, 64), np.float32)
        if kind == KIND_Q4_K:
            act8._matmul_q4k(x, qs, d, m, want)
        elif kind == KIND_Q6_K:
            act8._matmul_q6k(x, qs, d, want)
        else:
            act8._matmul_q4(x, qs, d, d, _M_SCALE[kind], kind == KIND_Q8_0, want)
        got = np.empty_like(want)
        run(kernel, kind, x, qs, d, m, got, 2)
        if not np.array_equal(got.view(np.uint32), want.view(np.uint32)):
            bad = int(np.count_nonzero(got != want))
            return f"{name}: {bad} of {got.size} outputs differ from the VNNI kernel's (max |diff| {np.abs(got - want).max():.3g})"
    return ""


_M_SCALE = {KIND_Q4_0: np.float32(-8.0), KIND_Q8_0: np.float32(0.0), KIND_Q4_K: np.float32(0.0), KIND_Q6_K: np.float32(0.0)}


def arguments(kind, x, qs, d, m, out, n_chunks=None) -> tuple:
    """The arguments :func:`run` passes a :func:`make_prefill` kernel (``x`` quantized, its rows
    padded to a multiple of 16): their Numba types are the signature the kernel is compiled for.
    A Q8_0 weight packed as ``q + 128`` (uint8, :data:`~llamatrace.kernels.int8.act8.Q8_0_UNSIGNED`) runs
    with ``m_scale`` -128: ``tdpbsud`` and Q4_0's integer zero point."""
    m_scale = np.float32(-128.0) if kind == KIND_Q8_0 and qs.dtype == np.uint8 else _M_SCALE[kind]
    if kind == KIND_Q6_K:                                   # Q8_K; its int32 sums of 16 as float32, exact
        xq, xd, xsum = act8._quantized_k_rows(x)
        xs = xsum.astype(np.float32)
    else:
        # the blocks' integer zero points, exact as float32: Q4_0's -8 sum(xq), Q8_0's -128 sum(xq) for q + 128
        zero = int(m_scale) if kind in (KIND_Q4_0, KIND_Q8_0) else 0
        xq, xd, xs, off = act8._quantized_rows(x, act8.PER32_F32 if kind == KIND_Q4_K else act8.Q8_0, zero)
        xs = off.astype(np.float32) if zero else xs
    pad = -x.shape[0] % ROWS
    if pad:
        xq = np.concatenate([xq, np.zeros((pad, xq.shape[1]), np.int8)])
        xd = np.concatenate([xd, np.zeros((pad, xd.shape[1]), np.float32)])
        xs = np.concatenate([xs, np.zeros((pad, xs.shape[1]), np.float32)])
    return (xq, xd, xs, qs.reshape(qs.size).view(np.uint8), d, m, m_scale, kind,
            n_chunks or numba.get_num_threads(), out)


def run(kernel, kind, x, qs, d, m, out, n_chunks=None) -> None:
    """``out = x @ W.T`` by ``kernel`` (:func:`make_prefill`) for a weight of ``kind``: x float32
    [S, n_in] quantized (:func:`llamatrace.kernels.int8.act8.quantize`: Q8_0 blocks, Q4_K's
    ``PER32_F32``; Q6_K: :func:`~llamatrace.kernels.int8.act8.quantize_k`), its rows padded to a multiple of 16 with zeros; ``qs``, ``d``, ``m`` the
    weight's packed arrays as they are; ``n_chunks`` default: Numba's thread count."""
    kernel(*arguments(kind, x, qs, d, m, out, n_chunks))


def vnni_prefill(kind, x, qs, d, m, out) -> None:
    """``out = x @ W.T`` by the VNNI / AVX2 prefill kernel that runs for ``kind`` where AMX does
    not (what the registry's ``act8_prefill_*`` adapters call): :func:`llamatrace.kernels.int8.act8._prefill`,
    Q6_K's ``_prefill_q6k``. Arguments as :func:`run`'s."""
    if kind == KIND_Q6_K:
        act8._prefill_q6k(x, qs, d, out, numba.get_num_threads())
    else:
        act8._prefill(x, qs, d, m, _M_SCALE[kind], _VNNI_KIND[kind], out)


_VNNI_KIND = {KIND_Q4_0: act8.PREFILL_Q4, KIND_Q8_0: act8.PREFILL_Q8, KIND_Q4_K: act8.PREFILL_Q4K}


# --------------------------------------------------------------------------------------------
# the decision: measured once per CPU model, kept in the user cache


ENV = "LLAMATRACE_AMX"
"""``"1"``: the ``q8`` prefill of every type here runs on AMX where :func:`available`; ``"0"``:
never (nothing AMX is touched); unset or anything else: each type as measured (:func:`decision`)."""

MIN_ROWS = ROWS
"""Prefills of fewer activation rows keep the VNNI kernels: the A tile is mostly zero padding
there, and the warm-up's 5-token prefill over every weight (in ``generate``'s load) ran ~15 s on
the tiles against ~1 s on VNNI (issue 51). The kernels that are chosen give the same bits."""

MARGIN = 1.2
"""AMX is chosen only when its best time is at most 1/MARGIN of the VNNI kernel's: a busy shared
machine slows some rounds by 10-20 %, and a wrong "on" costs more than a missed one."""

CALIBRATION = (128, 4096, 4096)
"""The matmul :func:`measure` times when deciding: (activation rows, n_out, n_in), a 128-token
prefill through an 8B attention matrix (~2.1 G multiply-adds, tens of ms on VNNI)."""
CALIBRATION_ROUNDS = 3
"""Rounds of one AMX and one VNNI call, alternated, after one untimed call of each; the best of
each counts (a busy machine only ever adds time)."""

DECISIONS_FILE = "amx.json"
"""In llamatrace's user cache folder (:func:`llamatrace.gguf.fetch.cache_root`)."""

KIND_NAMES = {KIND_Q4_0: "Q4_0", KIND_Q8_0: "Q8_0", KIND_Q4_K: "Q4_K", KIND_Q6_K: "Q6_K"}
KINDS = {name: kind for kind, name in KIND_NAMES.items()}
"""The GGML type names the AMX kernels serve -> their kind."""


@dataclass(frozen=True)
class Measurement:
    """One timing of the AMX and the VNNI prefill on the same random ``[rows, n_in] x [n_out,
    n_in]^T`` matmul of a type: the best ``amx_s`` and ``vnni_s`` (seconds a call) on ``threads``
    threads, and whether the two outputs were the same bits (``same_bits``)."""

    type: str
    rows: int
    n_out: int
    n_in: int
    threads: int
    amx_s: float
    vnni_s: float
    same_bits: bool

    @property
    def speedup(self) -> float:
        """VNNI's time over AMX's (above 1: AMX is faster)."""
        return self.vnni_s / self.amx_s

    @property
    def amx_wins(self) -> bool:
        """AMX may run by default: at least :data:`MARGIN` times as fast, and the same bits (so
        the choice changes speed, never an output)."""
        return self.same_bits and self.speedup >= MARGIN

    def row(self) -> dict:
        """The fields, with the speeds: ``amx_gmac_s`` and ``vnni_gmac_s`` (1e9 int8 multiply-adds a
        second) and ``speedup`` (``bench``'s report, JSON-ready)."""
        macs = self.rows * self.n_out * self.n_in / 1e9
        return {**{f: getattr(self, f) for f in Measurement.__dataclass_fields__}, "amx_gmac_s": macs / self.amx_s,
                "vnni_gmac_s": macs / self.vnni_s, "speedup": self.speedup}


def measure(kind: int, shape: tuple[int, int, int] = CALIBRATION, rounds: int = CALIBRATION_ROUNDS,
            kernel=None, clock: Callable[[], float] = time.perf_counter) -> Measurement:
    """Time ``kernel`` (default :func:`hw_prefill`) against :func:`vnni_prefill` on a random weight of
    ``kind`` (:func:`random_weight`) and random activations, ``shape`` = (rows, n_out, n_in):
    one untimed call of each (compile or load, warm the caches), then ``rounds`` rounds of one
    call of each, alternated; the best time of each, and whether the outputs are the same bits."""
    kernel = kernel or hw_prefill()
    rows, n_out, n_in = shape
    rng = np.random.default_rng(51)
    x = rng.standard_normal((rows, n_in)).astype(np.float32)
    qs, d, m = random_weight(rng, kind, n_out, n_in)
    outs = np.empty((2, rows, n_out), np.float32)
    calls = (lambda: run(kernel, kind, x, qs, d, m, outs[0]), lambda: vnni_prefill(kind, x, qs, d, m, outs[1]))
    for call in calls:
        call()
    same = bool(np.array_equal(outs[0].view(np.uint32), outs[1].view(np.uint32)))
    best = [float("inf")] * 2
    for _ in range(rounds):
        for i, call in enumerate(calls):
            t0 = clock()
            call()
            best[i] = min(best[i], clock() - t0)
    return Measurement(KIND_NAMES[kind], rows, n_out, n_in, numba.get_num_threads(), best[0], best[1], same)


def decisions_path() -> Path:
    """The file the measurements are kept in: ``cache_root() / "amx.json"``."""
    from llamatrace.gguf.fetch import cache_root
    return cache_root() / DECISIONS_FILE


def cpu_key() -> dict[str, str]:
    """What a measurement holds for: the CPU model, llamatrace's and Numba's versions, and a
    fingerprint of the kernels' sources (this module and the VNNI kernels it is timed against):
    a change to any of them measures again."""
    import llamatrace
    from llamatrace.kernels import tiles
    from llamatrace.kernels.int8 import act8, act8_ir
    from llamatrace.machine import jit
    from llamatrace.machine.runtime import cpu_model
    sources = hashlib.sha256()
    for module in (sys.modules[__name__], tiles, act8, act8_ir, jit):
        sources.update(Path(module.__file__).read_bytes())
    return {"cpu": cpu_model(), "llvm_cpu": llvm_binding.get_host_cpu_name(), "llamatrace": llamatrace.__version__,
            "numba": numba.__version__, "kernels": sources.hexdigest()[:16]}


def _entry_id(key: dict[str, str]) -> str:
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]


def _read_decisions(path: Path) -> dict:
    """The file's entries, ``{}`` when it is missing or not what :func:`remember` writes (then it is
    measured again and rewritten)."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) and all(isinstance(v, dict) for v in data.values()) else {}


def recalled(kind: int) -> Measurement | None:
    """This CPU's kept measurement of ``kind`` (:func:`cpu_key`), None when there is none."""
    entry = _read_decisions(decisions_path()).get(_entry_id(cpu_key()), {})
    record = entry.get("types", {}).get(KIND_NAMES[kind]) if isinstance(entry.get("types"), dict) else None
    try:
        measured = Measurement(**{f: record[f] for f in Measurement.__dataclass_fields__})
        measured.speedup                                    # numbers, not zero
    except (TypeError, KeyError, ZeroDivisionError):
        return None
    return measured


def remember(kind: int, measured: Measurement) -> None:
    """Keep ``measured`` as this CPU's measurement of ``kind`` (the file rewritten whole, by a
    rename: a reader never sees half of it; entries of other CPUs kept, this CPU's older ones
    dropped). A file that cannot be written leaves one warning line: the process keeps its
    decision, the next one measures again."""
    path = decisions_path()
    key = cpu_key()
    data = {k: v for k, v in _read_decisions(path).items()
            if k == _entry_id(key) or not isinstance(v.get("key"), dict) or v["key"].get("cpu") != key["cpu"]}
    if not isinstance(data.get(_entry_id(key), {}).get("types"), dict):
        data.pop(_entry_id(key), None)
    entry = data.setdefault(_entry_id(key), {"key": key, "types": {}})
    entry["types"][measured.type] = {f: getattr(measured, f) for f in Measurement.__dataclass_fields__}
    entry["types"][measured.type]["amx_wins"] = measured.amx_wins          # for a reader; recomputed on reading
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}")
        tmp.write_text(json.dumps(data, indent=1) + "\n", encoding="utf-8")
        os.replace(tmp, path)
    except OSError as exc:
        _log.warning("cannot keep the AMX measurement in %s (%s): the next process measures again", path, exc)


_DECIDED: dict[int, Status] = {}
"""This process's decisions, per kind (:func:`decision`)."""


def decision(kind: int, measure_now: bool = True) -> Status:
    """Whether the ``q8`` prefill of ``kind`` runs on AMX in this process, and why: not where the
    tiles are not :func:`available` (or :data:`ENV` is ``0``); forced on by :data:`ENV` ``=1``;
    else as this CPU's kept measurement says (:func:`recalled`: on when AMX was at least
    :data:`MARGIN` times as fast and gave the VNNI prefill's bits). Without one: measured now
    (:func:`measure`, once per CPU model, llamatrace version and kernel sources: :func:`remember`)
    when ``measure_now``, else off ("default until measured faster"). Decided once per process and
    kind."""
    tiles_ok = available()
    if not tiles_ok.on:
        return tiles_ok
    if os.environ.get(ENV) == "1":
        return Status(True, f"on: forced by {ENV}=1")
    if kind in _DECIDED:
        return _DECIDED[kind]
    measured = recalled(kind)
    if measured is None:
        if not measure_now:
            return Status(False, "off (default until measured faster)")
        _log.info("timing AMX against VNNI on a %s prefill (once for this CPU)", KIND_NAMES[kind])
        measured = measure(kind)
        remember(kind, measured)
    how = f"measured {measured.speedup:.2f}x VNNI on this CPU"
    where = f"(cache {decisions_path()})"
    if measured.amx_wins:
        _DECIDED[kind] = Status(True, f"on: {how} {where}")
    elif not measured.same_bits:
        _DECIDED[kind] = Status(False, f"off: {how}, but not the VNNI prefill's bits {where}")
    else:
        _DECIDED[kind] = Status(False, f"off: {how}, under the {MARGIN}x it needs {where}")
    return _DECIDED[kind]


def use(kind: int, n_rows: int) -> bool:
    """Whether a ``q8`` prefill of ``n_rows`` activation rows through a weight of ``kind`` runs on
    AMX: :func:`decision` (taken even for a short prefill, so the warm-up decides, and loads the
    kernel) and at least :data:`MIN_ROWS` rows."""
    return decision(kind).on and n_rows >= MIN_ROWS


def describe(type_names) -> str:
    """One line for ``info`` and ``bench``: which prefill runs for each of ``type_names`` (GGML type
    names; those AMX does not serve are left out) and why, without measuring; one reason when
    they share it (``"not available: no amx_int8"``, ``"off (default until measured faster)"``)."""
    tiles_ok = available()
    if not tiles_ok.on:
        return tiles_ok.reason
    reasons = {name: decision(KINDS[name], measure_now=False).reason for name in type_names if name in KINDS}
    if not reasons:
        return f"{tiles_ok.reason}; no Q4_0, Q8_0, Q4_K or Q6_K matrix here"
    if len(set(reasons.values())) == 1:
        return next(iter(reasons.values()))
    return "; ".join(f"{name} {reason}" for name, reason in reasons.items())


def prefill_q4_0(x, w, out) -> None:
    """The ``q8`` prefill of a Q4_0 :class:`~llamatrace.kernels.types.packing.Weight` on AMX (call
    only where :func:`use` says so)."""
    run(hw_prefill(), KIND_Q4_0, x, w.qs, w.d, w.d, out)


def prefill_q8_0(x, w, out) -> None:
    """The ``q8`` prefill of a Q8_0 weight on AMX (call only where :func:`use` says so)."""
    run(hw_prefill(), KIND_Q8_0, x, w.qs, w.d, w.d, out)


def prefill_q4_k(x, w, out) -> None:
    """The ``q8`` prefill of a Q4_K weight on AMX (call only where :func:`use` says so)."""
    run(hw_prefill(), KIND_Q4_K, x, w.qs, w.d, w.m, out)


def prefill_q6_k(x, w, out) -> None:
    """The ``q8`` prefill of a Q6_K weight on AMX (call only where :func:`use` says so)."""
    run(hw_prefill(), KIND_Q6_K, x, w.qs, w.d, w.d, out)
