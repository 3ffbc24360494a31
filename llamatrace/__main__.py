"""``python -m llamatrace`` — the same as the ``llamatrace`` command."""

from .cli import run

run()
