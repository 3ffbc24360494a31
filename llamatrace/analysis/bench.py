"""Speed and memory of the forward pass, against peers, on the same GGUF and the same token ids.

Each engine runs in a process of its own (so its peak RSS is its own), loaded once; the timed
runs are interleaved — llamatrace, then each peer, then llamatrace again — so a noisy shared
machine slows them alike and the ratios of one run are fair. Every run is a prefill of the
same ``prompt_tokens`` ids followed by ``decode_tokens`` greedy decode steps, every engine's
timed alike: the prefill up to its greedy token, then the steps up to the last token (each step's
forward pass and argmax). With
``background_load`` N, N busy loops (:mod:`llamatrace.analysis.busy`) keep N cores busy for the
whole bench: the case of a shared machine, reproducibly.

Peers (optional, never dependencies): ``llama.cpp`` through llama-cpp-python (the extra
``llamatrace[llamacpp]``; :mod:`llamatrace.peers.llamacpp` in last-token mode, so its prefill
computes one row of logits as ours does); ``hf``: HF transformers in fp32 on the same GGUF (torch, transformers, accelerate).
"""

from __future__ import annotations

import contextlib
import importlib.util
import multiprocessing
import os
import resource
import signal
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Iterator, NoReturn

import numpy as np

from llamatrace.analysis.busy import busy_loops
from llamatrace.analysis.roofline import Machine, TokenCost, fractions, measure_machine, read_bandwidth, read_buffer, token_cost
from llamatrace.errors import LlamatraceError, OptionError, PeerError
from llamatrace.machine.runtime import cpu_model, start_process, usable_cpus
from llamatrace.peers import LLAMACPP_BUILD, exit_reason
from llamatrace.tracing.recorder import finite_json

ENGINES = ("llamatrace", "llama.cpp", "hf")
# each engine's modules, and the pip requirement that installs each
_NEEDS = {"llama.cpp": {"llama_cpp": "llama-cpp-python"},
          "hf": {"torch": "torch==2.13.0", "transformers": "transformers", "accelerate": "accelerate"}}


@dataclass
class EngineResult:
    """One engine's figures. Rates in tokens per second, one entry per timed repeat."""

    engine: str
    version: str
    load_s: float                   # import, load and first runs, less compile_s
    prefill_tok_s: list[float] = field(default_factory=list)
    decode_tok_s: list[float] = field(default_factory=list)
    peak_rss_bytes: int = 0
    threading: str = ""
    huge_page_bytes: int = 0        # of the process's memory, after the runs (huge_page_bytes())
    before_load_rss_bytes: int = 0  # resident once the engine's modules are imported, before the model
    file_rss_bytes: int = 0         # of the model file's own pages, resident after the runs
    compile_s: float = 0.0          # Numba compiling kernels during the load (a first run's; 0 from its cache)

    @property
    def prefill(self) -> float:
        return statistics.median(self.prefill_tok_s)

    @property
    def decode(self) -> float:
        return statistics.median(self.decode_tok_s)


