"""The base model's log-probabilities on disk: llama.cpp's ``--kl-divergence-base`` file.

The same bytes ``llama-perplexity --kl-divergence-base FILE`` writes (``perplexity.cpp``,
``perplexity()`` with ``logits_file``), so a file made by either tool serves the other::

    char[8]  "_logits_"
    uint32   n_ctx
    int32    n_vocab
    int32    n_chunk
    int32    tokens[n_chunk * n_ctx]          the text's ids (no BOS substitution)
    uint16   rows[n_chunk][n_ctx - 1 - n_ctx/2][row_width(n_vocab)]

each row one scored position: float32 ``scale``, ``min_log_prob`` in its first four uint16, then
``n_vocab`` uint16 ``q`` with ``log p = scale * q + min_log_prob``, padded to even
(:mod:`llamatrace.corpus.metrics`). Little-endian. SmolLM2 (49152 tokens) at ``n_ctx`` 256 takes
12.5 MB a chunk.
"""

from __future__ import annotations

from pathlib import Path
from typing import BinaryIO

import numpy as np

from llamatrace.corpus.chunks import Chunks
from llamatrace.corpus.metrics import row_width
from llamatrace.errors import OptionError

MAGIC = b"_logits_"
_HEAD = np.dtype([("magic", "S8"), ("n_ctx", "<u4"), ("n_vocab", "<i4"), ("n_chunk", "<i4")])


def is_base_file(path: Path) -> bool:
    """True if ``path`` starts with the base file's magic (else it is taken for a GGUF)."""
    try:
        with open(path, "rb") as f:
            return f.read(len(MAGIC)) == MAGIC
    except OSError:
        return False


def write_header(f: BinaryIO, chunks: Chunks, n_vocab: int) -> None:
    """Write the magic, sizes and the ``n_chunk * n_ctx`` token ids."""
    head = np.array([(MAGIC, chunks.n_ctx, n_vocab, chunks.n_chunk)], dtype=_HEAD)
    f.write(head.tobytes())
    f.write(chunks.tokens[:chunks.n_chunk * chunks.n_ctx].astype("<i4").tobytes())


def write_rows(f: BinaryIO, rows: np.ndarray) -> None:
    """Append one chunk's uint16 ``[n_scored, row_width]`` rows."""
    f.write(np.ascontiguousarray(rows, dtype="<u2").tobytes())


class BaseFile:
    """A base file opened read-only (memory-mapped).

    Attributes:
        n_ctx, n_vocab, n_chunk: as stored.
        tokens: int32 ``[n_chunk * n_ctx]``.

    Raises:
        OptionError: the file is unreadable, not a base file, or truncated.
    """

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        try:
            raw = np.memmap(self.path, dtype=np.uint8, mode="r")
        except (OSError, ValueError) as exc:
            raise OptionError(f"--base {str(path)!r}: cannot read it ({exc})") from None
        if raw.size < _HEAD.itemsize or bytes(raw[:8]) != MAGIC:
            raise OptionError(f"--base {str(path)!r} is neither a GGUF model nor a base log-probabilities file")
        head = raw[:_HEAD.itemsize].view(_HEAD)[0]
        self.n_ctx, self.n_vocab, self.n_chunk = int(head["n_ctx"]), int(head["n_vocab"]), int(head["n_chunk"])
        n_tok = self.n_chunk * self.n_ctx
        n_scored = self.n_ctx - 1 - self.n_ctx // 2
        width = row_width(self.n_vocab)
        start = _HEAD.itemsize + 4 * n_tok
        need = start + 2 * self.n_chunk * n_scored * width
        if self.n_ctx < 4 or self.n_vocab < 1 or self.n_chunk < 1 or raw.size < need:
            raise OptionError(f"--base {str(path)!r} is truncated or damaged ({raw.size} bytes, "
                              f"{need} expected for {self.n_chunk} chunks of {self.n_ctx} tokens)")
        self.tokens = raw[_HEAD.itemsize:start].view("<i4")
        self._rows = raw[start:need].view("<u2").reshape(self.n_chunk, n_scored, width)

    def rows(self, i: int) -> np.ndarray:
        """uint16 ``[n_scored, row_width]`` rows of chunk ``i`` (a copy, safe to send to a worker)."""
        return np.array(self._rows[i])
