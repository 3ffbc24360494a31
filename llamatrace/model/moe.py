"""The mixture-of-experts FFN: the block that replaces the dense SwiGLU FFN in MoE layers.

As llama.cpp's ``build_moe_ffn`` (``src/llama-graph.cpp``) computes it for qwen3moe, Mixtral
(``llama`` files with experts) and OLMoE, per token ``x`` (a row of ``ffn_norm``)::

    logits  = W_router · x                              ffn_moe_logits   [seq_len, n_expert]
    probs   = softmax(logits)                           ffn_moe_probs    [seq_len, n_expert]
    ids     = top-k(probs)                              ffn_moe_topk     [seq_len, k] int32
    weights = probs[ids]  (÷ their sum: norm)           ffn_moe_weights(_norm) [seq_len, k]
    for each chosen expert e (slot s):
        gate, up = W1[e]·x, W3[e]·x                     ffn_moe_gate / ffn_moe_up  [seq_len, k, expert_hidden_dim]
        h = silu(gate) ⊙ up                             ffn_moe_swiglu   [seq_len, k, expert_hidden_dim]
        y[s] = W2[e]·h                                  ffn_moe_down     [seq_len, k, dim]
    out = Σ_s weights[s] · y[s]                         ffn_moe_weighted [seq_len, k, dim], ffn_moe_out [seq_len, dim]

The routing arithmetic is :mod:`llamatrace.kernels.ops.moe`. The experts' weights stay
quantized: GGUF stores each as one 3-D tensor ``[n_expert, rows, cols]`` (NumPy order), packed
here one expert at a time (:mod:`llamatrace.kernels.types.packing`, gate|up stacked per expert
as the dense FFN's ``w13``). Only the chosen experts run, and the tokens are grouped by expert,
as ``ggml_mul_mat_id`` does: each chosen expert's matrices are read once per call, for all the
rows that chose it.

:class:`MoEOptions` carries what differs between families (gating, normalisation), so that
others (gpt-oss's biases, clamped SwiGLU) are options of the same block.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np

from llamatrace.errors import ModelFormatError
from llamatrace.kernels.ops import fp32 as kernels
from llamatrace.kernels.ops import moe as routing
from llamatrace.kernels.types import packing
from llamatrace.kernels.types.registry import matmul
from llamatrace.model.config import ModelConfig
from llamatrace.tracing.recorder import Emit

EXPERT_TENSORS = ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")
"""The GGUF names (``blk.N.<name>.weight``) of the experts' gate, up and down matrices."""
ROUTER_TENSOR = "ffn_gate_inp"
"""The GGUF name of the router (``blk.N.ffn_gate_inp.weight``, ``[n_expert, dim]``)."""

EXPERT_STAGES = ("ffn_moe_gate", "ffn_moe_up", "ffn_moe_swiglu", "ffn_moe_down", "ffn_moe_weighted")
"""The per-expert stages: computed expert by expert, and assembled only when a recorder or hook watches one."""


@dataclass(frozen=True)
class MoEOptions:
    """How a family's MoE block differs (llama.cpp's ``build_moe_ffn`` arguments).

    Attributes:
        n_expert, k: experts per layer, chosen per token.
        gating: ``"softmax"`` or ``"softmax_weight"`` (:func:`llamatrace.kernels.ops.moe.route`).
        norm: divide the chosen weights by their sum (``norm_w``).
    """

    n_expert: int
    k: int
    gating: str = "softmax"
    norm: bool = False

    @classmethod
    def from_config(cls, c: ModelConfig) -> "MoEOptions":
        return cls(c.n_expert, c.n_expert_used, c.expert_gating, c.expert_weights_norm)


