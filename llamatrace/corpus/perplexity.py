"""Perplexity and KL divergence over a corpus, as ``llama-perplexity`` computes them.

One chunk (:func:`score_chunk`): a fresh KV cache, one prefill of the chunk's ``n_ctx`` tokens
with the logits of every position, then the per-token arithmetic of
:mod:`llamatrace.corpus.metrics` on the scored half. Three runs use it:

* :func:`perplexity`: NLL per token → PPL ± error;
* :func:`save_base`: the base model's compressed log-probabilities → a base file
  (:mod:`llamatrace.corpus.basefile`), as ``--kl-divergence-base`` does;
* :func:`kl_divergence`: a model against a base file → :class:`~llamatrace.corpus.metrics.KLDStats`;
* :func:`kl_divergence_stages`: both models on every chunk, with the stage attribution.

:mod:`llamatrace.corpus.perplexity_run` chooses among them for one ``llamatrace perplexity`` run.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Callable

import numpy as np

from llamatrace.corpus import basefile
from llamatrace.corpus.chunks import Chunks, make_chunks
from llamatrace.corpus.metrics import KLDStats, PerplexityStats, TokenKLD, compress_log_probs, token_kld, token_nll
from llamatrace.corpus.runner import run_chunks
from llamatrace.corpus.worker import ModelSpec
from llamatrace.corpus.stage_errors import scored_logits
from llamatrace.errors import OptionError

OnChunk = Callable[[int, float], None]     # on_chunk(chunk index, running PPL)


@dataclass
class ChunkJob:
    """One chunk's input: int32 ``[n_ctx]`` ids, int64 ``[n_scored]`` targets, the first scored
    position, and what to compute: ``"nll"``, ``"base"`` (base rows) or ``"kld"`` (``base_rows`` given)."""

    ids: np.ndarray
    targets: np.ndarray
    first: int
    mode: str = "nll"
    base_rows: np.ndarray | None = None


def chunk_logits(model, ids: np.ndarray, first: int) -> np.ndarray:
    """float32 ``[n_ctx - 1 - first, n_vocab]``: logits of positions ``first … n_ctx-2`` of one
    prefill of ``ids`` from position 0 (a fresh cache, as llama.cpp clears its KV cache per chunk)."""
    n = len(ids)
    scored = []

    def keep(a, event):
        scored.append(a[first:])

    # only the scored rows go through the output projection: the other half's logits are never
    # read, and a row's projection (vocab × dim) costs a quarter of its blocks' work at SmolLM2, 1/13 at 8B
    with model.hooks({"l_out": keep}, layers=[model.config.n_layers - 1]):
        model.forward(ids, 0, model.new_cache(n))
    return scored_logits(model, scored[0])


def score_chunk(model, job: ChunkJob):
    """The runner's work for one chunk: float64 NLL ``[n_scored]``, base rows, or a :class:`TokenKLD`."""
    logits = chunk_logits(model, job.ids, job.first)
    if job.mode == "base":
        return token_nll(logits, job.targets), compress_log_probs(logits)
    if job.mode == "kld":
        return token_kld(logits, job.base_rows, job.targets)
    return token_nll(logits, job.targets)


def _job(chunks: Chunks, i: int, mode: str = "nll", base: basefile.BaseFile | None = None) -> ChunkJob:
    return ChunkJob(chunks.chunk(i), chunks.targets(i), chunks.first, mode,
                    base.rows(i) if base is not None else None)


def perplexity(spec: ModelSpec, chunks: Chunks, workers: int = 1, model=None,
               on_chunk: OnChunk | None = None, ray: str | None = None) -> PerplexityStats:
    """PPL ± error over ``chunks.n_chunk`` chunks (``llama-perplexity`` without options).

    ``workers``, ``model``, ``ray``: where the chunks run (:func:`llamatrace.corpus.runner.run_chunks`).

    Raises:
        LlamatraceError: from the model or a worker (see :func:`llamatrace.corpus.runner.run_chunks`).
    """
    stats = PerplexityStats()

    def collect(i: int, nll: np.ndarray) -> None:
        running = stats.add(nll)
        if on_chunk:
            on_chunk(i, running)

    run_chunks(spec, chunks.n_chunk, lambda i: _job(chunks, i), score_chunk, collect, workers, model, ray)
    return stats


def save_base(spec: ModelSpec, chunks: Chunks, n_vocab: int, f: BinaryIO, workers: int = 1, model=None,
              on_chunk: OnChunk | None = None, ray: str | None = None) -> PerplexityStats:
    """Run the base model and write its base file to ``f`` (header, then each chunk's rows in
    order); returns the base's PPL (from exact log-probabilities, before compression)."""
    stats = PerplexityStats()
    basefile.write_header(f, chunks, n_vocab)

    def collect(i: int, result) -> None:
        nll, rows = result
        basefile.write_rows(f, rows)
        running = stats.add(nll)
        if on_chunk:
            on_chunk(i, running)

    run_chunks(spec, chunks.n_chunk, lambda i: _job(chunks, i, "base"), score_chunk, collect, workers, model, ray)
    return stats


def check_same_tokens(chunks: Chunks, n_vocab: int, other: Chunks, other_vocab: int, where: str) -> None:
    """Refuse a base model whose vocabulary or token ids for this text differ.

    Raises:
        OptionError: another vocabulary size or other token ids.
    """
    if other_vocab != n_vocab or not np.array_equal(other.tokens, chunks.tokens):
        raise OptionError(f"{where}: the base model's vocabulary differs from the model's ({other_vocab} vs "
                          f"{n_vocab} tokens, or other ids for this text): KL divergence needs the same vocabulary")


