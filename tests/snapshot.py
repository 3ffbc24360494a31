"""Snapshot files: our own output pinned byte for byte, so that any change to it is reviewed.

A snapshot is not a reference — it was written by llamatrace itself, and only says "nothing
changed". Independent references live in ``tests/golden/`` (HF transformers) and
``tests/book/`` (the book's log lines). After a deliberate change, rewrite the snapshots with
``LLAMATRACE_UPDATE_SNAPSHOTS=1 python3 -m pytest …``: each rewritten one then *fails* its test
once, so an update can never pass unnoticed; review ``git diff tests/snapshots`` and rerun.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

SNAPSHOTS = Path(__file__).parent / "snapshots"


def assert_matches_snapshot(text: str, name: str) -> None:
    """Compare ``text`` with ``tests/snapshots/<name>`` (or rewrite it and fail, in update mode)."""
    path = SNAPSHOTS / name
    if os.environ.get("LLAMATRACE_UPDATE_SNAPSHOTS"):
        if not path.exists() or path.read_text(encoding="utf-8") != text:
            path.write_text(text, encoding="utf-8")
            pytest.fail(f"snapshot {name} rewritten: review `git diff {path}` and rerun without "
                        "LLAMATRACE_UPDATE_SNAPSHOTS")
    assert text == path.read_text(encoding="utf-8"), f"output differs from snapshot {name}"
