"""The recipe search: which quant type each tensor group gets, for the least KL divergence at a byte budget.

Three steps, as exllamav3's measure / optimize does them, with the real end-to-end quantity:

1. **Measure** (:class:`Measurer`): for each tensor group (one matrix: ``blk.N.attn_q`` …
   ``blk.N.ffn_down``, ``token_embd``, ``output``; in a mixture of experts one per expert tensor,
   ``blk.N.ffn_{gate,up,down}_exps``: every expert of the layer together, as one GGUF tensor
   takes one type) and each candidate type, requantize that
   group alone from the base weights, swap it into the loaded base model, and read the mean KL
   divergence of the logits against the base's on the calibration chunks (llama.cpp's
   ``--kl-divergence`` arithmetic, :func:`llamatrace.corpus.metrics.token_kld`). Only layers
   from the group's own on are rerun: the residual stream entering every layer is cached from
   one base run (:meth:`llamatrace.model.llama.Llama.forward`'s ``start_layer``). ``ΔKLD`` is
   that KLD minus the unmodified base's (the base rows are stored compressed, as llama.cpp
   stores them, so the base is not exactly 0 against itself).
   In ``probe`` mode only the group's cheapest candidate is run end to end; the others are
   scaled by their local error (:func:`weighted_error`: squared weight error times the mean
   squared input of its column, or the frequency of its row for an embedding lookup), so a
   group costs one rerun instead of one per candidate.
   The groups are the work items of the corpus runner (:func:`measure_groups` on
   :func:`llamatrace.corpus.runner.run_chunks`): in this process, or on worker processes / Ray
   actors that each load the base and make their own base run once (:func:`measure_job`); each
   group's numbers are saved as they arrive, so an interrupted search resumes.
2. **Allocate** (:func:`allocate`): minimise the predicted KLD ``KLD(base) + Σ ΔKLD_g(type_g)``
   under the byte budget — an exact multiple-choice knapsack, dynamic programming over the
   bytes above each group's cheapest choice in units of ``budget / resolution``, every cost
   rounded *up* so the result never exceeds the budget. Exact rather than a Lagrangian sweep:
   a Lagrangian only reaches the points on the convex hull of each group's (bytes, ΔKLD)
   curve and leaves slack at the budget; the DP is a few million NumPy operations here.
   Additivity is a first approximation with a reason: KL divergence is second order in a small
   change of the logits (½ δᵀ F δ), and the quantization errors of different groups are
   independent with zero mean, so their cross terms average out — what is left is the sum of
   each group's own term. :func:`search`'s verification measures the real sum.
3. **Verify**: the caller writes the file with the chosen types and measures it (the CLI).

Budgets count as ``llama-quantize`` prints its BPW (``src/llama-quant.cpp``): 8 × the bytes of
every tensor's data (norms and all) ÷ the number of elements of every tensor.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Sequence

import gguf
import numpy as np

from llamatrace.corpus.metrics import KLDStats, compress_log_probs, token_kld
from llamatrace.errors import OptionError, OutputError, UnsupportedModelError
from llamatrace.kernels.mul_mat_id import FileExperts, supported
from llamatrace.kernels.types import packing
from llamatrace.model.moe import Experts, experts_bytes
from llamatrace.quantize.imatrix.compute import expert_squares
from llamatrace.quantize.rules import fallback

T = gguf.GGMLQuantizationType

KINDS: tuple[str, ...] = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
"""The per-layer matrices a recipe chooses types for, in llama.cpp's tensor names (``blk.N.KIND.weight``)."""
EXPERT_KINDS: tuple[str, ...] = ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")
"""A mixture-of-experts layer's expert tensors (3-D, ``[n_expert, rows, cols]``): one group each."""
DELTANET_KINDS: tuple[str, ...] = ("attn_qkv", "attn_gate", "ssm_alpha", "ssm_beta", "ssm_out")
"""A gated DeltaNet layer's matrices (Qwen3.5, :mod:`llamatrace.model.deltanet`), one group each:
those llama-quantize quantizes (``ssm_conv1d``, ``ssm_a``, ``ssm_dt`` and the norms stay)."""
LAYER_KINDS: tuple[str, ...] = KINDS[:4] + DELTANET_KINDS + KINDS[4:] + EXPERT_KINDS
"""Every kind of group a layer may have, in the order of the forward pass (attention or DeltaNet, then the FFN)."""

_KIND_FIELD = {"attn_q": "wq", "attn_k": "wk", "attn_v": "wv", "attn_output": "wo",
               "ffn_gate": "w1", "ffn_up": "w3", "ffn_down": "w2",
               "ffn_gate_exps": "w1", "ffn_up_exps": "w3", "ffn_down_exps": "w2",     # MoEWeights' lists
               "attn_qkv": "in_proj_qkv", "attn_gate": "in_proj_z", "ssm_alpha": "in_proj_a",   # DeltaNetWeights'
               "ssm_beta": "in_proj_b", "ssm_out": "out_proj"}
# the stage whose output is each matrix's input, for its column weights (probe mode); a gated
# attention's attn_output reads attn_gated, kept under kqv_out (Measurer)
_KIND_INPUT = {"attn_q": "attn_norm", "attn_k": "attn_norm", "attn_v": "attn_norm", "attn_output": "kqv_out",
               "ffn_gate": "ffn_norm", "ffn_up": "ffn_norm", "ffn_down": "ffn_glu", "attn_qkv": "attn_norm",
               "attn_gate": "attn_norm", "ssm_alpha": "attn_norm", "ssm_beta": "attn_norm",
               "ssm_out": "final_output"}

Quantizer = Callable[..., np.ndarray]     # quantize_rows(ggml_type, x [n, k] f32, imatrix=None) -> uint8 [n, row_bytes]


