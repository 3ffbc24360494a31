"""The packed-weights cache: a model's row tiles written once, memory-mapped on the next load.

:func:`llamatrace.kernels.types.packing.pack` rearranges every matrix of a GGUF file into row tiles
(TR rows interleaved, scales widened or regrouped): no tensor of the file is laid out as the
kernels read it, so a load copies the whole model, and at 8B most of that load is the first
touch of the copy's fresh pages. The first load of a file therefore also writes its tiles to
``<cache root>/packed/`` (:func:`llamatrace.gguf.fetch.cache_root`: ``~/.cache/llamatrace``
unless ``$LLAMATRACE_CACHE_DIR``); later loads map that file instead of packing, and every
process that loads the model shares its pages in the page cache.

One entry per model file and activations mode, about the size of the model file (the f32 mode's
float32 scales add 2 bytes per block: +11 % on Q4_0); a mixture of experts' entry holds none of
the experts the ``mul_mat_id`` kernels run on the GGUF's own blocks (:mod:`llamatrace.model.moe`: the
file's pages in the page cache are their cache), so it is a few percent of the file. Its name is
``<file stem>.<mode>.<key>.ltpack``; the key (:func:`entry_key`) hashes

- the GGUF's identity: its device, inode, size and modification time (ns), which change when a
  file is rewritten or replaced (including a re-quantization with the same header), and a
  SHA-256 of its header (metadata and tensor table), which a copy with a preserved time keeps;
- llamatrace's version, the source of the packing code (every module of
  :mod:`llamatrace.kernels`, this one, :mod:`llamatrace.model.llama` and :mod:`llamatrace.model.moe`:
  a changed layout can't be read by a kernel that expects another, and the ``mul_mat_id`` kernels'
  types decide which experts are packed at all) and the CPU features the kernels are compiled for.

File layout: ``MAGIC``, the header's offset, its length and its xxh3-64 (uint64 each), zeros to
4 KiB; the arrays, each at a 64-byte offset from there, in the order the loader asked for them
(the order a forward pass reads them); the header (JSON: the key, the arrays' bytes, each
weight's name, type, shape and arrays as ``[offset, dtype, shape, xxh3-64 of the array's
bytes]``); the key's first 16 bytes. The header comes after the arrays because a first load packs
into the file before it knows them all (:class:`EntryArena`). A reader checks all of it, the
checksums of the header and of every array included (a damaged entry would otherwise give wrong
answers silently: xxh3 reads ~9 GB/s, ~0.1 s per GB of entry at each load, docs/performance.md),
and on any mismatch packs, says so in one warning, and writes the entry again. A missing entry
is packed silently.

Writing: the load packs into ``<name>.partial`` (a shared map of it), under an exclusive
``flock`` on it, then writes the header and renames it to the final name: a reader never opens a partial file, so no process sees a half-written entry, and a
writer that dies leaves a partial file whose lock died with it (the next writer or eviction
takes it over). Loaders that find the partial file locked (corpus workers starting together)
load by packing and write nothing. No ``fsync``: it would cost the disk's write time on every
first load; after a power failure an entry is as whole as the filesystem left it, and a short
one is rejected.

Size: at most ``$LLAMATRACE_PACKED_CACHE_GB`` GB (default :data:`DEFAULT_CAP_GB`) of entries;
after each write the least recently used entries (by modification time, which every read
renews) go. An entry larger than the cap, or one that would leave less than
:data:`MIN_FREE_BYTES` free on the disk, is not written, and a warning says why (as for a write
that fails). ``$LLAMATRACE_NO_CACHE=1`` (the CLI's ``--no-cache``) neither reads nor writes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import functools
import hashlib
import json
import logging
import mmap
import os
import shutil
import struct
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO, Callable

import gguf
import numpy as np
import xxhash

from llamatrace import __version__
from llamatrace.errors import OptionError
from llamatrace.kernels.types.packing import Arena, Weight, populate

_log = logging.getLogger("llamatrace")

ENV_NO_CACHE = "LLAMATRACE_NO_CACHE"
ENV_CAP = "LLAMATRACE_PACKED_CACHE_GB"
DEFAULT_CAP_GB = 20.0
"""The cache's default size cap in GB (1e9 bytes): two 8B Q4 models in both activation modes."""
MIN_FREE_BYTES = 2 << 30
"""An entry is written only if the disk keeps this much free space after it."""

