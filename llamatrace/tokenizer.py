"""Text ↔ token ids for GGUF models with a byte-level BPE vocabulary (``tokenizer.ggml.model = "gpt2"``).

The GGUF file carries the whole tokenizer as metadata:

    tokenizer.ggml.tokens       [n_vocab] str   GPT-2 byte-level text of every token ('Ġthe' is b' the')
    tokenizer.ggml.token_type   [n_vocab] i32   1 normal, 2 unknown, 3 control, 4 user-defined, 5 unused, 6 byte
    tokenizer.ggml.merges       [n_merges] str  'Ġ t', 'h e', ... in priority order (first = merged first)
    tokenizer.ggml.pre          str             which pre-tokenizer regex splits text into words
    tokenizer.chat_template     str             Jinja template that turns messages into a prompt (chat.py)

We turn it into a :class:`tiktoken.Encoding`, the same thin-wrapper design as Meta's Llama 3 tokenizer.
Two facts make that a faithful copy of Hugging Face's BPE:

* tiktoken merges the adjacent pair whose *concatenation* has the lowest rank, so the rank of a
  multi-byte token must be the index of the merge that creates it. When token ids already grow in
  merge order (true of SmolLM2 and Llama 3) the ids serve as ranks; otherwise ranks are renumbered
  and mapped back to ids after encoding.
* tiktoken keeps only the text its split regex matches, so every pattern below ends with a
  catch-all ``|\\s+`` and covers every character.

Traps written down where they bite: a vocabulary may lack single bytes (SmolLM2 lacks 21), on which
tiktoken panics; Hugging Face silently drops such bytes and so do we (with one warning).
"""

from __future__ import annotations

import codecs
import re
import warnings
from collections.abc import Iterable, Sequence
from numbers import Integral
from typing import TYPE_CHECKING

import regex  # tiktoken's own dependency; used only on the rare missing-byte path
import tiktoken

from llamatrace.errors import ModelFormatError, PromptError, UnsupportedModelError

if TYPE_CHECKING:
    from llamatrace.gguf_io import GGUFFile

# token types of tokenizer.ggml.token_type (llama.cpp's llama_token_type)
TOKEN_NORMAL, TOKEN_UNKNOWN, TOKEN_CONTROL, TOKEN_USER_DEFINED, TOKEN_UNUSED, TOKEN_BYTE = 1, 2, 3, 4, 5, 6

# Pre-tokenizer split patterns, in tiktoken's (fancy-regex) syntax.
#
# GPT-2, from openai/gpt-2 encoder.py and HF's ByteLevel pre-tokenizer (llama.cpp's LLAMA_VOCAB_PRE_TYPE_GPT2
# omits the final `|\s+`; llama.cpp keeps unmatched text anyway, tiktoken would drop it).
GPT2_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""

# Llama 3, from meta-llama/llama3 tokenizer.py (= llama.cpp LLAMA_VOCAB_PRE_TYPE_LLAMA3, HF tokenizer.json).
LLAMA3_PATTERN = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)

# SmolLM / StarCoder: HF splits in two passes, Digits(individual_digits=True) and then the GPT-2
# ByteLevel regex on each non-digit piece (llama.cpp does the same with two regexes: "\p{N}" then GPT-2).
# One tiktoken regex reproduces both passes: a digit is a piece of its own, no alternative may run
# across a digit, and a digit ends a piece, so "whitespace followed by the end of the piece" becomes
# `\s+(?![^\s\p{N}])` ("a  1" splits as "a", "  ", "1", not "a", " ", " ", "1").
SMOLLM_PATTERN = r"""\p{N}|'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?[^\s\p{L}\p{N}]+|\s+(?![^\s\p{N}])|\s+"""

PRE_PATTERNS: dict[str, str] = {"gpt2": GPT2_PATTERN, "llama3": LLAMA3_PATTERN, "smollm": SMOLLM_PATTERN}