def run_base(base_spec: ModelSpec, text: str, chunks: Chunks, n_vocab: int, target: Path, workers: int = 1,
             on_chunk: OnChunk | None = None, ray: str | None = None) -> PerplexityStats:
    """Check that the base GGUF tokenizes ``text`` as the model does, run it over ``chunks`` and
    write its base file to ``target`` atomically (:func:`llamatrace.outputs.write_atomic`).

    Raises:
        OptionError: another vocabulary (:func:`check_same_tokens`).
        OutputError: ``target`` cannot be written (reported as ``--save-base``).
    """
    from llamatrace.outputs import write_atomic
    other, other_vocab = read_chunks(Path(base_spec.path), text, chunks.n_ctx, chunks.n_chunk)
    check_same_tokens(chunks, n_vocab, other, other_vocab, f"--base {base_spec.path!r}")
    kept: list[PerplexityStats] = []
    write_atomic(target, lambda f: kept.append(save_base(base_spec, chunks, n_vocab, f, workers, None, on_chunk, ray)),
                 "--save-base")
    return kept[0]


def check_base(base: basefile.BaseFile, chunks: Chunks, n_vocab: int) -> None:
    """Refuse a base file that was not made from the same tokens and vocabulary.

    Raises:
        OptionError: another vocabulary size, context size, fewer chunks or other token ids.
    """
    where = f"--base {str(base.path)!r}"
    if base.n_vocab != n_vocab:
        raise OptionError(f"{where}: the base model's vocabulary has {base.n_vocab} tokens, the model's "
                          f"{n_vocab}: KL divergence needs two models with the same vocabulary")
    if base.n_ctx != chunks.n_ctx:
        raise OptionError(f"{where} was made with --ctx-size {base.n_ctx}; use the same (not {chunks.n_ctx})")
    if base.n_chunk < chunks.n_chunk:
        raise OptionError(f"{where} holds {base.n_chunk} chunks; use --chunks {base.n_chunk} or fewer")
    n = chunks.n_chunk * chunks.n_ctx
    if not np.array_equal(np.asarray(base.tokens[:n]), chunks.tokens[:n]):
        raise OptionError(f"{where}: its token ids differ from this text's: it was made from another text, "
                          f"or the two models' vocabularies differ")


def kl_divergence(spec: ModelSpec, chunks: Chunks, base: basefile.BaseFile, workers: int = 1, model=None,
                  on_chunk: OnChunk | None = None, ray: str | None = None) -> KLDStats:
    """``llama-perplexity --kl-divergence`` statistics of the model against ``base``.

    Raises:
        OptionError: ``base`` does not match (:func:`check_base`).
    """
    n_vocab = model.config.vocab_size if model is not None else base.n_vocab
    check_base(base, chunks, n_vocab)
    parts: list[TokenKLD] = []
    stats = PerplexityStats()

    def collect(i: int, part: TokenKLD) -> None:
        parts.append(part)
        running = stats.add(part.nll)
        if on_chunk:
            on_chunk(i, running)

    run_chunks(spec, chunks.n_chunk, lambda i: _job(chunks, i, "kld", base), score_chunk, collect, workers, model, ray)
    return KLDStats.from_tokens(parts)


def kl_divergence_stages(spec, chunks: Chunks, workers: int = 1, on_chunk: OnChunk | None = None,
                         ray: str | None = None):
    """KLD statistics and the stage attribution (:mod:`llamatrace.corpus.stage_errors`) of
    ``spec.model`` against ``spec.base`` (a :class:`~llamatrace.corpus.stage_errors.PairSpec`), both run
    on every chunk. Returns ``(KLDStats, StageErrors)``."""
    from llamatrace.corpus.stage_errors import StageErrors, columns_of_file, score_pair
    parts: list[TokenKLD] = []
    errors: list[np.ndarray] = []
    embd: list[np.ndarray] = []
    experts = []
    stats = PerplexityStats()

    def collect(i: int, result) -> None:
        part, err, e0, per_expert = result
        parts.append(part)
        errors.append(err)
        embd.append(e0)
        if per_expert is not None:
            experts.append(per_expert)
        running = stats.add(part.nll)
        if on_chunk:
            on_chunk(i, running)

    run_chunks(spec, chunks.n_chunk, lambda i: _job(chunks, i), score_pair, collect, workers, None, ray)
    stages, notes, n_expert = columns_of_file(spec.model.path)
    return KLDStats.from_tokens(parts), StageErrors.from_chunks(errors, embd, stages, notes, experts, n_expert)


def read_chunks(model_path: Path, text: str, n_ctx: int, max_chunks: int | None) -> tuple[Chunks, int]:
    """The chunks of ``text`` under a GGUF's own tokenizer, and its vocabulary size, read without
    packing its weights (a parent of worker processes needs no model; two vocabularies are
    refused before any compute).

    Raises:
        ModelNotFoundError, ModelFormatError, UnsupportedModelError: the file cannot be used.
        OptionError, PromptError: as :func:`llamatrace.corpus.chunks.make_chunks`.
    """
    from llamatrace.corpus.chunks import read_header
    tokenizer, config = read_header(model_path)
    return make_chunks(tokenizer, text, n_ctx, max_chunks, config.max_seq_len), config.vocab_size
