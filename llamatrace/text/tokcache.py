"""The tokenizer cache: what :class:`~llamatrace.text.tokenizer.Tokenizer` derives from a GGUF's
vocabulary, kept beside the packed weights (:mod:`llamatrace.model.packcache`) for the next load.

Building Llama 3's tokenizer reads 128 k token strings and 280 k merges from the header and turns
them into tiktoken's ranks (~0.4 CPU-s, of which tiktoken's constructor 0.08; ~1 s before the
arrays were mapped at once). One file per GGUF file,
``<cache root>/packed/<file stem>.<hash of its path>.tokenizer``, holds the token strings and
types and :attr:`Tokenizer.vocab_tables` (each token's bytes, the ranks, rank → id); a load that
finds it reads neither the merges nor the strings from the GGUF and runs only tiktoken's
constructor (~0.23 CPU-s in all). About 7 MB at Llama 3's vocabulary; a file rewritten in place
replaces its entry; entries count in the packed cache's size cap and leave by age with its own
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
payload: an NPZ of flat integer arrays, read with ``allow_pickle=False``. A list of strings is a
byte array (``*_bytes``: the strings joined) and the end offset of each string (``*_ends``, int64):
``tokens`` (UTF-8; ends in characters), ``id`` (each token's bytes), ``rank`` (the byte strings
of tiktoken's ranks that are no token's bytes; ``rank_ids``, int64: for every rank in order, the
first id with its bytes or -1 for the next of ``rank``'s strings, so that a read shares the
tokens' byte strings as a build does; the ranks in ``rank_values``); ``types``, ``rank_to_id`` (int64), and
``rank_to_ids`` (``*_flat`` and ``*_ends`` likewise), each absent when None. Reading one back is
a few slices per token: faster than unpickling the same lists (docs/performance.md).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import io
import json
import logging
import os
import warnings
import zipfile
from dataclasses import dataclass
from itertools import chain, compress, repeat
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import xxhash

if TYPE_CHECKING:
    from llamatrace.gguf.reader import GGUFFile

_log = logging.getLogger("llamatrace")

MAGIC = b"llamatrace tokenizer cache 3\n"
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
            with np.load(io.BytesIO(payload), allow_pickle=False) as arrays:
                stored = _from_arrays({name: arrays[name] for name in arrays.files})
        except FileNotFoundError:
            return None
        except OSError as exc:                  # unreadable: the write that follows may say more
            _log.debug("tokenizer cache %s unreadable (%s): rebuilding", self.path, exc)
            return None
        except (ValueError, KeyError, TypeError, zipfile.BadZipFile) as exc:
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
        buf = io.BytesIO()
        np.savez(buf, **_to_arrays(tokens, types, tables))
        payload = buf.getvalue()
        head = json.dumps(dict(key=self.key, bytes=len(payload), xxh3=xxhash.xxh3_64_intdigest(payload))).encode()

        def dump(fh) -> None:
            fh.write(MAGIC + head + b"\n" + payload)
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            write_atomic(self.path, dump)
        except OSError as exc:
            _log.debug("could not write the tokenizer cache %s (%s)", self.path, exc)


def _joined(strings: list[bytes]) -> tuple[np.ndarray, np.ndarray]:
    """``strings`` as one uint8 array and each one's end offset (int64)."""
    return np.frombuffer(b"".join(strings), np.uint8), _ends(strings)


def _ends(items: list) -> np.ndarray:
    """Each item's end offset when ``items`` are joined (int64)."""
    return np.cumsum(np.fromiter(map(len, items), np.int64, len(items)))


def _split(data: bytes | str, ends: np.ndarray) -> list:
    """The strings :func:`_joined` joined (``data``: its bytes, or their text)."""
    ends = ends.tolist()
    return list(map(data.__getitem__, map(slice, [0, *ends[:-1]], ends)))       # no Python loop: ~2x


def _to_arrays(tokens: list[str], types: list[int] | None, tables: tuple) -> dict[str, np.ndarray]:
    """The payload (module docstring) of ``tokens``, ``types`` and :attr:`Tokenizer.vocab_tables`."""
    id_bytes, ranks, rank_to_id, rank_to_ids = tables
    out = dict(tokens_bytes=np.frombuffer("".join(tokens).encode("utf-8", "surrogatepass"), np.uint8),
               tokens_ends=_ends(tokens), rank_values=np.fromiter(ranks.values(), np.int64, len(ranks)))
    out["id_bytes"], out["id_ends"] = _joined(id_bytes)
    first_id = dict(zip(reversed(id_bytes), range(len(id_bytes) - 1, -1, -1)))   # the last write wins
    out["rank_ids"] = np.fromiter(map(first_id.get, ranks, repeat(-1)), np.int64, len(ranks))
    out["rank_bytes"], out["rank_ends"] = _joined(list(compress(ranks, out["rank_ids"] < 0)))
    if types is not None:
        out["types"] = np.array(types, np.int64)
    if rank_to_id is not None:
        out["rank_to_id"] = np.array(rank_to_id, np.int64)
    if rank_to_ids is not None:
        out["rank_to_ids_flat"] = np.fromiter(chain.from_iterable(rank_to_ids), np.int64)
        out["rank_to_ids_ends"] = _ends(rank_to_ids)
    return out


def _from_arrays(arrays: dict[str, np.ndarray]) -> tuple[list[str], list[int] | None, tuple]:
    """(tokens, types, vocab tables) from the arrays :func:`_to_arrays` made.

    Raises:
        ValueError, KeyError: ``arrays`` do not hold them.
    """
    for name, a in arrays.items():
        if a.ndim != 1 or a.dtype != (np.uint8 if name.endswith("_bytes") else np.int64):
            raise ValueError(f"{name}: {a.dtype} {a.shape}")
    tokens = _split(arrays["tokens_bytes"].tobytes().decode("utf-8", "surrogatepass"), arrays["tokens_ends"])
    id_bytes = _split(arrays["id_bytes"].tobytes(), arrays["id_ends"])
    rank_ids = arrays["rank_ids"]
    if rank_ids.size and rank_ids.max() >= len(id_bytes):
        raise ValueError(f"rank_ids up to {rank_ids.max()} for {len(id_bytes)} tokens")
    keys = list(map(id_bytes.__getitem__, np.maximum(rank_ids, 0).tolist()))
    others = np.flatnonzero(rank_ids < 0).tolist()
    for k, raw in zip(others, _split(arrays["rank_bytes"].tobytes(), arrays["rank_ends"]), strict=True):
        keys[k] = raw
    ranks = dict(zip(keys, arrays["rank_values"].tolist(), strict=True))
    types = arrays["types"].tolist() if "types" in arrays else None
    rank_to_id = arrays["rank_to_id"].tolist() if "rank_to_id" in arrays else None
    rank_to_ids = None
    if "rank_to_ids_flat" in arrays:
        rank_to_ids = _split(arrays["rank_to_ids_flat"].tolist(), arrays["rank_to_ids_ends"])
    if len(id_bytes) != len(tokens) or (types is not None and len(types) != len(tokens)):
        raise ValueError(f"{len(tokens)} tokens, {len(id_bytes)} byte strings, {len(types or [])} types")
    return tokens, types, (id_bytes, ranks, rank_to_id, rank_to_ids)
