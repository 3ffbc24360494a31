"""Which ggml type each tensor gets in a llama.cpp file type (``Q4_K_M`` …), as ``llama-quantize`` chooses.

Read from llama.cpp's ``src/llama-quant.cpp`` (llama-cpp-python 0.3.36's vendored copy):
``llama_tensor_get_type`` and ``llama_tensor_get_type_impl``, restricted to the file types of
:data:`FILE_TYPES` and the tensors of the Llama family, its mixtures of experts (the 3-D
``ffn_{gate,up,down}_exps`` take their category's rules, their layer read from the name; the routers
``ffn_gate_inp`` stay) and Qwen3.5's DeltaNet layers (``attn_qkv`` counts as an ``attn_v``, the
``ssm_conv1d`` and norms stay). For each tensor, in llama.cpp's order
(:func:`llama_order`: tensors outside the blocks first, then block by block, by name within each):

1. a tensor llama.cpp never quantizes (fewer than 2 dimensions, a name not ending in ``weight``,
   the norms …: :func:`allows_quantization`; ``output.weight`` with ``--leave-output-tensor``) keeps its type;
2. ``--token-embedding-type`` decides the token embedding, and ``--output-tensor-type`` the output
   matrix, before anything else and without a fallback (a type whose blocks do not divide the rows
   is an error here; llama.cpp aborts);
3. a file type whose default type is a float (F32, F16, BF16) gives every other tensor that type;
4. else the first ``--tensor-type PATTERN=TYPE`` whose regular expression is found in the name
   decides (:class:`Override`; the pattern is lower-cased, as ``llama-quantize`` does), and
   otherwise the file type's mix (:func:`_mix`) unless ``pure``: the output matrix (and the
   token embedding when tied to it) ``--output-tensor-type`` if given, else Q6_K, or Q8_0 when its rows do not fill the default type's
   blocks; more bits for ``attn_v`` and ``ffn_down`` in the layers :func:`use_more_bits` picks
   (the first and last eighth and every third between), counted in order of appearance
   (``attn_v``) or by layer (``ffn_down``); Q5_K for ``attn_v`` of a Llama 70B …;
   ``MXFP4_MOE`` (gpt-oss's) gives every expert tensor (``ne[2]`` > 1) MXFP4 and every other
   quantizable tensor, the output included, Q8_0;
5. a type whose block does not divide the rows falls back (``tensor_type_fallback``): Q2_K and
   Q3_K to Q4_0, Q4_K to Q5_0, Q5_K to Q5_1, Q6_K to Q8_0, and F16 when even that does not fit.

Shapes here are ggml's (``ne[0]`` = the row length), as in llama.cpp.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Sequence

import gguf

from llamatrace.errors import OptionError

T = gguf.GGMLQuantizationType


@dataclass(frozen=True)
class FileType:
    """A llama.cpp file type: its ``general.file_type`` value (``llama_ftype``) and default tensor type."""

    name: str
    ftype: int
    default: T


FILE_TYPES: dict[str, FileType] = {ft.name: ft for ft in (
    FileType("F32", 0, T.F32), FileType("F16", 1, T.F16), FileType("BF16", 32, T.BF16),
    FileType("Q4_0", 2, T.Q4_0), FileType("Q4_1", 3, T.Q4_1), FileType("Q5_0", 8, T.Q5_0),
    FileType("Q5_1", 9, T.Q5_1), FileType("Q8_0", 7, T.Q8_0), FileType("Q2_K", 10, T.Q2_K),
    FileType("Q2_K_S", 21, T.Q2_K), FileType("Q3_K_S", 11, T.Q3_K), FileType("Q3_K_M", 12, T.Q3_K), FileType("Q3_K_L", 13, T.Q3_K),
    FileType("Q4_K_S", 14, T.Q4_K), FileType("Q4_K_M", 15, T.Q4_K), FileType("Q5_K_S", 16, T.Q5_K),
    FileType("Q5_K_M", 17, T.Q5_K), FileType("Q6_K", 18, T.Q6_K), FileType("MXFP4_MOE", 38, T.MXFP4),
)}
"""The file types ``llamatrace quantize --type`` writes, by ``llama-quantize``'s name. The others
of llama.cpp 0.3.36 need ggml types llamatrace cannot quantize: IQ1_S/M, IQ2_XXS/XS/S/M, IQ3_XXS/XS/S/M,
IQ4_NL/XS (the i-quants), TQ1_0/TQ2_0, Q1_0, Q2_0, NVFP4."""

ALIASES = {"Q3_K": "Q3_K_M", "Q4_K": "Q4_K_M", "Q5_K": "Q5_K_M"}
"""``llama-quantize``'s short names."""