MAGIC = b"LTPACK\x00\x03"
SUFFIX = ".ltpack"
TOKENIZER_SUFFIX = ".tokenizer"   # llamatrace.text.tokcache's entries, evicted with these
PARTIAL = ".partial"
_ALIGN = 64                       # each array's offset: a cache line, as the packing arena does
_DATA_ALIGN = mmap.PAGESIZE       # the first array's offset
_HEAD = struct.Struct("<QQQ")      # the header's offset, its length and its xxh3-64
_TRAILER = 16                     # bytes of the key at the end of the file
_DTYPES = frozenset({"|u1", "|i1", "<u2", "<f4"})     # what packed arrays hold (packing.Weight)
# madvise: populate the page tables from the page cache, without reading or copying (Linux 5.14)
_MADV_POPULATE_READ = 22


def packed_dir() -> Path:
    """Where the entries live: ``cache_root() / "packed"``."""
    from llamatrace.gguf.fetch import cache_root
    return cache_root() / "packed"


def enabled(cache: bool | None = None) -> bool:
    """Whether a load uses the cache: ``cache`` when given, else on unless ``$LLAMATRACE_NO_CACHE``
    is set to anything but ``""`` or ``0``."""
    if cache is not None:
        return cache
    return os.environ.get(ENV_NO_CACHE, "") in ("", "0")


def cap_bytes() -> int:
    """The cache's size cap in bytes, from ``$LLAMATRACE_PACKED_CACHE_GB`` (default :data:`DEFAULT_CAP_GB`).

    Raises:
        OptionError: the variable is not a number of GB, 0 or more.
    """
    text = os.environ.get(ENV_CAP, "").strip()
    try:
        gb = float(text) if text else DEFAULT_CAP_GB
    except ValueError:
        gb = -1.0
    if not gb >= 0 or gb == float("inf"):
        raise OptionError(f"${ENV_CAP}={text!r}: expected the packed-weights cache's size cap in GB "
                          f"(a number, 0 or more; default {DEFAULT_CAP_GB:g})")
    return int(gb * 1e9)


def _fingerprint_files() -> list[Path]:
    """The source files whose change can change the packed bytes: every module of
    :mod:`llamatrace.kernels` (its rooms included: their ``mul_mat_id`` ``TYPES`` say which experts
    stay in the file, unpacked), this one, :mod:`llamatrace.model.llama` and :mod:`llamatrace.model.moe`."""
    import llamatrace.kernels as kernels_pkg
    return sorted(Path(kernels_pkg.__file__).parent.rglob("*.py")) + [
        Path(__file__), Path(__file__).with_name("llama.py"), Path(__file__).with_name("moe.py")]


@functools.cache
def _code_fingerprint() -> str:
    """SHA-256 of :func:`_fingerprint_files` and the CPU features the kernels are compiled for."""
    from llamatrace.machine.jit import target_features
    h = hashlib.sha256()
    for p in _fingerprint_files():
        h.update(p.name.encode() + b"\0" + p.read_bytes() + b"\0")
    h.update(" ".join(sorted(target_features())).encode())
    return h.hexdigest()


def entry_key(path: Path, data_start: int, activations: str) -> str:
    """The hex SHA-256 that names ``path``'s entry for ``activations`` (module docstring);
    ``data_start``: the offset of the file's first tensor byte (the header ends before it).

    Raises:
        OSError: the file cannot be read.
    """
    return file_key(path, data_start, _code_fingerprint(), activations)


def file_key(path: Path, data_start: int, *parts: str) -> str:
    """The hex SHA-256 of llamatrace's version, ``parts`` (what else the cached data depend on),
    the identity of the GGUF at ``path`` (device, inode, size, modification time in ns) and its
    header (its first ``data_start`` bytes): the key of anything cached from that file.

    Raises:
        OSError: the file cannot be read.
    """
    st = os.stat(path)
    h = hashlib.sha256()
    h.update(json.dumps([__version__, *parts, st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns]).encode())
    h.update(_header_digest(str(path), st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, data_start))
    return h.hexdigest()


@functools.lru_cache(maxsize=8)
def _header_digest(path: str, dev: int, ino: int, size: int, mtime_ns: int, data_start: int) -> bytes:
    """SHA-256 of the file's first ``data_start`` bytes, once per file version and process (the
    tokenizer's key and the packed entry's hash the same header: ~8 MB at Llama 3's vocabulary)."""
    with open(path, "rb") as fh:
        return hashlib.sha256(fh.read(data_start)).digest()


