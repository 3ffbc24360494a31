"""Flow diagrams of a real traced run: trace events + the stage catalogue → ``graphviz.Digraph``.

The book (*llama-nuts-and-bolts*, ch. 14–16 and 20) draws the forward pass as "STAGE 1" …
"STAGE 19" diagrams. Here the same pictures are drawn from one step of an actual run, so every
shape on them is the shape the model really produced.

Where things come from:

* nodes — one per :data:`llamatrace.tracing.stages.STAGES` entry that ran (op, chapter tensor name, shape,
  dtype from the event); weights are nodes of their own (GGUF name, quant type, shape);
* edges — an input of a stage is wired to the latest earlier stage whose chapter name it uses.
  The chapter reuses function-local names (inside ``LlamaAttention.Forward`` ``x`` *is*
  ``normalizedX``; in the FFN ``h`` names three tensors), so the catalogue names those producers
  by stage id (``Stage.sources``). An input shaped ``[max_seq, …]`` is the KV cache.
* layout — clusters for the attention and FFN sub-layers, the residual stream as a straight spine
  the sub-layers branch off and rejoin.

``--view model`` wraps the block in the model-level stages (tokens → embedding → block × n_layers
→ final norm → logits → sampled token); ``--view block`` draws only the block and its inputs.
Without ``stats`` / ``timings`` the DOT source is a pure function of the run's shapes: the same
model and prompt give byte-identical DOT (the golden test relies on it).

Modules: ``highlight`` (the book's STAGE views, pseudo nodes), ``flow`` (:class:`RunInfo`, the
wiring, :func:`trace_step` which runs the model for one step), ``draw`` (:func:`build_diagram`),
``output`` (file formats, Graphviz's ``dot``).
"""

from llamatrace.views.diagram.draw import VIEWS, build_diagram
from llamatrace.views.diagram.flow import RunInfo, run_info, trace_step
from llamatrace.views.diagram.highlight import (BLOCK_IN, BOOK_STAGES, KV_CACHE, LEGEND, SAMPLED, TOKENS, Highlight,
                                                resolve_highlight)
from llamatrace.views.diagram.output import FORMATS, GraphvizMissingError, check_graphviz, output_format, render

__all__ = ["VIEWS", "FORMATS", "BOOK_STAGES", "BLOCK_IN", "TOKENS", "KV_CACHE", "SAMPLED", "LEGEND", "RunInfo",
           "Highlight", "GraphvizMissingError", "build_diagram", "check_graphviz", "output_format", "render",
           "resolve_highlight", "run_info", "trace_step"]
