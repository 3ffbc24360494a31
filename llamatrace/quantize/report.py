"""The recipe search's report: a table for stdout, a JSON document, a picture.

Each beside a stock mix of the same base (llama.cpp's types for a file type), so the reader sees
what the search moved: which groups got more bits, which fewer, and what that was predicted to
buy; and, once the file is written and measured, predicted against measured KLD.
"""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np

from llamatrace.outputs import write_atomic
from llamatrace.quantize.search import LAYER_KINDS, Recipe

_BITS = {"Q2_K": 2.625, "Q3_K": 3.4375, "Q4_0": 4.5, "Q4_1": 5.0, "Q4_K": 4.5, "Q5_0": 5.5, "Q5_1": 6.0,
         "Q5_K": 5.5, "Q6_K": 6.5625, "Q8_0": 8.5, "F16": 16.0, "BF16": 16.0, "F32": 32.0}


def table(recipe: Recipe, stock: Recipe | None = None, stock_name: str | None = None) -> str:
    """One line per group: name, type, ΔKLD, bytes; then totals. With a ``stock`` mix (the CLI's
    ``--type``), a column named ``stock_name`` (default ``"stock"``) holds its type where it
    differs from the recipe's (blank where they agree), and a total line for it; without one
    there is nothing to compare with, and no such column."""
    stock_name = stock_name or "stock"
    column = (lambda text: f" {text:<8}") if stock is not None else (lambda text: "")
    lines = [f"{'group':<20} {'type':<6}{column(stock_name)} {'ΔKLD':>10} {'bytes':>10}"]
    stock_types = {c.group.name: c.ggml_type.name for c in stock.choices} if stock else {}
    for c in recipe.choices:
        was = stock_types.get(c.group.name, "")
        mark = "" if was in ("", c.ggml_type.name) else was
        lines.append(f"{c.group.name:<20} {c.ggml_type.name:<6}{column(mark)} {c.delta_kld:>10.6f} {c.bytes:>10}")
    rows = [("recipe", recipe)] + ([(stock_name, stock)] if stock else [])
    for name, r in rows:
        lines.append(f"{name}: {r.total_bytes} bytes, {r.budget.bpw(r.total_bytes):.4f} bpw, "
                     f"predicted KLD {r.predicted_kld:.6f}")
    return "\n".join(lines)


def document(recipe: Recipe, stock: Recipe | None = None, measured: dict | None = None) -> dict:
    """The ``--json`` document: the recipe (:meth:`Recipe.to_json`), the stock mix's, and measured statistics."""
    doc = {"recipe": recipe.to_json()}
    if stock is not None:
        doc["stock"] = stock.to_json()
    if measured:
        doc["measured"] = measured
    return doc


def _kinds(recipe: Recipe) -> list[str]:
    """The columns: the kinds of matrix the recipe's groups are (a MoE's expert tensors beside the dense ones)."""
    present = {c.group.name.split(".")[2] for c in recipe.choices if c.group.name.startswith("blk.")}
    return [k for k in LAYER_KINDS if k in present]


def _grid(recipe: Recipe, value, kinds: list[str]) -> tuple[np.ndarray, int]:
    n_layers = 1 + max((int(c.group.name.split(".")[1]) for c in recipe.choices if c.group.name.startswith("blk.")),
                       default=-1)
    grid = np.full((n_layers, len(kinds)), np.nan)
    for c in recipe.choices:
        if c.group.name.startswith("blk."):
            _, layer, kind = c.group.name.split(".")
            grid[int(layer), kinds.index(kind)] = value(c)
    return grid, n_layers


def plot(recipe: Recipe, path: Path, title: str, stock: Recipe | None = None, option: str = "-o") -> None:
    """Heat maps (layers × kinds) of each group's bits per weight in the recipe (and the stock mix)
    and of its sensitivity (ΔKLD at its cheapest candidate), written atomically to ``path``.

    Raises:
        OptionError: an extension matplotlib is not asked to write.
        OutputError: the file cannot be written.
    """
    from llamatrace.views.plots import _pyplot, check_format
    fmt = check_format(path, option)
    plt = _pyplot()
    kinds = _kinds(recipe)
    panels = [("recipe: bits per weight", _grid(recipe, lambda c: _BITS.get(c.ggml_type.name, np.nan), kinds)[0],
               "viridis")]
    if stock is not None:
        panels.append(("stock: bits per weight", _grid(stock, lambda c: _BITS.get(c.ggml_type.name, np.nan), kinds)[0],
                       "viridis"))
    sens, n_layers = _grid(recipe, lambda c: max(c.options.values()) if c.options else np.nan, kinds)
    panels.append(("sensitivity: ΔKLD at the cheapest candidate (log10)", np.log10(np.maximum(sens, 1e-9)), "magma"))
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 0.22 * n_layers + 3))
    vmin = np.nanmin([np.nanmin(p[1]) for p in panels[:-1]])
    vmax = np.nanmax([np.nanmax(p[1]) for p in panels[:-1]])
    for ax, (label, values, cmap) in zip(np.atleast_1d(axes), panels):
        bits = cmap == "viridis"
        image = ax.imshow(np.ma.masked_invalid(values), aspect="auto", cmap=cmap, interpolation="nearest",
                          vmin=vmin if bits else None, vmax=vmax if bits else None)
        ax.set_xticks(range(len(kinds)), kinds, rotation=60, ha="right", fontsize=8)
        ax.set_yticks(range(n_layers), [str(i) for i in range(n_layers)], fontsize=7)
        ax.set_ylabel("layer")
        ax.set_title(label, fontsize=9)
        fig.colorbar(image, ax=ax, fraction=0.04)
    fig.suptitle(title)
    fig.tight_layout()
    buffer = io.BytesIO()
    fig.savefig(buffer, format=fmt, dpi=110)
    plt.close(fig)
    write_atomic(path, lambda f: f.write(buffer.getvalue()), option)
