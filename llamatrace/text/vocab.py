"""A GGUF vocabulary as tiktoken ranks: the token bytes and merge order of byte-level BPE and
SentencePiece vocabularies (:mod:`llamatrace.text.tokenizer` wraps the result).

We turn it into a :class:`tiktoken.Encoding`, the same thin-wrapper design as Meta's Llama 3 tokenizer.
Two facts make that a faithful copy of Hugging Face's BPE:

* tiktoken merges the adjacent pair whose *concatenation* has the lowest rank, so the rank of a
  multi-byte token must be the index of the merge that creates it. When token ids already grow in
  merge order (true of SmolLM2 and Llama 3) the ids serve as ranks; otherwise ranks are renumbered
  and mapped back to ids after encoding.
* tiktoken keeps only the text its split regex matches, so every split pattern (in the tokenizer) ends with a
  catch-all ``|\\s+`` and covers every character.

SentencePiece (llama.cpp's ``llm_tokenizer_spm``) merges, over the *characters* of the whole text
(spaces escaped to '▁', one '▁' prefixed), the adjacent pair whose concatenation is the token with the
highest score, leftmost first; characters no token is made of fall back to ``<0xNN>`` byte tokens.
That is tiktoken's rule with rank = score order, except that tiktoken's atoms are bytes: a character
of 2–4 UTF-8 bytes must exist before any scored merge. So the ranks begin with every partial and
whole character the vocabulary uses (lower than any scored token), and ranks map back to ids, or to
byte tokens for characters that are not tokens themselves (:func:`spm_ranks`). Equal scores are
ordered by id, where llama.cpp takes the leftmost pair; Llama 2's only ties are its runs of '▁'
(score -1e9), where both orders give the same tokens on llama.cpp's test strings.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

import numpy as np

from llamatrace.errors import ModelFormatError, shown

# token types of tokenizer.ggml.token_type (llama.cpp's llama_token_type)
TOKEN_NORMAL, TOKEN_UNKNOWN, TOKEN_CONTROL, TOKEN_USER_DEFINED, TOKEN_UNUSED, TOKEN_BYTE = 1, 2, 3, 4, 5, 6
SPM_SPACE = "\u2581"  # '▁', SentencePiece's space marker


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte → printable character map (byte 0x20 ' ' is 'Ġ', 0x0A '\\n' is 'Ċ')."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table = {b: chr(b) for b in printable}
    n = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + n)
            n += 1
    return table


_UNICODE_TO_BYTE = str.maketrans({c: chr(b) for b, c in bytes_to_unicode().items()})
_NOT_BYTE_LEVEL = re.compile("[^" + re.escape("".join(bytes_to_unicode().values())) + "]")
_BYTE_OF_CHAR = np.full(max(map(ord, bytes_to_unicode().values())) + 1, 256, np.uint16)  # 256: not byte-level
_BYTE_OF_CHAR[[ord(c) for c in bytes_to_unicode().values()]] = list(bytes_to_unicode())


def _token_text_to_bytes(text: str) -> bytes | None:
    """'Ġthe' → b' the'; None if the text is not GPT-2 byte-level (then it is a literal string)."""
    if _NOT_BYTE_LEVEL.search(text):
        return None
    return text.translate(_UNICODE_TO_BYTE).encode("latin-1")


def bpe_token_bytes(tokens: Sequence[str], types: Sequence[int]) -> tuple[list[bytes], list[bool]]:
    """id → bytes: byte-level text for normal tokens, literal UTF-8 for control/user-defined/literal ones."""
    id_bytes: list[bytes] = []
    is_text: list[bool] = []  # not byte-level: Tokenizer.piece shows the text as it is
    for text, ttype in zip(tokens, types):
        raw = _token_text_to_bytes(text) if ttype in (TOKEN_NORMAL, TOKEN_UNUSED, TOKEN_BYTE) else None
        is_text.append(raw is None)
        id_bytes.append(raw if raw is not None else text.encode("utf-8"))
    return id_bytes, is_text


def _merged_bytes(merges: Sequence[str], where: str) -> list[bytes]:
    """The bytes each merge 'left right' (byte-level text) creates: left + right.

    All merges are mapped to bytes at once, through a table indexed by code point (one
    character is one byte, so their lengths carry over): Llama 3's 280,000 merges take 0.14 s,
    one at a time 0.5 s. Raises ModelFormatError naming the first merge that is not two
    byte-level strings around one space."""
    text = "\n".join(merges)
    if text.count(" ") == len(merges) and text.count("\n") == len(merges) - 1:
        parts = text.replace(" ", "").split("\n")
        codes = np.frombuffer("".join(parts).encode("utf-32-le"), np.uint32)
        raw = _BYTE_OF_CHAR[np.minimum(codes, len(_BYTE_OF_CHAR) - 1)]
        if not (codes >= len(_BYTE_OF_CHAR)).any() and not (raw == 256).any():
            data = raw.astype(np.uint8).tobytes()
            ends = np.cumsum([len(p) for p in parts]).tolist()
            return [data[a:b] for a, b in zip([0, *ends[:-1]], ends)]
    out = []
    for i, merge in enumerate(merges):    # something is wrong: find it
        left, sep, right = merge.partition(" ")
        lb, rb = _token_text_to_bytes(left), _token_text_to_bytes(right)
        if not sep or lb is None or rb is None:
            raise ModelFormatError(f"tokenizer.ggml.merges[{i}] = {shown(merge)} is not 'left right'{where}")
        out.append(lb + rb)
    return out


def bpe_ranks(types: Sequence[int], merges: Sequence[str], id_bytes: list[bytes], is_text: list[bool],
               where: str) -> tuple[dict[bytes, int], list[int] | None]:
    """tiktoken ranks of a byte-level BPE vocabulary, and rank → id (None when ids already are ranks).

    ``id_bytes`` and ``is_text`` come from :func:`bpe_token_bytes`; ``where`` (" in FILE" or "")
    ends error messages.

    Raises:
        ModelFormatError: a merge is not two byte-level strings around one space.
    """
    merge_index: dict[bytes, int] = {}  # the merge that first creates each byte string: its priority
    for i, raw in enumerate(_merged_bytes(merges, where)):
        merge_index.setdefault(raw, i)

    # BPE tokens: normal single bytes (the alphabet) and normal tokens that some merge creates.
    # A normal multi-byte token no merge creates can never come out of BPE; it is left out.
    singles: dict[bytes, int] = {}
    merged: list[tuple[int, int, bytes]] = []  # (merge index, id, bytes)
    for i, (ttype, raw) in enumerate(zip(types, id_bytes)):
        if ttype != TOKEN_NORMAL or is_text[i]:
            continue
        if len(raw) == 1:
            singles.setdefault(raw, i)
        elif raw in merge_index:
            merged.append((merge_index[raw], i, raw))
    merged.sort()
    first_id: dict[bytes, int] = {}
    for _, i, raw in merged:  # two ids with the same bytes: the one the first merge names wins
        first_id.setdefault(raw, i)
    merged = [m for m in merged if first_id[m[2]] == m[1]]

    merged_ids = [i for _, i, _ in merged]
    if all(a < b for a, b in zip(merged_ids, merged_ids[1:])):  # ids grow in merge order: ids are ranks
        return {raw: i for raw, i in singles.items()} | {raw: i for _, i, raw in merged}, None
    order = [*sorted(singles.items(), key=lambda kv: kv[1]), *((raw, i) for _, i, raw in merged)]
    return {raw: r for r, (raw, _) in enumerate(order)}, [i for _, i in order]


_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def spm_token_bytes(tokens: Sequence[str], types: Sequence[int]) -> list[bytes]:
    """id → bytes for SentencePiece: '▁' is a space, ``<0xNN>`` byte tokens are that byte, control,
    unknown and user-defined tokens their literal text (as llama.cpp's token_to_piece with special)."""
    id_bytes: list[bytes] = []
    for text, ttype in zip(tokens, types):
        m = _BYTE_TOKEN.fullmatch(text) if ttype == TOKEN_BYTE else None
        if m:
            id_bytes.append(bytes([int(m.group(1), 16)]))
        elif ttype in (TOKEN_NORMAL, TOKEN_UNUSED):
            id_bytes.append(text.replace(SPM_SPACE, " ").encode("utf-8"))
        else:
            id_bytes.append(text.encode("utf-8"))
    return id_bytes


def spm_ranks(tokens: Sequence[str], types: Sequence[int], scores: Sequence[float],
               id_bytes: list[bytes]) -> tuple[dict[bytes, int], list[list[int]]]:
    """tiktoken ranks reproducing llama.cpp's SPM merges, and rank → ids.

    Ranks, lowest first: the 256 single bytes; every partial and whole multi-byte character that
    normal tokens are made of (so characters, SPM's atoms, form before any scored merge); then normal
    tokens of two or more characters by descending score (ties: lower id first). A rank that is not
    a token (a character outside the vocabulary, or a partial one left over) maps to its bytes'
    ``<0xNN>`` tokens, or to ``<unk>`` when the vocabulary has no byte tokens.
    """
    byte_ids: dict[int, int] = {}
    unk = next((i for i, t in enumerate(types) if t == TOKEN_UNKNOWN), None)
    for i, (text, ttype) in enumerate(zip(tokens, types)):
        m = _BYTE_TOKEN.fullmatch(text) if ttype == TOKEN_BYTE else None
        if m:
            byte_ids.setdefault(int(m.group(1), 16), i)
    normal: dict[bytes, int] = {}
    for i, (text, ttype) in enumerate(zip(tokens, types)):
        if ttype == TOKEN_NORMAL and text:
            normal.setdefault(text.encode("utf-8"), i)  # '▁' kept: text is escaped before encoding

    def fallback(raw: bytes) -> list[int]:
        if all(b in byte_ids for b in raw):
            return [byte_ids[b] for b in raw]
        return [unk] if unk is not None else []

    atoms: dict[bytes, None] = {bytes([b]): None for b in range(256)}
    for raw in normal:
        for ch in raw.decode("utf-8"):
            cb = ch.encode("utf-8")
            for k in range(2, len(cb) + 1):
                atoms.setdefault(cb[:k])
    ranks: dict[bytes, int] = {}
    rank_to_ids: list[list[int]] = []
    for raw in atoms:
        ranks[raw] = len(rank_to_ids)
        rank_to_ids.append([normal[raw]] if raw in normal else fallback(raw))
    scored = sorted((-float(scores[i]), i, raw) for raw, i in normal.items() if raw not in ranks)
    for _, i, raw in scored:
        ranks[raw] = len(rank_to_ids)
        rank_to_ids.append([i])
    return ranks, rank_to_ids
