"""Where a token's time stands against the machine's limits (``bench``'s roofline columns).

Two limits, measured on the machine the benchmark runs on (:mod:`llamatrace.kernels.probe`):

- **read bandwidth** (GB/s): decode reads every weight once a token, so the weights' bytes times
  decode tokens per second is the bandwidth it draws;
- **int8 multiply-add peak** (G/s): prefill's 8-bit kernels (ours in ``q8``, llama.cpp's) are made
  of ``vpdpbusd`` / ``vpmaddubsw``, so the weights' multiply-adds per token times prefill tokens per
  second is the fraction of that peak it reaches;
- **AMX int8 peak** (G/s), where the CPU has AMX and the OS grants it (:func:`llamatrace.kernels.amx.status`):
  ``tdpbssd`` chains on the tiles, the limit of the AMX prefill kernels; elsewhere the reason it is
  not measured (``n/a (no amx_int8)``).

Per token, a weight matrix of ``n_out x n_in`` is ``n_out * n_in`` multiply-adds and its file
bytes; the token embedding counts only when the output projection shares it (a row is all a
token reads of it otherwise). Attention's own products (a few % at 128 positions) are left out.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

_READ_BYTES = 1 << 30          # far past any cache
_DOT_STEPS = 4_000_000         # ~0.1-0.4 s a thread
_AMX_STEPS = 2_000_000         # 4 tdpbssd a step: ~0.1 s a thread at 1.3 T multiply-adds/s (the figure)


@dataclass
class Machine:
    """The measured limits: ``read_gb_s`` (GB/s, 1e9 bytes), ``int8_gmac_s`` (1e9 int8
    multiply-adds a second), both with ``threads`` threads; ``isa``: the multiply-add instruction;
    ``amx_gmac_s``: the AMX int8 peak (0 where not measured, ``amx`` then says why)."""

    threads: int
    read_gb_s: float
    int8_gmac_s: float
    isa: str
    amx_gmac_s: float = 0.0
    amx: str = ""


@dataclass
class TokenCost:
    """What one token costs at every layer: ``weight_bytes`` read and ``macs`` multiply-adds."""

    weight_bytes: int
    macs: int


def measure_machine(threads: int, repeats: int = 3) -> Machine:
    """Best of ``repeats`` runs of each probe on ``threads`` threads (a 1 GiB read; 8 chains of
    int8 multiply-adds a thread; 4 chains of ``tdpbssd`` a thread where AMX is on). ``int8_gmac_s``
    is 0 on CPUs without AVX2."""
    from llamatrace.kernels import amx, probe

    best_read = best_dot = float("inf")
    words = np.ones(_READ_BYTES // 8, np.uint64)
    probe.read_words(words[:64], threads)                 # compile or load from the cache
    for _ in range(repeats):
        t0 = time.perf_counter()
        probe.read_words(words, threads)
        best_read = min(best_read, time.perf_counter() - t0)
    del words
    isa = probe.dot_isa()
    gmac = 0.0
    if isa:
        probe.dot_peak(8, threads, 0x04030201, 0x01FE0302)
        for _ in range(repeats):
            t0 = time.perf_counter()
            probe.dot_peak(_DOT_STEPS, threads, 0x04030201, 0x01FE0302)
            best_dot = min(best_dot, time.perf_counter() - t0)
        gmac = _DOT_STEPS * probe.CHAINS * probe.macs_per_step(isa) * threads / best_dot / 1e9
    amx_status, amx_gmac = amx.status(), 0.0
    if amx_status.on:
        peak, best_amx = amx.hw_dot_peak(), float("inf")
        peak(8, threads, 0x04030201, 0x01FE0302)
        for _ in range(repeats):
            t0 = time.perf_counter()
            peak(_AMX_STEPS, threads, 0x04030201, 0x01FE0302)
            best_amx = min(best_amx, time.perf_counter() - t0)
        amx_gmac = _AMX_STEPS * amx.PEAK_MACS_PER_STEP * threads / best_amx / 1e9
    return Machine(threads=threads, read_gb_s=_READ_BYTES / best_read / 1e9, int8_gmac_s=gmac, isa=isa,
                   amx_gmac_s=amx_gmac, amx=amx_status.reason)


def token_cost(gguf_file) -> TokenCost:
    """The weight bytes and multiply-adds of one token through every matrix of ``gguf_file``
    (:class:`llamatrace.gguf.reader.GGUFFile`)."""
    tensors = gguf_file.tensors
    tied = "output.weight" not in tensors
    mats = [t for name, t in tensors.items() if len(t.shape) == 2 and (name != "token_embd.weight" or tied)]
    return TokenCost(weight_bytes=sum(t.n_bytes for t in mats), macs=sum(t.n_elements for t in mats))


def fractions(cost: TokenCost, machine: Machine, prefill_tok_s: float, decode_tok_s: float) -> dict[str, float]:
    """``prefill_gmac_s`` and ``decode_gb_s`` an engine reached, and their fractions (0-1) of
    the machine's int8 peak (``prefill_of_amx_peak``: its AMX peak) and read bandwidth (``nan``
    where a limit was not measured)."""
    gmac = cost.macs * prefill_tok_s / 1e9
    gbs = cost.weight_bytes * decode_tok_s / 1e9
    return {"prefill_gmac_s": gmac, "prefill_of_int8_peak": gmac / machine.int8_gmac_s if machine.int8_gmac_s else float("nan"),
            "prefill_of_amx_peak": gmac / machine.amx_gmac_s if machine.amx_gmac_s else float("nan"),
            "decode_gb_s": gbs, "decode_of_read_bw": gbs / machine.read_gb_s if machine.read_gb_s else float("nan")}
