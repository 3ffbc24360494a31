"""Text ↔ token ids for GGUF models: byte-level BPE (``tokenizer.ggml.model = "gpt2"``) and
SentencePiece (``"llama"``: Llama 1/2, Mistral, TinyLlama, CodeLlama).

The GGUF file carries the whole tokenizer as metadata:

    tokenizer.ggml.tokens       [n_vocab] str   GPT-2 byte-level text of every token ('Ġthe' is b' the')
    tokenizer.ggml.token_type   [n_vocab] i32   1 normal, 2 unknown, 3 control, 4 user-defined, 5 unused, 6 byte
    tokenizer.ggml.merges       [n_merges] str  'Ġ t', 'h e', ... in priority order (first = merged first)
    tokenizer.ggml.pre          str             which pre-tokenizer regex splits text into words
    tokenizer.ggml.scores       [n_vocab] f32   SentencePiece only: merge priority (higher = merged first)
    tokenizer.ggml.add_space_prefix  bool       SentencePiece only: ' ' before the text (true when absent)
    tokenizer.chat_template     str             Jinja template that turns messages into a prompt (chat.py)

We turn it into a :class:`tiktoken.Encoding` (ranks built in :mod:`llamatrace.text.vocab`), the
same thin-wrapper design as Meta's Llama 3 tokenizer.

Traps written down where they bite: a vocabulary may lack single bytes (SmolLM2 lacks 21), on which
tiktoken panics; Hugging Face silently drops such bytes and so do we (with one warning).
"""

from __future__ import annotations

import codecs
import re
import warnings
from collections.abc import Iterable, Sequence
from itertools import compress
from numbers import Integral
from typing import TYPE_CHECKING

import regex  # tiktoken's own dependency: DeepSeek's regex sequences, the rare missing-byte path
import tiktoken

from llamatrace.errors import ModelFormatError, PromptError, UnsupportedModelError, shown
from llamatrace.text.vocab import (
    SPM_SPACE,
    TOKEN_CONTROL,
    TOKEN_NORMAL,
    TOKEN_USER_DEFINED,
    bpe_ranks,
    bytes_to_unicode,
    bpe_token_bytes,
    spm_ranks,
    spm_token_bytes,
)

if TYPE_CHECKING:
    from llamatrace.gguf.reader import GGUFFile, StringArray

__all__ = ["StreamDecoder", "Tokenizer", "bytes_to_unicode"]  # bytes_to_unicode lives in text.vocab


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

# Qwen2 / Qwen2.5 / Qwen3 (llama.cpp LLAMA_VOCAB_PRE_TYPE_QWEN2, Qwen's tokenizer.json): Llama 3's with
# single digits; Qwen3.5 (LLAMA_VOCAB_PRE_TYPE_QWEN35) also counts combining marks (\p{M}) as letters.
QWEN2_PATTERN = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
QWEN35_PATTERN = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)

# SmolLM / StarCoder: HF splits in two passes, Digits(individual_digits=True) and then the GPT-2
# ByteLevel regex on each non-digit piece (llama.cpp does the same with two regexes: "\p{N}" then GPT-2).
# One tiktoken regex reproduces both passes: a digit is a piece of its own, no alternative may run
# across a digit, and a digit ends a piece, so "whitespace followed by the end of the piece" becomes
# `\s+(?![^\s\p{N}])` ("a  1" splits as "a", "  ", "1", not "a", " ", " ", "1").
SMOLLM_PATTERN = r"""\p{N}|'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?[^\s\p{L}\p{N}]+|\s+(?![^\s\p{N}])|\s+"""