@dataclass
class MoEWeights:
    """One layer's router and experts, matrices ``[out_features, in_features]``.

    ``w13[e]`` stacks expert ``e``'s gate and up rows (one kernel call for both); when the file
    stores gate and up in different types, ``w13`` is ``None`` and ``w1`` / ``w3`` hold them.
    """

    router: packing.Weight                   # ffn_gate_inp [n_expert, dim]
    w2: list[packing.Weight]                 # ffn_down_exps, per expert [dim, expert_hidden_dim]
    w13: list[packing.Weight] | None = None  # per expert [2*expert_hidden_dim, dim]
    w1: list[packing.Weight] | None = None   # ffn_gate_exps, per expert [expert_hidden_dim, dim]
    w3: list[packing.Weight] | None = None   # ffn_up_exps, per expert [expert_hidden_dim, dim]

    def matrices(self) -> list[packing.Weight]:
        """Every packed matrix of the layer."""
        return [self.router, *self.w2, *(self.w13 or ()), *(self.w1 or ()), *(self.w3 or ())]

    def gate_up(self, x: np.ndarray, e: int) -> np.ndarray:
        """Expert ``e``'s gate|up product of rows ``x`` [n, dim]: float32 [n, 2*expert_hidden_dim]."""
        if self.w13 is not None:
            return matmul(x, self.w13[e])
        return np.concatenate([matmul(x, self.w1[e]), matmul(x, self.w3[e])], axis=1)


def load(f, c: ModelConfig, layer: int, pack: Callable, pack_rows: Callable) -> MoEWeights:
    """Pack layer ``layer``'s router and experts from the open GGUF file ``f``.

    ``pack(name, tensor, n_out, n_in)`` packs a 2-D tensor, ``pack_rows(name, [(tensor, row
    slice), …], n_in)`` stacks the given row blocks of 2-D views into one Weight (the model
    loader's helpers: the packed-weights cache and the load's progress live there).

    Raises:
        ModelFormatError: the router or an expert tensor is missing, or its shape disagrees with
            ``{arch}.expert_count``, ``embedding_length`` and the experts' hidden width.
    """
    n, dim, ff = c.n_expert, c.dim, c.expert_hidden_dim
    want = {ROUTER_TENSOR: (n, dim), "ffn_gate_exps": (n, ff, dim), "ffn_up_exps": (n, ff, dim),
            "ffn_down_exps": (n, dim, ff)}
    tensors = {}
    for short, shape in want.items():
        name = f"blk.{layer}.{short}.weight"
        if name not in f.tensors:
            what = "router" if short == ROUTER_TENSOR else "expert tensor"
            raise ModelFormatError(f"{f.path.name}: tensor {name!r} (the {what}) is missing; a {c.arch} mixture of "
                                   f"experts needs it — the file is incomplete or not really {c.arch}")
        got = f.matrix_shape(name)
        if got != shape:
            raise ModelFormatError(f"{f.path.name}: tensor {name!r} has shape {list(got)}, expected {list(shape)} "
                                   f"from {c.arch}.expert_count ({n}), embedding_length ({dim}) and the experts' "
                                   f"hidden width ({ff}); the file is inconsistent")
        tensors[short] = f.tensor(name)
    gate, up, down = (tensors[s] for s in EXPERT_TENSORS)
    router = pack(f"blk.{layer}.{ROUTER_TENSOR}.weight", tensors[ROUTER_TENSOR], n, dim)
    w2 = [pack_rows(f"{down.name}#{e}", [(down, e)], ff) for e in range(n)]
    if gate.tensor_type == up.tensor_type:
        w13 = [pack_rows(f"{gate.name}+{up.name}#{e}", [(gate, e), (up, e)], dim) for e in range(n)]
        return MoEWeights(router, w2, w13=w13)
    w1 = [pack_rows(f"{gate.name}#{e}", [(gate, e)], dim) for e in range(n)]
    w3 = [pack_rows(f"{up.name}#{e}", [(up, e)], dim) for e in range(n)]
    return MoEWeights(router, w2, w1=w1, w3=w3)


