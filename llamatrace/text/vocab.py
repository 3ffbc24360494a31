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
from itertools import filterfalse, repeat

import numpy as np

from llamatrace.errors import ModelFormatError, shown
from llamatrace.gguf.reader import StringArray

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


def _joined(strings: Sequence[str] | StringArray) -> tuple[str, np.ndarray] | None:
    """``strings`` as one text and each string's end in it (characters, int64 ``[n]``); None when
    a :class:`StringArray` is not valid UTF-8."""
    if isinstance(strings, StringArray):
        return strings.chars()
    return "".join(strings), np.cumsum(np.fromiter(map(len, strings), np.int64, len(strings)))


def _byte_level(text: str) -> tuple[np.ndarray, bytes]:
    """Per character of ``text``: whether it is not a GPT-2 byte-level character (bool), and the
    byte each byte-level one stands for (the others' bytes are meaningless)."""
    codes = np.frombuffer(text.encode("utf-32-le", "surrogatepass"), np.uint32)
    raw = _BYTE_OF_CHAR[np.minimum(codes, len(_BYTE_OF_CHAR) - 1)]
    return (codes >= len(_BYTE_OF_CHAR)) | (raw == 256), raw.astype(np.uint8).tobytes()


def _per_string(flags: np.ndarray, ends: np.ndarray) -> np.ndarray:
    """How many of ``flags`` (one per character; few are set) fall in each string ending at ``ends``."""
    return np.bincount(np.searchsorted(ends, np.flatnonzero(flags), side="right"), minlength=len(ends))[:len(ends)]


def _slices(data: bytes, ends: np.ndarray) -> list[bytes]:
    """``data`` cut at ``ends`` (int64): the pieces, without a Python loop."""
    ends = ends.tolist()
    return list(map(data.__getitem__, map(slice, [0, *ends[:-1]], ends)))


def bpe_token_bytes(tokens: Sequence[str], types: Sequence[int]) -> tuple[list[bytes], list[bool]]:
    """id → bytes: byte-level text for normal tokens, literal UTF-8 for control/user-defined/literal ones.

    All tokens are mapped at once through a table indexed by code point (one byte-level
    character is one byte, so the lengths carry over); only the literal ones are encoded one by one."""
    text, ends = _joined(tokens)
    bad, raw = _byte_level(text)
    kinds = np.asarray(types, np.int64)
    is_text = (_per_string(bad, ends) > 0) | ~np.isin(kinds, (TOKEN_NORMAL, TOKEN_UNUSED, TOKEN_BYTE))
    id_bytes = _slices(raw, ends)
    for i in np.flatnonzero(is_text).tolist():
        id_bytes[i] = tokens[i].encode("utf-8")
    return id_bytes, is_text.tolist()


def _merged_bytes(merges: Sequence[str] | StringArray, where: str) -> list[bytes]:
    """The bytes each merge 'left right' (byte-level text) creates: left + right.

    All merges are mapped to bytes at once, through a table indexed by code point (one
    character is one byte, so their lengths carry over): Llama 3's 280,000 merges take ~0.09
    CPU-s from the file's buffer (:meth:`GGUFFile.strings`, no string object per merge), one at
    a time 0.5 s. Raises ModelFormatError naming the first merge that is not two byte-level
    strings around one space (exactly one space, every other character byte-level)."""
    joined = _joined(merges)
    if joined is not None:
        text, ends = joined
        bad, raw = _byte_level(text)
        space = np.frombuffer(text.encode("utf-32-le", "surrogatepass"), np.uint32) == ord(" ")
        if (_per_string(space, ends) == 1).all() and not (bad & ~space).any():
            keep = ~space
            return _slices(np.frombuffer(raw, np.uint8)[keep].tobytes(), ends - np.arange(1, len(ends) + 1))
    if isinstance(merges, StringArray):
        merges = merges.tolist()
    for i, merge in enumerate(merges):    # something is wrong: find it
        left, sep, right = merge.partition(" ")
        lb, rb = _token_text_to_bytes(left), _token_text_to_bytes(right)
        if not sep or lb is None or rb is None:
            raise ModelFormatError(f"tokenizer.ggml.merges[{i}] = {shown(merge)} is not 'left right'{where}")
    raise AssertionError("unreachable: every merge is 'left right'")


def bpe_ranks(types: Sequence[int], merges: Sequence[str] | StringArray, id_bytes: list[bytes],
              is_text: list[bool], where: str) -> tuple[dict[bytes, int], list[int] | None]:
    """tiktoken ranks of a byte-level BPE vocabulary, and rank → id (None when ids already are ranks).

    ``merges``: the merges' strings, or the file's array of them (:meth:`GGUFFile.strings`);
    ``id_bytes`` and ``is_text`` come from :func:`bpe_token_bytes`; ``where`` (" in FILE" or "")
    ends error messages.

    Raises:
        ModelFormatError: a merge is not two byte-level strings around one space.
    """
    merged_bytes = _merged_bytes(merges, where)
    # the merge that first creates each byte string (its priority): the last write of a key wins
    merge_index = dict(zip(reversed(merged_bytes), range(len(merged_bytes) - 1, -1, -1)))

    # BPE tokens: normal single bytes (the alphabet) and normal tokens that some merge creates.
    # A normal multi-byte token no merge creates can never come out of BPE; it is left out.
    bpe = (np.asarray(types, np.int64) == TOKEN_NORMAL) & ~np.asarray(is_text, bool)
    sizes = np.fromiter(map(len, id_bytes), np.int64, len(id_bytes))
    singles: dict[bytes, int] = {}
    for i in np.flatnonzero(bpe & (sizes == 1)).tolist():
        singles.setdefault(id_bytes[i], i)
    multi = np.flatnonzero(bpe & (sizes != 1))
    index = np.fromiter(map(merge_index.get, [id_bytes[i] for i in multi.tolist()], repeat(-1)), np.int64,
                        len(multi))
    multi, index = multi[index >= 0], index[index >= 0]
    order = np.lexsort((multi, index))              # by merge, then id
    multi, index = multi[order], index[order]
    first = np.diff(index, prepend=-1) != 0         # two ids with the same bytes: the lower id wins
    merged_ids = multi[first].tolist()

    if (np.diff(merged_ids) > 0).all():             # ids grow in merge order: ids are ranks
        return singles | {id_bytes[i]: i for i in merged_ids}, None
    order = [*sorted(singles.items(), key=lambda kv: kv[1]), *((id_bytes[i], i) for i in merged_ids)]
    return {raw: r for r, (raw, _) in enumerate(order)}, [i for _, i in order]


