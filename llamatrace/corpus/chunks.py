"""A text cut into chunks of ``n_ctx`` tokens, as ``llama-perplexity`` cuts it.

llama.cpp ``tools/perplexity/perplexity.cpp`` (``perplexity()``): the whole text is tokenized
once, with BOS first where the vocabulary adds one; ``n_chunk = n_tokens // n_ctx`` (at most
``--chunks``); chunk ``i`` is ``tokens[i*n_ctx : (i+1)*n_ctx]`` with its first slot replaced by
BOS where the vocabulary adds one; at least ``2 * n_ctx`` tokens are needed.

That minimum is llama-perplexity's (and llama-imatrix's, which prints a perplexity as it goes), so
``perplexity`` and the KLD measurements of ``quantize`` keep it. A command that counts every token
of every chunk and scores none (``imatrix``, ``expert-load``) has no use for a second chunk: it
takes ``two_chunks=False``, and one chunk is enough; a text shorter than ``n_ctx`` is then one
chunk of its own length.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from llamatrace.errors import OptionError, PromptError


def read_header(model_path: Path):
    """``(tokenizer, config)`` of a GGUF, read without packing its weights (a parent of worker
    processes needs no model).

    Raises:
        ModelNotFoundError, ModelFormatError, UnsupportedModelError: the file cannot be used.
    """
    from llamatrace.gguf.reader import open_gguf
    from llamatrace.model.config import ModelConfig
    from llamatrace.text.tokenizer import Tokenizer
    with open_gguf(model_path) as f:
        return Tokenizer.from_reader(f, path=str(model_path)), ModelConfig.from_gguf(f)


def read_corpus(path: Path, option: str = "-f") -> str:
    """The UTF-8 text of ``path``; ``-`` is standard input (read whole, as ``generate -f -``).
    ``option`` names where the path came from in errors.

    Raises:
        OptionError: the file is missing or unreadable.
        PromptError: it is empty (or only whitespace), or binary (a NUL byte, or not UTF-8).
    """
    if str(path) == "-" and sys.stdin is None:
        raise OptionError(f"{option} -: standard input is closed; pipe the text in or give a file's path")
    try:
        data = sys.stdin.buffer.read() if str(path) == "-" else Path(path).read_bytes()
    except OSError as exc:
        raise OptionError(f"{option} {str(path)!r}: cannot read it ({exc.strerror or exc})") from None
    if b"\x00" in data:
        raise PromptError(f"{option} {str(path)!r} is a binary file (it contains NUL bytes): give a text file")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise PromptError(f"{option} {str(path)!r} is not UTF-8 text (invalid byte at offset {exc.start}): "
                          f"give a UTF-8 text file") from None
    if not text.strip():
        raise PromptError(f"{option} {str(path)!r} is empty: give a text file with some text in it")
    return text


@dataclass
class Chunks:
    """Token ids of a corpus and how they are cut.

    Attributes:
        tokens: int32 ``[n_tokens]``, the whole text (BOS first where the vocabulary adds one).
        n_ctx: tokens per chunk (``--ctx-size``).
        n_chunk: chunks evaluated.
        bos_id: put in each chunk's first slot, or ``None`` when the vocabulary adds no BOS.
    """

    tokens: np.ndarray
    n_ctx: int
    n_chunk: int
    bos_id: int | None

    @property
    def first(self) -> int:
        """First scored position: logits ``first … n_ctx-2`` predict tokens ``first+1 … n_ctx-1``."""
        return self.n_ctx // 2

    @property
    def n_scored(self) -> int:
        """Scored tokens per chunk."""
        return self.n_ctx - 1 - self.first

    def chunk(self, i: int) -> np.ndarray:
        """int32 ``[n_ctx]`` ids fed for chunk ``i`` (BOS in the first slot if the vocabulary adds one)."""
        ids = self.tokens[i * self.n_ctx:(i + 1) * self.n_ctx].copy()
        if self.bos_id is not None:
            ids[0] = self.bos_id
        return ids

    def targets(self, i: int) -> np.ndarray:
        """int64 ``[n_scored]``: the tokens predicted by the scored positions of chunk ``i``."""
        start = i * self.n_ctx
        return self.tokens[start + self.first + 1:start + self.n_ctx].astype(np.int64)


def make_chunks(tokenizer, text: str, n_ctx: int, max_chunks: int | None, max_seq_len: int,
                command: str = "perplexity", two_chunks: bool = True) -> Chunks:
    """Tokenize ``text`` and cut it into chunks of ``n_ctx`` tokens (``command``: what the
    error for a short text names).

    Args:
        two_chunks: llama-perplexity's rule, at least ``2 * n_ctx`` tokens (the module docstring);
            ``False``: one chunk is enough, and a text shorter than ``n_ctx`` tokens is one chunk
            of its own length (the returned ``n_ctx`` is then that length).

    Raises:
        OptionError: ``n_ctx`` below 4 or over the model's context ``max_seq_len``, or
            ``max_chunks`` below 1.
        PromptError: fewer than ``2 * n_ctx`` tokens, with ``two_chunks``; no token at all.
    """
    if not 4 <= n_ctx <= max_seq_len:
        raise OptionError(f"--ctx-size {n_ctx} is out of range: it must be between 4 and the model's "
                          f"context length {max_seq_len}")
    if max_chunks is not None and max_chunks < 1:
        raise OptionError(f"--chunks must be a positive integer, got {max_chunks}")
    ids = np.asarray(tokenizer.encode(text), dtype=np.int32)
    if two_chunks and len(ids) < 2 * n_ctx:
        raise PromptError(f"the text tokenizes to {len(ids)} tokens: {command} with --ctx-size {n_ctx} "
                          f"needs at least {2 * n_ctx} (two chunks); give a longer text or a smaller --ctx-size")
    if len(ids) == 0:
        raise PromptError(f"the text tokenizes to no token: {command} needs at least one; give a longer text")
    if len(ids) < n_ctx:                        # without two_chunks only: the whole text, one shorter chunk
        n_ctx = len(ids)
    n_chunk = len(ids) // n_ctx
    if max_chunks is not None:
        n_chunk = min(n_chunk, max_chunks)
    return Chunks(ids, n_ctx, n_chunk, tokenizer.bos_id if tokenizer.add_bos else None)
