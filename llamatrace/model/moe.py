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

With a shared expert (qwen35moe, ``qwen35moe.cpp``'s ``build_layer_ffn``), beside the routed ones::

    s = W2s·(silu(W1s·x) ⊙ W3s·x)                       ffn_shexp        [seq_len, dim]
    g = w_gs · x                                        shared_expert_gate [seq_len, 1]
    out = ffn_moe_out + sigmoid(g) · s                  shared_expert_gate_sigmoid, ffn_shexp_gated

The routing arithmetic is :mod:`llamatrace.kernels.ops.moe`. The experts' weights stay
quantized: GGUF stores each as one 3-D tensor ``[n_expert, rows, cols]`` (NumPy order), packed
here one expert at a time (:mod:`llamatrace.kernels.types.packing`, gate|up stacked per expert
as the dense FFN's ``w13``). Only the chosen experts run, and the tokens are grouped by expert,
as ``ggml_mul_mat_id`` does: each chosen expert's matrices are read once per call, for all the
rows that chose it. A decode step (up to ``GEMV_MAX_SEQ`` rows, no per-expert stage watched)
runs all chosen experts' gate|up in one parallel region and all their downs in another
(:mod:`llamatrace.kernels.int8.experts`, ``q8`` mode, Q4_K / Q6_K / MXFP4), with the same numbers.

:class:`MoEOptions` carries what differs between families (gating, normalisation), so that
others (gpt-oss's biases, clamped SwiGLU) are options of the same block.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Callable

import gguf
import numpy as np

from llamatrace.errors import ModelFormatError
from llamatrace.kernels.int8.experts import Experts
from llamatrace.kernels.ops import fp32 as kernels
from llamatrace.kernels.ops import moe as routing
from llamatrace.kernels.types import packing
from llamatrace.kernels.types.registry import GEMV_MAX_SEQ, matmul
from llamatrace.model.config import ModelConfig
from llamatrace.model.deltanet import sigmoid
from llamatrace.tracing.recorder import Emit

EXPERT_TENSORS = ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")
"""The GGUF names (``blk.N.<name>.weight``) of the experts' gate, up and down matrices."""
FUSED_GATE_UP = "ffn_gate_up_exps"
"""The GGUF name of the experts' gate and up stored as one tensor (``[n_expert, 2*expert_hidden_dim, dim]``,
gate rows first), which llama.cpp's loader takes instead of the two."""
SHEXP_TENSORS = ("ffn_gate_shexp", "ffn_up_shexp", "ffn_down_shexp", "ffn_gate_inp_shexp")
"""The GGUF names of the shared expert's gate, up, down and its gate's row (``[dim]``)."""
ROUTER_TENSOR = "ffn_gate_inp"
"""The GGUF name of the router (``blk.N.ffn_gate_inp.weight``, ``[n_expert, dim]``)."""

EXPERT_STAGES = ("ffn_moe_gate", "ffn_moe_up", "ffn_moe_gate_biased", "ffn_moe_up_biased", "ffn_moe_swiglu",
                 "ffn_moe_swiglu_oai", "ffn_moe_down", "ffn_moe_down_biased", "ffn_moe_weighted")
"""The per-expert stages: computed expert by expert, and assembled only when a recorder or hook watches one."""


@dataclass(frozen=True)
class MoEOptions:
    """How a family's MoE block differs (llama.cpp's ``build_moe_ffn`` arguments).

    Attributes:
        n_expert, k: experts per layer, chosen per token.
        gating: ``"softmax"`` or ``"softmax_weight"`` (:func:`llamatrace.kernels.ops.moe.route`).
        norm: divide the chosen weights by their sum (``norm_w``).
        act: ``"silu"`` (SwiGLU) or ``"swiglu_oai"`` (gpt-oss: :func:`llamatrace.kernels.ops.fp32.swiglu_oai`).
    """

    n_expert: int
    k: int
    gating: str = "softmax"
    norm: bool = False
    act: str = "silu"

    @classmethod
    def from_config(cls, c: ModelConfig) -> "MoEOptions":
        return cls(c.n_expert, c.n_expert_used, c.expert_gating, c.expert_weights_norm, c.expert_act)


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
    router_b: np.ndarray | None = None       # ffn_gate_inp.bias float32 [n_expert]          (moe_bias)
    b13: np.ndarray | None = None            # gate|up biases float32 [n_expert, 2*expert_hidden_dim]
    b2: np.ndarray | None = None             # ffn_down_exps.bias float32 [n_expert, dim]
    shexp_w1: packing.Weight | None = None   # ffn_gate_shexp [shexp_hidden_dim, dim]      (shared expert)
    shexp_w3: packing.Weight | None = None   # ffn_up_shexp [shexp_hidden_dim, dim]
    shexp_w2: packing.Weight | None = None   # ffn_down_shexp [dim, shexp_hidden_dim]
    shexp_gate: packing.Weight | None = None  # ffn_gate_inp_shexp [1, dim]

    def matrices(self) -> list[packing.Weight]:
        """Every packed matrix of the layer."""
        shexp = (self.shexp_w1, self.shexp_w3, self.shexp_w2, self.shexp_gate) if self.shexp_w2 is not None else ()
        return [self.router, *self.w2, *(self.w13 or ()), *(self.w1 or ()), *(self.w3 or ()), *shexp]

    def gate_up(self, x: np.ndarray, e: int, bias: bool = True) -> np.ndarray:
        """Expert ``e``'s gate|up product of rows ``x`` [n, dim]: float32 [n, 2*expert_hidden_dim]."""
        if self.w13 is not None:
            y = matmul(x, self.w13[e])
        else:
            y = np.concatenate([matmul(x, self.w1[e]), matmul(x, self.w3[e])], axis=1)
        if bias and self.b13 is not None:
            y += self.b13[e]
        return y

    @cached_property
    def decode_experts(self) -> tuple[Experts, Experts] | None:
        """The gate|up and down experts as :class:`~llamatrace.kernels.int8.experts.Experts`, whose
        chosen ones a decode step runs in one parallel region each; None where their types or
        mode are not served there (or gate and up are stored in different types)."""
        if self.w13 is None:
            return None
        w13, w2 = Experts.of(self.w13), Experts.of(self.w2)
        return (w13, w2) if w13 is not None and w2 is not None else None

    def down(self, h: np.ndarray, e: int, bias: bool = True) -> np.ndarray:
        """Expert ``e``'s down projection of rows ``h`` [n, expert_hidden_dim] (plus its bias): [n, dim]."""
        y = matmul(h, self.w2[e])
        if bias and self.b2 is not None:
            y += self.b2[e]
        return y


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
    fused = f"blk.{layer}.{FUSED_GATE_UP}.weight" in f.tensors
    gate_up = ({FUSED_GATE_UP: (n, 2 * ff, dim)} if fused
               else {"ffn_gate_exps": (n, ff, dim), "ffn_up_exps": (n, ff, dim)})
    want = {ROUTER_TENSOR: (n, dim), **gate_up, "ffn_down_exps": (n, dim, ff)}
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
    down = tensors["ffn_down_exps"]
    router = pack(f"blk.{layer}.{ROUTER_TENSOR}.weight", tensors[ROUTER_TENSOR], n, dim)
    w2 = [pack_rows(f"{down.name}#{e}", [(down, e)], ff) for e in range(n)]
    extra = _biases(f, c, layer) if c.moe_bias else {}
    if c.shexp_hidden_dim:
        extra |= _shared_expert(f, c, layer, pack)
    if fused:
        gu = tensors[FUSED_GATE_UP]
        return MoEWeights(router, w2, w13=[pack_rows(f"{gu.name}#{e}", [(gu, e)], dim) for e in range(n)], **extra)
    gate, up = tensors["ffn_gate_exps"], tensors["ffn_up_exps"]
    if gate.tensor_type == up.tensor_type:
        w13 = [pack_rows(f"{gate.name}+{up.name}#{e}", [(gate, e), (up, e)], dim) for e in range(n)]
        return MoEWeights(router, w2, w13=w13, **extra)
    w1 = [pack_rows(f"{gate.name}#{e}", [(gate, e)], dim) for e in range(n)]
    w3 = [pack_rows(f"{up.name}#{e}", [(up, e)], dim) for e in range(n)]
    return MoEWeights(router, w2, w1=w1, w3=w3, **extra)


def layer_tensors(f, layer: int) -> list:
    """The MoE tensors of ``layer`` the file holds (router, experts, fused gate|up, shared expert)."""
    names = (f"blk.{layer}.{n}.weight" for n in (ROUTER_TENSOR, *EXPERT_TENSORS, FUSED_GATE_UP, *SHEXP_TENSORS))
    return [f.tensor(name) for name in names if name in f.tensors]


def _shared_expert(f, c: ModelConfig, layer: int, pack: Callable) -> dict[str, packing.Weight]:
    """The shared expert of ``layer`` (qwen35moe): ``shexp_w1``, ``shexp_w3``, ``shexp_w2`` and
    ``shexp_gate`` (one row). Raises :class:`ModelFormatError` for a
    missing tensor or one whose shape disagrees with ``embedding_length`` and the shared width."""
    dim, ff = c.dim, c.shexp_hidden_dim
    want = {"ffn_gate_shexp": (ff, dim), "ffn_up_shexp": (ff, dim), "ffn_down_shexp": (dim, ff),
            "ffn_gate_inp_shexp": (dim,)}
    t = {}
    for short, shape in want.items():
        name = f"blk.{layer}.{short}.weight"
        if name not in f.tensors:
            raise ModelFormatError(f"{f.path.name}: tensor {name!r} (the shared expert) is missing; a {c.arch} "
                                   f"mixture of experts needs it — the file is incomplete or not really {c.arch}")
        t[short] = f.tensor(name)
        if int(np.prod(f.matrix_shape(name))) != int(np.prod(shape)) or (
                len(shape) == 2 and f.matrix_shape(name) != shape):
            raise ModelFormatError(f"{f.path.name}: tensor {name!r} has shape {list(f.matrix_shape(name))}, expected "
                                   f"{list(shape)} from embedding_length ({dim}) and the shared expert's width "
                                   f"({ff}, expert_shared_feed_forward_length); the file is inconsistent")
    return {field: pack(f"blk.{layer}.{short}.weight", t[short], *want[short]) if len(want[short]) == 2
            else pack(f"blk.{layer}.{short}.weight", t[short], 1, dim)
            for field, short in zip(("shexp_w1", "shexp_w3", "shexp_w2", "shexp_gate"), SHEXP_TENSORS)}


def _biases(f, c: ModelConfig, layer: int) -> dict[str, np.ndarray]:
    """The router's and experts' biases of ``layer`` (gpt-oss), float32: ``router_b`` [n_expert],
    ``b13`` [n_expert, 2*expert_hidden_dim] (gate's then up's), ``b2`` [n_expert, dim]. Raises
    :class:`ModelFormatError` for a missing bias or one whose shape disagrees with the keys."""
    n, dim, ff = c.n_expert, c.dim, c.expert_hidden_dim
    want = {ROUTER_TENSOR: (n,), "ffn_gate_exps": (n, ff), "ffn_up_exps": (n, ff), "ffn_down_exps": (n, dim)}
    got = {}
    for short, shape in want.items():
        name = f"blk.{layer}.{short}.bias"
        if name not in f.tensors:
            raise ModelFormatError(f"{f.path.name}: tensor {name!r} is missing; a {c.arch} mixture of experts "
                                   f"needs it — the file is incomplete or not really {c.arch}")
        t = f.tensor(name)
        v = np.array(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32)
        if v.size != int(np.prod(shape)):
            raise ModelFormatError(f"{f.path.name}: tensor {name!r} has {v.size} values, expected {list(shape)} "
                                   f"from {c.arch}.expert_count ({n}) and the experts' widths; the file is inconsistent")
        got[short] = v.reshape(shape)
    return dict(router_b=got[ROUTER_TENSOR], b2=got["ffn_down_exps"],
                b13=np.concatenate([got["ffn_gate_exps"], got["ffn_up_exps"]], axis=1))


def _glu(gate_up: np.ndarray, act: str) -> np.ndarray:
    """The gated activation of stacked gate|up rows [n, 2*ff] -> [n, ff]."""
    if act == "swiglu_oai":
        ff = gate_up.shape[1] // 2
        return kernels.swiglu_oai(gate_up[:, :ff], gate_up[:, ff:])
    return kernels.swiglu(gate_up)


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
    if mw.router_b is not None:
        logits = emit("ffn_moe_logits_biased", layer, logits + mw.router_b)
    probs, ids, weights, weights_norm = routing.route(logits, k, opts.gating, opts.norm)
    emit("ffn_moe_probs", layer, probs)
    ids = emit("ffn_moe_topk", layer, ids)
    weights = emit("ffn_moe_weights_softmax" if opts.gating == "softmax_weight" else "ffn_moe_weights",
                   layer, weights)
    if weights_norm is not None:
        weights = emit("ffn_moe_weights_norm", layer, weights_norm)
    flat = np.asarray(ids, dtype=np.int64).reshape(-1)
    if not watched(layer, *EXPERT_STAGES):
        if seq_len <= GEMV_MAX_SEQ and mw.decode_experts is not None:
            down = _decode_experts(x, mw, flat, k, opts.act)
        else:
            down = np.empty((seq_len * k, x.shape[1]), dtype=np.float32)       # row t*k + s: slot s of token t
            for e, pairs in _groups(flat):
                down[pairs] = mw.down(_glu(mw.gate_up(x[pairs // k], e), opts.act), e)
        return _shared(x, mw, emit, layer, emit("ffn_moe_out", layer, routing.combine(down.reshape(seq_len, k, -1),
                                                                                    weights)))
    groups = _groups(flat)
    down = np.empty((seq_len * k, x.shape[1]), dtype=np.float32)
    ff = mw.w2[0].n_in
    gate = np.empty((seq_len * k, ff), dtype=np.float32)
    up = np.empty((seq_len * k, ff), dtype=np.float32)
    for e, pairs in groups:
        gate[pairs], up[pairs] = np.split(mw.gate_up(x[pairs // k], e, bias=False), 2, axis=1)
    gate = emit("ffn_moe_gate", layer, gate.reshape(seq_len, k, ff)).reshape(-1, ff)
    up = emit("ffn_moe_up", layer, up.reshape(seq_len, k, ff)).reshape(-1, ff)
    if mw.b13 is not None:                       # each slot's expert's bias (ggml_add_id), as llama.cpp names them
        gate = emit("ffn_moe_gate_biased", layer, (gate + mw.b13[flat, :ff]).reshape(seq_len, k, ff)).reshape(-1, ff)
        up = emit("ffn_moe_up_biased", layer, (up + mw.b13[flat, ff:]).reshape(seq_len, k, ff)).reshape(-1, ff)
    if opts.act == "swiglu_oai":
        glu = emit("ffn_moe_swiglu_oai", layer, kernels.swiglu_oai(gate, up).reshape(seq_len, k, ff))
    else:
        glu = emit("ffn_moe_swiglu", layer, (kernels.silu(gate) * up).reshape(seq_len, k, ff))
    glu = glu.reshape(-1, ff)
    for e, pairs in groups:
        down[pairs] = mw.down(glu[pairs], e, bias=False)
    down = emit("ffn_moe_down", layer, down.reshape(seq_len, k, -1))
    if mw.b2 is not None:
        down = emit("ffn_moe_down_biased", layer, down + mw.b2[flat].reshape(seq_len, k, -1))
    weighted = emit("ffn_moe_weighted", layer, down * weights[:, :, None])
    out = weighted[:, 0].copy()
    for s in range(1, k):                        # slot by slot, as llama.cpp's chain of adds
        out += weighted[:, s]
    return _shared(x, mw, emit, layer, emit("ffn_moe_out", layer, out))


def _groups(flat: np.ndarray) -> list[tuple[int, np.ndarray]]:
    """The (token, slot) pairs (rows of ``flat``, the ids [seq_len * k]) grouped by expert, as
    ``ggml_mul_mat_id`` groups them: ``[(expert, rows)]``, each expert's rows in one call."""
    order = np.argsort(flat, kind="stable")
    experts, starts = np.unique(flat[order], return_index=True)
    return [(int(e), order[a:b]) for e, a, b in zip(experts, starts, list(starts[1:]) + [len(order)])]


def _decode_experts(x: np.ndarray, mw: MoEWeights, flat: np.ndarray, k: int, act: str) -> np.ndarray:
    """The chosen experts' ``ffn_moe_down`` (biased) of a few rows ``x`` [seq_len, dim], slot by
    slot (``flat`` the ids [seq_len * k], row ``t*k + s``): each kind's matrices in one parallel
    region (:class:`~llamatrace.kernels.int8.experts.Experts`), the same numbers as expert by
    expert. float32 [seq_len * k, dim]."""
    w13, w2 = mw.decode_experts
    gate_up = w13.matmul(x if x.shape[0] == 1 else np.repeat(x, k, axis=0), flat)
    if mw.b13 is not None:
        gate_up += mw.b13[flat]
    down = w2.matmul(_glu(gate_up, act), flat)
    if mw.b2 is not None:
        down += mw.b2[flat]
    return down


def _shared(x: np.ndarray, mw: MoEWeights, emit: Emit, layer: int, moe_out: np.ndarray) -> np.ndarray:
    """``moe_out`` plus the gated shared expert of rows ``x`` (qwen35moe's ``build_layer_ffn``), or
    ``moe_out`` itself without one: float32 ``[seq_len, dim]``."""
    if mw.shexp_w2 is None:
        return moe_out
    h = kernels.silu(matmul(x, mw.shexp_w1)) * matmul(x, mw.shexp_w3)
    shexp = emit("ffn_shexp", layer, matmul(h, mw.shexp_w2))
    gate = emit("shared_expert_gate", layer, matmul(x, mw.shexp_gate))
    gate = emit("shared_expert_gate_sigmoid", layer, sigmoid(gate))
    return moe_out + emit("ffn_shexp_gated", layer, shexp * gate)


def expert_rows(mw: MoEWeights, x: np.ndarray, ids: np.ndarray, part: str) -> np.ndarray:
    """One per-expert stage recomputed from its recorded inputs, for :mod:`llamatrace.analysis.local_error`.

    Args:
        x: float32 ``[seq_len, dim]`` (``ffn_norm``, for ``part`` ``"gate"`` / ``"up"``) or
            ``[seq_len, k, expert_hidden_dim]`` (``ffn_moe_swiglu``, for ``"down"``; or its rows
            flattened to ``[seq_len, k·expert_hidden_dim]``, as a corpus run records them).
        ids: int ``[seq_len, k]``, the chosen experts (``ffn_moe_topk``).

    Returns:
        float32 ``[seq_len, k, n_out]``: slot ``s`` of token ``t`` through expert ``ids[t, s]``,
        without the experts' biases (gpt-oss's ``ffn_moe_*_biased`` stages add them).
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
            out[sel] = np.split(mw.gate_up(rows[sel], int(e), bias=False), 2, axis=1)[0 if part == "gate" else 1]
    return out.reshape(seq_len, k, n_out)
