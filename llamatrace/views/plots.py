"""Pictures of :mod:`llamatrace.analysis.look`'s data with matplotlib: attention heatmaps, the logit
lens; and of :mod:`llamatrace.analysis.experts`' routes and expert loads.

matplotlib is imported here only, by the ``attention``, ``lens`` and ``experts`` commands, so other commands
do not pay for it. Files are written atomically (:func:`llamatrace.outputs.write_atomic`); the
format follows the extension (``.png``, ``.svg``, ``.pdf``).

Token labels are the pieces as the font can show them: characters the font lacks, control
characters and newlines are written escaped (``\\n``, ``\\u4e2d``) rather than drawn as
boxes; a leading space shows as ``␣``; long pieces are cut with ``…``; and on long prompts only
every n-th label is drawn, so labels never overlap.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from llamatrace.analysis.experts import ExpertLoad, Route
from llamatrace.analysis.look import AttentionMaps, Lens
from llamatrace.outputs import output_suffix, write_atomic

FORMATS = ("png", "svg", "pdf")
MASKED_COLOUR = "#c8c8c8"     # grey: no probability at all, distinct from the colormap's dark low end
MAX_LABELS = 40               # most tick labels drawn along one axis
DPI = 150
MAX_FIGURE_IN = 36.0          # widest and tallest figure (5,400 px at DPI): a long prompt's cells shrink


def check_format(path: Path, option: str = "-o") -> str:
    """The image format named by ``path``'s extension.

    Raises:
        OptionError: as :func:`~llamatrace.outputs.output_suffix` (``-``, a directory, no
            extension or one matplotlib is not asked to write here).
    """
    return output_suffix(Path(path), option, FORMATS, "an image", "plot.png")


def _pyplot():
    import matplotlib
    matplotlib.use("Agg")                      # files only, never a window
    import matplotlib.pyplot as plt
    return plt


_CHARMAP: set[int] | None = None


def _font_chars() -> set[int]:
    """Code points the default font (DejaVu Sans, shipped with matplotlib) can draw."""
    global _CHARMAP
    if _CHARMAP is None:
        from matplotlib import font_manager
        from matplotlib.ft2font import FT2Font
        font = FT2Font(font_manager.findfont(font_manager.FontProperties()))
        _CHARMAP = set(font.get_charmap())
    return _CHARMAP


def token_label(piece: str, width: int = 10) -> str:
    """A piece as a label the font can draw: escapes for what it cannot, ``␣`` for a leading
    space, ``…`` past ``width`` characters, ``$`` escaped (matplotlib's math mode)."""
    chars = _font_chars()
    out = []
    for ch in piece:
        if ch == "\n":
            out.append("\\n")
        elif ch == "\t":
            out.append("\\t")
        elif not ch.isprintable() or ord(ch) not in chars:
            out.append(f"\\u{ord(ch):04x}" if ord(ch) <= 0xFFFF else f"\\U{ord(ch):08x}")
        else:
            out.append(ch)
    text = "".join(out)
    if text.startswith(" "):
        text = "␣" + text[1:]
    if len(text) > width:
        text = text[:width - 1] + "…"
    return text.replace("$", r"\$") or "∅"


def _ticks(n: int, limit: int = MAX_LABELS) -> list[int]:
    """Every k-th index of ``n`` so that at most ``limit`` labels are drawn (the last one kept)."""
    step = max(1, math.ceil(n / limit))
    ticks = list(range(0, n, step))
    if ticks[-1] != n - 1 and n - 1 - ticks[-1] >= step / 2:
        ticks.append(n - 1)
    return ticks


def _save(fig, path: Path, option: str) -> None:
    fmt = check_format(path, option)
    plt = _pyplot()
    try:
        write_atomic(path, lambda f: fig.savefig(f, format=fmt, dpi=DPI, bbox_inches="tight"), option)
    finally:
        plt.close(fig)


def attention_figure(maps: AttentionMaps, pieces: list[str], heads: list[int], title: str):
    """One heatmap panel per query head in ``heads``; with several heads, one row per KV head
    group (the ``n_rep`` query heads that share it). Returns the matplotlib figure."""
    plt = _pyplot()
    from matplotlib.colors import PowerNorm

    n_q, kv_len = maps.masked.shape
    if len(heads) > 1 and maps.n_rep > 1:
        n_rows, n_cols = math.ceil(len(heads) / maps.n_rep), maps.n_rep
    else:
        n_cols = math.ceil(math.sqrt(len(heads)))
        n_rows = math.ceil(len(heads) / n_cols)
    label_pad = 1.0 if n_q > 1 else 0.4
    cell = min(0.32, max(0.09, 7.0 / max(kv_len, 1)),
               ((MAX_FIGURE_IN - 1.2) / n_cols - label_pad) / max(kv_len, 1),   # its pixels grew as kv_len²
               ((MAX_FIGURE_IN - 1.2) / n_rows - 0.6) / max(n_q, 1))
    # a readable floor, unless the grid's many panels would pass the cap with it
    panel_w = min(max(2.6, kv_len * cell), (MAX_FIGURE_IN - 1.2) / n_cols - label_pad)
    panel_h = min(max(0.9, n_q * cell) if n_q > 1 else 0.35, (MAX_FIGURE_IN - 1.2) / n_rows - 0.6)
    fig, axes = plt.subplots(n_rows, n_cols, squeeze=False, layout="constrained",
                             figsize=(n_cols * (panel_w + label_pad) + 1.2, n_rows * (panel_h + 0.6) + 1.2))
    cmap = plt.get_cmap("viridis").with_extremes(bad=MASKED_COLOUR)
    norm = PowerNorm(gamma=0.5, vmin=0.0, vmax=1.0)
    key_labels = [token_label(p) for p in pieces]
    query_labels = [token_label(pieces[q]) for q in maps.query_pos]
    fontsize = 7 if kv_len <= 24 else 6
    image = None
    for ax in axes.ravel()[len(heads):]:
        ax.set_visible(False)
    for i, (ax, head) in enumerate(zip(axes.ravel(), heads)):
        data = np.ma.masked_array(maps.probs[head], mask=maps.masked)
        # cells narrower than a pixel: averaged, not one key in several picked
        image = ax.imshow(data, cmap=cmap, norm=norm, aspect="auto",
                          interpolation="nearest" if cell * DPI >= 1 else "antialiased")
        ax.set_title(f"head {head} (KV head {head // maps.n_rep})", fontsize=8)
        row, col = divmod(i, n_cols)
        xt = _ticks(kv_len)
        ax.set_xticks(xt)
        last_row = row == n_rows - 1 or i + n_cols >= len(heads)
        ax.set_xticklabels([key_labels[j] for j in xt] if last_row else [], rotation=90, fontsize=fontsize)
        yt = _ticks(n_q, limit=MAX_LABELS if n_q * cell >= 0.9 else 1)
        ax.set_yticks(yt)
        ax.set_yticklabels([query_labels[j] for j in yt] if col == 0 else [], fontsize=fontsize)
        ax.tick_params(length=2, pad=1)
    fig.suptitle(title, fontsize=10)
    bar = fig.colorbar(image, ax=axes.ravel().tolist(), shrink=0.8, pad=0.02)
    beyond = f", or beyond the sliding window of {maps.window}" if maps.window else ""
    bar.set_label(f"probability (√ scale); grey = masked (a later key{beyond})", fontsize=8)
    bar.ax.tick_params(labelsize=7)
    fig.supxlabel("keys", fontsize=8)
    fig.supylabel("queries", fontsize=8)
    return fig


def save_attention(maps: AttentionMaps, pieces: list[str], heads: list[int], title: str, path: Path,
                   option: str = "-o") -> None:
    """Draw :func:`attention_figure` and write it atomically to ``path`` (format by extension).

    Raises:
        OptionError: a bad extension. OutputError: the file cannot be written.
    """
    _save(attention_figure(maps, pieces, heads, title), path, option)


def lens_figure(lens: Lens, pieces: list[str], title: str):
    """Layers down (embeddings first), positions across; cell colour = the top-1 probability,
    cell text = the top-1 piece. Returns the matplotlib figure."""
    plt = _pyplot()
    k = len(lens.positions)
    n_rows = len(lens.rows) // k
    probs = np.array([r.top_prob for r in lens.rows]).reshape(n_rows, k)
    # a cell holds its top piece while it is wide enough; many positions: within the cap, colour only
    cell_w, cell_h = min(1.05, (MAX_FIGURE_IN - 1.3) / k), min(0.24, (MAX_FIGURE_IN - 0.8) / n_rows)
    fig, ax = plt.subplots(figsize=(1.3 + cell_w * k, 0.8 + cell_h * n_rows), layout="constrained")
    image = ax.imshow(probs, cmap="magma", vmin=0.0, vmax=1.0, aspect="auto",
                      interpolation="nearest" if min(cell_w, cell_h) * DPI >= 1 else "antialiased")
    if cell_w >= 0.6 and cell_h >= 0.2:
        for idx, r in enumerate(lens.rows):
            i, j = divmod(idx, k)
            text = token_label(r.top_piece, width=9)
            colour = "black" if r.top_prob > 0.55 else "white"
            weight = "bold" if r.top_id == lens.final_id else "normal"
            ax.text(j, i, text, ha="center", va="center", fontsize=6.5, color=colour, fontweight=weight)
    xt = _ticks(k, limit=max(1, int(cell_w * k / 0.16)))          # a label needs ~0.16 in across
    ax.set_xticks(xt)
    ax.set_xticklabels([f"{lens.positions[j]}: {token_label(pieces[lens.positions[j]])}" for j in xt], fontsize=7,
                       rotation=30, ha="right")
    yt = _ticks(n_rows, limit=max(1, int(cell_h * n_rows / 0.12)))
    ax.set_yticks(yt)
    ax.set_yticklabels(["embd" if i == 0 else str(i - 1) for i in yt], fontsize=6.5)
    ax.set_ylabel("after layer")
    ax.set_xlabel("position: input token")
    ax.tick_params(length=2, pad=1)
    ax.set_title(title, fontsize=9)
    bar = fig.colorbar(image, ax=ax, shrink=0.6, pad=0.02)
    bar.set_label("top-1 probability (bold: the model's final prediction)", fontsize=7)
    bar.ax.tick_params(labelsize=7)
    return fig


def save_lens(lens: Lens, pieces: list[str], title: str, path: Path, option: str = "-o") -> None:
    """Draw :func:`lens_figure` and write it atomically to ``path`` (format by extension).

    Raises:
        OptionError: a bad extension. OutputError: the file cannot be written.
    """
    _save(lens_figure(lens, pieces, title), path, option)


def routes_figure(routes: list[Route], pieces: list[str], title: str):
    """One panel per layer: tokens down, experts across, cell colour = the weight the token gives
    the expert (white: not chosen). Returns the matplotlib figure."""
    plt = _pyplot()
    n_tokens, n_expert = len(routes[0].ids), routes[0].n_expert
    n_cols = min(len(routes), 4)
    n_rows = math.ceil(len(routes) / n_cols)
    cell = min(0.25, max(0.04, 6.0 / max(n_expert, n_tokens, 1)))
    panel_w = min(max(2.4, n_expert * cell), (MAX_FIGURE_IN - 1.2) / n_cols - 1.0)     # within the cap: 48
    panel_h = min(max(1.0, n_tokens * cell), (MAX_FIGURE_IN - 1.0) / n_rows - 0.7)    # layers of 1,000 tokens
    fig, axes = plt.subplots(n_rows, n_cols, squeeze=False, layout="constrained",
                             figsize=(n_cols * (panel_w + 1.0) + 1.2, n_rows * (panel_h + 0.7) + 1.0))
    cmap = plt.get_cmap("viridis").with_extremes(bad="white")
    labels = [token_label(p) for p in pieces]
    image = None
    for ax in axes.ravel()[len(routes):]:
        ax.set_visible(False)
    for i, (ax, route) in enumerate(zip(axes.ravel(), routes)):
        grid = route.dense()
        fine = panel_h * DPI >= n_tokens and panel_w * DPI >= n_expert        # a pixel or more a cell
        image = ax.imshow(np.ma.masked_equal(grid, 0.0), cmap=cmap, vmin=0.0, vmax=1.0, aspect="auto",
                          interpolation="nearest" if fine else "antialiased")
        ax.set_title(f"layer {route.layer}", fontsize=8)
        xt = _ticks(n_expert, limit=32)
        ax.set_xticks(xt)
        ax.set_xticklabels([str(j) for j in xt], fontsize=6, rotation=90)
        yt = _ticks(n_tokens)
        ax.set_yticks(yt)
        ax.set_yticklabels([labels[j] for j in yt] if i % n_cols == 0 else [], fontsize=6.5)
        ax.tick_params(length=2, pad=1)
    fig.suptitle(title, fontsize=10)
    bar = fig.colorbar(image, ax=axes.ravel().tolist(), shrink=0.8, pad=0.02)
    bar.set_label(f"routing weight (top-{routes[0].ids.shape[1]} of {n_expert}); white = not chosen", fontsize=8)
    bar.ax.tick_params(labelsize=7)
    fig.supxlabel("experts", fontsize=8)
    fig.supylabel("tokens", fontsize=8)
    return fig


def save_routes(routes: list[Route], pieces: list[str], title: str, path: Path, option: str = "-o") -> None:
    """Draw :func:`routes_figure` and write it atomically to ``path`` (format by extension).

    Raises:
        OptionError: a bad extension. OutputError: the file cannot be written.
    """
    _save(routes_figure(routes, pieces, title), path, option)


def load_figure(load: ExpertLoad, title: str):
    """Layers down, experts across: the share of each layer's tokens that chose the expert, and
    each layer's load entropy beside it. Returns the matplotlib figure."""
    plt = _pyplot()
    share = load.counts / max(load.n_tokens, 1)
    fig, (ax, side) = plt.subplots(1, 2, width_ratios=[5, 1], layout="constrained",
                                   figsize=(max(6.5, 3.0 + min(0.12 * load.n_expert, 14)),
                                            max(2.8, 1.2 + 0.22 * load.n_layers)))
    image = ax.imshow(share, cmap="magma", vmin=0.0, aspect="auto", interpolation="nearest")
    ax.set_xlabel("expert")
    ax.set_ylabel("layer")
    ax.set_yticks(_ticks(load.n_layers))
    ax.set_title(title, fontsize=9)
    bar = fig.colorbar(image, ax=ax, shrink=0.8, pad=0.02)
    bar.set_label("share of tokens", fontsize=7)
    bar.ax.tick_params(labelsize=7)
    entropy = load.entropy()
    side.barh(range(load.n_layers), entropy, color="#4c72b0")
    side.axvline(math.log2(load.n_expert), color="grey", linestyle="--", linewidth=0.8)
    side.set_ylim(load.n_layers - 0.5, -0.5)
    side.set_yticks([])
    side.set_xlabel("load entropy (bits)", fontsize=7)
    side.tick_params(labelsize=7)
    return fig


def save_load(load: ExpertLoad, title: str, path: Path, option: str = "-o") -> None:
    """Draw :func:`load_figure` and write it atomically to ``path`` (format by extension).

    Raises:
        OptionError: a bad extension. OutputError: the file cannot be written.
    """
    _save(load_figure(load, title), path, option)


def state_figure(sw, pieces: list[str], title: str):
    """Value heads down, prompt tokens across: what each token wrote into a gated DeltaNet state
    (‖β·k·(v − Sᵀk)‖), how much of the state it kept (exp(gate)), and the state's norm after it.
    Returns the matplotlib figure."""
    plt = _pyplot()
    n_heads, n = sw.write.shape
    panels = ((sw.write, "viridis", None, "written ‖β·k·(v − Sᵀk)‖"),
              (sw.decay, "magma", (0.0, 1.0), "kept exp(gate): 1 = nothing forgotten"),
              (sw.state_norm, "cividis", None, "state norm ‖S‖ after the token"))
    # within the size cap however long the prompt: cells shrink, labels thin out
    cell_w, cell_h = min(0.42, (MAX_FIGURE_IN - 1.6) / n), min(0.22, ((MAX_FIGURE_IN - 1.2) / 3 - 0.5) / n_heads)
    fig, axes = plt.subplots(3, 1, figsize=(1.6 + cell_w * n, 1.2 + 3 * (0.5 + cell_h * n_heads)),
                             layout="constrained", sharex=True)
    yt = _ticks(n_heads, limit=max(1, int(cell_h * n_heads / 0.12)))
    for ax, (data, cmap, limits, label) in zip(axes, panels):
        vmin, vmax = limits or (0.0, float(data.max()) or 1.0)
        image = ax.imshow(data, cmap=cmap, vmin=vmin, vmax=vmax, aspect="auto",
                          interpolation="nearest" if min(cell_w, cell_h) * DPI >= 1 else "antialiased")
        ax.set_yticks(yt)
        ax.set_yticklabels([f"v{h} (k{h % sw.n_k_heads})" for h in yt], fontsize=6.5)
        ax.set_ylabel("value head", fontsize=7)
        bar = fig.colorbar(image, ax=ax, shrink=0.8, pad=0.01)
        bar.set_label(label, fontsize=7)
        bar.ax.tick_params(labelsize=6.5)
    xt = _ticks(n, limit=max(1, int(cell_w * n / 0.16)))
    axes[-1].set_xticks(xt)
    axes[-1].set_xticklabels([f"{p}: {token_label(pieces[p])}" for p in xt], fontsize=6.5, rotation=45, ha="right")
    axes[-1].set_xlabel("position: input token")
    axes[0].set_title(title, fontsize=9)
    return fig


def save_state(sw, pieces: list[str], title: str, path: Path, option: str = "-o") -> None:
    """Draw :func:`state_figure` and write it atomically to ``path`` (format by extension).

    Raises:
        OptionError: a bad extension. OutputError: the file cannot be written.
    """
    _save(state_figure(sw, pieces, title), path, option)