TENSOR_TYPES = (T.F32, T.F16, T.BF16, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0,
                T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K, T.MXFP4)
"""The ggml types a ``--tensor-type`` override may name (those llamatrace can write)."""

# tensor_type_fallback: a 256-block type on rows that are not a multiple of 256
_FALLBACK = {T.Q2_K: T.Q4_0, T.Q3_K: T.Q4_0, T.Q4_K: T.Q5_0, T.Q5_K: T.Q5_1, T.Q6_K: T.Q8_0}

# tensor_allows_quantization: names (or parts of names) llama.cpp keeps as they are
_KEEP_PARTS = ("_norm.weight", "ffn_gate_inp.weight", "ffn_gate_tid2eid.weight", "altup", "laurel",
               "per_layer_model_proj", "ssm_conv1d", "shortconv.conv.weight", "indexer.k_proj.weight",
               "indexer.q_proj.weight", "attn_rel_b.weight", ".position_embd", ".rel_pos", ".patch_embd",
               ".patch_merger") + tuple(f"time_mix_{p}.weight" for p in (
                   "first", "w0", "w1", "w2", "v0", "v1", "v2", "a0", "a1", "a2", "g1", "g2",
                   "decay_w1", "decay_w2", "lerp_fused"))
_KEEP_NAMES = ("position_embd.weight", "token_types.weight")

# tensor_get_category, in its order of tests (substrings of the name)
_CATEGORIES = (("attn_qkv.weight", "attn_v"), ("attn_kv_b.weight", "attn_v"), ("attn_v.weight", "attn_v"),
               ("attn_k.weight", "attn_k"), ("attn_q.weight", "attn_q"), ("attn_output.weight", "attn_output"),
               ("ffn_up", "ffn_up"), ("ffn_gate", "ffn_gate"), ("ffn_down", "ffn_down"))


def file_type(name: str) -> FileType:
    """The file type called ``name`` (any case; ``Q4_K`` is ``Q4_K_M``, and ``15`` is the file type
    numbered 15, as in llama-quantize).

    Raises:
        OptionError: an unknown or unsupported name.
    """
    key = ALIASES.get(name.upper(), name.upper())
    if key.isdecimal():
        key = next((ft.name for ft in FILE_TYPES.values() if ft.ftype == int(key)), key)
    if key not in FILE_TYPES:
        raise OptionError(f"--type {name!r} is not a file type llamatrace writes; choose one of "
                          f"{', '.join(FILE_TYPES)} (or {', '.join(ALIASES)})")
    return FILE_TYPES[key]


