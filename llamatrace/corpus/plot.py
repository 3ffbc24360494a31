"""The ``perplexity --stages`` picture: heat maps (layers × stages) of the median relative
difference each stage adds (local) and has accumulated, the residual stream's difference by layer and, for
a mixture of experts, each expert's down projection by layer. matplotlib is imported here only;
the file is written atomically, its format picked by the extension (``.png``, ``.svg``, ``.pdf``).
A stage whose local error is not recomputed is a white column, named in a legend with the reason."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np

from llamatrace.corpus.stage_errors import StageErrors
from llamatrace.outputs import write_atomic
from llamatrace.views.plots import _pyplot, check_format


def plot_stage_errors(errors: StageErrors, path: Path, title: str, option: str = "-o") -> None:
    """Draw ``errors`` into ``path``.

    Raises:
        OptionError: an extension matplotlib is not asked to write.
        OutputError: the file cannot be written.
    """
    fmt = check_format(path, option)
    plt = _pyplot()
    n_layers = errors.median.shape[0]
    notes = errors.local_notes
    below = 0.16 * (len(notes) + 1) if notes else 0.0          # inches for the legend of the white columns
    height = 0.22 * n_layers + 3 + below
    x = errors.experts
    panels = 4 if x is not None else 3
    fig, axes = plt.subplots(1, panels, figsize=(20 + 6 * (panels - 3), height),
                             gridspec_kw={"width_ratios": [3, 3, 2, 3][:panels]})
    local, heat, line = axes[:3]
    for ax, values, label in ((local, errors.local_median, "where it enters: each stage from the base's inputs"),
                              (heat, errors.median, "accumulated: each model's own inputs")):
        image = ax.imshow(np.ma.masked_invalid(values), aspect="auto", cmap="magma", interpolation="nearest")
        ax.set_xticks(range(len(errors.stages)), errors.stages, rotation=60, ha="right", fontsize=8)
        ax.set_yticks(range(n_layers), [str(i) for i in range(n_layers)], fontsize=7)
        ax.set_ylabel("layer")
        ax.set_title(f"median ‖quant − base‖ / ‖base‖\n{label}", fontsize=9)
        fig.colorbar(image, ax=ax, fraction=0.04)
    if notes:                                # the empty (white) columns say why they are empty
        from matplotlib.patches import Patch
        fig.legend(handles=[Patch(facecolor="white", edgecolor="grey", label=f"{stage}: {why}")
                            for stage, why in notes.items()],
                   title="white: local error not recomputed", loc="lower left", bbox_to_anchor=(0.01, 0.0),
                   fontsize=7, title_fontsize=7, alignment="left", frameon=False)
    layers = np.arange(n_layers)
    line.plot(layers, errors.l_out, marker="o", ms=3, label="l_out (accumulated)")
    line.bar(layers, errors.added, color="tab:orange", alpha=0.6, label="added by the layer")
    line.axhline(0, color="grey", lw=0.5)
    line.set_xlabel("layer")
    line.set_title("residual stream: relative difference")
    line.legend(fontsize=8)
    if x is not None:                        # layers × experts of the down projection, from the base's inputs
        stage = "ffn_moe_down" if "ffn_moe_down" in x.stages else x.stages[-1]
        ax = axes[3]
        image = ax.imshow(np.ma.masked_invalid(x.local_median[:, x.stages.index(stage)]), aspect="auto",
                          cmap="magma", interpolation="nearest")
        ax.set_xlabel("expert (white: no token routed to it)")
        ax.set_ylabel("layer")
        ax.set_title(f"{stage} per expert, median over its tokens\n(local: the base's inputs and route)", fontsize=9)
        fig.colorbar(image, ax=ax, fraction=0.04)
    fig.suptitle(f"{title} — {errors.count} scored tokens")
    fig.tight_layout(rect=(0, below / height, 1, 1))
    buffer = io.BytesIO()
    fig.savefig(buffer, format=fmt, dpi=110)
    plt.close(fig)
    write_atomic(path, lambda f: f.write(buffer.getvalue()), option)
