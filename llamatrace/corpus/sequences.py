"""Documents cut into fixed-length token sequences, as SAELens's activation stores cut them.

SAELens ``tokenization_and_batching.concat_and_batch_sequences`` (its defaults
``begin_batch_token="bos"``, ``sequence_separator_token="bos"``, no ``begin_sequence_token``):
each document is tokenized without special tokens; documents are concatenated with the separator
between them; every sequence of ``ctx_size`` tokens starts with the begin-batch token (unless its
first token already is that token); the last, incomplete sequence is dropped. We use BOS for both
where the model adds BOS to a prompt, and otherwise no begin-batch token and EOS as separator.

The sequences stream from the text file line by line (``--jsonl``: one JSON object a line, its
``text_field``), so memory does not grow with the corpus.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Iterator

import numpy as np

from llamatrace.errors import OptionError, PromptError


@dataclass(frozen=True)
class Packing:
    """How documents become sequences (recorded in the manifest).

    Attributes:
        ctx_size: tokens per sequence.
        begin_batch_token: first token of every sequence, or ``None``.
        sequence_separator_token: put between two documents, or ``None``.
        jsonl: the input is JSON lines; ``text_field`` names the text.
    """

    ctx_size: int
    begin_batch_token: int | None
    sequence_separator_token: int | None
    jsonl: bool = False
    text_field: str = "text"

    @classmethod
    def for_tokenizer(cls, tokenizer, ctx_size: int, jsonl: bool = False, text_field: str = "text") -> "Packing":
        if tokenizer.add_bos and tokenizer.bos_id is not None:
            return cls(ctx_size, tokenizer.bos_id, tokenizer.bos_id, jsonl, text_field)
        return cls(ctx_size, None, tokenizer.eos_id, jsonl, text_field)

    def as_json(self) -> dict:
        return asdict(self)


def documents(path: Path, packing: Packing) -> Iterator[str]:
    """The documents of a text file: its non-empty lines, or each line's ``text_field`` (``--jsonl``).

    Raises:
        OptionError: the file cannot be read.
        PromptError: not UTF-8 or binary (a NUL byte, as ``perplexity``'s corpus refuses), a line
            that is not a JSON object with that string field.
    """
    try:
        with open(path, "rb") as f:
            for n, raw in enumerate(f, 1):
                if b"\x00" in raw:
                    raise PromptError(f"-f {str(path)!r} is a binary file (line {n} contains NUL bytes): "
                                      f"give a text file")
                try:
                    line = raw.decode("utf-8").rstrip("\r\n")
                except UnicodeDecodeError as exc:
                    raise PromptError(f"-f {str(path)!r} line {n} is not UTF-8 (invalid byte at offset "
                                      f"{exc.start}): give a UTF-8 text file") from None
                if not line.strip():
                    continue
                if not packing.jsonl:
                    yield line
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as exc:
                    raise PromptError(f"-f {str(path)!r} line {n} is not JSON ({exc.msg}); --jsonl "
                                      f"wants one JSON object a line") from None
                text = record.get(packing.text_field) if isinstance(record, dict) else None
                if not isinstance(text, str):
                    raise PromptError(f"-f {str(path)!r} line {n} has no string field "
                                      f"{packing.text_field!r}; name the field with --text-field")
                yield text
    except OSError as exc:
        raise OptionError(f"-f {str(path)!r}: cannot read it ({exc.strerror or exc})") from None


def pack(docs: Iterator[list[int]], packing: Packing) -> Iterator[np.ndarray]:
    """Sequences of exactly ``ctx_size`` token ids (int32), SAELens's concatenation."""
    ctx, bbt, sep = packing.ctx_size, packing.begin_batch_token, packing.sequence_separator_token
    batch: list[int] | None = None
    for tokens in docs:
        offset = 0
        while offset < len(tokens):
            if batch is None:
                prefix = [bbt] if bbt is not None and tokens[offset] != bbt else []
                need = ctx - len(prefix)
                batch = prefix + tokens[offset:offset + need]
            else:                                   # a new document after an unfinished sequence
                prefix = [sep] if sep is not None and tokens[offset] != sep else []
                need = max(ctx - len(batch) - len(prefix), 0)
                batch = batch + prefix[:ctx - len(batch)] + tokens[offset:offset + need]
            offset += need
            if len(batch) == ctx:
                yield np.asarray(batch, dtype=np.int32)
                batch = None


def sequences(path: Path, tokenizer, packing: Packing) -> Iterator[np.ndarray]:
    """The corpus at ``path`` as ``ctx_size``-token sequences under ``tokenizer``."""
    return pack((tokenizer.encode(doc, bos=False) for doc in documents(path, packing)), packing)