@dataclass(frozen=True)
class Override:
    """One ``--tensor-type PATTERN=TYPE``: tensors whose name contains a match of the regular
    expression ``pattern`` (``re.search``) get ``ggml_type``."""

    pattern: str
    ggml_type: T

    @classmethod
    def parse(cls, text: str) -> "Override":
        """``"attn_v=q6_k"`` → Override; the pattern lower-cased, the type any case (llama-quantize's
        ``parse_tensor_type``).

        Raises:
            OptionError: no ``=``, an empty pattern or type, a bad regular expression, or a type
                llamatrace cannot write.
        """
        return cls._parse(text, f"--tensor-type {text!r}")

    @classmethod
    def _parse(cls, text: str, where: str) -> "Override":
        pattern, sep, type_name = text.partition("=")
        if not sep or not pattern or not type_name:
            raise OptionError(f"{where}: write PATTERN=TYPE, e.g. attn_v=q6_k or 'blk\\.[0-3]\\.ffn_down=q5_k'")
        pattern = pattern.lower()
        try:
            re.compile(pattern)
        except re.error as exc:
            raise OptionError(f"{where}: {pattern!r} is not a regular expression ({exc})") from None
        return cls(pattern, ggml_type(type_name, where))

    def matches(self, name: str) -> bool:
        return re.search(self.pattern, name) is not None


def ggml_type(name: str, where: str) -> T:
    """The ggml type called ``name`` (any case: ``q6_k``), one llamatrace writes (:data:`TENSOR_TYPES`).

    Raises:
        OptionError: another name; the message starts with ``where`` (the option and its value).
    """
    t = getattr(T, name.upper(), None)
    if t not in TENSOR_TYPES:
        raise OptionError(f"{where}: {name!r} is not a type llamatrace writes; choose one of "
                          f"{', '.join(t.name.lower() for t in TENSOR_TYPES)}")
    return t


def read_tensor_type_file(path: str | Path) -> list[Override]:
    """The overrides of llama-quantize's ``--tensor-type-file``: ``PATTERN=TYPE`` entries separated by
    spaces or newlines, in order.

    Raises:
        OptionError: the file cannot be read, or an entry is not a valid override (its line is named).
    """
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise OptionError(f"--tensor-type-file {str(path)!r}: cannot read it ({reason})") from None
    return [Override._parse(entry, f"--tensor-type-file {str(path)!r} line {n}: {entry!r}")
            for n, line in enumerate(text.splitlines(), 1) for entry in line.split()]


def use_more_bits(i_layer: int, n_layers: int) -> bool:
    """llama.cpp's choice of the layers that get more bits: the first and last eighth, and every
    third layer between."""
    return i_layer < n_layers // 8 or i_layer >= 7 * n_layers // 8 or (i_layer - n_layers // 8) % 3 == 2


def llama_order(names: Iterable[str]) -> list[str]:
    """Tensor names in the order llama.cpp's model loader keeps (and ``llama-quantize`` writes)
    them: tensors outside the blocks first, then by block number, by name within each."""
    def key(name: str) -> tuple[int, str]:
        m = re.match(r"blk\.(\d+)\.", name)
        return (int(m.group(1)) if m else -1, name)
    return sorted(names, key=key)


def n_dims(shape: Sequence[int]) -> int:
    """``ggml_n_dims``: the dimensions up to the last that is not 1 (at least 1)."""
    dims = [int(d) for d in shape]
    while len(dims) > 1 and dims[-1] == 1:
        dims.pop()
    return len(dims)


def allows_quantization(name: str, shape: Sequence[int]) -> bool:
    """Whether llama.cpp may change this tensor's type (``tensor_allows_quantization``): 2 or more
    dimensions, a name ending in ``weight``, and not a norm or one of the small tensors it keeps."""
    return (n_dims(shape) >= 2 and name.endswith("weight") and name not in _KEEP_NAMES
            and not any(part in name for part in _KEEP_PARTS))


def category(name: str) -> str:
    """llama.cpp's tensor category: ``output``, ``token_embd``, ``attn_v`` (also ``attn_qkv`` and
    ``attn_kv_b``), ``attn_k``, ``attn_q``, ``attn_output``, ``ffn_up``, ``ffn_gate``, ``ffn_down``
    or ``other``."""
    if name == "output.weight":
        return "output"
    if name in ("token_embd.weight", "per_layer_token_embd.weight"):
        return "token_embd"
    return next((cat for part, cat in _CATEGORIES if part in name), "other")


