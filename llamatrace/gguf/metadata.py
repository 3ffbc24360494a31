"""The GGUF type of every metadata key llamatrace reads, declared once and checked when a file opens.

A GGUF value carries its type (:mod:`llamatrace.gguf.header`). llama.cpp reads each key with a
declared type and refuses another ("key … has wrong type … but expected type …",
``llama-model-loader.cpp``); so does llamatrace, before anything reads a value: a count stored as
the string ``"4"`` or a float stored as a string is one ``error:`` line naming the key, the type
found and the type expected, not a value coerced by ``int()`` or a crash deep in the loader.

A reader of a new key declares its type here, as one row of :data:`KEY_TYPES`
(``"{arch}.rope.scaling.factor": FLOAT``); ``tests/test_metadata_types.py`` fails while a key
read somewhere in the package has no row. Integer keys take any integer kind (``uint8`` …
``int64``), float keys ``float32`` or ``float64``; per-layer keys (llama.cpp's
``get_key_or_arr``) also an array of integers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Container, Mapping

from gguf import GGUFValueType as V

from llamatrace.errors import ModelFormatError, shown
from llamatrace.gguf.header import ARRAY, type_name

__all__ = ["KEY_TYPES", "Expected", "check_metadata_types"]

_INTEGERS = frozenset(int(t) for t in (V.UINT8, V.INT8, V.UINT16, V.INT16, V.UINT32, V.INT32, V.UINT64, V.INT64))
_FLOATS = frozenset({int(V.FLOAT32), int(V.FLOAT64)})


@dataclass(frozen=True)
class Expected:
    """The types a key may have: ``scalars`` (``gguf_type`` numbers) and, for an array, the types
    of its elements (``elements``; empty: no array). ``name`` says it in an error message."""

    name: str
    scalars: frozenset[int] = frozenset()
    elements: frozenset[int] = frozenset()

    def accepts(self, vtype: int, etype: int | None) -> bool:
        return etype in self.elements if vtype == ARRAY else vtype in self.scalars


INTEGER = Expected("an integer (uint8 … int64)", scalars=_INTEGERS)
FLOAT = Expected("a float (float32 or float64)", scalars=_FLOATS)
STRING = Expected("a string", scalars=frozenset({int(V.STRING)}))
BOOL = Expected("a bool", scalars=frozenset({int(V.BOOL)}))
PER_LAYER_INTEGER = Expected("an integer or an array of integers (one per layer)", scalars=_INTEGERS,
                             elements=_INTEGERS)
STRINGS = Expected("an array of strings", elements=frozenset({int(V.STRING)}))
INTEGERS = Expected("an array of integers", elements=_INTEGERS)
FLOATS = Expected("an array of floats", elements=_FLOATS)

KEY_TYPES: dict[str, Expected] = {
    "general.architecture": STRING,
    "general.type": STRING,
    # the model's hyper-parameters (llamatrace.model.config; llama.cpp's load_hparams)
    "{arch}.context_length": INTEGER,
    "{arch}.embedding_length": INTEGER,
    "{arch}.block_count": INTEGER,
    "{arch}.feed_forward_length": PER_LAYER_INTEGER,
    "{arch}.expert_count": INTEGER,
    "{arch}.expert_used_count": PER_LAYER_INTEGER,
    "{arch}.expert_feed_forward_length": PER_LAYER_INTEGER,
    "{arch}.expert_gating_func": INTEGER,
    "{arch}.expert_shared_feed_forward_length": INTEGER,
    "{arch}.attention.head_count": PER_LAYER_INTEGER,
    "{arch}.attention.head_count_kv": PER_LAYER_INTEGER,
    "{arch}.attention.key_length": INTEGER,
    "{arch}.attention.layer_norm_rms_epsilon": FLOAT,
    "{arch}.attention.sliding_window": INTEGER,
    "{arch}.attention.sliding_window_pattern": Expected(
        "an integer or an array of bools (one per layer)", scalars=_INTEGERS, elements=frozenset({int(V.BOOL)})),
    "{arch}.rope.dimension_count": INTEGER,
    "{arch}.rope.freq_base": FLOAT,
    "{arch}.rope.freq_base_swa": FLOAT,
    "{arch}.rope.scaling.type": STRING,
    "{arch}.rope.scaling.factor": FLOAT,
    "{arch}.rope.scale_linear": FLOAT,
    "{arch}.rope.scaling.attn_factor": FLOAT,
    "{arch}.rope.scaling.original_context_length": INTEGER,
    "{arch}.attention.causal": BOOL,
    "{arch}.attn_logit_softcapping": FLOAT,
    "{arch}.final_logit_softcapping": FLOAT,
    # gated DeltaNet layers (llamatrace.model.config._deltanet_fields; llama.cpp's qwen35 load_arch_hparams)
    "{arch}.ssm.conv_kernel": INTEGER,
    "{arch}.ssm.inner_size": INTEGER,
    "{arch}.ssm.state_size": INTEGER,
    "{arch}.ssm.time_step_rank": INTEGER,
    "{arch}.ssm.group_count": INTEGER,
    "{arch}.attention.recurrent_layers": Expected(
        "an array of bools or integers (one per block)", elements=frozenset({int(V.BOOL)}) | _INTEGERS),
    "{arch}.full_attention_interval": INTEGER,
    "{arch}.rope.dimension_sections": INTEGERS,
    "{arch}.nextn_predict_layers": INTEGER,
    # the tokenizer (llamatrace.text.tokenizer)
    "tokenizer.ggml.model": STRING,
    "tokenizer.ggml.pre": STRING,
    "tokenizer.ggml.tokens": STRINGS,
    "tokenizer.ggml.token_type": INTEGERS,
    "tokenizer.ggml.merges": STRINGS,
    "tokenizer.ggml.scores": FLOATS,
    "tokenizer.ggml.bos_token_id": INTEGER,
    "tokenizer.ggml.eos_token_id": INTEGER,
    "tokenizer.ggml.eot_token_id": INTEGER,
    "tokenizer.ggml.eom_token_id": INTEGER,
    "tokenizer.ggml.add_bos_token": BOOL,
    "tokenizer.ggml.add_eos_token": BOOL,
    "tokenizer.ggml.add_space_prefix": BOOL,
    "tokenizer.chat_template": STRING,
    # an importance matrix (llamatrace.quantize.imatrix.files)
    "imatrix.datasets": STRINGS,
    "imatrix.chunk_count": INTEGER,
    "imatrix.chunk_size": INTEGER,
}
"""Metadata key (``{arch}`` = the file's ``general.architecture``) → the types it may have."""


def check_metadata_types(value_type: Callable[[str], tuple[int, int | None]], present: Container[str],
                         metadata: Mapping[str, Any], source: str) -> None:
    """Check every key of :data:`KEY_TYPES` a file holds against the types declared there.

    Args:
        value_type: key → (``gguf_type``, the elements' ``gguf_type`` for an array, else None), as
            :meth:`~llamatrace.gguf.reader.GGUFFile.value_type`.
        present: the file's keys.
        metadata: the decoded values (for ``general.architecture`` and to show a scalar found).
        source: the file name used in the message.

    Raises:
        ModelFormatError: a key of another type (the first in :data:`KEY_TYPES`' order).
    """
    arch = metadata.get("general.architecture")
    for pattern, expected in KEY_TYPES.items():
        if "{arch}" in pattern:
            if not isinstance(arch, str):
                continue                         # the config refuses the file, naming the architecture
            key = pattern.replace("{arch}", arch)
        else:
            key = pattern
        if key not in present:
            continue
        vtype, etype = value_type(key)
        if expected.accepts(vtype, etype):
            continue
        found = f"array of {type_name(etype)}" if vtype == ARRAY else type_name(vtype)
        if vtype != ARRAY and key in metadata:
            found += f" ({shown(metadata[key])})"
        raise ModelFormatError(
            f"{source}: metadata key {shown(key)} has type {found}, expected {expected.name}; the file was "
            f"written by a broken tool: re-convert the model (llama.cpp's convert_hf_to_gguf.py) or re-download it")
