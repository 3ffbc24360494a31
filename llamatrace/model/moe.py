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
quantized: GGUF stores each kind as one 3-D tensor ``[n_expert, rows, cols]`` (NumPy order). Those
of a type the activation mode's ``mul_mat_id`` kernels run (:func:`llamatrace.kernels.mul_mat_id.supported`)
stay in the file, a read-only map of it of their own (:class:`~llamatrace.kernels.mul_mat_id.FileExperts`:
never packed, copied or written to the packed-weights cache); the others are packed one expert at a
time (:mod:`llamatrace.kernels.types.packing`, gate|up stacked per expert as the dense FFN's ``w13``).
Only the chosen experts run, with the slots grouped by expert, as ``ggml_mul_mat_id`` does: each
chosen expert's matrices are read once per call, for all the rows that chose it. A layer makes
two calls, decode and prefill alike and whether a stage is watched or not: every slot's gate|up
(:func:`~llamatrace.kernels.mul_mat_id.mul_mat_id`, one parallel region; packed experts: expert by
expert through :func:`~llamatrace.kernels.types.registry.matmul`), then every slot's down.

:class:`MoEOptions` carries what differs between families (gating, normalisation), so that
others (gpt-oss's biases, clamped SwiGLU) are options of the same block.
"""

from __future__ import annotations

import mmap
from dataclasses import dataclass, field
from typing import Callable

import gguf
import numpy as np

from llamatrace.errors import ModelFormatError, UnsupportedModelError
from llamatrace.kernels import mul_mat_id as mmid
from llamatrace.kernels.mul_mat_id import FileExperts
from llamatrace.kernels.ops import fp32 as kernels
from llamatrace.kernels.ops import moe as routing
from llamatrace.kernels.types import packing
from llamatrace.kernels.types.registry import matmul
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


Experts = list[packing.Weight] | FileExperts
"""One kind of a layer's experts: packed, one Weight per expert, or left in the file."""


@dataclass
class MoEWeights:
    """One layer's router and experts, matrices ``[out_features, in_features]``.

    Each kind of expert is :data:`Experts`: a :class:`~llamatrace.kernels.mul_mat_id.FileExperts`
    (the file's blocks, for a type ``activations``' ``mul_mat_id`` kernels run) or a list of one
    packed Weight per expert. ``w13`` holds gate and up together: the file's fused tensor, or
    packed, expert ``e``'s gate and up rows stacked (one kernel call for both); otherwise (``w13``
    ``None``) ``w1`` / ``w3`` hold them apart.
    """

    router: packing.Weight                   # ffn_gate_inp [n_expert, dim]
    w2: Experts                              # ffn_down_exps, per expert [dim, expert_hidden_dim]
    w13: Experts | None = None               # per expert [2*expert_hidden_dim, dim]
    w1: Experts | None = None                # ffn_gate_exps, per expert [expert_hidden_dim, dim]
    w3: Experts | None = None                # ffn_up_exps, per expert [expert_hidden_dim, dim]
    router_b: np.ndarray | None = None       # ffn_gate_inp.bias float32 [n_expert]          (moe_bias)
    b13: np.ndarray | None = None            # gate|up biases float32 [n_expert, 2*expert_hidden_dim]
    b2: np.ndarray | None = None             # ffn_down_exps.bias float32 [n_expert, dim]
    shexp_w1: packing.Weight | None = None   # ffn_gate_shexp [shexp_hidden_dim, dim]      (shared expert)
    shexp_w3: packing.Weight | None = None   # ffn_up_shexp [shexp_hidden_dim, dim]
    shexp_w2: packing.Weight | None = None   # ffn_down_shexp [dim, shexp_hidden_dim]
    shexp_gate: packing.Weight | None = None  # ffn_gate_inp_shexp [1, dim]
    activations: str = "f32"                 # the mode FileExperts run in (mul_mat_id's activations)
    _in_file: dict = field(default_factory=dict, init=False, repr=False, compare=False)  # site -> (kinds, ExpertParts)

    def _kinds(self) -> list[Experts]:
        return [k for k in (self.w2, self.w13, self.w1, self.w3) if k is not None]

    def matrices(self) -> list[packing.Weight]:
        """Every packed matrix of the layer (not the experts left in the file: :meth:`file_experts`)."""
        shexp = (self.shexp_w1, self.shexp_w3, self.shexp_w2, self.shexp_gate) if self.shexp_w2 is not None else ()
        packed = [w for k in self._kinds() if not isinstance(k, FileExperts) for w in k]
        return [self.router, *packed, *shexp]

    def file_experts(self) -> list[FileExperts]:
        """The kinds of experts run on the file's blocks (:func:`~llamatrace.kernels.mul_mat_id.mul_mat_id`)."""
        return [k for k in self._kinds() if isinstance(k, FileExperts)]

    @property
    def expert_hidden_dim(self) -> int:
        return int(self.w2.n_in if isinstance(self.w2, FileExperts) else self.w2[0].n_in)

    def gate_up(self, x: np.ndarray, ids: np.ndarray, rows: np.ndarray | None = None) -> np.ndarray:
        """Each slot's gate|up product, without biases: slot ``i`` is row ``rows[i]`` of ``x``
        (float32 ``[n_rows, dim]``; ``rows`` None: row ``i``) through expert ``ids[i]``. float32
        ``[n_slots, 2*expert_hidden_dim]``, gate's columns first."""
        return self._slots("gate_up", (self.w13,) if self.w13 is not None else (self.w1, self.w3), x, ids, rows)

    def down(self, h: np.ndarray, ids: np.ndarray) -> np.ndarray:
        """Each slot's down projection, without bias: row ``i`` of ``h`` (float32 ``[n_slots,
        expert_hidden_dim]``) through expert ``ids[i]``. float32 ``[n_slots, dim]``."""
        return self._slots("down", (self.w2,), h, ids, None)

    def _slots(self, site: str, kinds: tuple[Experts, ...], x: np.ndarray, ids: np.ndarray,
               rows: np.ndarray | None) -> np.ndarray:
        """``x[rows[i]]`` through expert ``ids[i]`` of each kind, the kinds' outputs side by side:
        one :func:`~llamatrace.kernels.mul_mat_id.mul_mat_id` call when they are all in the file in
        one type (an :class:`~llamatrace.kernels.mul_mat_id.ExpertParts` checked once, kept per call
        ``site`` while its kinds stay the same objects: the recipe search reassigns them candidate
        after candidate, and each replaces the last), else kind by kind (packed ones expert by
        expert, as ``ggml_mul_mat_id`` groups the rows)."""
        if all(isinstance(k, FileExperts) for k in kinds):
            kept = self._in_file.get(site)
            if kept is None or kept[0] != kinds:          # FileExperts compare by identity
                one_type = len({k.ggml_type for k in kinds}) == 1
                kept = self._in_file[site] = (kinds, mmid.ExpertParts(kinds, self.activations) if one_type else None)
            if kept[1] is not None:
                return kept[1](x, ids, rows)
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        if len(kinds) > 1:
            return np.concatenate([self._slots(f"{site}.{i}", (k,), x, ids, rows) for i, k in enumerate(kinds)],
                                  axis=1)
        w = kinds[0]
        rows = np.arange(ids.shape[0]) if rows is None else np.asarray(rows, dtype=np.int64)
        out = np.empty((ids.shape[0], w[0].n_out), dtype=np.float32)
        order, starts, experts = mmid.groups(ids)
        for g, e in enumerate(experts):
            sel = order[starts[g]:starts[g + 1]]
            out[sel] = matmul(np.ascontiguousarray(x[rows[sel]]), w[e])
        return out


def file_experts(t, data: np.ndarray, n_out: int, n_in: int) -> FileExperts:
    """The 3-D expert tensor ``t`` (a :class:`llamatrace.gguf.reader.Tensor`) as :class:`FileExperts`
    over ``data``, uint8 holding its bytes (a read-only map of the file, never the GGUFFile's own)."""
    return FileExperts(t.name, gguf.GGMLQuantizationType(t.tensor_type), n_out, n_in,
                       experts_bytes(data, int(t.shape[2]), n_out, n_in, t.tensor_type))


def experts_bytes(data: np.ndarray, n_expert: int, n_out: int, n_in: int, ggml_type) -> np.ndarray:
    """uint8 ``data`` (an expert tensor's GGUF blocks, any shape, C-contiguous) as ``[n_expert,
    n_out, row_bytes]``, a read-only view."""
    block, type_size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(ggml_type)]
    view = np.asarray(data).view(np.uint8).reshape(n_expert, n_out, n_in // block * type_size)
    view.flags.writeable = False
    return view


class InFile:
    """The expert tensors of the GGUF at ``path`` that ``activations``' ``mul_mat_id`` kernels run,
    left in the file: :class:`FileExperts` over one read-only map of the whole file of their own
    (not the GGUFFile's, which :meth:`llamatrace.model.llama.Llama.close` unmaps), opened at the
    first such tensor. Its pages are the page cache's: mapped on first touch, counted in the
    process's resident memory once touched, never copied. Not populated at load
    (``MADV_POPULATE_READ``, as the packed-weights cache's entries are): with the file in the page
    cache, faulting every expert page in costs the same either way (~0.1 s per GB, the kernel
    maps 16 pages a fault), so a load leaves it to the first prefill, and a short run maps only
    the experts its tokens choose."""

    def __init__(self, path, activations: str) -> None:
        self.path, self.activations = path, activations
        self._bytes: np.ndarray | None = None

    def holds(self, t) -> bool:
        """Whether the tensor ``t`` stays in the file (an expert tensor of a type the kernels run)."""
        parts = t.name.split(".")
        return (len(parts) == 4 and parts[0] == "blk" and parts[2] in (*EXPERT_TENSORS, FUSED_GATE_UP)
                and parts[3] == "weight" and mmid.supported(t.tensor_type, self.activations))

    def __call__(self, t, n_out: int, n_in: int) -> FileExperts | None:
        """The 3-D expert tensor ``t`` (``[n_expert, n_out, n_in]``) as :class:`FileExperts`, or None
        when it does not stay in the file (:meth:`holds`)."""
        if not self.holds(t):
            return None
        if self._bytes is None:
            with open(self.path, "rb") as fh:
                self._bytes = np.frombuffer(mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ), dtype=np.uint8)
        return file_experts(t, self._bytes[t.offset:t.offset + t.n_bytes], n_out, n_in)


def load(f, c: ModelConfig, layer: int, pack: Callable, pack_rows: Callable,
         in_file: Callable | None = None, activations: str = "f32") -> MoEWeights:
    """Layer ``layer``'s router and experts from the open GGUF file ``f``.

    ``pack(name, tensor, n_out, n_in)`` packs a 2-D tensor, ``pack_rows(name, [(tensor, row
    slice), …], n_in)`` stacks the given row blocks of 2-D views into one Weight (the model
    loader's helpers: the packed-weights cache and the load's progress live there);
    ``in_file(tensor, n_out, n_in)`` gives an expert tensor as :class:`FileExperts` when
    ``activations``' ``mul_mat_id`` kernels run its type, else None (then it is packed).

    Raises:
        ModelFormatError: the router or an expert tensor is missing, or its shape disagrees with
            ``{arch}.expert_count``, ``embedding_length`` and the experts' hidden width.
        UnsupportedModelError: the experts are stored one 2-D tensor each (``blk.N.ffn_gate.E.weight``).
    """
    in_file = in_file or (lambda t, n_out, n_in: None)
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
            one = f"blk.{layer}.{short.removesuffix('_exps')}.0.weight"
            if short != ROUTER_TENSOR and one in f.tensors:   # 2023's Mixtral files: llama.cpp dropped them too
                raise UnsupportedModelError(
                    f"{f.path.name}: the experts are stored one tensor each ({one!r} …), the layout of "
                    f"early (2023 – early 2024) Mixtral GGUF files, which llama.cpp no longer loads either; "
                    f"re-convert the model with a current convert_hf_to_gguf.py, or download a newer GGUF of it")
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
    w2 = in_file(down, dim, ff) or [pack_rows(f"{down.name}#{e}", [(down, e)], ff) for e in range(n)]
    extra = _biases(f, c, layer) if c.moe_bias else {}
    if c.shexp_hidden_dim:
        extra |= _shared_expert(f, c, layer, pack)
    extra["activations"] = activations
    if fused:
        gu = tensors[FUSED_GATE_UP]
        w13 = in_file(gu, 2 * ff, dim) or [pack_rows(f"{gu.name}#{e}", [(gu, e)], dim) for e in range(n)]
        return MoEWeights(router, w2, w13=w13, **extra)
    gate, up = tensors["ffn_gate_exps"], tensors["ffn_up_exps"]
    w1, w3 = in_file(gate, ff, dim), in_file(up, ff, dim)
    if w1 is None and w3 is None and gate.tensor_type == up.tensor_type:
        w13 = [pack_rows(f"{gate.name}+{up.name}#{e}", [(gate, e), (up, e)], dim) for e in range(n)]
        return MoEWeights(router, w2, w13=w13, **extra)
    w1 = w1 or [pack_rows(f"{gate.name}#{e}", [(gate, e)], dim) for e in range(n)]
    w3 = w3 or [pack_rows(f"{up.name}#{e}", [(up, e)], dim) for e in range(n)]
    return MoEWeights(router, w2, w1=w1, w3=w3, **extra)


def describe_experts(tensors) -> str | None:
    """One line saying how the expert tensors among ``tensors`` (the file's
    :class:`llamatrace.gguf.reader.Tensor` values) run, per type: on the file's own blocks
    (``mul_mat_id``, in the activation modes that have kernels for it) or packed expert by
    expert; None without experts (``llamatrace info``)."""
    kinds = (*EXPERT_TENSORS, FUSED_GATE_UP)
    found = {}
    for t in tensors:
        parts = t.name.split(".")
        if len(parts) == 4 and parts[2] in kinds and parts[3] == "weight":
            found[t.tensor_type.name] = found.get(t.tensor_type.name, 0) + int(t.n_bytes)
    if not found:
        return None
    said = []
    for name in sorted(found, key=found.get, reverse=True):
        on = [m for m in mmid.TYPES if mmid.supported(gguf.GGMLQuantizationType[name], m)]
        off = [m for m in mmid.TYPES if m not in on]
        said.append(f"{name}: " + ", ".join(([f"mul_mat_id on the file's blocks ({', '.join(on)})"] if on else [])
                                            + ([f"packed per expert ({', '.join(off)})"] if off else [])))
    return "experts: " + "; ".join(said)


def layer_tensors(f, layer: int) -> list:
    """The MoE tensors of ``layer`` the file holds (router, experts, fused gate|up, shared expert), for
    the load's accounting: not a read (:attr:`GGUFFile.read`), which only :func:`load`'s are."""
    names = (f"blk.{layer}.{n}.weight" for n in (ROUTER_TENSOR, *EXPERT_TENSORS, FUSED_GATE_UP, *SHEXP_TENSORS))
    return [f.tensors[name] for name in names if name in f.tensors]


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


def moe_ffn(x: np.ndarray, mw: MoEWeights, opts: MoEOptions, emit: Emit, layer: int,
            watched: Callable[..., bool]) -> np.ndarray:
    """The MoE FFN of rows ``x`` (float32 ``[seq_len, dim]``, the ``ffn_norm`` output); returns
    ``ffn_moe_out`` float32 ``[seq_len, dim]``.

    Every stage goes through ``emit(stage, layer, array)`` (which may replace it, as hooks do).
    The per-expert stages (:data:`EXPERT_STAGES`) are assembled as ``[seq_len, k, …]`` arrays
    only when ``watched(layer, *stages)`` says a recorder or hook reads one, from the same two
    calls (every slot's gate|up, then every slot's down: :meth:`MoEWeights.gate_up`,
    :meth:`MoEWeights.down`), so with the same numbers.
    """
    seq_len = x.shape[0]
    k = opts.k
    # router: one logit per expert, then the choice of k and their weights
    logits = emit("ffn_moe_logits", layer, matmul(x, mw.router))
    if mw.router_b is not None:
        logits = emit("ffn_moe_logits_biased", layer, logits + mw.router_b)
    probs, ids, weights, weights_norm = routing.route(logits, k, opts.gating, opts.norm)
    # a stage a hook replaces (--ablate, a lens hook) is what every later one is made of
    hooked = emit("ffn_moe_probs", layer, probs)
    if hooked is not probs:
        probs = hooked
        ids, weights, weights_norm = routing.choose_ref(probs, k, opts.gating, opts.norm)
    hooked = emit("ffn_moe_topk", layer, ids)
    if hooked is not ids:                        # other experts: their weights from probs, as get_rows takes them
        ids, weights, weights_norm = routing.choose_ref(probs, k, opts.gating, opts.norm, ids=hooked)
    hooked = emit("ffn_moe_weights_softmax" if opts.gating == "softmax_weight" else "ffn_moe_weights", layer, weights)
    if hooked is not weights:
        weights = hooked
        weights_norm = routing.normalise_ref(weights) if opts.norm else None
    if weights_norm is not None:
        weights = emit("ffn_moe_weights_norm", layer, weights_norm)
    flat = np.asarray(ids, dtype=np.int64).reshape(-1)          # slot t*k + s: slot s of token t
    gate_up = mw.gate_up(x, flat, np.arange(seq_len, dtype=np.int64).repeat(k))
    if not watched(layer, *EXPERT_STAGES):      # biases, activation and weighted sum fused, the same numbers
        down = mw.down(routing.expert_glu(gate_up, opts.act, mw.b13, flat), flat)
        out = routing.combine(down.reshape(seq_len, k, -1), weights, mw.b2, flat)
        return _shared(x, mw, emit, layer, emit("ffn_moe_out", layer, out))
    ff = gate_up.shape[1] // 2
    gate, up = (np.ascontiguousarray(a).reshape(seq_len, k, ff) for a in (gate_up[:, :ff], gate_up[:, ff:]))
    gate = emit("ffn_moe_gate", layer, gate).reshape(-1, ff)
    up = emit("ffn_moe_up", layer, up).reshape(-1, ff)
    if mw.b13 is not None:                       # each slot's expert's bias (ggml_add_id), as llama.cpp names them
        gate = emit("ffn_moe_gate_biased", layer, (gate + mw.b13[flat, :ff]).reshape(seq_len, k, ff)).reshape(-1, ff)
        up = emit("ffn_moe_up_biased", layer, (up + mw.b13[flat, ff:]).reshape(seq_len, k, ff)).reshape(-1, ff)
    if opts.act == "swiglu_oai":
        glu = emit("ffn_moe_swiglu_oai", layer, kernels.swiglu_oai(gate, up).reshape(seq_len, k, ff))
    else:
        glu = emit("ffn_moe_swiglu", layer, (kernels.silu(gate) * up).reshape(seq_len, k, ff))
    down = emit("ffn_moe_down", layer, mw.down(np.ascontiguousarray(glu.reshape(-1, ff)), flat).reshape(seq_len, k, -1))
    if mw.b2 is not None:
        down = emit("ffn_moe_down_biased", layer, down + mw.b2[flat].reshape(seq_len, k, -1))
    weighted = emit("ffn_moe_weighted", layer, down * weights[:, :, None])
    out = weighted[:, 0].copy()
    for s in range(1, k):                        # slot by slot, as llama.cpp's chain of adds
        out += weighted[:, s]
    return _shared(x, mw, emit, layer, emit("ffn_moe_out", layer, out))


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
    x = np.ascontiguousarray(x, dtype=np.float32)
    if part == "down":
        out = mw.down(x.reshape(seq_len * k, -1), flat)
    else:
        ff = mw.expert_hidden_dim
        gate_up = mw.gate_up(x, flat, np.arange(seq_len, dtype=np.int64).repeat(k))
        out = gate_up[:, :ff] if part == "gate" else gate_up[:, ff:]
    return np.ascontiguousarray(out).reshape(seq_len, k, -1)
