"""A diagram as a file: the format an output path names, and Graphviz's ``dot`` to render it."""

from __future__ import annotations

import shutil
from pathlib import Path

import graphviz

from llamatrace.errors import OutputError

FORMATS = ("svg", "png", "pdf", "dot", "html")


def output_format(path: Path) -> str:
    """The diagram format named by ``path``'s extension.

    Raises:
        OptionError: no or an unknown extension (the message lists the formats).
    """
    from llamatrace.outputs import output_suffix
    return output_suffix(Path(path), "-o", FORMATS, "a diagram", "flow.svg")


class GraphvizMissingError(OutputError):
    """Graphviz's ``dot`` program is needed for SVG/PNG/PDF output and was not found."""

    def __init__(self, fmt: str) -> None:
        super().__init__(
            f"Graphviz's `dot` program is needed for .{fmt} output and was not found on PATH: install it "
            f"(`apt-get install graphviz`, `brew install graphviz`, or `bash scripts/setup.sh`), "
            f"or write DOT source instead with `-o flow.dot`")


def check_graphviz(fmt: str) -> None:
    """Raise :class:`GraphvizMissingError` when ``fmt`` needs ``dot`` and it is not on PATH."""
    if fmt != "dot" and shutil.which("dot") is None:
        raise GraphvizMissingError(fmt)


def render(graph: graphviz.Digraph, fmt: str) -> bytes:
    """The diagram as bytes: DOT source (no Graphviz needed) or ``dot``'s SVG/PNG/PDF output.

    Raises:
        GraphvizMissingError: ``dot`` is not installed.
        OutputError: ``dot`` failed.
    """
    if fmt == "dot":
        return graph.source.encode("utf-8")
    try:
        return graph.pipe(format=fmt)
    except graphviz.ExecutableNotFound:
        raise GraphvizMissingError(fmt) from None
    except graphviz.CalledProcessError as exc:
        detail = (exc.stderr or b"").decode("utf-8", "replace").strip().splitlines()
        raise OutputError(f"Graphviz `dot` failed to render .{fmt}: {detail[-1] if detail else exc}") from None