# GPT-4o / gpt-oss (o200k), tiktoken's o200k_base pat_str (tiktoken_ext/openai_public.py; llama.cpp's
# LLAMA_VOCAB_PRE_TYPE_GPT4O quotes it and runs an equivalent rewrite without the case classes)
O200K_PATTERN = "|".join((
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""\p{N}{1,3}""",
    r""" ?[^\s\p{L}\p{N}]+[\r\n/]*""",
    r"""\s*[\r\n]+""",
    r"""\s+(?!\S)""",
    r"""\s+""",
))

# Mistral's Tekken (Mistral Nemo, Small 3, Ministral, Devstral: `tokenizer.ggml.pre = tekken`), the
# "pattern" of Mistral's tekken.json (mistral_common's Tekkenizer splits with it through tiktoken) and
# of those models' tokenizer.json: o200k's case classes without the contractions, single digits, and
# `/` kept after a newline. llama.cpp's LLAMA_VOCAB_PRE_TYPE_TEKKEN quotes it and runs a rewrite
# whose letter classes are ASCII-cased and leave out combining marks; this is the original. (Files
# converted from the Hugging Face copies of Pixtral and Mistral Small 3.1 say `pixtral`: llama.cpp
# splits those with Llama 3's regex, as their tokenizer.json does, and so does llamatrace.)
TEKKEN_PATTERN = "|".join((
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*""",
    r"""\p{N}""",
    r""" ?[^\s\p{L}\p{N}]+[\r\n/]*""",
    r"""\s*[\r\n]+""",
    r"""\s+(?!\S)""",
    r"""\s+""",
))

PRE_PATTERNS: dict[str, str] = {"gpt2": GPT2_PATTERN, "llama3": LLAMA3_PATTERN, "qwen2": QWEN2_PATTERN,
                                "qwen35": QWEN35_PATTERN, "smollm": SMOLLM_PATTERN, "o200k": O200K_PATTERN,
                                "tekken": TEKKEN_PATTERN}

# DeepSeek LLM / Coder: several regexes applied in sequence (llama.cpp llama-vocab.cpp; HF's Sequence of
# Split(isolated)): each splits every piece of the previous one into matches and the text between them.
# One tiktoken pattern cannot say that, so these split with `regex` and tiktoken encodes each piece.
# Copied from llama.cpp by a script; \uXXXX marks characters that Unicode normalization would change.
DEEPSEEK_LLM_SEQUENCE = (
    "[\r\n]",
    "\\s?[A-Za-zµÀ-ÖØ-öø-ƺƼ-ƿǄ-ʓʕ-ʯͰ-ͳͶͷͻ-ͽͿΆΈ-ΊΌΎ-ΡΣ-ϵϷ-ҁҊ-ԯԱ-ՖႠ-ჅᎠ-Ᏽᏸ-ᏽᲐ-ᲺᲽ-Ჿᴀ-ᴫᵫ-ᵷᵹ-ᶚḀ-ἕἘ-Ἕἠ-ὅὈ-Ὅὐ-ὗὙὛὝὟ-\u1f7dᾀ-ᾴᾶ-ᾼ\u1fbeῂ-ῄῆ-ῌῐ-\u1fd3ῖ-\u1fdbῠ-Ῥῲ-ῴῶ-ῼℂℇℊ-ℓℕℙ-ℝℤ\u2126ℨ\u212a-ℭℯ-ℴℹℼ-ℿⅅ-ⅉⅎↃↄⰀ-ⱻⱾ-ⳤⳫ-ⳮⳲⳳꙀ-ꙭꚀ-ꚛꜢ-ꝯꝱ-ꞇꞋ-ꞎꭰ-ꮿﬀ-ﬆﬓ-ﬗＡ-Ｚａ-ｚ𐐀-𐑏𐒰-𐓓𐓘-𐓻𐲀-𐲲𐳀-𐳲𑢠-𑣟𞤀-𞥃]+",
    "\\s?[!-/:-~！-／：-～‘-‟　-。]+",
    "\\s+\\Z",  # llama.cpp's `\s+$`: the end of the piece ($ would also match before a final \n)
    "[一-龥ࠀ-一가-퟿]+",
    "\\p{N}+",
)
DEEPSEEK_CODER_SEQUENCE = ("[\r\n]", "\\s?\\p{L}+", "\\s?\\p{P}+", "[一-龥ࠀ-一가-퟿]+", "\\p{N}")
PRE_SEQUENCES: dict[str, tuple[str, ...]] = {"deepseek-llm": DEEPSEEK_LLM_SEQUENCE,
                                             "deepseek-coder": DEEPSEEK_CODER_SEQUENCE}
