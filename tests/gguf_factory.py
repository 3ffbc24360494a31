"""Tiny llama-architecture GGUF files written with ``gguf.GGUFWriter`` for unit tests.

Random weights, a byte-level BPE vocabulary (256 byte tokens, a few merges, ChatML control
tokens) and a ChatML chat template: small enough to run the whole forward pass in
milliseconds, shaped like SmolLM2 (GQA, tied output projection) unless told otherwise.
"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np

T = gguf.GGMLQuantizationType

CHATML = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] "
          "+ '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")

MERGES = [("Ġ", "t"), ("h", "e"), ("Ġt", "he"), ("i", "n"), ("Ġ", "a"), ("e", "r"), ("o", "n"),
          ("Ġ", "c"), ("a", "t"), ("Ġc", "at")]
CONTROL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def byte_tokens() -> list[str]:
    """The GPT-2 byte→unicode alphabet, in byte order."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    table = dict(zip(bs, cs))
    return [chr(table[b]) for b in range(256)]


def vocabulary() -> tuple[list[str], list[int], list[str]]:
    """(tokens, token types, merges): control tokens first (ids 0-2, like SmolLM2), then bytes, then merges."""
    tokens = CONTROL + byte_tokens() + [a + b for a, b in MERGES]
    types = [3] * len(CONTROL) + [1] * (len(tokens) - len(CONTROL))
    return tokens, types, [f"{a} {b}" for a, b in MERGES]


# Byte offsets of the fp16 scale fields (d, then dmin / m) inside a block, for the types that
# gguf-py cannot quantize (K-quants) or that tests fill with raw random blocks.
FP16_FIELDS = {T.Q2_K: (80, 82), T.Q3_K: (108,), T.Q4_K: (0, 2), T.Q5_K: (0, 2), T.Q6_K: (208,),
               T.Q5_0: (0,), T.Q5_1: (0, 2)}
SPECIAL_F16 = np.array([0x0000, 0x8000, 0x0001, 0x8001, 0x03FF, 0x83FF, 0x0400, 0x7BFF, 0xFBFF, 0x3C00],
                       dtype=np.uint16)
# |weight| / d of a random block, roughly: (sub-block scale) x (quant), so d = std / this
_TYPICAL = {T.Q2_K: 10.0, T.Q3_K: 40.0, T.Q4_K: 230.0, T.Q5_K: 470.0, T.Q6_K: 1000.0,
            T.Q5_0: 8.0, T.Q5_1: 16.0}


def random_blocks(qtype: T, n_rows: int, n_blocks: int, seed: int = 0, std: float | None = None) -> np.ndarray:
    """uint8 ``[n_rows, n_blocks * block_bytes]``: valid random blocks of ``qtype``.

    Quant and scale bytes are uniform random (so every scale pattern occurs given enough
    blocks). The fp16 ``d``/``dmin`` are any finite value, with 0, -0, subnormals and +-65504
    over-represented, unless ``std`` is given: then they are drawn so weights have roughly that
    magnitude (for forward-pass tests). Types without known fp16 fields get random bytes.
    """
    rng = np.random.default_rng(seed)
    block_size, nbytes = gguf.GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, size=(n_rows, n_blocks, nbytes), dtype=np.uint8)
    for off in FP16_FIELDS.get(qtype, ()):
        if std is not None:
            f16 = (std / _TYPICAL[qtype] * rng.uniform(0.5, 1.5, size=(n_rows, n_blocks))).astype(np.float16)
            f16 = f16.view(np.uint16)
        else:
            f16 = rng.integers(0, 65536, size=(n_rows, n_blocks), dtype=np.uint16)
            f16 = np.where((f16 & 0x7C00) == 0x7C00, f16 & 0x83FF, f16)      # inf/nan -> finite
            pick = rng.random((n_rows, n_blocks)) < 0.3
            f16 = np.where(pick, rng.choice(SPECIAL_F16, size=(n_rows, n_blocks)), f16).astype(np.uint16)
        blocks[:, :, off:off + 2] = f16.view(np.uint8).reshape(n_rows, n_blocks, 2)
    return blocks.reshape(n_rows, -1)


