"""The tokenizer cache: what :class:`~llamatrace.text.tokenizer.Tokenizer` derives from a GGUF's
vocabulary, kept beside the packed weights (:mod:`llamatrace.model.packcache`) for the next load.

Building Llama 3's tokenizer reads 128 k token strings and 280 k merges from the header and turns
them into tiktoken's ranks in Python (~1 s of a warm 8B load). One file per GGUF file,
``<cache root>/packed/<file stem>.<hash of its path>.tokenizer``, holds the token strings and
types and :attr:`Tokenizer.vocab_tables` (each token's bytes, the ranks, rank → id); a load that
finds it reads neither the merges nor the strings from the GGUF and runs only tiktoken's
constructor. About 4 MB at Llama 3's vocabulary; a file rewritten in place replaces its entry;
entries count in the packed cache's size cap and leave by age with its own
(:func:`llamatrace.model.packcache.evict`).

Its key is the packed entry's (:func:`llamatrace.model.packcache.file_key`: llamatrace's version,
the GGUF's identity and header) with the source of the tokenizer modules in place of the kernels';
an entry whose key differs, or that cannot be read whole, is rebuilt silently. Written to a
locked partial file in the folder and renamed, as the packed entries, so no reader sees a
partial one and eviction clears what a writer that died left; ``--no-cache``
(``$LLAMATRACE_NO_CACHE``) neither reads nor writes it. The file is a pickle: like Numba's own
cache it is trusted as the user's own (the folder is under the user's cache root).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import logging
import os
import pickle
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from llamatrace.gguf.reader import GGUFFile

_log = logging.getLogger("llamatrace")


@functools.cache
def _code_fingerprint() -> str:
    """SHA-256 of the modules whose change can change the cached tables."""
    h = hashlib.sha256()
    for name in ("tokenizer.py", "vocab.py", "tokcache.py"):
        h.update(name.encode() + b"\0" + Path(__file__).with_name(name).read_bytes() + b"\0")
    return h.hexdigest()


@dataclass
class Entry:
    """The tokenizer cache file of one open GGUF file."""

    path: Path
    key: str

    @classmethod
    def open(cls, reader: GGUFFile) -> "Entry | None":
        """The entry of ``reader``'s file, or None when its key cannot be made (the file is
        unreadable, or was replaced since it was opened)."""
        from llamatrace.model.packcache import TOKENIZER_SUFFIX, file_key, packed_dir
        gguf = Path(reader.path)
        try:
            if os.stat(gguf).st_size != reader.file_size:
                return None
            data_start = min((t.offset for t in reader.tensors.values()), default=reader.file_size)
            key = file_key(gguf, data_start, _code_fingerprint(), "tokenizer")
        except OSError:
            return None
        where = hashlib.sha256(os.fsencode(gguf.resolve())).hexdigest()[:16]
        return cls(packed_dir() / f"{gguf.stem}.{where}{TOKENIZER_SUFFIX}", key)

    def read(self) -> tuple[list[str], list[int] | None, tuple] | None:
        """(token strings, token types, :attr:`Tokenizer.vocab_tables`) when the entry exists and
        holds this key, else None (never raises)."""
        try:
            with open(self.path, "rb") as fh:
                key, tokens, types, tables = pickle.load(fh)
        except FileNotFoundError:
            return None
        except Exception as exc:            # a damaged or foreign file: rebuilt
            _log.debug("tokenizer cache %s unusable (%s): rebuilding", self.path, exc)
            return None
        if key != self.key:
            return None
        with contextlib.suppress(OSError):
            os.utime(self.path)             # recently used: evicted with the packed entries, by age
        return tokens, types, tables

    def write(self, tokens: list[str], types: list[int] | None, tables: tuple) -> None:
        """Write the entry atomically, as the packed entries are
        (:func:`llamatrace.model.packcache.write_atomic`: a locked ``.partial`` file renamed; a
        writer that dies leaves a partial file the next eviction removes). Skipped while another
        process writes it. Never raises for an I/O problem: a failed write is a debug message,
        and the next load builds the tokenizer again."""
        from llamatrace.model.packcache import write_atomic

        def dump(fh) -> None:
            pickle.dump((self.key, list(tokens), None if types is None else list(types), tables), fh,
                        protocol=pickle.HIGHEST_PROTOCOL)
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            write_atomic(self.path, dump)
        except OSError as exc:
            _log.debug("could not write the tokenizer cache %s (%s)", self.path, exc)