WHOLE_TEXT_PATTERN = r"[\s\S]+"  # one piece: SentencePiece, and each piece of a regex sequence

# tokenizer.ggml.pre value → pattern, following llama.cpp's llama-vocab.cpp groups of identical regexes
PRE_ALIASES: dict[str, str] = {
    "gpt2": "gpt2", "gpt-2": "gpt2", "phi-2": "gpt2", "mpt": "gpt2", "olmo": "gpt2",
    "llama-bpe": "llama3", "llama3": "llama3", "llama-v3": "llama3", "falcon3": "llama3",
    "dbrx": "llama3", "smaug-bpe": "llama3", "pixtral": "llama3",
    "qwen2": "qwen2", "deepseek-r1-qwen": "qwen2", "megrez": "qwen2", "qwen35": "qwen35",
    "smollm": "smollm", "starcoder": "smollm", "refact": "smollm", "codeshell": "smollm",
    "deepseek-llm": "deepseek-llm", "deepseek-coder": "deepseek-coder",
    "gpt-4o": "o200k", "tekken": "tekken",
}  # fmt: skip

# tokenizer.ggml.pre values for which llama.cpp adds BOS when the file has no add_bos_token (llama-vocab.cpp:
# the llama3 group and tekken; not dbrx or smaug-bpe, whose regex is llama3's)
ADD_BOS_PRE = frozenset({"llama3", "llama-v3", "llama-bpe", "falcon3", "pixtral", "tekken"})

# Texts of tokens that end generation: llama.cpp's list (llama-vocab.cpp, llama_vocab::impl::load)
# plus DeepSeek Coder's "<|EOT|>". As in llama.cpp, a token with such a text stops generation whatever
# its type, and a user-defined one becomes a control token, which user text cannot produce (Gemma's
# HTML tag "</s>" is one).
STOP_TOKEN_NAMES = frozenset(
    {"<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<|flush|>", "<|calls|>", "<end_of_turn>",
     "<|endoftext|>", "</s>", "<|eom_id|>", "<EOT>", "_<EOT>", "[EOT]", "[EOS]", "<|end_of_text|>",
     "<end_of_utterance>", "<eos>", "<turn|>", "<|tool_response>", "<｜end▁of▁sentence｜>", "[e~[", "<|EOT|>"}
)


def _field(f: GGUFFile, key: str, default=None):
    return f.field(key, default)