# tokenizer.ggml.pre value → pattern, following llama.cpp's llama-vocab.cpp groups of identical regexes
PRE_ALIASES: dict[str, str] = {
    "gpt2": "gpt2", "gpt-2": "gpt2", "phi-2": "gpt2", "mpt": "gpt2", "olmo": "gpt2",
    "llama-bpe": "llama3", "llama3": "llama3", "llama-v3": "llama3", "falcon3": "llama3",
    "dbrx": "llama3", "smaug-bpe": "llama3",
    "smollm": "smollm", "starcoder": "smollm", "refact": "smollm", "codeshell": "smollm",
}  # fmt: skip

# Names of control tokens that end a turn or the text, in the vocabularies we know.
STOP_TOKEN_NAMES = frozenset(
    {"<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|end_of_text|>", "<|endoftext|>", "<end_of_turn>"}
)


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


def _token_text_to_bytes(text: str) -> bytes | None:
    """'Ġthe' → b' the'; None if the text is not GPT-2 byte-level (then it is a literal string)."""
    if _NOT_BYTE_LEVEL.search(text):
        return None
    return text.translate(_UNICODE_TO_BYTE).encode("latin-1")


def _field(f: GGUFFile, key: str, default=None):
    return f.field(key, default)


class Tokenizer:
    """Byte-level BPE tokenizer read from GGUF metadata, encoding with a :class:`tiktoken.Encoding`.

    ``encode`` treats its text as user text: "<|im_end|>" typed by a user stays plain text (several
    ids). Only the chat template's own text (``encode_chat``) can produce control tokens.
    """

    n_vocab: int
    bos_id: int | None
    eos_id: int | None
    add_bos: bool
    stop_ids: frozenset[int]
    chat_template: str | None

    def __init__(
        self,
        tokens: Sequence[str],
        token_types: Sequence[int] | None,
        merges: Sequence[str],
        pre: str | None,
        *,
        bos_id: int | None = None,
        eos_id: int | None = None,
        eot_id: int | None = None,
        eom_id: int | None = None,
        add_bos: bool | None = None,
        chat_template: str | None = None,
        path: str = "",
    ) -> None:
        where = f" in {path}" if path else ""
        self.n_vocab = n = len(tokens)
        if n == 0:
            raise ModelFormatError(f"tokenizer.ggml.tokens is empty{where}")
        types = list(token_types) if token_types is not None else [TOKEN_NORMAL] * n
        if len(types) != n:
            raise ModelFormatError(
                f"tokenizer.ggml.token_type has {len(types)} entries but there are {n} tokens{where}"
            )

        def valid(i: int | None, key: str) -> int | None:
            if i is None:
                return None
            if not 0 <= i < n:
                warnings.warn(f"{key} = {i} is outside the vocabulary of {n} tokens{where}; ignored", stacklevel=3)
                return None
            return int(i)

        self.bos_id = valid(bos_id, "tokenizer.ggml.bos_token_id")
        self.eos_id = valid(eos_id, "tokenizer.ggml.eos_token_id")
        self.chat_template = chat_template or None
        self.pre = self._pre_name(pre, where)

        # token id → bytes: byte-level text for normal tokens, literal UTF-8 for control/user-defined
        self._id_bytes: list[bytes] = []
        self._is_text_token: list[bool] = []  # control / user-defined / literal: shown as-is by piece()
        for text, ttype in zip(tokens, types):
            raw = _token_text_to_bytes(text) if ttype in (TOKEN_NORMAL, TOKEN_UNUSED, TOKEN_BYTE) else None
            self._is_text_token.append(raw is None)
            self._id_bytes.append(raw if raw is not None else text.encode("utf-8"))

        # the merge that first creates each byte string; its index is the merge priority
        merge_index: dict[bytes, int] = {}
        for i, merge in enumerate(merges):
            left, sep, right = merge.partition(" ")
            lb, rb = _token_text_to_bytes(left), _token_text_to_bytes(right)
            if not sep or lb is None or rb is None:
                raise ModelFormatError(f"tokenizer.ggml.merges[{i}] = {merge!r} is not 'left right'{where}")
            merge_index.setdefault(lb + rb, i)

        # BPE tokens: normal single bytes (the alphabet) and normal tokens that some merge creates.
        # A normal multi-byte token no merge creates can never come out of BPE; it is left out.
        singles: dict[bytes, int] = {}
        merged: list[tuple[int, int, bytes]] = []  # (merge index, id, bytes)
        for i, (ttype, raw) in enumerate(zip(types, self._id_bytes)):
            if ttype != TOKEN_NORMAL or self._is_text_token[i]:
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

        # ranks: use the ids themselves when they already grow in merge order, else renumber
        merged_ids = [i for _, i, _ in merged]
        self._ids_are_ranks = all(a < b for a, b in zip(merged_ids, merged_ids[1:]))
        if self._ids_are_ranks:
            ranks = {raw: i for raw, i in singles.items()} | {raw: i for _, i, raw in merged}
            rank_to_id = None
        else:
            order = [*sorted(singles.items(), key=lambda kv: kv[1]), *((raw, i) for _, i, raw in merged)]
            ranks = {raw: r for r, (raw, _) in enumerate(order)}
            rank_to_id = [i for _, i in order]
        self._rank_to_id = rank_to_id

        # control and user-defined tokens are tiktoken special tokens (their literal text)
        special_ids = [i for i, t in enumerate(types) if t in (TOKEN_CONTROL, TOKEN_USER_DEFINED)]
        specials: dict[str, int] = {}
        for i in special_ids:
            text = tokens[i]
            if text and text.encode("utf-8") not in ranks:
                specials.setdefault(text, i)
        if rank_to_id is not None:  # special ranks follow the BPE ranks and map back to their ids
            base = len(rank_to_id)
            rank_to_id.extend(specials.values())
            specials = {text: base + k for k, text in enumerate(specials)}
        self.encoding = tiktoken.Encoding(
            name=f"gguf-{self.pre}-{n}", pat_str=PRE_PATTERNS[self.pre], mergeable_ranks=ranks,
            special_tokens=specials,
        )  # fmt: skip
        self._split_re = regex.compile(PRE_PATTERNS[self.pre])

        # special-token text → id; template text may produce all of them, user text only user-defined ones
        self._special_ids = {tokens[i]: i for i in reversed(special_ids) if tokens[i]}
        user_defined = [tokens[i] for i in special_ids if types[i] == TOKEN_USER_DEFINED and tokens[i]]
        self._template_special_re = _alternation(self._special_ids)
        self._user_special_re = _alternation(user_defined)

        # bytes with no single-byte token: Hugging Face drops them, tiktoken would panic
        self.missing_bytes = bytes(b for b in range(256) if bytes([b]) not in ranks)
        self._warned_missing = False

        if add_bos is None:  # llama.cpp's default when the file does not say: on for Llama 3 vocabularies
            add_bos = self.pre == "llama3"
        self.add_bos = bool(add_bos) and self.bos_id is not None

        stops = {valid(eot_id, "tokenizer.ggml.eot_token_id"), valid(eom_id, "tokenizer.ggml.eom_token_id")}
        stops.add(self.eos_id)
        stops.update(i for i in special_ids if tokens[i] in STOP_TOKEN_NAMES)
        self.stop_ids = frozenset(i for i in stops if i is not None)

    @staticmethod
    def _pre_name(pre: str | None, where: str) -> str:
        if pre is None or pre == "default":
            warnings.warn(
                f"tokenizer.ggml.pre is {'missing' if pre is None else repr(pre)}{where}; "
                "splitting text with the GPT-2 regex",
                stacklevel=4,
            )
            return "gpt2"
        if pre not in PRE_ALIASES:
            raise UnsupportedModelError(
                f"pre-tokenizer tokenizer.ggml.pre = {pre!r}{where} is not supported; "
                f"supported: {', '.join(sorted(PRE_ALIASES))}, default"
            )
        return PRE_ALIASES[pre]

    @classmethod
    def from_reader(cls, reader: GGUFFile, path: str = "") -> Tokenizer:
        """Build the tokenizer from the ``tokenizer.*`` metadata of an open GGUF file."""
        where = f" in {path}" if path else ""
        model = _field(reader, "tokenizer.ggml.model")
        if model is None:
            raise ModelFormatError(f"no tokenizer.ggml.model{where}: the file carries no tokenizer; use a GGUF converted with its vocabulary (llama.cpp convert_hf_to_gguf.py)")
        if model == "llama":
            raise UnsupportedModelError(
                f"tokenizer.ggml.model = 'llama'{where}: SentencePiece vocabularies (Llama 2) are not supported yet; "
                "use a model with a byte-level BPE ('gpt2') vocabulary such as SmolLM2 or Llama 3"
            )
        if model != "gpt2":
            raise UnsupportedModelError(
                f"tokenizer.ggml.model = {model!r}{where} is not supported; only byte-level BPE ('gpt2') is"
            )
        tokens = _field(reader, "tokenizer.ggml.tokens")
        if not tokens:
            raise ModelFormatError(f"tokenizer.ggml.tokens is missing{where}")
        return cls(
            tokens,
            _field(reader, "tokenizer.ggml.token_type"),
            _field(reader, "tokenizer.ggml.merges", []),
            _field(reader, "tokenizer.ggml.pre"),
            bos_id=_field(reader, "tokenizer.ggml.bos_token_id"),
            eos_id=_field(reader, "tokenizer.ggml.eos_token_id"),
            eot_id=_field(reader, "tokenizer.ggml.eot_token_id"),
            eom_id=_field(reader, "tokenizer.ggml.eom_token_id"),
            add_bos=_field(reader, "tokenizer.ggml.add_bos_token"),
            chat_template=_field(reader, "tokenizer.chat_template"),
            path=path,
        )

    # ---- encoding ----

    def encode(self, text: str, bos: bool | None = None) -> list[int]:
        """User text → ids. Control-token text ("<|im_end|>") stays plain text; ``bos`` defaults to ``add_bos``."""
        ids = [self.bos_id] if (self.add_bos if bos is None else bos) and self.bos_id is not None else []
        for segment in self._segments(text, self._user_special_re):
            ids.extend(segment if isinstance(segment, list) else self._encode_ordinary(segment))
        return ids

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
        """Messages → prompt ids through the model's chat template.

        The template's own text may contain control tokens; message contents are user text. Text
        runs on either side of a content boundary are split by the regex as one string, exactly as
        Hugging Face tokenizes the rendered prompt (``apply_chat_template``).
        """
        from llamatrace.chat import render_chat

        if self.chat_template is None:
            raise PromptError(
                "the model has no chat template (tokenizer.chat_template); use --raw to send the prompt as is"
            )
        token_text = lambda i: self._id_bytes[i].decode("utf-8", "replace") if i is not None else ""  # noqa: E731
        try:
            parts = render_chat(
                self.chat_template, messages, add_generation_prompt=add_generation_prompt,
                bos_token=token_text(self.bos_id), eos_token=token_text(self.eos_id),
            )  # fmt: skip
        except PromptError as exc:
            if "--raw" in str(exc):
                raise
            raise PromptError(f"{exc} (in the model's tokenizer.chat_template); "
                              f"use --raw to send the prompt without it") from None
        ids: list[int] = []
        pending = ""  # ordinary text not yet encoded, possibly spanning template and user parts
        for text, is_user in parts:
            for segment in self._segments(text, self._user_special_re if is_user else self._template_special_re):
                if isinstance(segment, list):
                    ids.extend(self._encode_ordinary(pending) + segment)
                    pending = ""
                else:
                    pending += segment
        ids.extend(self._encode_ordinary(pending))
        return ids

    def _segments(self, text: str, special_re: re.Pattern | None) -> Iterable[str | list[int]]:
        """Split text at special-token matches: ordinary strings and ``[id]`` lists in order."""
        if special_re is None:
            yield text
            return
        start = 0
        for m in special_re.finditer(text):
            if m.start() > start:
                yield text[start : m.start()]
            yield [self._special_ids[m.group()]]
            start = m.end()
        if start < len(text):
            yield text[start:]

    def _encode_ordinary(self, text: str) -> list[int]:
        if not text:
            return []
        try:
            raw = text.encode("utf-8")
        except UnicodeEncodeError:  # lone surrogates: replaced by U+FFFD, as tiktoken does
            text = text.encode("utf-16", "surrogatepass").decode("utf-16", "replace")
            raw = text.encode("utf-8")
        if self.missing_bytes and len(raw.translate(None, self.missing_bytes)) != len(raw):
            ranks = self._encode_dropping_missing(text)
        else:
            try:
                ranks = self.encoding.encode_ordinary(text)
            except BaseException as err:  # pyo3 PanicException derives from BaseException
                if isinstance(err, (KeyboardInterrupt, SystemExit, GeneratorExit)):
                    raise
                ranks = self._encode_dropping_missing(text)
        if self._rank_to_id is None:
            return ranks
        return [self._rank_to_id[r] for r in ranks]

    def _encode_dropping_missing(self, text: str) -> list[int]:
        """Split like tiktoken, then BPE each word without the bytes the vocabulary lacks (as HF does)."""
        if not self._warned_missing:
            self._warned_missing = True
            warnings.warn(
                f"the text contains bytes the vocabulary has no token for "
                f"({', '.join(f'0x{b:02x}' for b in self.missing_bytes)}); they are dropped",
                stacklevel=4,
            )
        ranks: list[int] = []
        for word in self._split_re.findall(text):
            raw = word.encode("utf-8").translate(None, self.missing_bytes)
            if raw:
                ranks.extend(self.encoding._encode_single_piece(raw))
        return ranks

    # ---- decoding ----

    def decode_bytes(self, ids: Iterable[int]) -> bytes:
        """Ids → the raw bytes they stand for (control tokens as their literal text)."""
        ids = list(ids)
        try:
            return b"".join([self._id_bytes[i] for i in ids])
        except (IndexError, TypeError):
            bad = next(i for i in ids if not (isinstance(i, Integral) and 0 <= i < self.n_vocab))
            raise ValueError(f"token id {bad!r} is outside the vocabulary of {self.n_vocab} tokens") from None

    def decode(self, ids: Iterable[int]) -> str:
        """Ids → text; bytes that are not valid UTF-8 become U+FFFD."""
        return self.decode_bytes(list(ids)).decode("utf-8", errors="replace")

    def piece(self, id: int) -> str:
        """One token as display text: 'Ġthe' → ' the', control tokens as-is, a partial UTF-8 char as '\\xf0'."""
        if not 0 <= id < self.n_vocab:
            raise ValueError(f"token id {id!r} is outside the vocabulary of {self.n_vocab} tokens")
        return self._id_bytes[id].decode("utf-8", errors="backslashreplace")

    def is_control(self, id: int) -> bool:
        """True for control and user-defined tokens (their text is a name, not content)."""
        return self._is_text_token[id]

    def __repr__(self) -> str:
        return (
            f"Tokenizer(n_vocab={self.n_vocab}, pre={self.pre!r}, bos_id={self.bos_id}, eos_id={self.eos_id}, "
            f"add_bos={self.add_bos}, stop_ids={sorted(self.stop_ids)})"
        )


def _alternation(texts: Iterable[str]) -> re.Pattern | None:
    """A regex matching any of ``texts``, longest first (so '<|im_end|>x' beats a prefix of it)."""
    texts = sorted(set(texts), key=lambda t: (-len(t), t))
    return re.compile("|".join(map(re.escape, texts))) if texts else None


class StreamDecoder:
    """Incremental decoding for generation: push ids, get the text that is complete so far.

    A character split across tokens (an emoji is often 2–4 byte tokens) is held back until its last
    byte arrives, so no U+FFFD appears mid-stream; ``flush`` emits whatever remains.
    """

    def __init__(self, tok: Tokenizer) -> None:
        self.tok = tok
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, id: int) -> str:
        return self._utf8.decode(self.tok.decode_bytes([id]))

    def flush(self) -> str:
        text = self._utf8.decode(b"", final=True)
        self._utf8.reset()
        return text