def fallback(ggml_type: T, n_per_row: int) -> T:
    """``tensor_type_fallback``: the type written for ``ggml_type`` on rows of ``n_per_row``."""
    block = gguf.GGML_QUANT_SIZES[ggml_type][0]
    if n_per_row % block == 0:
        return ggml_type
    ggml_type = _FALLBACK.get(ggml_type, ggml_type)
    return ggml_type if n_per_row % gguf.GGML_QUANT_SIZES[ggml_type][0] == 0 else T.F16


@dataclass(frozen=True)
class ModelShape:
    """What the rules read of a model's hyper-parameters (llama.cpp's ``hparams`` and model type).

    Attributes:
        arch: ``general.architecture``.
        n_layers: ``{arch}.block_count``.
        n_gqa: query heads per key/value head in layer 0 (0 when it has no key/value heads).
        n_expert: ``{arch}.expert_count`` (0 without experts).
        is_70b: llama.cpp's ``LLM_TYPE_70B`` (a Llama with 80 layers and GQA, a Qwen2 with 80).
    """

    arch: str
    n_layers: int
    n_gqa: int
    n_expert: int = 0
    is_70b: bool = False

    @classmethod
    def from_metadata(cls, meta: Mapping[str, Any]) -> "ModelShape":
        """From a GGUF's metadata (key → value).

        Raises:
            OptionError: no ``general.architecture`` or ``{arch}.block_count``.
        """
        arch = meta.get("general.architecture")
        n_layers = meta.get(f"{arch}.block_count")
        if not isinstance(arch, str) or not isinstance(n_layers, int):
            raise OptionError("the base model has no general.architecture or block_count: not a model llama.cpp "
                              "can quantize")

        def first(key: str, default: int) -> int:
            value = meta.get(f"{arch}.{key}", default)
            return int(value[0] if isinstance(value, list) else value)

        n_head = first("attention.head_count", 0)
        n_head_kv = first("attention.head_count_kv", n_head)
        n_expert = first("expert_count", 0)
        is_70b = n_layers == 80 and ((arch == "llama" and n_expert != 8 and n_head != n_head_kv) or arch == "qwen2")
        return cls(arch, n_layers, n_head // n_head_kv if n_head_kv else 0, n_expert, is_70b)


@dataclass
class _Counters:
    """``quantize_state_impl``'s running counts."""

    n_attention_wv: int
    i_attention_wv: int = 0
    i_ffn_down: int = 0


def _layer(name: str, counter: int, model: ModelShape) -> int:
    """``layer_info``: the layer of an FFN tensor (its order of appearance, or its name with experts)."""
    if model.n_expert > 1:
        m = re.match(r"blk\.(\d+)\.", name)
        if m is None or not 0 <= int(m.group(1)) < model.n_layers:
            raise OptionError(f"cannot tell the layer of tensor {name!r}")
        return int(m.group(1))
    return counter


def _mix(t: T, name: str, shape: Sequence[int], ft: str, cat: str, model: ModelShape, tied: bool,
         has_imatrix: bool, c: _Counters, output_type: T | None) -> T:
    """``llama_tensor_get_type_impl`` for the file types of :data:`FILE_TYPES` (``shape``: ggml's)."""
    falcon = model.arch == "falcon"
    n = model.n_layers
    ne0 = int(shape[0])
    if cat == "output" or (tied and cat == "token_embd"):
        if output_type is not None:
            return output_type
        if ft == "MXFP4_MOE" or falcon or ne0 % gguf.GGML_QUANT_SIZES[t][0] != 0:
            return T.Q8_0
        return t if t == T.Q8_0 else T.Q6_K
    if ft == "MXFP4_MOE":
        # the experts (3-D, more than one matrix) MXFP4, every other tensor Q8_0; before any category
        return T.MXFP4 if len(shape) > 2 and int(shape[2]) > 1 else T.Q8_0
    if cat == "attn_v":
        i, n_wv = c.i_attention_wv, c.n_attention_wv
        if ft == "Q2_K":
            t = T.Q4_K if model.n_gqa >= 4 else T.Q3_K
        elif ft == "Q2_K_S" and model.n_gqa >= 4:
            t = T.Q4_K
        elif ft == "Q3_K_M":
            t = T.Q5_K if i < 2 else T.Q4_K
        elif ft == "Q3_K_L":
            t = T.Q5_K
        elif ft in ("Q4_K_M", "Q5_K_M") and use_more_bits(i, n_wv):
            t = T.Q6_K
        elif ft == "Q4_K_S" and i < 4:
            t = T.Q5_K
        if model.is_70b and t in (T.Q3_K, T.Q4_K):
            t = T.Q5_K          # 8 query heads share each attn_v: more bits cost little
        if model.n_expert == 8:
            t = T.Q8_0
        c.i_attention_wv += 1
    elif cat == "attn_k":
        if model.n_expert == 8:
            t = T.Q8_0
    elif cat == "ffn_down":
        i = _layer(name, c.i_ffn_down, model)
        if ft == "Q2_K":
            t = T.Q3_K
        elif ft == "Q2_K_S":
            if i < n // 8:
                t = T.Q4_K
        elif ft == "Q3_K_M":
            t = T.Q5_K if i < n // 16 else T.Q4_K if not falcon or use_more_bits(i, n) else T.Q3_K
        elif ft == "Q3_K_L":
            t = T.Q4_K if falcon else T.Q5_K
        elif ft == "Q4_K_M":
            if falcon:
                t = T.Q6_K if i < n // 16 else T.Q5_K if use_more_bits(i, n) else T.Q4_K
            elif use_more_bits(i, n):
                t = T.Q6_K
        elif ft == "Q5_K_M" and use_more_bits(i, n):
            t = T.Q6_K
        elif ft == "Q4_K_S" and not falcon and i < n // 8:
            t = T.Q5_K
        elif ft in ("Q4_0", "Q5_0") and has_imatrix and i < n // 8:
            t = T.Q4_1 if ft == "Q4_0" else T.Q5_1     # llama.cpp's guard for the first ffn_down layers
        c.i_ffn_down += 1
    elif cat == "attn_output":
        if falcon:
            if ft == "Q3_K_L":
                t = T.Q4_K
        elif model.n_expert == 8:
            if ft in ("Q2_K", "Q3_K_S", "Q3_K_M", "Q4_K_S", "Q4_K_M"):
                t = T.Q5_K
        else:
            t = {"Q2_K": T.Q3_K, "Q3_K_M": T.Q4_K, "Q3_K_L": T.Q5_K}.get(ft, t)
    return t


def tensor_types(tensors: Mapping[str, tuple[T, Sequence[int]]], metadata: Mapping[str, Any], ftype: FileType | str,
                 overrides: Sequence[Override] = (), *, pure: bool = False, has_imatrix: bool = False,
                 output_type: T | None = None, token_embd_type: T | None = None, leave_output: bool = False,
                 on_fallback: Callable[[str, T, T], None] | None = None) -> dict[str, T]:
    """The type llama-quantize gives each tensor, in llama.cpp's order.

    Args:
        tensors: name → (current type, ggml shape ``[ne0, ne1, …]``), every tensor of the file.
        metadata: the file's key → value (architecture, block and head counts).
        ftype: the file type (:data:`FILE_TYPES`, or its name).
        overrides: ``--tensor-type`` overrides; the first whose pattern is found in a name wins.
        pure: every quantizable tensor the default type (llama-quantize's ``--pure``), overrides still apply.
        has_imatrix: an importance matrix is given (Q4_0/Q5_0 then give the first ffn_down layers Q4_1/Q5_1).
        output_type: ``--output-tensor-type``: ``output.weight``'s type, before the overrides (and the
            tied token embedding's in the mix, with the fallback).
        token_embd_type: ``--token-embedding-type``: the token embedding's type, before the overrides
            (``per_layer_token_embd.weight`` only when no override names it).
        leave_output: ``--leave-output-tensor``: ``output.weight`` keeps its type.
        on_fallback: called ``(name, wanted, written)`` for a tensor whose rows do not fit the wanted type's blocks.

    Returns:
        name → ggml type, ordered as llama.cpp writes the tensors (:func:`llama_order`).

    Raises:
        OptionError: an unknown file type, a model the rules cannot place (no block count), an
            output/token embedding type whose blocks do not divide that tensor's rows, or a tensor of
            more than 3 dimensions to convert (llama.cpp reads ``ne[1] × ne[2]`` rows and would drop the rest).
    """
    ft = file_type(ftype) if isinstance(ftype, str) else ftype
    model = ModelShape.from_metadata(metadata)
    order = llama_order(tensors)
    tied = "output.weight" not in tensors
    counters = _Counters(n_attention_wv=sum(category(n) == "attn_v" for n in order))
    default_quantized = ft.default not in (T.F32, T.F16, T.BF16)
    out: dict[str, T] = {}
    for name in order:
        current, shape = tensors[name]
        if not allows_quantization(name, shape) or (leave_output and name == "output.weight"):
            out[name] = T(current)
            continue
        cat = category(name)
        manual = next((o for o in overrides if o.matches(name)), None)
        if token_embd_type is not None and cat == "token_embd" and (
                name != "per_layer_token_embd.weight" or manual is None):
            out[name] = _whole_rows(token_embd_type, name, int(shape[0]), "--token-embedding-type")
            continue
        if output_type is not None and cat == "output":
            out[name] = _whole_rows(output_type, name, int(shape[0]), "--output-tensor-type")
            continue
        t = ft.default
        if default_quantized:
            if manual is not None:
                t = manual.ggml_type
            elif not pure:
                t = _mix(t, name, shape, ft.name, cat, model, tied, has_imatrix, counters, output_type)
            written = fallback(t, int(shape[0]))
            if written != t and on_fallback is not None:
                on_fallback(name, t, written)
            t = written
        if t != current and n_dims(shape) > 3:
            raise OptionError(f"tensor {name!r} has {n_dims(shape)} dimensions {list(shape)}: llama-quantize converts "
                              f"matrices and stacks of expert matrices (2 or 3 dimensions) only; keep its type with "
                              f"--tensor-type '{re.escape(name)}={T(current).name.lower()}'")
        out[name] = t
    return out


def _whole_rows(t: T, name: str, ne0: int, option: str) -> T:
    """``t`` if its blocks divide rows of ``ne0`` (llama.cpp takes these two options without a fallback).

    Raises:
        OptionError: they do not.
    """
    block = gguf.GGML_QUANT_SIZES[t][0]
    if ne0 % block:
        raise OptionError(f"{option} {t.name.lower()}: the rows of {name} have {ne0} weights, not a multiple of "
                          f"{t.name.lower()}'s {block}-weight blocks; choose a type with blocks of 32 (q8_0, q5_0, "
                          f"q4_0 …) or f16")
    return t


def requires_imatrix(name: str, t: T, ftype: FileType) -> bool:
    """llama.cpp's ``tensor_requires_imatrix`` for the types llamatrace writes: the Q2_K tensors of a
    Q2_K_S file, the token embedding and output aside."""
    return t == T.Q2_K and ftype.name == "Q2_K_S" and category(name) not in ("token_embd", "output")


def unmatched(overrides: Sequence[Override], names: Iterable[str]) -> list[Override]:
    """The overrides whose pattern is found in none of ``names``."""
    names = list(names)
    return [o for o in overrides if not any(o.matches(n) for n in names)]
