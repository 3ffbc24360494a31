"""One ``llamatrace perplexity`` run as an object: what is scored, against what, where it runs.

:class:`CorpusRun` holds the settings and checks them before any compute; :func:`execute`
cuts the text, runs the base when there is one (or reads its base file), then the model, and
returns a :class:`RunResult`. The CLI only parses options, shows progress and prints.
"""

from __future__ import annotations

import tempfile
import time
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from llamatrace.corpus import basefile
from llamatrace.corpus import perplexity as corpus
from llamatrace.corpus.chunks import Chunks, make_chunks
from llamatrace.corpus.metrics import KLDStats, PerplexityStats
from llamatrace.corpus.stage_errors import PairSpec, StageErrors, check_same_shape
from llamatrace.corpus.worker import ModelSpec
from llamatrace.errors import OptionError

# progress(name, n_chunks, main) -> a context giving on_chunk(i, running PPL); main: the model's run
Progress = Callable[[str, int, bool], AbstractContextManager]


def _no_progress(name: str, total: int, main: bool):
    return nullcontext(lambda i, ppl: None)


@dataclass
class CorpusRun:
    """Settings of a run.

    Attributes:
        model: the model scored (path, activations, threads per worker).
        text: the corpus.
        base: ``None`` (perplexity only), a GGUF, or a base file (:mod:`llamatrace.corpus.basefile`).
        save_base: keep the base GGUF's base file there.
        stages: with a GGUF base, the stage attribution (:mod:`llamatrace.corpus.stage_errors`).
        workers, ray: where the chunks run (:func:`llamatrace.corpus.runner.run_chunks`).
    """

    model: ModelSpec
    text: str
    ctx_size: int = 512
    max_chunks: int | None = None
    base: Path | None = None
    save_base: Path | None = None
    stages: bool = False
    workers: int = 1
    ray: str | None = None

    @property
    def base_is_file(self) -> bool:
        return self.base is not None and basefile.is_base_file(self.base)

    def check(self) -> None:
        """Raises :class:`OptionError` for settings that do not go together."""
        if self.workers < 1:
            raise OptionError(f"--workers must be a positive integer, got {self.workers}")
        if self.save_base is not None and (self.base is None or self.base_is_file):
            raise OptionError("--save-base needs --base BASE.gguf (the model whose log-probabilities are kept)")
        if self.stages and (self.base is None or self.base_is_file or self.save_base is not None):
            raise OptionError("--stages needs --base BASE.gguf (both models run on every chunk) and no --save-base")
        if self.base is not None and not self.base_is_file and Path(self.base).is_file():
            with open(self.base, "rb") as f:              # before the model loads: its error named no option
                if f.read(4) != b"GGUF":
                    raise OptionError(f"--base {str(self.base)!r} is neither a GGUF model nor a base file "
                                      f"(--save-base makes one)")


@dataclass
class RunResult:
    """What a run found: ``scores`` are PPL statistics without a base, KLD statistics with one;
    ``base_exact`` the base GGUF's PPL from exact log-probabilities; ``attribution`` with ``stages``."""

    chunks: Chunks
    scores: PerplexityStats | KLDStats
    base_exact: PerplexityStats | None
    attribution: StageErrors | None
    seconds: float

    def as_json(self, run: CorpusRun) -> dict:
        """The ``--json`` object (``seconds``, ``tokens_per_s``, ``workers``, ``threads``, ``ray``
        are timings and settings; the rest are results)."""
        c = self.chunks
        summary = {"model": run.model.path, "ctx_size": c.n_ctx, "n_chunks": c.n_chunk,
                   "n_scored": c.n_chunk * c.n_scored, "activations": run.model.activations,
                   "workers": run.workers, "threads": run.model.threads, "ray": run.ray,
                   "seconds": round(self.seconds, 3), "tokens_per_s": round(self.tokens_per_s, 1)}
        if isinstance(self.scores, PerplexityStats):
            summary.update(ppl=self.scores.ppl, ppl_error=self.scores.ppl_error)
            return summary
        summary.update({"base": str(run.base), **{k: v for k, v in vars(self.scores).items() if k != "count"}})
        if self.base_exact is not None:
            summary["ppl_base_exact"] = self.base_exact.ppl
        if self.attribution is not None:
            summary["attribution"] = self.attribution.as_json()
        return summary

    @property
    def tokens_per_s(self) -> float:
        return self.chunks.n_chunk * self.chunks.n_ctx / self.seconds


def execute(run: CorpusRun, model=None, progress: Progress = _no_progress) -> RunResult:
    """Run ``run``; ``model``: the loaded model when it runs in this process (one worker, no Ray).

    Raises:
        LlamatraceError: bad settings (:meth:`CorpusRun.check`), text, base or model; a worker's error.
    """
    from llamatrace.gguf.fetch import resolve_model
    run.check()
    if model is not None:
        chunks = make_chunks(model.tokenizer, run.text, run.ctx_size, run.max_chunks, model.config.max_seq_len)
        n_vocab = model.config.vocab_size
    else:
        chunks, n_vocab = corpus.read_chunks(Path(run.model.path), run.text, run.ctx_size, run.max_chunks)
    base_file = base_exact = attribution = None
    name = Path(run.model.path).name
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="llamatrace-base-") as scratch:
        if run.base_is_file:
            base_file = basefile.BaseFile(run.base)
        elif run.base is not None:
            base_spec = ModelSpec(str(resolve_model(run.base, option="--base")), run.model.activations, run.model.threads)
            if run.stages:
                check_same_shape(base_spec.path, run.model.path)      # before tokenizing the base's text
                other, other_vocab = corpus.read_chunks(Path(base_spec.path), run.text, run.ctx_size, run.max_chunks)
                corpus.check_same_tokens(chunks, n_vocab, other, other_vocab, f"--base {str(run.base)!r}")
            else:
                target = run.save_base if run.save_base is not None else Path(scratch) / "base.logits"
                with progress(f"base {Path(base_spec.path).name}", chunks.n_chunk, False) as on_chunk:
                    base_exact = corpus.run_base(base_spec, run.text, chunks, n_vocab, target, run.workers,
                                                 on_chunk, run.ray)
                base_file = basefile.BaseFile(target)
        with progress(name, chunks.n_chunk, True) as on_chunk:
            if run.stages:
                scores, attribution = corpus.kl_divergence_stages(PairSpec(base_spec, run.model), chunks,
                                                                  run.workers, on_chunk, run.ray)
            elif base_file is None:
                scores = corpus.perplexity(run.model, chunks, run.workers, model, on_chunk, run.ray)
            else:
                scores = corpus.kl_divergence(run.model, chunks, base_file, run.workers, model, on_chunk, run.ray)
    return RunResult(chunks, scores, base_exact, attribution, time.perf_counter() - t0)