def moe_ffn(x: np.ndarray, mw: MoEWeights, opts: MoEOptions, emit: Emit, layer: int,
            watched: Callable[..., bool]) -> np.ndarray:
    """The MoE FFN of rows ``x`` (float32 ``[seq_len, dim]``, the ``ffn_norm`` output); returns
    ``ffn_moe_out`` float32 ``[seq_len, dim]``.

    Every stage goes through ``emit(stage, layer, array)`` (which may replace it, as hooks do).
    The per-expert stages (:data:`EXPERT_STAGES`) are assembled as ``[seq_len, k, …]`` arrays
    only when ``watched(layer, *stages)`` says a recorder or hook reads one; otherwise each
    expert's rows go from gate|up to down in one pass, with the same numbers.
    """
    seq_len = x.shape[0]
    k = opts.k
    # router: one logit per expert, then the choice of k and their weights
    logits = emit("ffn_moe_logits", layer, matmul(x, mw.router))
    probs, ids, weights, weights_norm = routing.route(logits, k, opts.gating, opts.norm)
    emit("ffn_moe_probs", layer, probs)
    ids = emit("ffn_moe_topk", layer, ids)
    weights = emit("ffn_moe_weights_softmax" if opts.gating == "softmax_weight" else "ffn_moe_weights",
                   layer, weights)
    if weights_norm is not None:
        weights = emit("ffn_moe_weights_norm", layer, weights_norm)
    # group the (token, slot) pairs by expert, as ggml_mul_mat_id: each expert's rows in one call
    flat = np.asarray(ids, dtype=np.int64).reshape(-1)
    order = np.argsort(flat, kind="stable")
    experts, starts = np.unique(flat[order], return_index=True)
    groups = [(int(e), order[a:b]) for e, a, b in zip(experts, starts, list(starts[1:]) + [len(order)])]
    down = np.empty((seq_len * k, x.shape[1]), dtype=np.float32)       # row t*k + s: slot s of token t
    if not watched(layer, *EXPERT_STAGES):
        for e, pairs in groups:
            down[pairs] = matmul(kernels.swiglu(mw.gate_up(x[pairs // k], e)), mw.w2[e])
        return emit("ffn_moe_out", layer, routing.combine(down.reshape(seq_len, k, -1), weights))
    ff = mw.w2[0].n_in
    gate = np.empty((seq_len * k, ff), dtype=np.float32)
    up = np.empty((seq_len * k, ff), dtype=np.float32)
    for e, pairs in groups:
        gate[pairs], up[pairs] = np.split(mw.gate_up(x[pairs // k], e), 2, axis=1)
    gate = emit("ffn_moe_gate", layer, gate.reshape(seq_len, k, ff)).reshape(-1, ff)
    up = emit("ffn_moe_up", layer, up.reshape(seq_len, k, ff)).reshape(-1, ff)
    glu = kernels.silu(gate) * up
    glu = emit("ffn_moe_swiglu", layer, glu.reshape(seq_len, k, ff)).reshape(-1, ff)
    for e, pairs in groups:
        down[pairs] = matmul(glu[pairs], mw.w2[e])
    down = emit("ffn_moe_down", layer, down.reshape(seq_len, k, -1))
    weighted = emit("ffn_moe_weighted", layer, down * weights[:, :, None])
    out = weighted[:, 0].copy()
    for s in range(1, k):                        # slot by slot, as llama.cpp's chain of adds
        out += weighted[:, s]
    return emit("ffn_moe_out", layer, out)


def expert_rows(mw: MoEWeights, x: np.ndarray, ids: np.ndarray, part: str) -> np.ndarray:
    """One per-expert stage recomputed from its recorded inputs, for :mod:`llamatrace.analysis.local_error`.

    Args:
        x: float32 ``[seq_len, dim]`` (``ffn_norm``, for ``part`` ``"gate"`` / ``"up"``) or
            ``[seq_len, k, expert_hidden_dim]`` (``ffn_moe_swiglu``, for ``"down"``; or its rows
            flattened to ``[seq_len, k·expert_hidden_dim]``, as a corpus run records them).
        ids: int ``[seq_len, k]``, the chosen experts (``ffn_moe_topk``).

    Returns:
        float32 ``[seq_len, k, n_out]``: slot ``s`` of token ``t`` through expert ``ids[t, s]``.
    """
    seq_len, k = np.shape(ids)
    flat = np.asarray(ids, dtype=np.int64).reshape(-1)
    rows = x.reshape(seq_len * k, -1) if part == "down" else np.repeat(x, k, axis=0)
    rows = np.ascontiguousarray(rows, dtype=np.float32)
    n_out = mw.w2[0].n_out if part == "down" else mw.w2[0].n_in
    out = np.empty((seq_len * k, n_out), dtype=np.float32)
    for e in np.unique(flat):
        sel = np.flatnonzero(flat == e)
        if part == "down":
            out[sel] = matmul(rows[sel], mw.w2[e])
        else:
            out[sel] = np.split(mw.gate_up(rows[sel], int(e)), 2, axis=1)[0 if part == "gate" else 1]
    return out.reshape(seq_len, k, n_out)