_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def _utf8_slices(text: str, ends: np.ndarray) -> list[bytes]:
    """The UTF-8 bytes of each string of ``text`` cut at ``ends`` (characters): one encoding of
    the whole text, cut where each string's bytes end."""
    data = text.encode("utf-8")
    if len(data) != len(text):
        codes = np.frombuffer(text.encode("utf-32-le", "surrogatepass"), np.uint32)
        size = 1 + (codes >= 0x80).astype(np.int64) + (codes >= 0x800) + (codes >= 0x10000)  # UTF-8 bytes
        ends = np.concatenate(([0], np.cumsum(size)))[ends]
    return _slices(data, ends)


def _byte_token_ids(tokens: Sequence[str], kinds: np.ndarray) -> dict[int, int]:
    """byte value → id of the ``<0xNN>`` byte tokens (the first one of each byte)."""
    byte_ids: dict[int, int] = {}
    for i in np.flatnonzero(kinds == TOKEN_BYTE).tolist():
        m = _BYTE_TOKEN.fullmatch(tokens[i])
        if m:
            byte_ids.setdefault(int(m.group(1), 16), i)
    return byte_ids


def spm_token_bytes(tokens: Sequence[str], types: Sequence[int]) -> list[bytes]:
    """id → bytes for SentencePiece: '▁' is a space, ``<0xNN>`` byte tokens are that byte, control,
    unknown and user-defined tokens their literal text (as llama.cpp's token_to_piece with special)."""
    text, ends = _joined(tokens)
    kinds = np.asarray(types, np.int64)
    id_bytes = _utf8_slices(text, ends)
    spaced = _utf8_slices(text.replace(SPM_SPACE, " "), ends)      # one character for one: the ends hold
    for i in np.flatnonzero(np.isin(kinds, (TOKEN_NORMAL, TOKEN_UNUSED))).tolist():
        id_bytes[i] = spaced[i]
    for i in np.flatnonzero(kinds == TOKEN_BYTE).tolist():
        m = _BYTE_TOKEN.fullmatch(tokens[i])
        if m:
            id_bytes[i] = bytes([int(m.group(1), 16)])
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
    kinds = np.asarray(types, np.int64)
    byte_ids = _byte_token_ids(tokens, kinds)
    unknown = np.flatnonzero(kinds == TOKEN_UNKNOWN)
    unk = int(unknown[0]) if unknown.size else None
    normal_ids = [i for i in np.flatnonzero(kinds == TOKEN_NORMAL).tolist() if tokens[i]]
    text, ends = _joined([tokens[i] for i in normal_ids])
    # '▁' kept: text is escaped before encoding; two ids with the same text: the first one's (the
    # last write of a key wins)
    normal = dict(zip(reversed(_utf8_slices(text, ends)), reversed(normal_ids)))

    def fallback(raw: bytes) -> list[int]:
        if all(b in byte_ids for b in raw):
            return [byte_ids[b] for b in raw]
        return [unk] if unk is not None else []

    # the multi-byte characters, in the order the vocabulary first uses them, and their prefixes
    codes = np.frombuffer(text.encode("utf-32-le", "surrogatepass"), np.uint32)
    wide = codes[codes >= 0x80]
    chars, first = np.unique(wide, return_index=True)
    atoms: dict[bytes, None] = {bytes([b]): None for b in range(256)}
    for code in chars[np.argsort(first)].tolist():
        cb = chr(code).encode("utf-8")
        for k in range(2, len(cb) + 1):
            atoms.setdefault(cb[:k])
    ranks: dict[bytes, int] = {}
    rank_to_ids: list[list[int]] = []
    for raw in atoms:
        ranks[raw] = len(rank_to_ids)
        rank_to_ids.append([normal[raw]] if raw in normal else fallback(raw))
    raws = list(filterfalse(ranks.__contains__, normal))
    ids = np.fromiter(map(normal.__getitem__, raws), np.int64, len(raws))
    key = -np.asarray(scores, np.float64)[ids]
    if np.isnan(key).any():         # NaN does not order: as Python's sort leaves it, from id order
        by_id = np.argsort(ids).tolist()
        ordered = sorted((-float(scores[ids[k]]), int(ids[k]), raws[k]) for k in by_id)
        raws, ids = [raw for _, _, raw in ordered], [i for _, i, _ in ordered]
    else:                           # by descending score, then id
        order = np.lexsort((ids, key))
        raws, ids = list(map(raws.__getitem__, order.tolist())), ids[order].tolist()
    ranks.update(zip(raws, range(len(rank_to_ids), len(rank_to_ids) + len(raws))))
    rank_to_ids.extend(map(list, zip(ids)))     # [id] each
    return ranks, rank_to_ids