@dataclass
class BenchReport:
    model: str
    file_bytes: int
    cpu: str
    threads: int
    prompt_tokens: int
    decode_tokens: int
    repeats: int
    background_load: int
    results: list[EngineResult]
    machine: Machine
    cost: TokenCost
    kv_bytes_per_token: int = 0    # one more position of context: float32 K and V of the attention layers
    state_bytes: int = 0           # fixed whatever the context: the recurrent layers' conv and DeltaNet states
    n_attn_layers: int = 0
    n_recurrent_layers: int = 0
    matrix_types: tuple[str, ...] = ()    # the GGML types of the file's matrices, most bytes first

    def roofline(self, r: EngineResult) -> dict[str, float]:
        """Engine ``r``'s median prefill and decode against the machine's limits
        (:func:`llamatrace.analysis.roofline.fractions`)."""
        return fractions(self.cost, self.machine, r.prefill, r.decode)

    def round_ratios(self, r: EngineResult, base: EngineResult) -> dict[str, list[float]]:
        """Engine ``r``'s prefill and decode tok/s over ``base``'s, round by round: each round runs
        every engine once, one after the other, so a ratio pairs two runs a few seconds apart (the
        minute's memory bandwidth alike), where the ratio of the medians may pair runs of
        different minutes. ``{"prefill": [...], "decode": [...]}``, one ratio a round."""
        return {"prefill": [a / b for a, b in zip(r.prefill_tok_s, base.prefill_tok_s)],
                "decode": [a / b for a, b in zip(r.decode_tok_s, base.decode_tok_s)]}

    def to_dict(self) -> dict:
        """The report as JSON-ready values: a limit the machine did not measure (``nan`` in
        :func:`~llamatrace.analysis.roofline.fractions`) and any other non-finite number are None."""
        d = asdict(self)
        base = next((r for r in self.results if r.engine == "llama.cpp"), None)
        for r, row in zip(self.results, d["results"]):
            row["prefill_median"], row["decode_median"] = r.prefill, r.decode
            row["roofline"] = self.roofline(r)
            if base is not None and r is not base:
                row["per_round_vs_llama_cpp"] = self.round_ratios(r, base)
        return finite_json(d)


class _CompileTimer:
    def __init__(self, listener) -> None:
        self._listener = listener

    def seconds(self) -> float:
        return self._listener.duration if self._listener.done else 0.0


@contextlib.contextmanager
def compile_timer() -> Iterator[_CompileTimer]:
    """Time Numba's compiles inside the block (its ``numba:compile`` events: a kernel missing from
    the cache; nested compiles counted once); ``.seconds()`` gives the total, 0.0 if none."""
    from numba.core import event
    with event.install_listener("numba:compile", event.TimingListener()) as listener:
        yield _CompileTimer(listener)


_HUGE_FIELDS = ("AnonHugePages:", "FilePmdMapped:", "ShmemPmdMapped:")


def huge_page_bytes(smaps_rollup: str) -> int:
    """Bytes of a process's memory mapped in 2 MiB pages, from the text of its
    ``/proc/PID/smaps_rollup``: anonymous (``AnonHugePages``), file (``FilePmdMapped``: the
    packed-weights cache's map where the page cache holds 2 MiB folios) and shared memory
    (``ShmemPmdMapped``), in kB there. Weights read from 4 KiB pages pay a TLB miss and a page walk
    every 4 KiB: docs/performance.md "Decode"."""
    total = 0
    for line in smaps_rollup.splitlines():
        fields = line.split()
        if len(fields) == 3 and fields[0] in _HUGE_FIELDS and fields[2] == "kB":
            total += int(fields[1]) * 1024
    return total


def process_huge_page_bytes() -> int:
    """:func:`huge_page_bytes` of this process; 0 where ``/proc`` cannot tell (not Linux)."""
    return huge_page_bytes(_proc_self("smaps_rollup"))


def mapped_file_bytes(smaps: str, path: str) -> int:
    """Resident bytes of the maps of file ``path`` (absolute, resolved), from the text of a
    process's ``/proc/PID/smaps``: the pages of a memory-mapped GGUF that the runs read (a
    mixture of experts' experts that were never chosen stay on disk). A page two maps of the file
    hold counts twice."""
    total, ours = 0, False
    for line in smaps.splitlines():
        fields = line.split(maxsplit=5)
        if len(fields) >= 5 and "-" in fields[0] and ":" in fields[3]:       # a map's header line
            ours = len(fields) == 6 and fields[5] == path
        elif ours and fields[:1] == ["Rss:"] and fields[2:] == ["kB"]:
            total += int(fields[1]) * 1024
    return total


def _proc_self(name: str) -> str:
    try:
        with open(f"/proc/self/{name}", encoding="utf-8", errors="replace") as fh:
            return fh.read()
    except OSError:                 # not Linux: the figures read 0
        return ""