class Tokenizer:
    """A GGUF vocabulary (byte-level BPE or SentencePiece), encoding with a :class:`tiktoken.Encoding`.

    ``encode`` treats its text as user text: "<|im_end|>" typed by a user stays plain text (several
    ids). Only the chat template's own text (``encode_chat``) can produce control tokens.
    """

    n_vocab: int
    kind: str  # "bpe" or "spm"
    bos_id: int | None
    eos_id: int | None
    add_bos: bool
    add_eos: bool  # llama.cpp's add_special appends EOS (Qwen3-Embedding's files say so)
    add_space_prefix: bool  # SentencePiece: a space before the text (and after a control token)
    stop_ids: frozenset[int]
    chat_template: str | None
    vocab_tables: tuple  # (id → bytes, tiktoken ranks, rank → id | None, rank → ids | None): what the cache keeps

    def __init__(
        self,
        tokens: Sequence[str],
        token_types: Sequence[int] | None,
        merges: Sequence[str] | StringArray,
        pre: str | None,
        *,
        kind: str = "bpe",
        scores: Sequence[float] | None = None,
        add_space_prefix: bool | None = None,
        bos_id: int | None = None,
        eos_id: int | None = None,
        eot_id: int | None = None,
        eom_id: int | None = None,
        add_bos: bool | None = None,
        add_eos: bool | None = None,
        chat_template: str | None = None,
        path: str = "",
        vocab: tuple | None = None,
    ) -> None:
        """``vocab``: :attr:`vocab_tables` of a tokenizer built from the same tokens, types,
        merges and scores (:mod:`llamatrace.text.tokcache`): ``merges`` and ``scores`` are then
        not read."""
        self._where = where = f" in {path}" if path else ""
        self.kind = kind
        self.n_vocab = n = len(tokens)
        types = self._check_types(tokens, token_types)
        self.bos_id = self._valid_id(bos_id, "tokenizer.ggml.bos_token_id")
        self.eos_id = self._valid_id(eos_id, "tokenizer.ggml.eos_token_id")
        self.chat_template = chat_template or None
        self.pre = "sentencepiece" if kind == "spm" else self._pre_name(pre, where)
        self.add_space_prefix = kind == "spm" and add_space_prefix is not False  # llama.cpp: true when absent

        if vocab is not None:
            self._id_bytes, ranks, self._rank_to_id, self._rank_to_ids = vocab
        elif kind == "spm":
            self._id_bytes = spm_token_bytes(tokens, types)
            if scores is None or len(scores) != n:
                raise ModelFormatError(f"tokenizer.ggml.scores must give one score per token{where}")
            ranks, self._rank_to_ids = spm_ranks(tokens, types, scores, self._id_bytes)
            self._rank_to_id = None
        else:
            self._id_bytes, is_text = bpe_token_bytes(tokens, types)
            ranks, self._rank_to_id = bpe_ranks(types, merges, self._id_bytes, is_text, where)
            self._rank_to_ids = None
        # what the lines above derive from the vocabulary, before _make_encoding extends the lists
        self.vocab_tables = (self._id_bytes, ranks, *(None if r is None else list(r)
                                                      for r in (self._rank_to_id, self._rank_to_ids)))
        self._ids_are_ranks = self._rank_to_id is None and self._rank_to_ids is None
        stop_texts = _stop_texts(tokens)
        stop_token_ids = list(compress(range(n), map(stop_texts.__contains__, tokens)))
        for i in stop_token_ids:
            if types[i] == TOKEN_USER_DEFINED:
                types[i] = TOKEN_CONTROL
        self._make_encoding(tokens, types, ranks)

        # bytes with no single-byte token: Hugging Face drops them, tiktoken would panic
        self.missing_bytes = bytes(b for b in range(256) if bytes([b]) not in ranks)
        self._warned_missing = False

        if add_bos is None:  # llama.cpp's default when the file does not say: by the pre-tokenizer's name
            add_bos = kind == "spm" or pre in ADD_BOS_PRE
        self.add_bos = bool(add_bos) and self.bos_id is not None
        self.add_eos = bool(add_eos) and self.eos_id is not None   # llama.cpp: false when absent

        stops = {self._valid_id(eot_id, "tokenizer.ggml.eot_token_id"),
                 self._valid_id(eom_id, "tokenizer.ggml.eom_token_id"), self.eos_id}
        stops.update(stop_token_ids)
        self.stop_ids = frozenset(i for i in stops if i is not None)

    def _check_types(self, tokens: Sequence[str], token_types: Sequence[int] | None) -> list[int]:
        if self.n_vocab == 0:
            raise ModelFormatError(f"tokenizer.ggml.tokens is empty{self._where}")
        types = list(token_types) if token_types is not None else [TOKEN_NORMAL] * self.n_vocab
        if len(types) != self.n_vocab:
            raise ModelFormatError(f"tokenizer.ggml.token_type has {len(types)} entries but there are "
                                   f"{self.n_vocab} tokens{self._where}")
        return types

    def _valid_id(self, i: int | None, key: str) -> int | None:
        if i is None:
            return None
        if not 0 <= i < self.n_vocab:
            warnings.warn(f"{key} = {i} is outside the vocabulary of {self.n_vocab} tokens{self._where}; ignored",
                          stacklevel=4)
            return None
        return int(i)

    def _make_encoding(self, tokens: Sequence[str], types: list[int], ranks: dict[bytes, int]) -> None:
        """The tiktoken Encoding, with control and user-defined tokens as its special tokens."""
        special_ids = list(compress(range(len(types)), map({TOKEN_CONTROL, TOKEN_USER_DEFINED}.__contains__, types)))
        specials: dict[str, int] = {}
        for i in special_ids:
            text = tokens[i]
            if text and text.encode("utf-8") not in ranks:
                specials.setdefault(text, i)
        base = len(ranks)  # special ranks follow the others and map back to their ids
        if self._rank_to_id is not None:
            self._rank_to_id.extend(specials.values())
            specials = {text: base + k for k, text in enumerate(specials)}
        elif self._rank_to_ids is not None:
            self._rank_to_ids.extend([i] for i in specials.values())
            specials = {text: base + k for k, text in enumerate(specials)}
        self._sequence = [regex.compile(p) for p in PRE_SEQUENCES.get(self.pre, ())]
        whole = self.kind == "spm" or bool(self._sequence)
        pattern = WHOLE_TEXT_PATTERN if whole else PRE_PATTERNS[self.pre]
        self.encoding = tiktoken.Encoding(name=f"gguf-{self.pre}-{self.n_vocab}", pat_str=pattern,
                                          mergeable_ranks=ranks, special_tokens=specials)
        self._split_re = regex.compile(pattern)

        # special-token text → id; template text may produce all of them, user text only user-defined ones
        self._special_ids = {tokens[i]: i for i in reversed(special_ids) if tokens[i]}
        user_defined = [tokens[i] for i in special_ids if types[i] == TOKEN_USER_DEFINED and tokens[i]]
        self._template_special_re = _alternation(self._special_ids)
        self._user_special_re = _alternation(user_defined)

    @staticmethod
    def _pre_name(pre: str | None, where: str) -> str:
        if pre is None or pre == "default":
            warnings.warn(
                f"tokenizer.ggml.pre is {'missing' if pre is None else shown(pre)}{where}; "
                "splitting text with the GPT-2 regex",
                stacklevel=4,
            )
            return "gpt2"
        if pre not in PRE_ALIASES:
            raise UnsupportedModelError(
                f"pre-tokenizer tokenizer.ggml.pre = {shown(pre)}{where} is not supported; "
                f"supported: {', '.join(sorted(PRE_ALIASES))}, default"
            )
        return PRE_ALIASES[pre]

    def describe(self) -> str:
        """One line for ``llamatrace info``: 'SentencePiece, 32000 tokens, space prefix' or
        'byte-level BPE (pre-tokenizer smollm), 49152 tokens'."""
        if self.kind == "spm":
            return f"SentencePiece, {self.n_vocab} tokens{', space prefix' if self.add_space_prefix else ''}"
        return f"byte-level BPE (pre-tokenizer {self.pre}), {self.n_vocab} tokens"

    @classmethod
    def from_reader(cls, reader: GGUFFile, path: str = "", cache: bool | None = None) -> Tokenizer:
        """Build the tokenizer from the ``tokenizer.*`` metadata of an open GGUF file (``path``:
        its name in messages). ``cache``: read and write the tokenizer cache
        (:mod:`llamatrace.text.tokcache`, beside the packed weights); ``None``: on unless
        ``$LLAMATRACE_NO_CACHE`` is set (:func:`llamatrace.model.packcache.enabled`).

        Raises:
            ModelFormatError, UnsupportedModelError: no tokenizer, or one llamatrace can't read.
        """
        from llamatrace.model.packcache import enabled
        from llamatrace.text import tokcache
        where = f" in {path}" if path else ""
        model = _field(reader, "tokenizer.ggml.model")
        if model is None:
            raise ModelFormatError(f"no tokenizer.ggml.model{where}: the file carries no tokenizer; use a GGUF converted with its vocabulary (llama.cpp convert_hf_to_gguf.py)")
        if model not in ("gpt2", "llama"):
            raise UnsupportedModelError(
                f"tokenizer.ggml.model = {shown(model)}{where} is not supported; byte-level BPE ('gpt2') and "
                "SentencePiece ('llama') are"
            )
        entry = tokcache.Entry.open(reader) if enabled(cache) else None
        stored = entry.read() if entry is not None else None
        if stored is not None:
            tokens, types, vocab = stored
        else:
            tokens, types, vocab = _field(reader, "tokenizer.ggml.tokens"), _field(reader, "tokenizer.ggml.token_type"), None
        if not tokens:
            raise ModelFormatError(f"tokenizer.ggml.tokens is missing{where}")
        tok = cls(
            tokens,
            types,
            (reader.strings("tokenizer.ggml.merges") or ()) if vocab is None else (),
            _field(reader, "tokenizer.ggml.pre"),
            kind="spm" if model == "llama" else "bpe",
            scores=_field(reader, "tokenizer.ggml.scores") if vocab is None else None,
            add_space_prefix=_field(reader, "tokenizer.ggml.add_space_prefix"),
            bos_id=_field(reader, "tokenizer.ggml.bos_token_id"),
            eos_id=_field(reader, "tokenizer.ggml.eos_token_id"),
            eot_id=_field(reader, "tokenizer.ggml.eot_token_id"),
            eom_id=_field(reader, "tokenizer.ggml.eom_token_id"),
            add_bos=_field(reader, "tokenizer.ggml.add_bos_token"),
            add_eos=_field(reader, "tokenizer.ggml.add_eos_token"),
            chat_template=_field(reader, "tokenizer.chat_template"),
            path=path,
            vocab=vocab,
        )
        if entry is not None and stored is None:
            entry.write(tokens, types, tok.vocab_tables)
        return tok

    # ---- encoding ----

    def encode(self, text: str, bos: bool | None = None, eos: bool | None = None) -> list[int]:
        """User text → ids. Control-token text ("<|im_end|>") stays plain text. ``bos`` defaults to
        ``add_bos``, ``eos`` to ``add_eos`` unless ``bos`` is False (a piece of a longer text): the
        defaults add what llama.cpp's ``add_special`` adds.

        Raises:
            TypeError: ``text`` is not a str."""
        if not isinstance(text, str):
            raise TypeError(f"encode takes a str, got {type(text).__name__}")
        ids = [self.bos_id] if (self.add_bos if bos is None else bos) and self.bos_id is not None else []
        if eos is None:
            eos = self.add_eos and bos is not False
        after_special = True  # SentencePiece prefixes a space to text at the start or after a control token
        for segment in self._segments(text, self._user_special_re):
            if isinstance(segment, list):
                ids.extend(segment)
            else:
                ids.extend(self._encode_ordinary(segment, after_special))
            after_special = isinstance(segment, list)
        if eos and self.eos_id is not None:
            ids.append(self.eos_id)
        return ids

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
        """Messages → prompt ids through the model's chat template.

        The template's own text may contain control tokens; message contents are user text. Text
        runs on either side of a content boundary are split by the regex as one string, exactly as
        Hugging Face tokenizes the rendered prompt (``apply_chat_template``).
        """
        from llamatrace.text.chat import render_chat

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
                    ids.extend(self._encode_ordinary(pending, True) + segment)
                    pending = ""
                else:
                    pending += segment
        ids.extend(self._encode_ordinary(pending, True))
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

    def _encode_ordinary(self, text: str, after_special: bool) -> list[int]:
        """Text without special tokens → ids. ``after_special``: the text starts the input or follows
        a control token (SentencePiece then prefixes a space when ``add_space_prefix``)."""
        if not text:
            return []
        try:
            raw = text.encode("utf-8")
        except UnicodeEncodeError:  # lone surrogates: replaced by U+FFFD, as tiktoken does
            text = text.encode("utf-16", "surrogatepass").decode("utf-16", "replace")
            raw = text.encode("utf-8")
        if self.kind == "spm":
            text = (" " if after_special and self.add_space_prefix else "") + text
            ranks = self.encoding.encode_ordinary(text.replace(" ", SPM_SPACE))
            return [i for r in ranks for i in self._rank_to_ids[r]]
        if self.missing_bytes and len(raw.translate(None, self.missing_bytes)) != len(raw):
            ranks = self._encode_dropping_missing(text)
        elif self._sequence:
            ranks = [r for word in self._words(text) for r in self.encoding.encode_ordinary(word)]
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

    def _words(self, text: str) -> list[str]:
        """The pre-tokenizer's pieces: one regex, or a sequence where each regex splits every piece
        into its matches and the text between them (llama.cpp's unicode_regex_split)."""
        if not self._sequence:
            return self._split_re.findall(text)
        pieces = [text]
        for pattern in self._sequence:
            split: list[str] = []
            for piece in pieces:
                start = 0
                for m in pattern.finditer(piece):
                    if m.start() > start:
                        split.append(piece[start : m.start()])
                    if m.end() > m.start():
                        split.append(m.group())
                    start = m.end()
                if start < len(piece):
                    split.append(piece[start:])
            pieces = split
        return pieces

    def _encode_dropping_missing(self, text: str) -> list[int]:
        """Split like tiktoken, then BPE each word without the bytes the vocabulary lacks (as HF does)."""
        if not self._warned_missing:
            self._warned_missing = True
            found = sorted(set(text.encode("utf-8")) & set(self.missing_bytes))
            warnings.warn(
                f"the text contains bytes the vocabulary has no token for "
                f"({', '.join(f'0x{b:02x}' for b in found)}); they are dropped",
                stacklevel=4,
            )
        ranks: list[int] = []
        for word in self._words(text):
            raw = word.encode("utf-8").translate(None, self.missing_bytes)
            if raw:
                ranks.extend(self.encoding._encode_single_piece(raw))
        return ranks

    # ---- decoding ----

    def decode_bytes(self, ids: Iterable[int]) -> bytes:
        """Ids → the raw bytes they stand for (control tokens as their literal text)."""
        ids = list(ids)
        try:
            if ids and min(ids) < 0:          # a list would take -1 as its last entry
                raise IndexError
            return b"".join([self._id_bytes[i] for i in ids])
        except (IndexError, TypeError):
            bad = next(i for i in ids if not (isinstance(i, Integral) and 0 <= i < self.n_vocab))
            raise ValueError(f"token id {bad!r} is outside the vocabulary of {self.n_vocab} tokens") from None

    def decode(self, ids: Iterable[int]) -> str:
        """Ids → text; bytes that are not valid UTF-8 become U+FFFD.

        With a SentencePiece space prefix, one leading space of the first token is dropped, as
        llama.cpp's detokenize does (a leading BOS keeps it: "<s> Hello")."""
        raw = self.decode_bytes(list(ids))
        if self.add_space_prefix and raw.startswith(b" "):
            raw = raw[1:]
        return raw.decode("utf-8", errors="replace")

    def piece(self, id: int) -> str:
        """One token as display text: 'Ġthe' → ' the', control tokens as-is, a partial UTF-8 char as '\\xf0'."""
        if not 0 <= id < self.n_vocab:
            raise ValueError(f"token id {id!r} is outside the vocabulary of {self.n_vocab} tokens")
        return self._id_bytes[id].decode("utf-8", errors="backslashreplace")

    def __repr__(self) -> str:
        return (
            f"Tokenizer(n_vocab={self.n_vocab}, kind={self.kind!r}, pre={self.pre!r}, "
            f"bos_id={self.bos_id}, eos_id={self.eos_id}, "
            f"add_bos={self.add_bos}, add_eos={self.add_eos}, stop_ids={sorted(self.stop_ids)})"
        )


