"""``llamatrace stages``: the stage catalogue (:mod:`llamatrace.tracing.stages`) as a table or JSON."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.markup import escape

from llamatrace.cli.app import app, stdout
from llamatrace.cli.options import print_wide


def _concrete(formula: str, dims: dict[str, int]) -> str:
    """A shape formula with the model's sizes filled in; seq_len, kv_len and max_seq stay symbolic."""
    def term(match: re.Match) -> str:
        names = match.group(0).split("*")
        if all(n.isdigit() or n in dims for n in names):     # 2*q_dim: a number times a size
            value = 1
            for n in names:
                value *= int(n) if n.isdigit() else dims[n]
            return str(value)
        return match.group(0)
    return re.sub(r"[a-z_0-9]+(\*[a-z_0-9]+)*", term, formula)


@app.command()
def stages(
    model: Annotated[Optional[Path], typer.Option(
        "--model", "-m", help="GGUF model file, or a known model's name (smollm2-135m, gemma3-270m): list only "
        "the stages it computes, with its sizes. Default: every stage ($LLAMATRACE_MODEL's or the default "
        "model's sizes when on disk; never fetched).", show_default=False)] = None,
    json_out: Annotated[bool, typer.Option("--json", help="Print a JSON list of objects instead of the table.")]
        = False,
) -> None:
    """List every traced stage: id, the book's name and STAGE, llama.cpp's and TransformerLens's
    names (and how they differ), whether a hook can replace it, and its shape.

    With --model, only the stages that model computes are listed (on a hybrid, with the layers
    that compute each), with its sizes in the shapes. Without it, every stage of every supported
    architecture, and the default model's sizes when it is already downloaded (never fetched for
    this); seq_len, kv_len and max_seq depend on the run.

    Examples:

      llamatrace stages

      llamatrace stages --json

      llamatrace stages --model Llama-3.2-1B-Instruct-Q8_0.gguf
    """
    from llamatrace.model.config import ModelConfig
    from llamatrace.errors import ModelNotFoundError
    from llamatrace.gguf.fetch import resolve_model
    from llamatrace.gguf.reader import open_gguf
    from llamatrace.tracing.stages import STAGES, layer_list, model_stage_ids, stage_for, stage_layers

    dims: dict[str, int] = {}
    features: frozenset[str] = frozenset()
    path = c = None
    try:
        path = resolve_model(model, fetch=False)
    except ModelNotFoundError:
        if model is not None:
            raise
    if path is not None:
        with open_gguf(path) as f:
            c = ModelConfig.from_gguf(f)
        dims = dict(dim=c.dim, n_heads=c.n_heads, n_kv_heads=c.n_kv_heads, head_dim=c.head_dim,
                    hidden_dim=c.hidden_dim, vocab_size=c.vocab_size, rope_half=c.rope_dim // 2,
                    q_dim=c.q_dim, kv_dim=c.kv_dim, n_rep=c.n_rep, ssm_n_k_heads=c.ssm_n_k_heads,
                    ssm_n_v_heads=c.ssm_n_v_heads, ssm_head_dim=c.ssm_head_dim, ssm_conv_dim=c.ssm_conv_dim,
                    ssm_v_dim=c.ssm_v_dim, n_expert=c.n_expert, n_expert_used=c.n_expert_used,
                    expert_hidden_dim=c.expert_hidden_dim)
        features = c.features                    # each stage as this model computes it (gpt-oss's probs)
    rows = [{
        "id": s.id, "level": s.level, "op": s.op, "chapter": s.chapter, "section": s.section,
        "book_stage": s.book_stage, "llama_cpp": s.llama_cpp, "llama_cpp_note": s.llama_cpp_note,
        "tl_hook": s.tl_hook, "tl_differs": s.tl_differs, "replaceable": s.replaceable, "when": s.when,
        "shape": s.shape, **({"model_shape": _concrete(s.shape, dims)} if dims else {}),
        "description": s.description,
    } for s in (stage_for(s.id, features) for s in STAGES)]
    if model is not None:        # the model's own stages (the default model's sizes alone filter nothing)
        computed = model_stage_ids(c)
        rows = [r for r in rows if r["id"] in computed]
        for r in rows:
            if r["level"] == "layer":
                layers = stage_layers(r["id"], c)
                r["layers"] = list(layers)
                if len(layers) < c.n_layers:
                    where = f"layers {layer_list(layers)}"
                    r["when"] = where if r["when"] == "always" else f"{r['when']}; {where}"
    if json_out:
        stdout.write(json.dumps(rows, ensure_ascii=False, indent=1) + "\n")
        return

    from rich.table import Table

    title = ("Stage catalogue" + (f" · the {len(rows)} stages of {path.name}" if model is not None else
                                  f" · shapes of {path.name}" if dims else ""))
    table = Table(title=title, title_justify="left", show_lines=True)
    for name, kw in (("id", {"no_wrap": True}), ("book", {"no_wrap": True}), ("llama.cpp", {}),
                     ("TransformerLens", {}), ("hook", {"no_wrap": True}), ("shape", {})):
        table.add_column(name, **kw)
    for r in rows:
        lc = r["llama_cpp"] or "—"
        if r["llama_cpp_note"]:
            lc += f"\n[dim]{escape(r['llama_cpp_note'])}[/]"
        tl = r["tl_hook"] or "—"
        if r["tl_differs"]:
            tl += f"\n[dim]{escape(r['tl_differs'])}[/]"
        shape = escape(r["shape"]) + (f"\n{escape(r['model_shape'])}" if dims else "")
        if r["when"] != "always":
            shape += f"\n[dim]({r['when']} only)[/]"
        table.add_row(r["id"], f"{r['chapter']}\nSTAGE {r['book_stage']}", lc, tl,
                      "yes" if r["replaceable"] else "[dim]no[/]", shape)
    print_wide(table)
