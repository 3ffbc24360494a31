"""Where a token's time stands against the machine's limits (``bench``'s roofline columns).

The limits, measured on the machine the benchmark runs on (:mod:`llamatrace.machine.probe`):

- **read bandwidth** (GB/s): decode reads every weight once a token, so the weights' bytes times
  decode tokens per second is the bandwidth it draws. Read from memory on 2 MiB pages (NumPy
  asks for transparent huge pages for arrays of 4 MiB or more), and again from memory on the
  pages a load without the packed-weights cache gives the weights (:func:`llamatrace.kernels.types.packing.small_pages`:
  4 KiB): each 4 KiB page costs a TLB miss and a page walk (two-level in a VM), and a plain read
  of such pages on two threads was 0-20 % slower than on 2 MiB pages (Xeon VM, 2026-11-27). The
  cache's map of its file is on 2 MiB pages as far as the page cache holds the file in 2 MiB
  folios (ext4 on Linux 6.18 does, for a file written or read whole): docs/performance.md "Decode";
- **int8 multiply-add peak** (G/s): prefill's 8-bit kernels (ours in ``q8``, llama.cpp's) are made
  of ``vpdpbusd`` / ``vpmaddubsw``, so the weights' multiply-adds per token times prefill tokens per
  second is the fraction of that peak it reaches;
- **float32 multiply-add peak** (G/s): ``vfmadd231ps`` chains, the arithmetic of the ``f32`` mode,
  whose kernels make each weight a float32 and multiply-add it with the float32 activations: its
  prefill is held to this peak, not the int8 one (a ceiling of ``peak / prefill_macs`` tokens a
  second before any weight is made);
- **AMX int8 peak** (G/s), where the CPU has AMX and the OS grants it (:func:`llamatrace.kernels.int8.amx.available`):
  ``tdpbssd`` chains on the tiles, the limit of the AMX prefill kernels; elsewhere the reason it is
  not measured (``not available: no amx_int8``). There, too, the AMX and the VNNI prefill of
  each of the model's types on the same matmul (:func:`llamatrace.kernels.int8.amx.measure`), and
  which of them runs, and why (:func:`llamatrace.kernels.int8.amx.describe`).

Per token, a weight matrix of ``n_out x n_in`` is ``n_out * n_in`` multiply-adds and its file
bytes; the token embedding counts only when the output projection shares it (a row is all a
token reads of it otherwise). Attention's own products (a few % at 128 positions) are left out.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

_READ_BYTES = 1 << 30          # far past any cache
_DOT_STEPS = 4_000_000         # ~0.1-0.4 s a thread
_FMA_STEPS = 2_000_000         # ~0.1-0.3 s a thread
_FMA_A, _FMA_B = 1.0, 2.0 ** -20   # sums exact in float32 (fma_peak_np)
_AMX_STEPS = 2_000_000         # 4 tdpbssd a step: ~0.1 s a thread at 1.3 T multiply-adds/s (the figure)


@dataclass
class Machine:
    """The measured limits: ``read_gb_s`` (GB/s, 1e9 bytes, memory on 2 MiB pages), ``int8_gmac_s``
    (1e9 int8 multiply-adds a second), both with ``threads`` threads; ``isa``: the multiply-add
    instruction; ``amx_gmac_s``: the AMX int8 peak (0 where not measured); ``amx``: which prefill
    kernel runs for the model's types and why (:func:`llamatrace.kernels.int8.amx.describe`);
    ``amx_matmuls``: per type, the AMX and the VNNI prefill timed on the same matmul
    (:meth:`llamatrace.kernels.int8.amx.Measurement.row`; empty without AMX);
    ``read_small_pages_gb_s``: the read from memory on the pages of weights packed without the cache
    (:func:`read_bandwidth`; 0 where not measured); ``read_between_runs_gb_s``: one read on 2 MiB
    pages after each round of a benchmark's runs (a machine shared with other work reads slower in
    some rounds than in others: the decode fractions divide by ``read_gb_s`` all the same);
    ``f32_gmac_s``: the float32 multiply-add peak (1e9 a second, ``threads`` threads; 0 where not
    measured), ``f32_isa`` its instruction."""

    threads: int
    read_gb_s: float
    int8_gmac_s: float
    isa: str
    amx_gmac_s: float = 0.0
    amx: str = ""
    amx_matmuls: list[dict] = field(default_factory=list)
    read_small_pages_gb_s: float = 0.0
    read_between_runs_gb_s: list[float] = field(default_factory=list)
    f32_gmac_s: float = 0.0
    f32_isa: str = ""


@dataclass
class TokenCost:
    """What one token costs at every layer: ``weight_bytes`` read and ``macs`` multiply-adds;
    ``prefill_macs``: the multiply-adds of a prompt token, without the output projection, which a
    prefill runs for its last token only (both engines: last-token logits) — counted per prompt
    token it showed prefills above 100 % of the int8 peak with a 248k vocabulary. ``None``: ``macs``."""

    weight_bytes: int
    macs: int
    prefill_macs: int | None = None

    def __post_init__(self) -> None:
        if self.prefill_macs is None:
            self.prefill_macs = self.macs


def read_buffer(small_pages: bool = False) -> np.ndarray:
    """uint64 ``[2**27]`` (1 GiB, far past any cache) of ones for :func:`read_bandwidth`: NumPy's
    memory (on 2 MiB pages where the kernel's transparent huge pages are ``always`` or ``madvise``),
    or with ``small_pages`` the memory packed weights get on a load without the cache
    (:func:`llamatrace.kernels.types.packing.small_pages`)."""
    from llamatrace.kernels.types.packing import small_pages as pages
    if not small_pages:
        return np.ones(_READ_BYTES // 8, np.uint64)
    words = pages(_READ_BYTES).view(np.uint64)
    words.fill(1)
    return words


def read_bandwidth(threads: int, repeats: int = 3, words: np.ndarray | None = None) -> float:
    """GB/s (1e9 bytes) of the best of ``repeats`` reads of ``words`` (uint64, default a
    :func:`read_buffer`) by :func:`llamatrace.machine.probe.read_words` on ``threads`` threads:
    ``bench``'s read bandwidth, and ``benchmarks/profile_decode.py``'s."""
    from llamatrace.machine import probe

    words = read_buffer() if words is None else words
    probe.read_words(words[:64], threads)                 # compile or load from the cache
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        probe.read_words(words, threads)
        best = min(best, time.perf_counter() - t0)
    return words.nbytes / best / 1e9


def measure_machine(threads: int, repeats: int = 3, amx_types: tuple[str, ...] = ()) -> Machine:
    """Best of ``repeats`` runs of each probe on ``threads`` threads (a 1 GiB read on 2 MiB pages,
    then on small pages: :func:`read_bandwidth`; 8 chains of int8 multiply-adds a thread, and of
    float32 ones (:func:`llamatrace.machine.probe.fma_peak`); 4 chains
    of ``tdpbssd`` a thread, and the AMX and VNNI prefill of each of ``amx_types`` (GGML type
    names; those AMX serves) on the same matmul, where AMX is available). ``int8_gmac_s`` is 0 on
    CPUs without AVX2."""
    from llamatrace.kernels.int8 import amx
    from llamatrace.machine import probe

    def best_seconds(peak, steps: int, *args) -> float:     # warm (compile or cache), then the best of repeats
        peak(8, threads, *args)
        best = float("inf")
        for _ in range(repeats):
            t0 = time.perf_counter()
            peak(steps, threads, *args)
            best = min(best, time.perf_counter() - t0)
        return best

    read_gb_s = read_bandwidth(threads, repeats)
    read_small_gb_s = read_bandwidth(threads, repeats, read_buffer(small_pages=True))
    isa, f32_isa = probe.dot_isa(), probe.fma_isa()
    gmac = f32_gmac = amx_gmac = 0.0
    if isa:
        seconds = best_seconds(probe.dot_peak, _DOT_STEPS, 0x04030201, 0x01FE0302)
        gmac = _DOT_STEPS * probe.CHAINS * probe.macs_per_step(isa) * threads / seconds / 1e9
    if f32_isa:
        seconds = best_seconds(probe.fma_peak, _FMA_STEPS, np.float32(_FMA_A), np.float32(_FMA_B))
        f32_gmac = _FMA_STEPS * probe.CHAINS * probe.fma_lanes(f32_isa) * threads / seconds / 1e9
    amx_matmuls = []
    if amx.available().on:
        seconds = best_seconds(amx.hw_dot_peak(), _AMX_STEPS, 0x04030201, 0x01FE0302)
        amx_gmac = _AMX_STEPS * amx.PEAK_MACS_PER_STEP * threads / seconds / 1e9
        amx_matmuls = [amx.measure(amx.KINDS[name]).row() for name in amx_types if name in amx.KINDS]
    return Machine(threads=threads, read_gb_s=read_gb_s, int8_gmac_s=gmac, isa=isa, amx_gmac_s=amx_gmac,
                   amx=amx.describe(amx_types), amx_matmuls=amx_matmuls, read_small_pages_gb_s=read_small_gb_s,
                   f32_gmac_s=f32_gmac, f32_isa=f32_isa)


def token_cost(gguf_file) -> TokenCost:
    """The weight bytes and multiply-adds of one token through every matrix of ``gguf_file``
    (:class:`llamatrace.gguf.reader.GGUFFile`); of a mixture's 3-D expert tensors ``[n_expert,
    rows, cols]``, the ``expert_used_count`` experts a token goes through (on average, the share
    ``expert_used_count / expert_count`` of their bytes)."""
    tensors = gguf_file.tensors
    tied = "output.weight" not in tensors
    mats = [t for name, t in tensors.items() if len(t.shape) == 2 and (name != "token_embd.weight" or tied)]
    arch = gguf_file.field("general.architecture")
    used = gguf_file.field(f"{arch}.expert_used_count", 0)
    experts = [t for t in tensors.values() if len(t.shape) == 3 and used]
    share = [(int(t.n_bytes) * used // int(t.shape[-1]), int(t.n_elements) * used // int(t.shape[-1])) for t in experts]
    macs = sum(t.n_elements for t in mats) + sum(m for _, m in share)
    output = tensors["token_embd.weight" if tied else "output.weight"]
    return TokenCost(weight_bytes=sum(t.n_bytes for t in mats) + sum(b for b, _ in share), macs=macs,
                     prefill_macs=macs - int(output.n_elements))


def fractions(cost: TokenCost, machine: Machine, prefill_tok_s: float, decode_tok_s: float) -> dict[str, float]:
    """``prefill_gmac_s`` (from :attr:`TokenCost.prefill_macs`) and ``decode_gb_s`` an engine reached, and their fractions (0-1) of
    the machine's int8 peak (``prefill_of_amx_peak``: its AMX peak; ``prefill_of_f32_peak``: its
    float32 peak) and read bandwidth (``nan`` where a limit was not measured)."""
    gmac = cost.prefill_macs * prefill_tok_s / 1e9
    gbs = cost.weight_bytes * decode_tok_s / 1e9
    return {"prefill_gmac_s": gmac, "prefill_of_int8_peak": gmac / machine.int8_gmac_s if machine.int8_gmac_s else float("nan"),
            "prefill_of_amx_peak": gmac / machine.amx_gmac_s if machine.amx_gmac_s else float("nan"),
            "prefill_of_f32_peak": gmac / machine.f32_gmac_s if machine.f32_gmac_s else float("nan"),
            "decode_gb_s": gbs, "decode_of_read_bw": gbs / machine.read_gb_s if machine.read_gb_s else float("nan")}