_DOUBLED_BYTE = re.compile(r"(?<!\\)((?:\\\\)*)\\\\x([89a-f][0-9a-f])")     # a partial character's bytes are >= 0x80


def quoted(piece: str) -> str:
    """A piece as a quoted Python literal for tables and log lines: ``repr``, except that a byte
    of a partial UTF-8 character (:meth:`Tokenizer.piece`'s ``\\xc3``) stays one escape, as Python
    shows bytes (``' \\xc3'``, not ``' \\\\xc3'``)."""
    return _DOUBLED_BYTE.sub(r"\1\\x\2", repr(piece))


def _stop_texts(tokens: Sequence[str]) -> set[str]:
    """The texts of :data:`STOP_TOKEN_NAMES` this vocabulary has, less llama.cpp's two exceptions:
    "<|end|>" is ordinary beside gpt-oss's or solar-open's call markers, "</s>" beside gemma4's
    "<|tool_response>" or plamo's "<|plamo:eos|>"."""
    texts = STOP_TOKEN_NAMES.intersection(tokens)
    if {"<|call|>", "<|calls|>"} & texts and {"<|return|>", "<|flush|>"} & texts:
        texts.discard("<|end|>")
    if "<|tool_response>" in texts or "<|plamo:eos|>" in tokens:
        texts.discard("</s>")
    return texts


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
