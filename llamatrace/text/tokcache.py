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
an entry whose key differs, or a file of another format (an older llamatrace's), is rebuilt
silently; one whose bytes do not match their checksum, or do not hold the tables, is rebuilt
with one warning. Written to a locked partial file in the folder and renamed, as the packed
entries, so no reader sees a partial one and eviction clears what a writer that died left;
``--no-cache`` (``$LLAMATRACE_NO_CACHE``) neither reads nor writes it.

The file holds data only, never code: anyone who can write the cache folder (a shared or synced
home, a container volume) could otherwise run code in every later llamatrace process. Layout:
``MAGIC``, one line of JSON (the key, the payload's length in bytes and its xxh3-64), then the
payload, UTF-8 JSON: ``tokens`` (strings), ``types`` (ints or null), ``id_bytes`` (each token's
bytes as a Latin-1 string: one character per byte), ``ranks`` (``[byte strings, ranks]``, the
strings as ``id_bytes``), ``rank_to_id`` and ``rank_to_ids`` (ints, lists of ints, or null).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import logging
import os
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import xxhash

if TYPE_CHECKING:
    from llamatrace.gguf.reader import GGUFFile

_log = logging.getLogger("llamatrace")

MAGIC = b"llamatrace tokenizer cache 2\n"
_MAX_HEAD = 4096                            # the header line's bytes, at most


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
        holds this key, else None (never raises; a damaged entry is one warning)."""
        try:
            with open(self.path, "rb") as fh:
                if fh.read(len(MAGIC)) != MAGIC:
                    _log.debug("tokenizer cache %s: another format, rebuilding", self.path)
                    return None
                head = json.loads(fh.readline(_MAX_HEAD))
                if head["key"] != self.key:
                    return None                 # the GGUF or llamatrace changed: an outdated entry
                payload = fh.read()
            if len(payload) != head["bytes"] or xxhash.xxh3_64_intdigest(payload) != head["xxh3"]:
                raise ValueError("its bytes do not match their checksum")
            stored = _from_json(json.loads(payload))
        except FileNotFoundError:
            return None
        except OSError as exc:                  # unreadable: the write that follows may say more
            _log.debug("tokenizer cache %s unreadable (%s): rebuilding", self.path, exc)
            return None
        except (ValueError, KeyError, TypeError) as exc:
            warnings.warn(f"the tokenizer cache entry {self.path} is damaged ({exc}); building the tokenizer "
                          "again and writing the entry anew", stacklevel=2)
            return None
        with contextlib.suppress(OSError):
            os.utime(self.path)             # recently used: evicted with the packed entries, by age
        return stored

    def write(self, tokens: list[str], types: list[int] | None, tables: tuple) -> None:
        """Write the entry atomically, as the packed entries are
        (:func:`llamatrace.model.packcache.write_atomic`: a locked ``.partial`` file renamed; a
        writer that dies leaves a partial file the next eviction removes). Skipped while another
        process writes it. Never raises for an I/O problem: a failed write is a debug message
        (the packed entry, written next to it, warns), and the next load builds the tokenizer again."""
        from llamatrace.model.packcache import write_atomic
        payload = json.dumps(_to_json(tokens, types, tables), ensure_ascii=False).encode()
        head = json.dumps(dict(key=self.key, bytes=len(payload), xxh3=xxhash.xxh3_64_intdigest(payload))).encode()

        def dump(fh) -> None:
            fh.write(MAGIC + head + b"\n" + payload)
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            write_atomic(self.path, dump)
        except OSError as exc:
            _log.debug("could not write the tokenizer cache %s (%s)", self.path, exc)


def _to_json(tokens: list[str], types: list[int] | None, tables: tuple) -> dict:
    """The payload (module docstring) of ``tokens``, ``types`` and :attr:`Tokenizer.vocab_tables`."""
    id_bytes, ranks, rank_to_id, rank_to_ids = tables
    return dict(tokens=list(tokens), types=None if types is None else [int(t) for t in types],
                id_bytes=[b.decode("latin-1") for b in id_bytes],
                ranks=[[b.decode("latin-1") for b in ranks], list(ranks.values())],
                rank_to_id=rank_to_id, rank_to_ids=rank_to_ids)


def _from_json(payload: dict) -> tuple[list[str], list[int] | None, tuple]:
    """(tokens, types, vocab tables) from a payload :func:`_to_json` made.

    Raises:
        ValueError, KeyError, TypeError: ``payload`` does not hold them.
    """
    def ints(xs, what: str) -> list[int]:
        if not isinstance(xs, list) or not all(type(x) is int for x in xs):
            raise ValueError(f"{what} is not a list of integers")
        return xs

    def raw(strings, what: str) -> list[bytes]:
        if not isinstance(strings, list) or not all(type(x) is str for x in strings):
            raise ValueError(f"{what} is not a list of strings")
        return [x.encode("latin-1") for x in strings]          # UnicodeEncodeError: a ValueError

    tokens = payload["tokens"]
    if not isinstance(tokens, list) or not all(type(t) is str for t in tokens):
        raise ValueError("tokens is not a list of strings")
    types = None if payload["types"] is None else ints(payload["types"], "types")
    id_bytes = raw(payload["id_bytes"], "id_bytes")
    rank_bytes, rank_values = payload["ranks"]
    ranks = dict(zip(raw(rank_bytes, "ranks"), ints(rank_values, "ranks"), strict=True))
    rank_to_id = None if payload["rank_to_id"] is None else ints(payload["rank_to_id"], "rank_to_id")
    rank_to_ids = payload["rank_to_ids"]
    if rank_to_ids is not None:
        if not isinstance(rank_to_ids, list):
            raise ValueError("rank_to_ids is not a list")
        rank_to_ids = [ints(ids, "rank_to_ids") for ids in rank_to_ids]
    if len(id_bytes) != len(tokens) or (types is not None and len(types) != len(tokens)):
        raise ValueError(f"{len(tokens)} tokens, {len(id_bytes)} byte strings, {len(types or [])} types")
    return tokens, types, (id_bytes, ranks, rank_to_id, rank_to_ids)