def _rss_now() -> int:
    for line in _proc_self("status").splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def check_engines(engines: list[str]) -> None:
    """Raise :class:`OptionError` for an unknown engine, :class:`PeerError` for one not installed."""
    for name in engines:
        if name not in ENGINES:
            raise OptionError(f"--against {name!r}: unknown engine; choose from {', '.join(ENGINES[1:])}")
        missing = [req for module, req in _NEEDS.get(name, {}).items() if importlib.util.find_spec(module) is None]
        if not missing:
            continue
        names = [req.split("==")[0] for req in missing]
        listed = names[0] if len(names) == 1 else f"{', '.join(names[:-1])} and {names[-1]}"
        verb = "is" if len(names) == 1 else "are"
        if name == "llama.cpp":
            how = f"pip install -e \".[llamacpp]\" in the checkout (on CPUs with AMX see {LLAMACPP_BUILD})"
        else:
            how = f"pip install {' '.join(missing)}" + (" (a CPU build of torch)" if "torch" in names else "")
        raise PeerError(f"--against {name}: {listed} {verb} not installed in this Python: {how}")


def prompt_ids(vocab_size: int, n: int, seed: int = 0) -> list[int]:
    """``n`` reproducible token ids away from the special tokens at either end of the vocabulary."""
    rng = np.random.default_rng(seed)
    return [int(x) for x in rng.integers(min(100, vocab_size // 4), vocab_size - min(300, vocab_size // 4), size=n)]


def run_bench(model_path: str | os.PathLike[str], *, against: list[str] = (), prompt_tokens: int = 128,
              decode_tokens: int = 64, repeats: int = 5, threads: int | None = None,
              activations: list[str] = ("f32",), background_load: int = 0,
              progress: Callable[[str], None] = lambda msg: None) -> BenchReport:
    """Load every engine in its own process, then time ``repeats`` interleaved runs of each.

    ``activations``: llamatrace's modes to time, each as an engine of its own (``llamatrace f32``,
    ``llamatrace q8``). ``background_load``: busy-loop processes running from the engines' load
    to their end (stopped however the bench ends). The machine's limits are measured once the
    engines are loaded, and the read bandwidth again after each round of runs
    (``Machine.read_between_runs_gb_s``).

    Raises:
        OptionError: a count below 1 (``background_load`` below 0 or above the usable cores), an unknown engine or activations mode.
        PeerError: a peer is not installed, or its process failed (its last words are quoted).
    """
    from llamatrace.kernels.types.packing import check_activations

    if prompt_tokens < 1 or decode_tokens < 1 or repeats < 1:
        raise OptionError("--prompt-tokens, --decode-tokens and --repeats must be at least 1")
    if not 0 <= background_load <= usable_cpus():     # more loops than cores would only starve the run
        raise OptionError(f"--background-load must be 0 to {usable_cpus()} busy loops (the cores this process "
                          f"may use), got {background_load}")
    modes = list(dict.fromkeys(check_activations(a) for a in (activations or ("f32",))))
    check_engines([a for a in against if a != "llamatrace"])
    engines = [engine_name(mode) for mode in modes] + [a for a in dict.fromkeys(against) if a != "llamatrace"]
    peer_threads = threads or usable_cpus()      # ours: None = AutoThreads, as by default
    n_ctx = prompt_tokens + decode_tokens + 8
    path = str(Path(model_path).resolve())
    cost, matrix_types, config = _check_fits(path, prompt_tokens, decode_tokens, n_ctx)
    workers = {}
    with contextlib.ExitStack() as stack:
        if background_load:
            progress(f"starting {background_load} busy loops")
        stack.enter_context(busy_loops(background_load))
        stack.callback(lambda: [w.close() for w in workers.values()])
        for name in engines:
            progress(f"loading {name}")
            ours = name.startswith("llamatrace")
            workers[name] = _Worker(name, path, threads if ours else peer_threads, n_ctx)
        results = {name: w.result for name, w in workers.items()}
        # after the engines' processes exist: a child inherits its parent's peak RSS at fork
        progress("measuring the machine's read bandwidth and multiply-add peaks")
        # AMX against VNNI only where a q8 engine runs: the f32 kernels never use the tiles
        machine = measure_machine(peer_threads, amx_types=matrix_types if "q8" in modes else ())
        words = read_buffer()                            # read again after each round of runs
        ids = prompt_ids(workers[engines[0]].result_vocab, prompt_tokens)
        for name, w in workers.items():                  # warm-up: caches, lazy allocations
            progress(f"warming up {name}")
            w.run(ids[:8], 2)
        for rep in range(repeats):
            for name, w in workers.items():
                progress(f"run {rep + 1}/{repeats}: {name}")
                prefill_s, decode_s = w.run(ids, decode_tokens)
                results[name].prefill_tok_s.append(prompt_tokens / prefill_s)
                results[name].decode_tok_s.append(decode_tokens / decode_s)
            machine.read_between_runs_gb_s.append(read_bandwidth(peer_threads, 1, words))
        for name, w in workers.items():
            results[name].peak_rss_bytes = w.peak_rss()
            results[name].huge_page_bytes = w.huge_pages()
            results[name].before_load_rss_bytes, results[name].file_rss_bytes = w.memory()
    return BenchReport(model=path, file_bytes=os.path.getsize(path), cpu=cpu_model(), threads=peer_threads,
                       prompt_tokens=prompt_tokens, decode_tokens=decode_tokens, repeats=repeats,
                       background_load=background_load, results=[results[name] for name in engines],
                       machine=machine, cost=cost, kv_bytes_per_token=config.kv_bytes_per_token,
                       state_bytes=config.state_bytes, n_attn_layers=len(config.attn_layers),
                       n_recurrent_layers=len(config.recurrent_layers), matrix_types=matrix_types)


# ---------------------------------------------------------------------------------------------
# one process per engine


def _check_fits(path: str, prompt_tokens: int, decode_tokens: int, n_ctx: int) -> tuple[TokenCost, tuple[str, ...], object]:
    """Raise :class:`OptionError` naming ``--prompt-tokens`` / ``--decode-tokens`` when a run
    (plus 8 spare cells) does not fit the model's context, before any engine loads; else return
    what a token costs in the file's weights, the GGML type names of its matrices (most bytes first)
    and the model's :class:`~llamatrace.model.config.ModelConfig` (its cache's bytes, as ``info`` shows them)."""
    from llamatrace.gguf.reader import open_gguf, tensor_type_name
    from llamatrace.model.config import ModelConfig
    with open_gguf(path) as gguf_file:
        config = ModelConfig.from_gguf(gguf_file)
        limit, cost = config.max_seq_len, token_cost(gguf_file)
        by_type: dict[str, int] = {}
        for t in gguf_file.tensors.values():
            if len(t.shape) == 2:
                by_type[tensor_type_name(t)] = by_type.get(tensor_type_name(t), 0) + int(t.n_bytes)
    if n_ctx > limit:
        if limit - decode_tokens - 8 >= 1:
            fix = f"use at most {limit - decode_tokens - 8} prompt tokens"
        elif limit - prompt_tokens - 8 >= 1:
            fix = f"use at most {limit - prompt_tokens - 8} decode tokens"
        else:
            fix = f"use at most {max(1, limit - 9)} prompt tokens and 1 decode token"
        raise OptionError(f"--prompt-tokens {prompt_tokens} and --decode-tokens {decode_tokens} need "
                          f"{n_ctx} positions (8 spare), more than the model's context length {limit}; {fix}")
    return cost, tuple(sorted(by_type, key=by_type.get, reverse=True)), config


def engine_name(activations: str) -> str:
    """The engine name of llamatrace in an activations mode."""
    return f"llamatrace {activations}"


class _Worker:
    """An engine loaded in a child process, driven through a pipe."""

    def __init__(self, engine: str, path: str, threads: int | None, n_ctx: int) -> None:
        ctx = multiprocessing.get_context("spawn")
        self.engine = engine
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_child, args=(child, engine, path, threads, n_ctx), daemon=True)
        start_process(self.proc)
        child.close()
        load_s, compile_s, version, threading, vocab = self._recv()
        self.result = EngineResult(engine, version, load_s, threading=threading, compile_s=compile_s)
        self.result_vocab = vocab

    def _send(self, message) -> None:
        try:
            self.conn.send(message)
        except OSError:                          # BrokenPipeError: the child is dead, as in _recv
            self._died()

    def _recv(self):
        try:
            reply = self.conn.recv()
        except (EOFError, OSError):
            self._died()
        if isinstance(reply, LlamatraceError):
            raise reply                          # our own error, already one line that says how to fix it
        if isinstance(reply, BaseException):
            raise PeerError(f"{self.engine}: {type(reply).__name__}: {reply}")
        return reply

    def _died(self) -> NoReturn:
        self.proc.join(5)
        raise PeerError(exit_reason(self.engine, self.proc.exitcode)) from None

    def run(self, ids: list[int], n_decode: int) -> tuple[float, float]:
        self._send(("run", ids, n_decode))
        return self._recv()

    def peak_rss(self) -> int:
        self._send(("rss",))
        return self._recv()

    def huge_pages(self) -> int:
        self._send(("huge",))
        return self._recv()

    def memory(self) -> tuple[int, int]:
        """(resident bytes before the model, the model file's resident bytes now)."""
        self._send(("memory",))
        return self._recv()

    def close(self) -> None:
        try:
            self.conn.send(("quit",))
        except (OSError, ValueError):
            pass
        self.proc.join(10)
        if self.proc.is_alive():
            self.proc.kill()


def _child(conn, engine: str, path: str, threads: int | None, n_ctx: int) -> None:
    from llamatrace.machine import runtime
    try:
        runtime.catch_interrupts(repeat=False)     # Ctrl-C: the parent stops the run, this process ends
        _serve(conn, engine, path, threads, n_ctx)
    except KeyboardInterrupt:
        pass
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)


def _serve(conn, engine: str, path: str, threads: int | None, n_ctx: int) -> None:
    from llamatrace.machine import runtime
    if not engine.startswith("llamatrace"):      # peers' own progress bars and logs would garble ours
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, 2)
        os.environ["TRANSFORMERS_VERBOSITY"] = "error"
    if engine.startswith("llamatrace"):
        runtime.configure_process()   # an engine process of llamatrace's own: the CLI's settings
    elif os.environ.get("GOMP_SPINCOUNT") == runtime.SPIN_COUNT:
        del os.environ["GOMP_SPINCOUNT"]    # ours (the CLI's); llama.cpp's OpenMP keeps its default
    try:
        t0 = time.perf_counter()
        for module in (["llamatrace.model.llama"] if engine.startswith("llamatrace") else _NEEDS[engine]):
            importlib.import_module(module)         # timed as load, as a user's command pays it
        before_load = _rss_now()
        if engine.startswith("llamatrace"):
            eng = _Llamatrace(path, threads, n_ctx, engine.partition(" ")[2] or "f32")
        else:
            eng = _ENGINES[engine](path, threads, n_ctx)
        compile_s = getattr(eng, "compile_s", 0.0)
        conn.send((time.perf_counter() - t0 - compile_s, compile_s, eng.version, eng.threading(), eng.vocab_size))
    except KeyboardInterrupt:
        raise
    except BaseException as exc:  # noqa: BLE001 — reported to the parent as one line
        conn.send(exc)
        return
    while True:
        msg = conn.recv()
        try:
            if msg[0] == "run":
                conn.send(eng.run(msg[1], msg[2]))
            elif msg[0] == "rss":
                conn.send(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
            elif msg[0] == "huge":
                conn.send(process_huge_page_bytes())
            elif msg[0] == "memory":
                conn.send((before_load, mapped_file_bytes(_proc_self("smaps"), path)))
            else:
                return
        except Exception as exc:  # noqa: BLE001
            conn.send(exc)


class _Llamatrace:
    def __init__(self, path: str, threads: int | None, n_ctx: int, activations: str = "f32") -> None:
        from llamatrace import __version__
        from llamatrace.machine.threads import set_threads
        from llamatrace.model.llama import Llama
        if threads:
            set_threads(threads)
        with compile_timer() as compiling:      # a first run's compiles: timed apart from the load
            self.model = Llama.load(path, activations=activations)
            self.model.warmup()
        self.compile_s = compiling.seconds()
        self.n_ctx = n_ctx
        self.version = f"llamatrace {__version__} ({self.model.activations} activations)"   # what was loaded
        self.vocab_size = self.model.config.vocab_size

    def threading(self) -> str:
        from llamatrace.machine.threads import AUTO_THREADS, threading_layer
        return f"numba {threading_layer()}, {AUTO_THREADS.describe()}"

    def run(self, ids: list[int], n_decode: int) -> tuple[float, float]:
        from llamatrace.model.generate import generate
        # greedy, no stop tokens: the prompt's token, then exactly n_decode steps, as users run it;
        # timed as the peers' loops are: the prefill up to its token, the steps up to the last
        # token (their sampling included, as the peers' argmax)
        t0 = time.perf_counter()
        marks = [time.perf_counter() for _ in generate(self.model, ids, max_tokens=n_decode + 1, ctx_size=self.n_ctx,
                                                       stop_ids=frozenset())]
        return marks[0] - t0, marks[-1] - marks[0]


class _LlamaCpp:
    def __init__(self, path: str, threads: int, n_ctx: int) -> None:
        from llamatrace.peers.llamacpp import LlamaCpp
        self.engine = LlamaCpp(path, n_ctx, threads)      # last-token mode, as logits_all=False
        self.version = self.engine.version
        self.vocab_size = self.engine.vocab_size

    def threading(self) -> str:
        return "ggml threads"

    def run(self, ids: list[int], n_decode: int) -> tuple[float, float]:
        eng = self.engine
        eng.reset()
        t0 = time.perf_counter()
        token = int(np.argmax(eng.eval(ids)))
        t1 = time.perf_counter()
        for _ in range(n_decode):
            token = int(np.argmax(eng.eval([token])))
        return t1 - t0, time.perf_counter() - t1


class _HF:
    def __init__(self, path: str, threads: int, n_ctx: int) -> None:
        import torch
        import transformers
        torch.set_num_threads(threads)
        p = Path(path)
        self.torch = torch
        self.model = transformers.AutoModelForCausalLM.from_pretrained(
            str(p.parent), gguf_file=p.name, torch_dtype=torch.float32).eval()
        self.version = f"transformers {transformers.__version__} (torch {torch.__version__}, fp32)"
        self.vocab_size = int(self.model.config.vocab_size)

    def threading(self) -> str:
        return f"torch {self.torch.get_num_threads()} threads"

    def run(self, ids: list[int], n_decode: int) -> tuple[float, float]:
        torch = self.torch
        with torch.inference_mode():
            t0 = time.perf_counter()
            out = self.model(torch.tensor([ids]), use_cache=True)
            token = out.logits[0, -1].argmax().view(1, 1)
            t1 = time.perf_counter()
            past = out.past_key_values
            for _ in range(n_decode):
                out = self.model(token, past_key_values=past, use_cache=True)
                past, token = out.past_key_values, out.logits[0, -1].argmax().view(1, 1)
            return t1 - t0, time.perf_counter() - t1


_ENGINES = {"llama.cpp": _LlamaCpp, "hf": _HF}
