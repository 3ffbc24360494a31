"""The importance matrix of a model over a calibration text, as ``llama-imatrix`` computes it.

llama.cpp ``tools/imatrix/imatrix.cpp``: the text is tokenized once (BOS first where the
vocabulary adds one) and cut into ``n_ctx``-token chunks as ``llama-perplexity`` cuts it
(:mod:`llamatrace.corpus.chunks`: each chunk's first slot is BOS); every chunk runs from an empty
cache with every position evaluated. llama-imatrix refuses a text shorter than two chunks, a rule
of the perplexity it prints as it goes; nothing here is scored, so one chunk is enough, and a
text shorter than ``n_ctx`` is one chunk of its own length (the file's ``chunk_size``).

For each matrix multiplication by a weight of a block (``blk.*``; ``output.weight`` only with
``process_output``, never the token embedding, not even when the output is tied to it) the
squares of its input columns are summed over every token: ``in_sum2[j] = Σ_t x[t, j]²``, with
``counts`` = the tokens summed.

A weight's input is the output of one stage of the forward pass, shared by the weights that read
it (:data:`INPUTS`): ``attn_norm`` feeds ``attn_q/k/v`` (or the fused ``attn_qkv``), ``kqv_out``
(the heads merged) feeds ``attn_output``, ``ffn_norm`` feeds ``ffn_gate/up``, the gated product
(``ffn_swiglu`` / ``ffn_geglu``) feeds ``ffn_down``, ``result_norm`` feeds ``output``. Qwen3.5 (``qwen35``, llama.cpp ``models/qwen35.cpp``): on a gated
DeltaNet layer ``attn_norm`` also feeds the mixed ``attn_qkv``, ``attn_gate`` (z), ``ssm_alpha``
and ``ssm_beta``, and the gated RMSNorm's output (``final_output``) feeds ``ssm_out``; on a full
attention layer the gated heads (``attn_gated``, the output × sigmoid(gate)) feed ``attn_output``
and ``attn_norm`` the joint ``attn_q`` (query | gate). So a chunk
sums each stage once, by hooks (:meth:`llamatrace.model.llama.Llama.hooks`) that read and change
nothing.

Mixtures of experts (``ggml_mul_mat_id``: llama-imatrix collects every one): the router
``ffn_gate_inp`` reads ``ffn_norm`` as a dense weight does; an expert tensor ``ffn_{gate,up}_exps``
is summed per expert over the ``ffn_norm`` rows of the tokens that chose that expert, and
``ffn_down_exps`` over the ``ffn_moe_swiglu`` rows of each (token, chosen expert) pair, with
``counts`` per expert = the (token, slot) pairs routed to it (``ffn_moe_topk``): ``in_sum2`` is
``[n_expert, width]``, ``counts`` ``[n_expert]``, 0 for an expert no token chose. The rows, the route
and the experts' gated rows are the forward pass's own stages (hooks on ``ffn_norm``,
``ffn_moe_topk`` and ``ffn_moe_swiglu`` / gpt-oss's ``ffn_moe_swiglu_oai``; :func:`expert_squares`).

llama.cpp adds each token's square to float32 sums, token after token; here each chunk's sums
are float64 and chunks are added in chunk order in float64 (then stored as float32, the file's
type): the same numbers to float32 rounding (about 1e-6 relative after thousands of tokens),
and the same bits with any number of workers or Ray actors, since the runner delivers results
in chunk order (:func:`llamatrace.corpus.runner.run_chunks`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np

from llamatrace.corpus.chunks import Chunks
from llamatrace.corpus.runner import run_chunks
from llamatrace.corpus.worker import ModelSpec
from llamatrace.errors import NumericalError
from llamatrace.quantize.imatrix.files import Entries, ImatrixMeta

# stage whose output is the input of these weights (GGUF names within a block); ffn_down's is the
# gated product, whose stage id depends on the activation, and attn_output's is attn_gated where the
# attention output is gated (Qwen3.5; see input_stages)
INPUTS: dict[str, tuple[str, ...]] = {
    "attn_norm": ("attn_q", "attn_k", "attn_v", "attn_qkv", "attn_gate", "ssm_alpha", "ssm_beta"),
    "kqv_out": ("attn_output",),
    "final_output": ("ssm_out",),
    "ffn_norm": ("ffn_gate", "ffn_up", "ffn_gate_inp"),
    "ffn_glu": ("ffn_down",),
}
# the expert tensors (mul_mat_id) and the stage whose rows they read, per chosen expert
EXPERT_INPUTS: dict[str, tuple[str, ...]] = {
    "ffn_norm": ("ffn_gate_exps", "ffn_up_exps"),
    "ffn_moe_swiglu": ("ffn_down_exps",),
}


@dataclass(frozen=True)
class Input:
    """One summed input: the stage (at ``layer``; ``None`` = model level) and the GGUF names of
    the weights it feeds, ``width`` columns each; ``n_expert`` > 0: summed per expert over the rows
    routed to each (:data:`EXPERT_INPUTS`)."""

    stage: str
    layer: int | None
    weights: tuple[str, ...]
    width: int
    n_expert: int = 0

    @property
    def key(self) -> tuple[str, int | None, int]:
        return (self.stage, self.layer, self.n_expert)


def input_stages(tensor_names, config, process_output: bool = False) -> list[Input]:
    """The inputs to sum for a model, from its GGUF tensor names and config: every block weight
    listed in :data:`INPUTS` the file holds, and ``output.weight`` with ``process_output`` when
    the file has one (a tied output reads ``token_embd.weight``, which llama-imatrix skips).
    """
    c = config
    glu = "ffn_geglu" if c.ffn_act == "gelu" else "ffn_swiglu"
    width = {"attn_norm": c.dim, "kqv_out": c.q_dim, "final_output": c.ssm_v_dim, "ffn_norm": c.dim,
             "ffn_glu": c.hidden_dim}
    stage_id = {"ffn_glu": glu, "kqv_out": "attn_gated" if c.attn_output_gate else "kqv_out"}
    found = []
    for layer in range(c.n_layers):
        for stage, kinds in INPUTS.items():
            weights = tuple(name for kind in kinds if (name := f"blk.{layer}.{kind}.weight") in tensor_names)
            if weights:
                found.append(Input(stage_id.get(stage, stage), layer, weights, width[stage]))
        for stage, kinds in EXPERT_INPUTS.items():
            weights = tuple(name for kind in kinds if (name := f"blk.{layer}.{kind}.weight") in tensor_names)
            if weights and c.n_expert:
                found.append(Input(stage, layer, weights, c.dim if stage == "ffn_norm" else c.expert_hidden_dim,
                                   c.n_expert))
    if process_output and "output.weight" in tensor_names:
        found.append(Input("result_norm", None, ("output.weight",), c.dim))
    return found


@dataclass
class SquaresJob:
    """One chunk's input: int32 ``[n_ctx]`` ids, the stages to sum (:attr:`Input.key`: ``(stage,
    layer, n_expert)`` in order), and whether the output projection's input (every row of
    ``result_norm``) is among them."""

    ids: np.ndarray
    keys: tuple[tuple[str, int | None, int], ...]
    all_rows: bool


def sum_squares(model, job: SquaresJob) -> list[tuple[np.ndarray, np.ndarray]]:
    """The runner's work for one chunk: one prefill of ``job.ids`` from an empty cache; per key,
    float64 ``[n_mat, width]`` Σ of the squares of the stage output's rows that reach each matrix
    (every token: ``n_mat`` 1; per expert, the rows routed to it), and int64 ``[n_mat]`` the rows summed."""
    want = set(job.keys)
    routed = {layer for _, layer, n in job.keys if n}
    out: dict[tuple[str, int | None, int], tuple[np.ndarray, np.ndarray]] = {}
    seen: dict[tuple[str, int], np.ndarray] = {}          # a MoE layer's ffn_norm rows, route and gated rows

    def keep(a, event) -> None:
        stage, layer = event.stage, event.layer
        if (stage, layer, 0) in want:
            x = np.asarray(a, dtype=np.float64).reshape(a.shape[0], -1)
            out[(stage, layer, 0)] = (np.einsum("tj,tj->j", x, x)[None, :], np.array([x.shape[0]], np.int64))
        if layer in routed and stage in ROUTE_HOOKS:
            seen[(ROUTE_HOOKS[stage], layer)] = np.array(a)

    stages = {k[0] for k in job.keys if not k[2]} | (set(ROUTE_HOOKS) if routed else set())
    with model.hooks({stage: keep for stage in stages}):
        model.forward(job.ids, 0, model.new_cache(len(job.ids)), all_logits=job.all_rows)
    n_expert = model.config.n_expert
    for layer in sorted(routed):
        out.update(expert_squares(seen[("x", layer)], seen[("ids", layer)], seen.get(("glu", layer)), layer, n_expert))
    return [out[key] for key in job.keys]


ROUTE_HOOKS = {"ffn_norm": "x", "ffn_moe_topk": "ids", "ffn_moe_swiglu": "glu", "ffn_moe_swiglu_oai": "glu"}
"""The MoE stages whose outputs a layer's per-expert sums read: the rows every expert of the layer
reads (``ffn_norm``), the route (``ffn_moe_topk``) and each chosen expert's gated rows, the input of
``ffn_down_exps`` (``ffn_moe_swiglu``, or gpt-oss's clamped ``ffn_moe_swiglu_oai``)."""


def expert_squares(x: np.ndarray, ids: np.ndarray, glu: np.ndarray | None, layer: int, n_expert: int) -> dict:
    """A MoE layer's per-expert sums, as llama-imatrix collects them from ``mul_mat_id``: per
    expert, the squares of the ``ffn_norm`` rows ``x`` (``[n_tokens, dim]``) of the tokens that
    chose it (``ids`` int ``[n_tokens, k]``, ``ffn_moe_topk``), for gate/up, and of its own gated
    rows ``glu`` (``[n_tokens, k, expert_hidden_dim]``, the slot that chose it) for down; counts are
    the (token, slot) pairs routed to it.

    Returns:
        ``{(stage, layer, n_expert): (float64 [n_expert, width], int64 [n_expert])}``.
    """
    flat = np.asarray(ids, dtype=np.int64).reshape(-1)            # pair t*k + s: slot s of token t
    counts = np.bincount(flat, minlength=n_expert).astype(np.int64)
    x64 = np.asarray(x, np.float64).reshape(len(ids), -1)
    gate_up = np.zeros((n_expert, x64.shape[1]), np.float64)
    rows = None if glu is None else np.asarray(glu, np.float64).reshape(flat.size, -1)
    glu_sums = np.zeros((n_expert, 0 if rows is None else rows.shape[1]), np.float64)
    for e in np.flatnonzero(counts):
        pairs = np.flatnonzero(flat == e)
        tokens = pairs // ids.shape[1]
        gate_up[e] = np.einsum("tj,tj->j", x64[tokens], x64[tokens])
        if rows is not None:
            glu_sums[e] = np.einsum("tj,tj->j", rows[pairs], rows[pairs])
    out = {("ffn_norm", layer, n_expert): (gate_up, counts)}
    if rows is not None:
        out[("ffn_moe_swiglu", layer, n_expert)] = (glu_sums, counts.copy())
    return out


@dataclass
class ImatrixRun:
    """Settings of one ``llamatrace imatrix`` run.

    Attributes:
        model: the model run (path, activations, threads per worker).
        text: the calibration text.
        dataset: the name recorded in ``imatrix.datasets`` (the ``-f`` path as given).
        ctx_size, max_chunks: the chunking (``--ctx-size``, ``--chunks``).
        process_output: sum ``output.weight``'s input too (llama-imatrix's ``--process-output``).
        workers, ray: where the chunks run (:func:`llamatrace.corpus.runner.run_chunks`).
    """

    model: ModelSpec
    text: str
    dataset: str
    ctx_size: int = 512
    max_chunks: int | None = None
    process_output: bool = False
    workers: int = 1
    ray: str | None = None


@dataclass
class ImatrixResult:
    """What a run made: the entries and metadata of the file, and the chunks evaluated."""

    entries: Entries
    meta: ImatrixMeta
    chunks: Chunks


def calibration_text(text: str) -> str:
    """The text as llama.cpp's ``-f`` reads it: one trailing newline dropped."""
    return text[:-1] if text.endswith("\n") else text


def prepare(run: ImatrixRun) -> tuple[Chunks, list[Input]]:
    """The chunks and the inputs to sum, read from the GGUF header (no weights packed).

    Raises:
        ModelNotFoundError, ModelFormatError, UnsupportedModelError: the model cannot be used.
        OptionError: a bad ``--ctx-size`` or ``--chunks``, ``--workers`` below 1, or a model
            with no block weights to sum.
        PromptError: a text that tokenizes to nothing.
    """
    from llamatrace.corpus.chunks import make_chunks, read_header
    from llamatrace.errors import OptionError
    from llamatrace.gguf.reader import open_gguf
    if run.workers < 1:
        raise OptionError(f"--workers must be a positive integer, got {run.workers}")
    tokenizer, config = read_header(Path(run.model.path))
    with open_gguf(run.model.path) as f:
        names = set(f.tensors)
    inputs = input_stages(names, config, run.process_output)
    if not inputs:
        raise OptionError(f"{run.model.path}: no block weight (blk.N.attn_q.weight …) to collect an imatrix for")
    chunks = make_chunks(tokenizer, run.text, run.ctx_size, run.max_chunks, config.max_seq_len, "imatrix",
                         two_chunks=False)
    return chunks, inputs


def compute(run: ImatrixRun, model=None, on_chunk: Callable[[int], None] | None = None,
            prepared: tuple[Chunks, list[Input]] | None = None) -> ImatrixResult:
    """Run the model over every chunk and sum its matmul inputs' squares (the module docstring).

    Args:
        model: the loaded model when the chunks run in this process (one worker, no Ray).
        on_chunk: called with each chunk's index once its sums are added, in chunk order.
        prepared: what :func:`prepare` returned for ``run``, if it was called already.

    Raises:
        LlamatraceError: as :func:`prepare`; a worker's or the model's error.
        NumericalError: a sum of squares is not finite (the model computes NaN or inf).
    """
    chunks, inputs = prepared if prepared is not None else prepare(run)
    keys = tuple(i.key for i in inputs)
    totals = [np.zeros((max(i.n_expert, 1), i.width), dtype=np.float64) for i in inputs]
    counts = [np.zeros(max(i.n_expert, 1), dtype=np.int64) for i in inputs]
    all_rows = any(i.layer is None for i in inputs)

    def add(i: int, sums: list[tuple[np.ndarray, np.ndarray]]) -> None:
        for total, count, (s, n) in zip(totals, counts, sums):
            total += s
            count += n
        if on_chunk:
            on_chunk(i)

    run_chunks(run.model, chunks.n_chunk, lambda i: SquaresJob(chunks.chunk(i), keys, all_rows), sum_squares,
               add, run.workers, model, run.ray)
    for inp, total in zip(inputs, totals):          # an all-NaN imatrix would be written, and refused by quantize
        if not np.isfinite(total).all():
            raise NumericalError(f"the inputs of {inp.weights[0]} summed to NaN or inf over the text: "
                                 f"{Path(run.model.path).name} computes non-finite values (a damaged weight?); "
                                 f"find the first stage with `llamatrace trace --check-finite`; nothing was written")
    entries = {name: (total.astype(np.float32) if inp.n_expert else total[0].astype(np.float32), count)
               for inp, total, count in zip(inputs, totals, counts) for name in inp.weights}
    return ImatrixResult(entries, ImatrixMeta([run.dataset], chunks.n_chunk, chunks.n_ctx), chunks)