def _store(writer: gguf.GGUFWriter, name: str, data: np.ndarray, qtype: T) -> None:
    data = data.astype(np.float32)
    if qtype == T.F32:
        writer.add_tensor(name, data)
    elif qtype == T.F16:
        writer.add_tensor(name, data.astype(np.float16))
    else:
        try:
            writer.add_tensor(name, gguf.quants.quantize(data, qtype), raw_dtype=qtype)
            return
        except NotImplementedError:  # K-quants and others: random blocks of about the same magnitude
            pass
        block_size = gguf.GGML_QUANT_SIZES[qtype][0]
        seed = int(np.frombuffer(name.encode(), np.uint8).sum()) + int(qtype)
        raw = random_blocks(qtype, data.shape[0], data.shape[1] // block_size, seed, std=float(data.std()))
        writer.add_tensor(name, raw, raw_dtype=qtype)


def write_tiny_llama(path: str | Path, *, qtype: T = T.Q8_0, embd_type: T | None = None,
                     n_layers: int = 2, dim: int = 64, n_heads: int = 4, n_kv_heads: int = 2,
                     hidden_dim: int = 96, context_length: int = 64, tied: bool = True, seed: int = 0,
                     arch: str = "llama", tokenizer_model: str = "gpt2", pre: str = "smollm",
                     chat_template: str | None = CHATML, rope_theta: float = 10000.0,
                     skip_tensors: tuple[str, ...] = (), extra_kv: dict | None = None,
                     rope_freqs: np.ndarray | None = None, add_bos: bool = False,
                     extra_types: dict[str, T] | None = None,
                     extra_tensors: dict[str, np.ndarray] | None = None) -> Path:
    """Write a random llama GGUF and return its path. Matrices use ``qtype`` (norms are F32);
    K-quant matrices are random blocks (gguf-py cannot quantize them) and need ``dim`` and
    ``hidden_dim`` multiples of 256.

    ``extra_types`` overrides the type of single tensors by name. ``rope_freqs`` adds Llama 3.1's ``rope_freqs.weight`` (per-frequency divisors, [head_dim/2]).
    ``extra_tensors`` adds F32 tensors by name (Phi-3 128k's ``rope_factors_long.weight`` …).
    """
    rng = np.random.default_rng(seed)
    tokens, types, merges = vocabulary()
    vocab = len(tokens)
    head_dim = dim // n_heads
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name("tiny-test-llama")
    w.add_block_count(n_layers)
    w.add_context_length(context_length)
    w.add_embedding_length(dim)
    w.add_feed_forward_length(hidden_dim)
    w.add_head_count(n_heads)
    w.add_head_count_kv(n_kv_heads)
    w.add_rope_freq_base(rope_theta)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_dimension_count(head_dim)
    w.add_vocab_size(vocab)
    w.add_tokenizer_model(tokenizer_model)
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(0)
    w.add_eos_token_id(0)
    w.add_add_bos_token(add_bos)
    if chat_template is not None:
        w.add_chat_template(chat_template)
    for key, value in (extra_kv or {}).items():
        if isinstance(value, bool):
            w.add_bool(key, value)
        else:
            w.add_string(key, value) if isinstance(value, str) else w.add_uint32(key, value)

    def mat(n_out: int, n_in: int, scale: float) -> np.ndarray:
        return rng.normal(0, scale, size=(n_out, n_in))

    tensors = {"token_embd.weight": (mat(vocab, dim, 1.0), embd_type or qtype)}
    for i in range(n_layers):
        p = f"blk.{i}."
        tensors.update({
            p + "attn_norm.weight": (1.0 + 0.1 * rng.normal(size=dim), T.F32),
            p + "attn_q.weight": (mat(n_heads * head_dim, dim, dim ** -0.5), qtype),
            p + "attn_k.weight": (mat(n_kv_heads * head_dim, dim, dim ** -0.5), qtype),
            p + "attn_v.weight": (mat(n_kv_heads * head_dim, dim, dim ** -0.5), qtype),
            p + "attn_output.weight": (mat(dim, n_heads * head_dim, dim ** -0.5), qtype),
            p + "ffn_norm.weight": (1.0 + 0.1 * rng.normal(size=dim), T.F32),
            p + "ffn_gate.weight": (mat(hidden_dim, dim, dim ** -0.5), qtype),
            p + "ffn_up.weight": (mat(hidden_dim, dim, dim ** -0.5), qtype),
            p + "ffn_down.weight": (mat(dim, hidden_dim, hidden_dim ** -0.5), qtype),
        })
    if rope_freqs is not None:
        tensors["rope_freqs.weight"] = (np.asarray(rope_freqs, dtype=np.float64), T.F32)
    for name, data in (extra_tensors or {}).items():
        tensors[name] = (np.asarray(data, dtype=np.float64), T.F32)
    tensors["output_norm.weight"] = (1.0 + 0.1 * rng.normal(size=dim), T.F32)
    if not tied:
        tensors["output.weight"] = (mat(vocab, dim, dim ** -0.5), qtype)
    for name, (data, t) in tensors.items():
        if name not in skip_tensors:
            _store(w, name, data, (extra_types or {}).get(name, t))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return Path(path)


def rewrite_metadata(src: str | Path, dst: str | Path, changes: dict[str, tuple],
                     extra_tensors: dict[str, np.ndarray] | None = None, tensors=None) -> Path:
    """Copy the GGUF ``src`` to ``dst`` with metadata changed: ``key → (value, GGUFValueType)``
    or ``(values, GGUFValueType.ARRAY, element type)`` (a new key is added at the end);
    ``general.architecture`` takes ``(name,)``. Tensors are copied byte for byte (or, with
    ``tensors``, what ``tensors(reader)`` yields: ``(name, data, GGMLQuantizationType)``), then
    ``extra_tensors`` (name → array, stored as F32) are appended."""
    r = gguf.GGUFReader(str(src))
    arch = changes.get("general.architecture", (r.fields["general.architecture"].contents(),))[0]
    w = gguf.GGUFWriter(str(dst), arch)
    todo = {k: v for k, v in changes.items() if k != "general.architecture"}
    for key, field in r.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        if key in todo:
            w.add_key_value(key, *todo.pop(key))
        else:
            w.add_key_value(key, field.contents(), field.types[0],
                            sub_type=field.types[-1] if len(field.types) > 1 else None)
    for key, change in todo.items():
        w.add_key_value(key, *change)
    for name, data, kind in (tensors or _same_tensors)(r):
        w.add_tensor(name, data, raw_dtype=kind)
    for name, data in (extra_tensors or {}).items():
        w.add_tensor(name, np.asarray(data, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return Path(dst)


def _same_tensors(r: gguf.GGUFReader):
    """Every tensor of ``r`` as it is: ``(name, data, type)``."""
    for t in r.tensors:
        yield t.name, np.asarray(t.data), t.tensor_type
