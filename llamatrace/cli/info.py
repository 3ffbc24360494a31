"""``llamatrace info``: a model's config, metadata and tensor table."""

from __future__ import annotations

from typing import Annotated

import typer

from ..errors import LlamatraceError
from .app import app, err, out
from .options import ModelOpt


@app.command()
def info(
    model: ModelOpt = None,
    all_metadata: Annotated[bool, typer.Option("--all", help="Also list every metadata key.")] = False,
) -> None:
    """Show a model's config, metadata and tensors (name, type, shape, bytes).

    Examples:

      llamatrace info

      llamatrace info --model Llama-3.2-1B-Instruct-Q8_0.gguf --all
    """
    from rich.table import Table

    from ..fetch import resolve_model
    from ..gguf_io import open_gguf, tensor_type_name

    path = resolve_model(model, log=lambda msg: err.print(msg))
    f = open_gguf(path)
    meta = f.metadata
    out.print(f"[bold]{path}[/]  ({f.file_size / 1e6:.1f} MB, GGUF v{meta.get('GGUF.version')})")
    cfg = Table(title="Model", show_header=False, box=None)
    for key in ("general.name", "general.architecture", "general.file_type"):
        if key in meta:
            cfg.add_row(key, str(meta[key]))
    arch = meta.get("general.architecture", "")
    for key, value in meta.items():
        if key.startswith(f"{arch}.") or (all_metadata and not key.startswith("GGUF.")):
            text = str(value)
            cfg.add_row(key, text if len(text) < 120 else text[:117] + "…")
    for key in ("tokenizer.ggml.model", "tokenizer.ggml.pre", "tokenizer.ggml.bos_token_id",
                "tokenizer.ggml.eos_token_id"):
        if key in meta and not all_metadata:
            cfg.add_row(key, str(meta[key]))
    if not all_metadata and "tokenizer.chat_template" in meta:
        cfg.add_row("tokenizer.chat_template", f"({len(str(meta['tokenizer.chat_template']))} chars; --all shows it)")
    out.print(cfg)
    if "token_embd.weight" in f.tensors:
        from ..config import ModelConfig
        try:
            c = ModelConfig.from_metadata(meta, vocab_size=f.matrix_shape("token_embd.weight")[0], source=path.name)
        except LlamatraceError as exc:
            err.print(f"[yellow]note:[/] llamatrace cannot run this model: {exc}")
        else:
            derived = Table(title="As llamatrace reads it (Meta's ModelArgs names)", show_header=False, box=None)
            for key, value in c.to_dict().items():
                derived.add_row(key, str(value))
            derived.add_row("n_rep", f"{c.n_rep} query heads per KV head" + (" (GQA)" if c.n_rep > 1 else ""))
            derived.add_row("output", "tied to token_embd.weight" if "output.weight" not in f.tensors
                            else "output.weight")
            out.print(derived)
    table = Table(title=f"Tensors ({len(f.tensors)})")
    table.add_column("name")
    table.add_column("type")
    table.add_column("shape [out, in]", justify="right")
    table.add_column("bytes", justify="right")
    total = 0
    for name, t in f.tensors.items():
        total += int(t.n_bytes)
        table.add_row(name, tensor_type_name(t), str(list(f.matrix_shape(name))), f"{int(t.n_bytes):,}")
    table.add_row("[bold]total[/]", "", "", f"[bold]{total:,}[/]")
    out.print(table)