class EntryArena:
    """The packing arena of a load that writes an entry: each array is placed in the entry file
    itself, through a shared writable map, at the next 64-byte offset from :data:`_DATA_ALIGN`.

    Packing into the file's pages instead of fresh anonymous memory costs the same first touch
    (~0.5 CPU-s per GiB either way, once the file's blocks are reserved with ``fallocate``;
    without it a fault into a hole costs 4x) and saves copying the packed model into the page
    cache afterwards (``write``: another 0.5 CPU-s per GiB, which the load waited for). The
    kernel writes the dirty pages to disk in the background; they are the page cache's, so a
    model packed this way holds the same pages a later load maps, and no second copy. Maps are
    taken ``chunk_bytes`` at a time (or an array's size when larger), each from the page
    that holds the next free byte, so the file stays dense; they overlap where chunks meet,
    which a shared map allows (the same page cache pages). Views keep their map alive.
    """

    CHUNK_BYTES = 64 << 20

    def __init__(self, fd: int, chunk_bytes: int | None = None) -> None:
        self.fd = fd
        self.chunk_bytes = chunk_bytes or self.CHUNK_BYTES
        self.end = _DATA_ALIGN                  # the first free byte of the file
        self._maps: list[tuple[int, int, int]] = []     # (address, file offset, length)
        self._chunk = np.empty(0, dtype=np.uint8)
        self._chunk_at = 0                      # the file offset of _chunk[0]
        self.failed: OSError | None = None
        self._spare = Arena()

    def empty(self, shape: tuple[int, ...], dtype) -> np.ndarray:
        """An uninitialised C-contiguous array at the file's next 64-byte offset; in anonymous
        memory once the file's blocks could not be reserved (a full disk) or mapped
        (:attr:`failed` then holds the ``OSError``)."""
        if self.failed is None:
            try:
                return self._in_file(shape, np.dtype(dtype))
            except OSError as exc:
                self.failed = exc
        return self._spare.empty(shape, dtype)

    def _in_file(self, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
        n_bytes = int(np.prod(shape)) * dtype.itemsize
        start = -(-self.end // _ALIGN) * _ALIGN
        if start + n_bytes > self._chunk_at + self._chunk.size:
            base = start // mmap.PAGESIZE * mmap.PAGESIZE
            length = -(-max(self.chunk_bytes, start + n_bytes - base) // mmap.PAGESIZE) * mmap.PAGESIZE
            os.posix_fallocate(self.fd, base, length)     # the blocks now: no fault into a hole, no ENOSPC later
            pages = mmap.mmap(self.fd, length, flags=mmap.MAP_SHARED, offset=base)
            populate(pages)
            self._chunk, self._chunk_at = np.frombuffer(pages, dtype=np.uint8), base
            self._maps.append((self._chunk.ctypes.data, base, length))
        self.end = start + n_bytes
        return self._chunk[start - self._chunk_at:self.end - self._chunk_at].view(dtype).reshape(shape)

    def offset(self, a: np.ndarray) -> int | None:
        """The file offset of C-contiguous ``a``'s first byte if it lies in one of the maps, else None."""
        addr = a.ctypes.data
        for lo, at, length in self._maps:
            if lo <= addr and addr + a.nbytes <= lo + length:
                return at + addr - lo
        return None


@dataclass
class PackCache:
    """One model file's entry, for one activations mode, during a load.

    :meth:`weight` returns a weight from the entry when it was read, else packs it. A load that
    packs takes its :meth:`arena` first: when the entry is to be written, the arrays are packed
    straight into its ``.partial`` file (:class:`EntryArena`), and :meth:`save` writes the header
    and renames it; :meth:`abort` removes it if the load fails. A ``PackCache`` whose ``path`` is
    None (:meth:`off`) only packs, in memory.

    Attributes:
        path: the entry's file; None when the cache is off.
        read: the entry was found valid and is mapped.
        written: :meth:`save` wrote the entry.
    """

    path: Path | None
    key: str = ""
    read: bool = False
    written: bool = False
    _found: dict[tuple[str, str], Weight] = field(default_factory=dict, repr=False)
    _order: list[tuple[str, str, Weight, list]] = field(default_factory=list, repr=False)
    _arena: EntryArena | None = field(default=None, repr=False)
    _lock: contextlib.ExitStack | None = field(default=None, repr=False)

    @classmethod
    def off(cls) -> "PackCache":
        """A cache that reads and writes nothing."""
        return cls(path=None)

    @classmethod
    def open(cls, path: str | os.PathLike[str], data_start: int, file_size: int, activations: str) -> "PackCache":
        """The entry of the GGUF at ``path`` (``file_size`` bytes as opened, tensors from
        ``data_start``) for ``activations``, mapped if a valid one exists. Never raises for a
        missing, unreadable or invalid entry (it is then packed and written anew; an invalid one,
        a damaged file, with a warning); a file whose size changed since it was opened gets
        :meth:`off`.

        Raises:
            OptionError: a malformed ``$LLAMATRACE_PACKED_CACHE_GB``.
        """
        cap_bytes()                    # a bad cap is bad input: say so now, not after packing
        path = Path(path)
        try:
            if os.stat(path).st_size != file_size:
                return cls.off()
            key = entry_key(path, data_start, activations)
        except OSError:
            return cls.off()
        entry = packed_dir() / f"{path.stem}.{activations}.{key[:16]}{SUFFIX}"
        cache = cls(path=entry, key=key)
        try:
            cache._found = _read_entry(entry, key)
        except FileNotFoundError:
            return cache
        except OSError as exc:             # unreadable: the write that follows says if it fails too
            _log.debug("packed-weights cache %s unreadable (%s): packing", entry, exc)
            return cache
        except (ValueError, KeyError, TypeError, struct.error) as exc:
            warnings.warn(f"the packed-weights cache entry {entry} is damaged ({exc}); packing the model "
                          "again and writing the entry anew", stacklevel=2)
            return cache
        cache.read = True
        with contextlib.suppress(OSError):
            os.utime(entry)            # recently used: the last to be evicted
        return cache

    def arena(self, estimate: int):
        """Where the load packs: the entry's :class:`EntryArena` when the entry is to be written
        (the cache is on, the entry was not read, it fits on the disk by ``estimate``, its
        packed bytes, and no other process is writing it), else a
        :class:`~llamatrace.kernels.types.packing.Arena` of anonymous memory. Never raises for an
        I/O problem: an entry that is not to be written is one warning (as :meth:`save` words it),
        or none when another process writes it. The cap is checked by :meth:`save`, on the
        entry's real size (``estimate`` bounds it from above: a tiny model's is 3x)."""
        from llamatrace.gguf.fetch import ENV_CACHE
        if self.path is None or self.read or self._arena is not None:
            return self._arena or Arena()
        size = estimate + _DATA_ALIGN + (1 << 20)        # the header: ~100 bytes a weight
        stack = contextlib.ExitStack()
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            free = shutil.disk_usage(self.path.parent).free
            if free < size + MIN_FREE_BYTES:
                warnings.warn(_skipped(
                    f"{self.path.name} would take about {_gb(size)} of the {_gb(free)} free in "
                    f"{self.path.parent}, and the cache leaves {MIN_FREE_BYTES / 2**30:g} GiB free "
                    f"(${ENV_CACHE} moves it to another disk)"), stacklevel=2)
                return Arena()
            fd = stack.enter_context(_locked(self._partial()))
            if fd is None:                   # another process writes it: pack, write nothing
                stack.close()
                return Arena()
            os.ftruncate(fd, 0)              # what a writer that died left
        except OSError as exc:
            stack.close()
            warnings.warn(_skipped(f"could not write {self.path} ({exc.strerror or exc})"), stacklevel=2)
            return Arena()
        self._lock, self._arena = stack, EntryArena(fd)
        return self._arena

    def _partial(self) -> Path:
        return self.path.with_name(self.path.name + PARTIAL)

    def weight(self, name: str, acts: str, expect: tuple, build: Callable[[], Weight]) -> Weight:
        """The weight ``name`` packed for activations ``acts``: from the entry when it holds one whose
        ``(ggml_type, n_out, n_in, row_splits)`` equals ``expect``, else ``build()`` (whose arrays,
        when the entry is being written, are moved into it if they were not packed there)."""
        w = self._found.get((name, acts))
        if w is not None and (w.ggml_type, w.n_out, w.n_in, w.row_splits) == expect:
            return w
        w = build()
        if self._arena is not None and self._arena.failed is None:
            w = self._place(name, acts, w)
        if self._arena is not None and self._arena.failed is not None:
            exc = self._arena.failed
            self.abort()
            warnings.warn(_skipped(f"could not write {self.path} ({exc.strerror or exc})"), stacklevel=2)
        return w

    def _place(self, name: str, acts: str, w: Weight) -> Weight:
        """``w`` with its arrays in the entry (copied there if packed elsewhere: F32 / F16 / BF16
        tiles), and their offsets and checksums noted for the header; ``w`` itself if the file
        could not take them (the arena's :attr:`~EntryArena.failed`)."""
        arrays, placed = [], []
        for a in (w.qs, w.d, w.m):
            at = self._arena.offset(a) if a.size else 0
            if at is None:
                a = np.copyto(copy := self._arena.empty(a.shape, a.dtype), a) or copy
                if self._arena.failed is not None:
                    return w
                at = self._arena.offset(a)
            placed.append(a)
            arrays.append([at - _DATA_ALIGN if a.size else 0, a.dtype.str, list(a.shape), xxhash.xxh3_64_intdigest(a)])
        self._order.append((name, acts, w, arrays))
        return dataclasses.replace(w, qs=placed[0], d=placed[1], m=placed[2])

    def abort(self) -> None:
        """Stop writing the entry (a failed load, a full disk): its partial file goes, the weights
        packed into it stay mapped (an unlinked file's pages live as long as their map)."""
        if self._lock is not None:
            with contextlib.suppress(OSError):
                os.unlink(self._partial())
            self._lock.close()
        self._lock = self._arena = None

    def save(self) -> None:
        """Finish the entry the load packed into (see the module docstring): its header and trailer
        after the arrays, its first page, the rename, then eviction down to the cap. Never raises
        for an I/O problem: an entry not written (a failed write, over the cap) is one warning,
        and the model loads as it was."""
        if self._arena is None:
            return
        fd, data_end = self._arena.fd, self._arena.end
        weights = [dict(name=name, acts=acts, type=int(w.ggml_type), n_out=w.n_out, n_in=w.n_in,
                        row_splits=list(w.row_splits), act8=w.act8, arrays=arrays)
                   for name, acts, w, arrays in self._order]
        header = json.dumps(dict(key=self.key, data_bytes=data_end - _DATA_ALIGN, weights=weights)).encode()
        size, cap = data_end + len(header) + _TRAILER, cap_bytes()
        try:
            if size > cap:
                warnings.warn(_skipped(f"{self.path.name} takes {_gb(size)}, over the cap of {_gb(cap)} "
                                       f"(${ENV_CAP})"), stacklevel=2)
                return
            os.ftruncate(fd, data_end)                   # the blocks reserved past the last array
            os.pwrite(fd, header + bytes.fromhex(self.key)[:_TRAILER], data_end)
            os.pwrite(fd, MAGIC + _HEAD.pack(data_end, len(header), xxhash.xxh3_64_intdigest(header)), 0)
            os.replace(self._partial(), self.path)
            self.written = True
            evict(cap, keep=self.path)
        except OSError as exc:
            warnings.warn(_skipped(f"could not write {self.path} ({exc.strerror or exc})"), stacklevel=2)
        finally:
            self.abort()                                 # the lock (and the partial file, if not renamed)


def _skipped(why: str) -> str:
    """The warning for an entry that is not written."""
    return (f"the packed-weights cache is skipped: {why}; the next load packs the model again "
            f"(--no-cache, or ${ENV_NO_CACHE}=1, turns the cache off)")


def _gb(n: int) -> str:
    """``n`` bytes for a message: '5.27 GB', '41.2 MB', '0.001 MB'."""
    return f"{n / 1e9:.2f} GB" if n >= 1e9 else f"{n / 1e6:.3g} MB"


def _read_entry(entry: Path, key: str) -> dict[tuple[str, str], Weight]:
    """The weights of the entry file ``entry``, views of its private read-write map (never
    written: a private map keeps the file unchanged and the arrays writable, as Numba's compiled
    kernels expect them), keyed by ``(name, acts)``. Every byte read is checked: the header
    against its xxh3-64, each array against the xxh3-64 the header gives.

    Raises:
        OSError: the file cannot be opened or mapped.
        ValueError, KeyError, TypeError, struct.error: it is not a whole entry for ``key``, or
            its bytes changed since it was written.
    """
    with open(entry, "rb") as fh:
        size = os.fstat(fh.fileno()).st_size
        head = fh.read(len(MAGIC) + _HEAD.size)
        if len(head) < len(MAGIC) + _HEAD.size or head[:len(MAGIC)] != MAGIC:
            raise ValueError("not a packed-weights file")
        header_at, header_len, header_digest = _HEAD.unpack_from(head, len(MAGIC))
        if not _DATA_ALIGN <= header_at or header_at + header_len + _TRAILER != size:
            raise ValueError(f"{size} bytes, the first page says {header_at + header_len + _TRAILER}")
        fh.seek(header_at)
        header = fh.read(header_len)
        if xxhash.xxh3_64_intdigest(header) != header_digest:
            raise ValueError("its header does not match its checksum")
        header = json.loads(header)
        if header["key"] != key:
            raise ValueError("another file's entry")
        data_bytes = int(header["data_bytes"])
        if data_bytes != header_at - _DATA_ALIGN:
            raise ValueError(f"{data_bytes} bytes of arrays, the first page says {header_at - _DATA_ALIGN}")
        if fh.read(_TRAILER) != bytes.fromhex(key)[:_TRAILER]:
            raise ValueError("its last bytes are not the key: not written whole")
        buf = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_COPY)
    with contextlib.suppress(OSError):     # map every page now, in one call, not one fault at a time
        buf.madvise(_MADV_POPULATE_READ)
    found = {}
    for w in header["weights"]:
        arrays = []
        for offset, dtype, shape, digest in w["arrays"]:
            dtype, shape = np.dtype(dtype), tuple(int(n) for n in shape)
            if dtype.str not in _DTYPES or offset % _ALIGN or offset < 0 or min(shape, default=0) < 0:
                raise ValueError(f"{w['name']}: bad array {offset}, {dtype}, {shape}")
            count = int(np.prod(shape))
            if offset + count * dtype.itemsize > data_bytes:
                raise ValueError(f"{w['name']}: an array past the end of the data")
            a = np.frombuffer(buf, dtype, count, _DATA_ALIGN + offset).reshape(shape)
            if xxhash.xxh3_64_intdigest(a) != digest:
                raise ValueError(f"{w['name']}: its bytes do not match their checksum")
            arrays.append(a)
        found[w["name"], w["acts"]] = Weight(w["name"], gguf.GGMLQuantizationType(w["type"]), int(w["n_out"]),
                                             int(w["n_in"]), *arrays, tuple(int(n) for n in w["row_splits"]),
                                             bool(w["act8"]))
    return found


@contextlib.contextmanager
def _locked(path: Path):
    """Hold an exclusive ``flock`` on the file at ``path`` (created if missing): yields its fd,
    or None when another process holds it or the path stopped naming the file that was locked
    (renamed or removed meanwhile: its owner finished, or someone cleared it)."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            ours = os.path.samestat(os.fstat(fd), os.stat(path))
        except (BlockingIOError, FileNotFoundError):
            ours = False
        yield fd if ours else None
    finally:
        os.close(fd)                    # and the lock with it


def write_atomic(entry: Path, write: Callable[[BinaryIO], None]) -> bool:
    """Call ``write`` on ``<entry>.partial`` (emptied first: what a writer that died left) under
    its lock, then rename it to ``entry``; False if another process is writing it. The partial
    file goes if ``write`` raises (the exception propagates)."""
    partial = entry.with_name(entry.name + PARTIAL)
    with _locked(partial) as fd:
        if fd is None:
            return False
        try:
            os.ftruncate(fd, 0)
            with open(fd, "wb", closefd=False) as out:
                write(out)
            os.replace(partial, entry)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(partial)
            raise
    return True


def evict(cap: int, keep: Path | None = None) -> list[Path]:
    """Remove the least recently used entries (oldest modification time first) until the entries
    in :func:`packed_dir` (the tokenizers' too) total at most ``cap`` bytes, and the partial files no process is
    writing; ``keep`` is never removed. Returns the entries removed. A process that has an entry
    mapped keeps its pages (the file goes when the last map does).

    Raises:
        OSError: the folder cannot be listed.
    """
    folder = packed_dir()
    if not folder.is_dir():
        return []
    for partial in [*folder.glob(f"*{SUFFIX}{PARTIAL}"), *folder.glob(f"*{TOKENIZER_SUFFIX}{PARTIAL}")]:
        with contextlib.suppress(OSError), _locked(partial) as fd:
            if fd is not None:
                os.unlink(partial)
    entries = []
    for p in [*folder.glob(f"*{SUFFIX}"), *folder.glob(f"*{TOKENIZER_SUFFIX}")]:
        with contextlib.suppress(OSError):
            st = p.stat()
            entries.append((st.st_mtime_ns, st.st_size, p))
    entries.sort()
    total = sum(size for _, size, _ in entries)
    removed = []
    for _, size, p in entries:
        if total <= cap:
            break
        if keep is not None and p == keep:
            continue
        with contextlib.suppress(FileNotFoundError):
            p.unlink()
            removed.append(p)
        total -= size
    return removed