def tensor_bytes(ggml_type: T, n_rows: int, n_per_row: int) -> int:
    """Bytes of an ``[n_rows, n_per_row]`` tensor's data in ``ggml_type`` (``ggml_row_size`` × rows)."""
    block, size = gguf.GGML_QUANT_SIZES[ggml_type]
    return n_rows * (n_per_row // block) * size


@dataclass(frozen=True)
class Group:
    """One matrix the recipe chooses a type for.

    Attributes:
        name: ``blk.N.KIND``, ``token_embd`` or ``output`` (the GGUF name without ``.weight``).
        layer: the first layer a change reruns from (0 for the embedding, ``n_layers`` for the output).
        n_rows, n_per_row: the matrix's NumPy shape ``[out_features, in_features]`` (an expert
            tensor's: every expert's rows stacked, ``n_expert × rows``).
        candidates: the types it may get (the requested ones after llama.cpp's fallback, cheapest first).
        n_expert: the experts an expert tensor stacks (0: one matrix).
    """

    name: str
    layer: int
    n_rows: int
    n_per_row: int
    candidates: tuple[T, ...]
    n_expert: int = 0

    @property
    def tensor(self) -> str:
        return self.name + ".weight"

    @property
    def n_weights(self) -> int:
        return self.n_rows * self.n_per_row

    def bytes(self, ggml_type: T) -> int:
        return tensor_bytes(ggml_type, self.n_rows, self.n_per_row)


def parse_types(text: str, what: str = "--candidates") -> list[T]:
    """Types from a comma list (``"Q3_K,q4_k,Q8_0"``).

    Raises:
        OptionError: an empty list or an unknown or unsupported type name.
    """
    names = [n.strip().upper() for n in text.split(",") if n.strip()]
    if not names:
        raise OptionError(f"{what}: give a comma-separated list of types, e.g. Q3_K,Q4_K,Q5_K,Q6_K")
    from llamatrace.kernels.quantizers.rows import QUANTIZABLE
    types = []
    for n in names:
        t = T.__members__.get(n)
        if t not in QUANTIZABLE:
            allowed = ", ".join(sorted(x.name for x in QUANTIZABLE))
            raise OptionError(f"{what}: unknown type {n!r}; choose from {allowed}")
        types.append(t)
    return types


def make_groups(file, n_layers: int, requested: Sequence[T]) -> list[Group]:
    """The groups of a GGUF (:class:`llamatrace.gguf.reader.GGUFFile`): every layer's
    :data:`KINDS`, :data:`EXPERT_KINDS` and :data:`DELTANET_KINDS` the file holds, then ``token_embd`` and ``output`` (when
    the file has its own; a tied output is the embedding's group). Each gets ``requested`` after
    fallback, deduplicated, by bytes. The routers (``ffn_gate_inp``) are no group: llama.cpp never
    quantizes them.

    Raises:
        UnsupportedModelError: a file that stores q/k/v or gate/up fused (phi3); a DeltaNet
            layer's ``attn_qkv`` (beside its ``ssm_out``) is one matrix, a group.
    """
    fused = [n for n in file.tensors if n.endswith(".attn_qkv.weight")
             and n.replace(".attn_qkv.", ".ssm_out.") not in file.tensors]
    if fused:
        raise UnsupportedModelError("the recipe search does not handle fused attn_qkv tensors "
                                    "(phi3, or a file converted with --fuse-qkv) yet")
    groups = []

    def add(name: str, layer: int) -> None:
        shape = file.matrix_shape(name + ".weight")
        n_expert = int(shape[0]) if len(shape) == 3 else 0
        n_rows, n_per_row = int(np.prod(shape[:-1])), int(shape[-1])
        cands = {fallback(t, n_per_row) for t in requested}
        order = sorted(cands, key=lambda t: (tensor_bytes(t, n_rows, n_per_row), t.value))
        groups.append(Group(name, layer, n_rows, n_per_row, tuple(order), n_expert))

    for layer in range(n_layers):
        for kind in LAYER_KINDS:
            if f"blk.{layer}.{kind}.weight" in file.tensors:
                add(f"blk.{layer}.{kind}", layer)
    add("token_embd", 0)
    if "output.weight" in file.tensors:
        add("output", n_layers)
    return groups


# ----------------------------------------------------------------------------------------------
# budget


@dataclass(frozen=True)
class Budget:
    """What the recipe may spend: ``limit`` bytes of tensor data in all, of which ``fixed``
    go to the tensors no group covers (norms, kept as they are); ``n_elements`` of every tensor."""

    limit: int
    fixed: int
    n_elements: int

    def bpw(self, total_bytes: int) -> float:
        """llama-quantize's BPW of a file with ``total_bytes`` of tensor data."""
        return 8.0 * total_bytes / self.n_elements


def make_budget(file, groups: Sequence[Group], target_bpw: float | None = None,
                target_size: int | None = None) -> Budget:
    """The budget of ``--target-bpw`` (``limit = floor(bpw × n_elements / 8)``) or ``--target-size``
    (bytes of tensor data); the smaller if both.

    Raises:
        OptionError: neither given, a non-positive one, a budget below what the cheapest
            candidates of every group need or one that holds their largest (the message says
            that minimum or maximum).
    """
    if target_bpw is None and target_size is None:
        raise OptionError("give --target-bpw or --target-size for a recipe search")
    covered = {g.tensor for g in groups}
    n_elements = sum(t.n_elements for t in file.tensors.values())
    fixed = sum(t.n_bytes for name, t in file.tensors.items() if name not in covered)
    limits = []
    if target_bpw is not None:
        if not target_bpw > 0:
            raise OptionError(f"--target-bpw must be positive, got {target_bpw}")
        limits.append(math.floor(target_bpw * n_elements / 8))
    if target_size is not None:
        if target_size <= 0:
            raise OptionError(f"--target-size must be a positive number of bytes, got {target_size}")
        limits.append(int(target_size))
    budget = Budget(min(limits), fixed, n_elements)
    least = fixed + sum(g.bytes(g.candidates[0]) for g in groups)
    if least > budget.limit:
        raise OptionError(f"the budget ({budget.limit} bytes, {budget.bpw(budget.limit):.3f} bpw) is below the "
                          f"smallest file the candidates allow ({least} bytes, {budget.bpw(least):.3f} bpw): "
                          f"raise --target-bpw / --target-size or add cheaper --candidates")
    most = fixed + sum(max(g.bytes(t) for t in g.candidates) for g in groups)
    if most <= budget.limit:   # nothing to choose: measuring would take minutes to pick the largest everywhere
        raise OptionError(f"the budget ({budget.limit} bytes, {budget.bpw(budget.limit):.3f} bpw) holds the largest "
                          f"file the candidates allow ({most} bytes, {budget.bpw(most):.3f} bpw): every matrix would "
                          f"get its largest candidate; lower --target-bpw / --target-size or add larger --candidates")
    return budget


# ----------------------------------------------------------------------------------------------
# allocation


def allocate(costs: Sequence[Sequence[int]], losses: Sequence[Sequence[float]], budget: int,
             resolution: int = 1 << 16) -> list[int]:
    """Multiple-choice knapsack: one option per group, total cost ≤ ``budget``, least total loss.

    Args:
        costs: per group, the integer cost (bytes) of each option.
        losses: per group, the loss (predicted ΔKLD) of each option, same shape as ``costs``.
        budget: the most the chosen options may cost in all.
        resolution: units the budget above the cheapest options is cut into; each option's extra
            cost is rounded up to whole units, so the answer is feasible and optimal up to that rounding
            (exact when the extra costs are multiples of a unit). The table has one entry per unit
            up to what the options can spend, at most ``resolution + len(costs)`` entries whatever
            the budget.

    Returns:
        The chosen option's index, per group.

    Raises:
        ValueError: no choice fits (the cheapest options together cost more than ``budget``),
            or ``costs`` and ``losses`` differ in shape.
    """
    if len(costs) != len(losses) or any(len(c) != len(l) or not c for c, l in zip(costs, losses)):
        raise ValueError("allocate: costs and losses must give each group the same, non-empty options")
    base = [min(c) for c in costs]
    spare = budget - sum(base)
    if spare < 0:
        raise ValueError(f"allocate: the cheapest options cost {sum(base)}, over the budget {budget}")
    extra_max = sum(max(c) - b for c, b in zip(costs, base))
    unit = max(1, -(-min(spare, extra_max) // resolution))     # ceil: n_units * unit >= what can be spent
    # the table ends at what the options can spend (each group's dearest, in rounded units), not at
    # the spare budget: past it every entry equals the last one, and a generous budget (one
    # candidate type, --target-bpw 8) would make it gigabytes
    n_units = min(spare // unit, sum(-(-(max(c) - b) // unit) for c, b in zip(costs, base)))
    inf = np.inf
    best = np.zeros(n_units + 1)             # least loss of the groups so far within u units (monotone)
    choices = []
    for c, l in zip(costs, losses):
        nxt = np.full(n_units + 1, inf)
        pick = np.zeros(n_units + 1, dtype=np.int32)
        for k, (ck, lk) in enumerate(zip(c, l)):
            u = -(-(ck - min(c)) // unit)                        # rounded up: never over budget
            if u > n_units:
                continue
            cand = np.full(n_units + 1, inf)
            cand[u:] = best[:n_units + 1 - u] + lk
            better = cand < nxt
            nxt[better] = cand[better]
            pick[better] = k
        best = nxt
        choices.append(pick)
    u = int(np.argmin(best))
    chosen = [0] * len(costs)
    for g in range(len(costs) - 1, -1, -1):
        k = int(choices[g][u])
        chosen[g] = k
        u -= -(-(costs[g][k] - min(costs[g])) // unit)
    return chosen


# ----------------------------------------------------------------------------------------------
# measurement


def weighted_error(w: np.ndarray, q: np.ndarray, col_weights: np.ndarray | None,
                   row_weights: np.ndarray | None) -> float:
    """Σ_ij (w_ij − q_ij)² · col_ij · row_i of float32 ``[n_rows, n_per_row]`` weights and their
    dequantized quantization (``col_weights`` float ``[n_per_row]``: the input's mean square per
    column; ``row_weights`` float ``[n_rows]``; ``None`` = 1). The local error probe mode scales by."""
    d2 = (np.asarray(w, np.float64) - np.asarray(q, np.float64)) ** 2
    if col_weights is not None:
        d2 = d2 * col_weights[None, :]
    if row_weights is not None:
        d2 = d2 * row_weights[:, None]
    return float(d2.sum())


@dataclass
class Calibration:
    """Calibration chunks as :mod:`llamatrace.corpus.chunks` cuts them: int ``[n_ctx]`` ids, int64
    ``[n_scored]`` targets of each, and the first scored position."""

    ids: list[np.ndarray]
    targets: list[np.ndarray]
    first: int

    @classmethod
    def from_chunks(cls, chunks) -> "Calibration":
        return cls([chunks.chunk(i) for i in range(chunks.n_chunk)],
                   [chunks.targets(i) for i in range(chunks.n_chunk)], chunks.first)


class Measurer:
    """ΔKLD of one group at one type, on a loaded base model (:class:`llamatrace.model.llama.Llama`).

    The base is run once over the calibration chunks: its compressed log-probabilities (the base
    rows), the residual entering every layer, and per matrix input the mean square of each column
    (for probe mode) are kept: ``(n_layers + 1) × n_ctx × dim`` float32 a chunk.
    The model's fused q/k/v and gate/up weights are split (the forward pass takes either) so
    that one matrix can be swapped; :meth:`measure` puts the base weight back after each run.

    Args:
        model: the loaded base model; its weights are swapped in place during :meth:`measure`.
        calibration: the chunks.
        quantize: ``quantize_rows(ggml_type, x, imatrix=None)``
            (:func:`llamatrace.kernels.quantizers.rows.quantize_rows`).
    """

    def __init__(self, model, calibration: Calibration, quantize: Quantizer) -> None:
        self.model = model
        self.cal = calibration
        self.quantize = quantize
        self._unfuse()
        n_layers = model.config.n_layers
        self.residuals: list[list[np.ndarray]] = []        # [chunk][layer 0..n_layers] entering the layer
        self.base_rows: list[np.ndarray] = []
        sq: dict[tuple[str, int | None], np.ndarray] = {}
        count = 0
        for ids in calibration.ids:
            seen: dict[tuple[str, int | None], np.ndarray] = {}

            def keep(a, e, seen=seen):
                seen[(e.stage, e.layer)] = np.array(a, dtype=np.float32)

            stages = ("inp_embd", "inp_scaled", "l_out", "attn_norm", "kqv_out", "attn_gated", "final_output",
                      "ffn_norm", "ffn_swiglu", "ffn_geglu", "result_norm")
            if model.config.n_expert:                # the route and the experts' gated rows (ROUTE_HOOKS)
                stages += ("ffn_moe_topk", "ffn_moe_swiglu", "ffn_moe_swiglu_oai")
            with model.hooks({s: keep for s in stages}):
                model.forward(ids, 0, model.new_cache(len(ids)))
            for stage, layer in [k for k in seen if k[0] == "attn_gated"]:     # attn_output's input (Qwen3.5)
                seen[("kqv_out", layer)] = seen.pop((stage, layer))
            embd = seen.get(("inp_scaled", None), seen[("inp_embd", None)])
            res = [embd] + [seen[("l_out", i)] for i in range(n_layers)]
            self.residuals.append(res)
            self.base_rows.append(compress_log_probs(self._scored_logits(res[-1])))
            for (stage, layer), a in seen.items():
                if stage in ("attn_norm", "kqv_out", "final_output", "ffn_norm", "ffn_swiglu", "ffn_geglu"):
                    key = ("ffn_glu" if stage.startswith("ffn_") and stage != "ffn_norm" else stage, layer)
                    sq[key] = sq.get(key, 0.0) + (a.astype(np.float64) ** 2).sum(axis=0)
                if stage == "ffn_norm" and model.weights.layers[layer].moe is not None:
                    # each expert's inputs, over the tokens routed to it ([n_expert, width]: 0 where none)
                    glu = seen.get(("ffn_moe_swiglu", layer), seen.get(("ffn_moe_swiglu_oai", layer)))
                    found = expert_squares(a, seen[("ffn_moe_topk", layer)].astype(np.int64), glu, layer,
                                           model.config.n_expert)
                    for (exp_stage, _, _), (sums, _) in found.items():
                        key = ("exps_" + exp_stage, layer)
                        sq[key] = sq.get(key, 0.0) + sums
            # the output projection's input: the last row is all result_norm holds without all_logits
            out_in = self._final_norm(res[-1][calibration.first:len(ids) - 1])
            sq[("result_norm", None)] = sq.get(("result_norm", None), 0.0) + (out_in.astype(np.float64) ** 2).sum(axis=0)
            count += len(ids)
        self._col_sq = {k: v / count for k, v in sq.items()}
        tokens = np.concatenate(calibration.ids)
        self._token_freq = np.bincount(tokens, minlength=model.config.vocab_size).astype(np.float64) / len(tokens)
        self.base_kld = self._kld()

    # -- the model's weights
    def _unfuse(self) -> None:
        m = self.model
        for i, lw in enumerate(m.weights.layers):
            if lw.moe is not None and isinstance(lw.moe.w13, list):   # each expert's gate and up apart
                lw.moe.w1, lw.moe.w3 = (self._pack_experts(f"blk.{i}.{k}.weight") for k in ("ffn_gate_exps", "ffn_up_exps"))
                lw.moe.w13 = None
            if lw.wqkv is not None:
                lw.wq, lw.wk, lw.wv = (self._pack_file(f"blk.{i}.{k}.weight") for k in ("attn_q", "attn_k", "attn_v"))
                lw.wqkv = None
            if lw.w13 is not None:
                lw.w1, lw.w3 = (self._pack_file(f"blk.{i}.{k}.weight") for k in ("ffn_gate", "ffn_up"))
                lw.w13 = None

    def _pack_experts(self, name: str) -> list[packing.Weight]:
        t = self.model.file.tensor(name)
        n, n_rows, n_per_row = self.model.file.matrix_shape(name)
        return [packing.pack(f"{name}#{e}", t.tensor_type, t.data[e], n_rows, n_per_row,
                             activations=self.model.activations) for e in range(n)]

    def _pack_file(self, name: str) -> packing.Weight:
        t = self.model.file.tensor(name)
        n_rows, n_per_row = self.model.file.matrix_shape(name)
        return packing.pack(name, t.tensor_type, t.data, n_rows, n_per_row, activations=self.model.activations)

    def base_weights(self, group: Group) -> np.ndarray:
        """float32 ``[n_rows, n_per_row]``: the group's weights in the base file, dequantized."""
        t = self.model.file.tensor(group.tensor)
        return np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(
            group.n_rows, group.n_per_row)

    def quantized(self, group: Group, ggml_type: T, weights: np.ndarray | None = None,
                  imatrix: np.ndarray | None = None) -> np.ndarray:
        """uint8 ``[n_rows, row_bytes]``: the group's base weights (or ``weights``) quantized to
        ``ggml_type``, with the group's importance ``imatrix`` (float32 ``[n_per_row]``, or ``[n_expert
        × n_per_row]`` for an expert tensor: each expert's rows with its own slice) if given."""
        w = self.base_weights(group) if weights is None else weights
        if imatrix is None or imatrix.size == group.n_per_row:
            return np.asarray(self.quantize(ggml_type, w, imatrix), dtype=np.uint8)
        rows = group.n_rows // group.n_expert
        imatrix = np.asarray(imatrix, np.float32).reshape(group.n_expert, group.n_per_row)
        return np.concatenate([np.asarray(self.quantize(ggml_type, w[e * rows:(e + 1) * rows], imatrix[e]), np.uint8)
                               for e in range(group.n_expert)])

    def _slots(self, group: Group) -> list[tuple[object, str]]:
        w = self.model.weights
        if group.name == "token_embd":
            return [(w, "tok_embeddings")] + ([(w, "output")] if w.tied_output else [])
        if group.name == "output":
            return [(w, "output")]
        layer, kind = group.name.split(".")[1:]
        lw = w.layers[int(layer)]
        owner = lw.moe if group.n_expert else lw.deltanet if kind in DELTANET_KINDS else lw
        return [(owner, _KIND_FIELD[kind])]

    def swap(self, group: Group, weight: packing.Weight) -> list[packing.Weight]:
        """Put ``weight`` in the group's place(s) in the model (both, for a tied embedding); returns
        what was there, for :meth:`restore`."""
        old = []
        for obj, attr in self._slots(group):
            old.append(getattr(obj, attr))
            setattr(obj, attr, weight)
        return old

    def restore(self, group: Group, old: list[packing.Weight]) -> None:
        for (obj, attr), w in zip(self._slots(group), old):
            setattr(obj, attr, w)

    # -- running
    def _final_norm(self, h: np.ndarray) -> np.ndarray:
        from llamatrace.kernels.ops import fp32
        return fp32.rmsnorm(np.ascontiguousarray(h), self.model.weights.norm, self.model.config.norm_eps)

    def _scored_logits(self, final: np.ndarray) -> np.ndarray:
        return self.model.logits(final[self.cal.first:final.shape[0] - 1])

    def _final_residual(self, chunk: int, start_layer: int) -> np.ndarray:
        """The last layer's output of a chunk, rerun from ``start_layer`` with the model's current weights."""
        m, ids = self.model, self.cal.ids[chunk]
        n_layers = m.config.n_layers
        if start_layer == n_layers:
            return self.residuals[chunk][n_layers]
        out = {}

        def keep(a, e):
            out[0] = a

        residual = self.residuals[chunk][start_layer] if start_layer else None
        with m.hooks({"l_out": keep}, layers=[n_layers - 1]):
            m.forward(ids, 0, m.new_cache(len(ids)), start_layer=start_layer, residual=residual)
        return out[0]

    def _kld(self, start_layer: int = 0) -> float:
        """Mean KLD over the calibration tokens of the model as it is now, against the base rows,
        rerunning from ``start_layer`` (the layers before it must be the base's)."""
        total, n = 0.0, 0
        for c in range(len(self.cal.ids)):
            final = self._final_residual(c, start_layer)
            logits = self._scored_logits(final)
            kld = token_kld(logits, self.base_rows[c], self.cal.targets[c]).kld
            total += float(kld.sum())
            n += kld.size
        return total / n

    def pack(self, group: Group, ggml_type: T, data: np.ndarray) -> packing.Weight | Experts:
        """The group's quantized bytes packed as the model packs that matrix (an expert tensor as
        :func:`llamatrace.model.moe.load` holds one: the bytes themselves, as
        :class:`~llamatrace.kernels.mul_mat_id.FileExperts`, for a type the model's ``mul_mat_id``
        kernels run, else one Weight per expert)."""
        if group.n_expert:
            rows = group.n_rows // group.n_expert
            if supported(ggml_type, self.model.activations):
                return FileExperts(group.tensor, T(ggml_type), rows, group.n_per_row,
                                   experts_bytes(data, group.n_expert, rows, group.n_per_row, ggml_type))
            return [packing.pack(f"{group.tensor}#{e}", ggml_type, data[e * rows:(e + 1) * rows], rows,
                                 group.n_per_row, activations=self.model.activations) for e in range(group.n_expert)]
        return packing.pack(group.tensor, ggml_type, data, group.n_rows, group.n_per_row,
                            activations=self.model.activations)

    def measure(self, group: Group, ggml_type: T, data: np.ndarray | None = None) -> float:
        """ΔKLD of the model with only ``group`` quantized to ``ggml_type`` (``data``: its bytes, else
        quantized here), rerunning from the group's layer (the embedding: every layer)."""
        data = self.quantized(group, ggml_type) if data is None else data
        old = self.swap(group, self.pack(group, ggml_type, data))
        try:
            return self._kld(group.layer) - self.base_kld
        finally:
            self.restore(group, old)

    def local_error(self, group: Group, weights: np.ndarray, data: np.ndarray, ggml_type: T) -> float:
        """:func:`weighted_error` of the group's quantized ``data`` (``ggml_type``) against ``weights``."""
        q = gguf.quants.dequantize(data, ggml_type).reshape(weights.shape)
        if group.name == "token_embd":
            tied = self.model.weights.tied_output
            return weighted_error(weights, q, self._col_sq[("result_norm", None)] if tied else None,
                                  None if tied else self._token_freq)
        if group.name == "output":
            return weighted_error(weights, q, self._col_sq[("result_norm", None)], None)
        layer, kind = group.name.split(".")[1:]
        if group.n_expert:              # each expert by the mean square of the inputs routed to it
            col = self._col_sq[("exps_ffn_moe_swiglu" if kind == "ffn_down_exps" else "exps_ffn_norm", int(layer))]
            rows = group.n_rows // group.n_expert
            return sum(weighted_error(weights[e * rows:(e + 1) * rows], q[e * rows:(e + 1) * rows], col[e], None)
                       for e in range(group.n_expert))
        return weighted_error(weights, q, self._col_sq[(_KIND_INPUT[kind], int(layer))], None)


# ----------------------------------------------------------------------------------------------
# the search


_KEY_NAMES = {"version": "llamatrace version", "base": "base model", "base_bytes": "base model",
              "n_ctx": "--ctx-size", "n_chunk": "--chunks", "mode": "--measure", "activations": "--activations",
              "text": "text (-f)", "imatrix": "--imatrix"}
"""What each field of a :class:`Measurements` key is, in the words of the command line."""


@dataclass
class Measurements:
    """ΔKLD per group and type (``{group: {type name: ΔKLD}}``) and the base's own KLD against its
    compressed rows, saved after every group so a rerun resumes; ``key`` identifies what they were
    measured on (base, text, options)."""

    key: dict
    delta: dict[str, dict[str, float]] = field(default_factory=dict)
    path: Path | None = None
    base_kld: float | None = None

    @staticmethod
    def read(path: Path) -> dict | None:
        """What ``path`` holds: None when there is no file, else its measurements (``key``,
        ``delta``, ``base_kld``).

        Raises:
            OutputError: a file there that holds no measurements (a model, another JSON): the search
                would replace it.
        """
        if not path.is_file():
            return None
        try:
            saved = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            saved = None
        if not (isinstance(saved, dict) and all(isinstance(saved.get(k), dict) for k in ("key", "delta"))):
            raise OutputError(f"--measurements {str(path)!r}: the file there holds no measurements of a recipe search, "
                              f"and the search would replace it; give --measurements another path, or move the file")
        return saved

    @classmethod
    def open(cls, path: Path | None, key: dict) -> "Measurements":
        """Resume from ``path`` when it holds measurements with the same ``key``, else start empty.

        Raises:
            OutputError: a file at ``path`` that holds no measurements (:meth:`read`), or measurements
                of another base, text or options, which the search would replace (minutes of work).
        """
        saved = cls.read(path) if path is not None else None
        if saved is None:
            return cls(key, {}, path)
        if saved["key"] != key:
            differ = [_KEY_NAMES.get(k, k) for k in sorted(set(key) | set(saved["key"]))
                      if key.get(k) != saved["key"].get(k)]
            raise OutputError(f"--measurements {str(path)!r} holds measurements made with another "
                              f"{', '.join(dict.fromkeys(differ))}: give --measurements another path to keep them, "
                              f"or delete the file to measure anew")
        return cls(key, {g: dict(v) for g, v in saved["delta"].items()}, path, saved.get("base_kld"))

    def save(self) -> None:
        if self.path is None:
            return
        tmp = self.path.with_name(self.path.name + ".tmp")
        doc = {"key": self.key, "base_kld": self.base_kld, "delta": self.delta}
        tmp.write_text(json.dumps(doc, indent=1) + "\n", encoding="utf-8")
        os.replace(tmp, self.path)


@dataclass
class Choice:
    """One group's place in a recipe: its type, bytes and predicted ΔKLD, and every candidate's."""

    group: Group
    ggml_type: T
    bytes: int
    delta_kld: float
    options: dict[str, float]          # type name -> ΔKLD (measured or scaled)


@dataclass
class Recipe:
    """The chosen types (GGUF tensor name → type), with what the search predicts for them."""

    choices: list[Choice]
    budget: Budget
    base_kld: float
    mode: str

    @property
    def types(self) -> dict[str, T]:
        return {c.group.tensor: c.ggml_type for c in self.choices}

    @property
    def total_bytes(self) -> int:
        return self.budget.fixed + sum(c.bytes for c in self.choices)

    @property
    def predicted_kld(self) -> float:
        return self.base_kld + sum(c.delta_kld for c in self.choices)

    def tensor_type_args(self) -> list[str]:
        """The recipe as ``llama-quantize --tensor-type`` values: one regex per (kind, type) over its
        layers (``blk\\.(0|3)\\.ffn_down\\.weight=q5_k``), the embedding and output by name."""
        by: dict[tuple[str, T], list[int]] = {}
        args = []
        for c in self.choices:
            if c.group.name.startswith("blk."):
                _, layer, kind = c.group.name.split(".")
                by.setdefault((kind, c.ggml_type), []).append(int(layer))
            else:
                args.append(f"{c.group.name}\\.weight={c.ggml_type.name.lower()}")
        for (kind, t), layers in by.items():
            alt = "|".join(str(i) for i in sorted(layers))
            args.append(f"blk\\.({alt})\\.{kind}\\.weight={t.name.lower()}")
        return args

    def to_json(self) -> dict:
        return {"mode": self.mode, "budget_bytes": self.budget.limit, "bytes": self.total_bytes,
                "bpw": self.budget.bpw(self.total_bytes), "base_kld": self.base_kld,
                "predicted_kld": self.predicted_kld, "tensor_type": self.tensor_type_args(),
                "groups": [{"group": c.group.name, "type": c.ggml_type.name, "bytes": c.bytes,
                            "delta_kld": c.delta_kld, "options": c.options} for c in self.choices]}


@dataclass(frozen=True)
class Setup:
    """What every measurement of a search shares besides the model: the calibration chunks, the
    quantizer (a module-level function: worker processes import it by name) and the mode
    (:func:`measure_group`)."""

    calibration: Calibration
    quantize: Quantizer
    mode: str = "probe"

    def digest(self) -> str:
        """What a worker's base run depends on (the chunks' ids and first scored position), hashed."""
        h = hashlib.sha256(str(self.calibration.first).encode())
        for ids in self.calibration.ids:
            h.update(np.asarray(ids, np.int64).tobytes())
        return h.hexdigest()


@dataclass(frozen=True)
class GroupJob:
    """One unit of work on the corpus runner: a group, all its candidates, its importance row."""

    setup: Setup
    group: Group
    imatrix: np.ndarray | None = None


def measure_group(measurer: Measurer, group: Group, mode: str, imatrix: np.ndarray | None = None) -> dict[str, float]:
    """ΔKLD of each of ``group``'s candidates (type name → ΔKLD).

    ``mode`` ``"all"``: every candidate measured end to end; ``"probe"``: the cheapest one, the
    others scaled by :meth:`Measurer.local_error` (ΔKLD ∝ local error, the ratio from the probe;
    a probe at or below 0 — within the noise of a tiny change — scales to 0).
    ``imatrix``: the group's float32 ``[n_per_row]`` importance, for the quantizer.
    """
    weights = measurer.base_weights(group)
    data = {t: measurer.quantized(group, t, weights, imatrix) for t in group.candidates}
    if mode == "all":
        return {t.name: measurer.measure(group, t, data[t]) for t in group.candidates}
    probe = group.candidates[0]
    d_probe = measurer.measure(group, probe, data[probe])
    errors = {t: measurer.local_error(group, weights, data[t], t) for t in group.candidates}
    scale = max(d_probe, 0.0) / errors[probe] if errors[probe] > 0 else 0.0
    return {t.name: (d_probe if t == probe else scale * errors[t]) for t in group.candidates}


# The Measurer a process built last, with what it was built for: a worker measures many groups
# on one model and calibration, and its base run (the residuals it resumes from) is done once.
_built: list[tuple[object, str, Quantizer, Measurer]] = []


def _measurer(model, setup: Setup) -> Measurer:
    key = setup.digest()
    if not (_built and _built[0][0] is model and _built[0][1] == key and _built[0][2] is setup.quantize):
        _built.clear()                     # free the last one's residuals before the new base run
        _built.append((model, key, setup.quantize, Measurer(model, setup.calibration, setup.quantize)))
    return _built[0][3]


def measure_job(model, job: GroupJob) -> tuple[dict[str, float], float]:
    """The runner's work (:func:`llamatrace.corpus.runner.run_chunks`): ``(ΔKLD per type name, the
    base's KLD)`` of ``job``'s group on a loaded base ``model``. The first job of a process runs
    the base over the calibration chunks (one forward per chunk, the cost of measuring the
    embedding): cheaper than shipping every layer's residuals to each worker."""
    measurer = _measurer(model, job.setup)
    return measure_group(measurer, job.group, job.setup.mode, job.imatrix), measurer.base_kld


def measure_groups(setup: Setup, groups: Sequence[Group], store: Measurements,
                   imatrix: dict[str, np.ndarray] | None = None, *, model=None, spec=None, workers: int = 1,
                   ray: str | None = None, progress: Callable[[int, int], None] | None = None) -> int:
    """Fill ``store`` for every group whose candidates are not all in it yet, on the corpus runner
    (:func:`llamatrace.corpus.runner.run_chunks`: in this process on ``model``, or on ``workers``
    processes / Ray actors that load ``spec``); each group's ΔKLD is saved as it arrives (in
    group order), so an interrupted run (KeyboardInterrupt, a killed process) keeps what it measured.
    ``progress(done, total)`` once before (``done``: the groups resumed from ``store``) and after each group.

    Returns:
        How many groups were measured now.

    Raises:
        OptionError: an unknown ``setup.mode``; ``workers`` below 1.
        LlamatraceError: a worker's error (:func:`~llamatrace.corpus.runner.run_chunks`).
    """
    from llamatrace.corpus.runner import run_chunks
    if setup.mode not in ("probe", "all"):
        raise OptionError(f"unknown measurement mode {setup.mode!r}: probe or all")
    imatrix = imatrix or {}
    todo = [g for g in groups if not {t.name for t in g.candidates} <= set(store.delta.get(g.name, {}))]
    resumed = len(groups) - len(todo)

    def on_result(i: int, result: tuple[dict[str, float], float]) -> None:
        store.delta[todo[i].name], base_kld = result
        if store.base_kld is None:
            store.base_kld = base_kld
        store.save()
        if progress:
            progress(resumed + i + 1, len(groups))

    if progress:
        progress(resumed, len(groups))
    if not todo:
        return 0
    try:
        run_chunks(spec, len(todo), lambda i: GroupJob(setup, todo[i], imatrix.get(todo[i].tensor)), measure_job,
                   on_result, workers, model, ray)
    finally:
        _built.clear()                     # this process's model is the caller's again
    return len(todo)


def choose(groups: Sequence[Group], store: Measurements, budget: Budget, base_kld: float, mode: str) -> Recipe:
    """The recipe of least predicted KLD within ``budget`` (:func:`allocate` over the measured ΔKLD).

    Raises:
        OptionError: the budget is below the cheapest candidates (as :func:`make_budget`).
    """
    costs = [[g.bytes(t) for t in g.candidates] for g in groups]
    losses = [[store.delta[g.name][t.name] for t in g.candidates] for g in groups]
    try:
        picked = allocate(costs, losses, budget.limit - budget.fixed)
    except ValueError:
        raise OptionError(f"the budget ({budget.limit} bytes) is below the smallest file the candidates allow") from None
    choices = [Choice(g, g.candidates[k], costs[i][k], losses[i][k],
                      {t.name: store.delta[g.name][t.name] for t in g.candidates})
               for i, (g, k) in enumerate(zip(groups, picked))]
    recipe = Recipe(choices, budget, base_kld, mode)
    assert recipe.total_bytes <= budget.limit, (recipe.total_bytes, budget.limit)
    return recipe


def stock_like(groups: Iterable[Group], types: dict[str, T], budget: Budget, store: Measurements,
               base_kld: float) -> Recipe:
    """A given mix (a stock file type's per-tensor types, GGUF name → type) as a :class:`Recipe`,
    with the ΔKLD the measurements predict for it where they cover its types (else NaN)."""
    choices = []
    for g in groups:
        t = types[g.tensor]
        delta = store.delta.get(g.name, {}).get(t.name, math.nan)
        choices.append(Choice(g, t, g.bytes(t), delta, dict(store.delta.get(g.name, {}))))
    return Recipe(choices, budget, base_kld, "stock")


def measured_kld(base_model, model, chunks) -> KLDStats:
    """``llama-perplexity --kl-divergence`` statistics of ``model`` against ``base_model`` (both loaded)
    on ``chunks`` (:class:`llamatrace.corpus.chunks.Chunks`): the base's rows are made in memory,
    then :func:`llamatrace.corpus.perplexity.kl_divergence`'s per-token arithmetic."""
    from llamatrace.corpus.metrics import KLDStats
    from llamatrace.corpus.perplexity import ChunkJob, score_chunk
    parts = []
    for i in range(chunks.n_chunk):
        job = ChunkJob(chunks.chunk(i), chunks.targets(i), chunks.first, "base")
        _, rows = score_chunk(base_model, job)
        parts.append(score_chunk(model, ChunkJob(job.ids, job.targets, job.first, "kld", rows)))
    return KLDStats.from_tokens(parts)


def search(model, calibration_text: str, *, target_bpw: float | None = None, target_size: int | None = None,
           candidates: Sequence[T], quantize: Quantizer, imatrix: dict[str, np.ndarray] | None = None,
           n_ctx: int = 512, n_chunks: int | None = None, mode: str = "probe",
           measurements: Path | None = None, workers: int = 1, ray: str | None = None, threads: int | None = None,
           progress: Callable[[int, int], None] | None = None) -> tuple[Recipe, Measurements]:
    """Measure (resuming from ``measurements``) and allocate: the recipe for a loaded base ``model``.

    Args:
        model: the base (:class:`llamatrace.model.llama.Llama`), F32/F16/BF16/Q8_0; in this process
            (``workers`` 1, no ``ray``) its weights are swapped while measuring and restored, but its
            fused q/k/v and gate/up stay split.
        calibration_text: the text the ΔKLD are measured on (cut as ``llama-perplexity`` cuts it).
        target_bpw, target_size: the budget (:func:`make_budget`).
        candidates: the types asked for (each group gets them after llama.cpp's fallback).
        quantize: as :class:`Measurer` (a module-level function when ``workers`` > 1 or ``ray``).
        imatrix: GGUF tensor name → float32 ``[n_per_row]`` importance, for ``quantize``.
        n_ctx, n_chunks: the chunks of ``calibration_text`` (``--ctx-size``, ``--chunks``).
        mode: ``"probe"`` or ``"all"`` (:func:`measure_group`).
        measurements: a JSON file of measured groups, read if it matches and written after each group.
        workers, ray, threads: where the groups are measured (:func:`measure_groups`): worker
            processes or Ray actors, each loading ``model``'s file with ``threads`` kernel threads.
        progress: ``progress(done, total)`` before measuring and after each measured group (:func:`measure_groups`).

    Raises:
        OptionError, PromptError: bad options, a text too short for two chunks, a budget below the
            cheapest candidates.
        UnsupportedModelError: a model the search does not handle (:func:`make_groups`).
        KeyboardInterrupt: the measurements made so far are in ``measurements``.
    """
    from llamatrace.corpus.chunks import make_chunks
    from llamatrace.corpus.worker import ModelSpec
    groups = make_groups(model.file, model.config.n_layers, candidates)
    budget = make_budget(model.file, groups, target_bpw, target_size)
    chunks = make_chunks(model.tokenizer, calibration_text, n_ctx, n_chunks, model.config.max_seq_len)
    text = hashlib.sha256(chunks.tokens[:chunks.n_chunk * n_ctx].tobytes()).hexdigest()
    key = {"version": 2, "base": Path(model.path).name, "base_bytes": Path(model.path).stat().st_size,
           "n_ctx": n_ctx, "n_chunk": chunks.n_chunk, "mode": mode, "activations": model.activations, "text": text,
           "imatrix": hashlib.sha256(b"".join(n.encode() + np.asarray(imatrix[n], np.float32).tobytes()
                                               for n in sorted(imatrix))).hexdigest() if imatrix else None}
    store = Measurements.open(measurements, key)
    setup = Setup(Calibration.from_chunks(chunks), quantize, mode)
    in_process = workers == 1 and ray is None
    measure_groups(setup, groups, store, imatrix, model=model if in_process else None,
                   spec=ModelSpec(str(model.path), model.activations, threads), workers=workers, ray=ray,
                   progress=progress)
    return choose(groups, store, budget, store.base_kld, mode), store
