"""``llamatrace collect``: activations of a corpus written to Parquet shards, with a manifest.

Layout of the output directory::

    .manifest.json                settings, hooks, tokenization, each complete shard (rows, sha256)
    data/shard-00000.parquet      one row per token: sequence (int64), position (int32), token (int32),
    data/shard-00001.parquet      and one fixed-size list<float16|float32> column per hook
    ...

The directory itself is the dataset: pyarrow (so pandas) and Hugging Face ``datasets`` skip
names that start with ``.``, so ``pyarrow.parquet.read_table("acts")``,
``pandas.read_parquet("acts")`` and ``datasets.load_dataset("acts")`` read the shards alone (polars
refuses a directory with any other file in it: ``polars.read_parquet("acts/**/*.parquet")``).
Collections made before this layout have ``manifest.json``: a rerun renames it.

Every shard holds whole sequences (``sequences_per_shard`` of them, ~``shard_mb`` MB), so a shard
is a unit of work: the chunk runner (:mod:`llamatrace.corpus.runner`) hands shards to workers,
which load the model once and write each shard to a temporary name, then rename it into place;
the manifest lists a shard only once it is complete. Rerunning the same command keeps the
shards the manifest lists and makes the rest; the bytes do not depend on how many workers made
them, or on interruptions.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np

from llamatrace import __version__
from llamatrace.corpus import faults
from llamatrace.corpus.runner import run_chunks
from llamatrace.corpus.worker import ModelSpec
from llamatrace.corpus.sequences import Packing, sequences
from llamatrace.errors import OptionError, OutputError
from llamatrace.outputs import check_writable_dir, is_temp_name, replace_durably

FORMAT = "llamatrace.activations/1"
MANIFEST = ".manifest.json"              # hidden: Parquet and datasets readers of the directory skip it
LEGACY_MANIFEST = "manifest.json"       # collections made before: still resumed, renamed by the next run
DATA = "data"
DTYPES = ("float32", "float16")


def shard_name(index: int) -> str:
    return f"shard-{index:05d}.parquet"


@dataclass(frozen=True)
class Hook:
    """One collected activation: the name asked for, the stage@layer that carries it, its shape per token."""

    name: str
    stage: str
    layer: int | None
    shape: tuple[int, ...]

    @property
    def width(self) -> int:
        return math.prod(self.shape)


def resolve_hooks(names: list[str], config) -> list[Hook]:
    """TL names or stage ids -> :class:`Hook` (one vector per token each), in the order given.

    Raises:
        OptionError: an unknown or refused name (close matches listed), a layer the model does
            not have, a stage it does not compute, a name given twice, or one that is not a vector
            per token (attention).
    """
    from llamatrace.model import tl
    from llamatrace.tracing.stages import STAGE_BY_ID, absent_reason, eval_shape, model_stage_ids
    if not names:
        raise OptionError("give at least one --hook (e.g. --hook blocks.0.hook_resid_post)")
    hooks, seen = [], set()
    c = config
    dims = dict(seq_len=1, kv_len=1, dim=c.dim, n_heads=c.n_heads, n_kv_heads=c.n_kv_heads, head_dim=c.head_dim,
                hidden_dim=c.hidden_dim, vocab_size=c.vocab_size, rope_half=c.rope_dim // 2, q_dim=c.q_dim,
                kv_dim=c.kv_dim, n_rep=c.n_rep, max_seq=1, ssm_n_k_heads=c.ssm_n_k_heads,
                ssm_n_v_heads=c.ssm_n_v_heads, ssm_head_dim=c.ssm_head_dim, ssm_conv_dim=c.ssm_conv_dim,
                ssm_v_dim=c.ssm_v_dim, n_expert=c.n_expert, n_expert_used=c.n_expert_used,
                expert_hidden_dim=c.expert_hidden_dim)
    have = model_stage_ids(c)
    for name in names:
        served = tl.resolve(name, c.n_layers, c.post_norms, bool(c.n_expert), c.recurrent_layers)
        if served.kind == "stage" and served.stage not in have:      # a stage id this model never emits
            raise OptionError(f"--hook {name}: {absent_reason(served.stage, c)}")
        if not served.per_token:
            raise OptionError(f"--hook {name}: attention scores and patterns (and a recurrent state) are not one "
                              f"vector per token; collect residual, MLP or head activations (or use "
                              f"model.run_with_cache)")
        if served.name in seen:
            raise OptionError(f"--hook {name} is given twice")
        seen.add(served.name)
        when = STAGE_BY_ID[served.stage].when or ""
        if served.kind == "stage" or when == "deltanet" or "moe" in when:   # in our layout (TL's MoE hooks too)
            shape = eval_shape(STAGE_BY_ID[served.stage].shape, dims)[1:]
        else:
            shape = _tl_shape(served, c)
        hooks.append(Hook(served.name, served.stage, served.layer, tuple(int(x) for x in shape)))
    return hooks


def _tl_shape(served, c) -> tuple[int, ...]:
    """Per-token shape of a TL name: ``[d_model]``, ``[d_mlp]``, ``[head, d_head]`` or ``[1]``."""
    kind, stage = served.kind, served.stage
    if kind == "scale":
        return (1,)
    if kind in ("q_heads", "swap01") or stage == "Qcur_rope":
        return (c.n_heads, c.head_dim)
    if kind in ("kv_heads", "v_heads") or stage == "Kcur_rope":
        return (c.n_kv_heads, c.head_dim)
    if stage in ("ffn_gate", "ffn_up", "ffn_swiglu"):
        return (c.hidden_dim,)
    return (c.dim,)


def stop_layer(hooks: list[Hook], n_layers: int) -> int | None:
    """The ``stop_at_layer`` that runs no more blocks than the hooks need (``None``: the whole model)."""
    last = -1
    for h in hooks:
        if h.layer is None:
            if h.stage != "inp_embd":
                return None                            # ln_final, result_norm...: after every block
        else:
            last = max(last, h.layer)
    return last + 1 if last >= 0 else 1


@dataclass
class Collection:
    """Settings of one collect run; :meth:`manifest` is what ``manifest.json`` says of them."""

    model: ModelSpec
    model_sha256: str
    corpus: Path
    hooks: list[Hook]
    packing: Packing
    dtype: str = "float32"
    shard_mb: float = 256.0
    out: Path = Path("acts")
    workers: int = 1
    ray: str | None = None
    d_model: int = 0
    n_layers: int = 0
    corpus_sha256: str = ""
    n_sequences: int = 0
    shards: list[dict] = field(default_factory=list)
    remade: str | None = None      # why :func:`resume` dropped a listed shard and the ones after it

    @property
    def bytes_per_token(self) -> int:
        return 16 + sum(h.width for h in self.hooks) * np.dtype(self.dtype).itemsize

    @property
    def sequences_per_shard(self) -> int:
        return max(1, int(self.shard_mb * 1e6 // (self.bytes_per_token * self.packing.ctx_size)))

    @property
    def n_shards(self) -> int:
        return -(-self.n_sequences // self.sequences_per_shard)

    def settings(self) -> dict:
        """Everything that decides the bytes of the shards."""
        return {
            "format": FORMAT,
            "llamatrace_version": __version__,
            "model": {"file": Path(self.model.path).name, "sha256": self.model_sha256,
                      "activations": self.model.activations},
            "corpus": {"file": self.corpus.name, "sha256": self.corpus_sha256},
            "tokenization": self.packing.as_json(),
            "hooks": [{"name": h.name, "column": h.name, "stage": h.stage, "layer": h.layer,
                       "shape": list(h.shape)} for h in self.hooks],
            "dtype": self.dtype,
            "d_model": self.d_model,
            "ctx_size": self.packing.ctx_size,
            "sequences_per_shard": self.sequences_per_shard,
            "n_sequences": self.n_sequences,
            "n_tokens": self.n_sequences * self.packing.ctx_size,
        }

    def manifest(self) -> dict:
        complete = len(self.shards) == self.n_shards
        return {**self.settings(), "n_shards": self.n_shards, "complete": complete, "shards": self.shards}


# ---- the work of one shard (in a worker process, a Ray actor, or here) ------------------------
@dataclass
class ShardJob:
    index: int
    first_sequence: int
    tokens: np.ndarray              # int32 [n_seq, ctx_size]
    hooks: list[Hook]
    dtype: str
    out: str
    stop_at_layer: int | None
    on_sequence: Callable[[int], None] | None = None     # progress, in this process only


def write_shard(model, job: ShardJob) -> dict:
    """Run ``job``'s sequences, write ``shard-NNNNN.parquet`` (temporary name, then renamed).

    Returns:
        ``{"file", "rows", "sha256"}`` of the shard.

    Raises:
        OutputError: the shard cannot be written.
    """
    import pyarrow as pa
    import pyarrow.parquet as pq

    from llamatrace.model import tl
    n_seq, ctx = job.tokens.shape
    rows = n_seq * ctx
    columns = {h.name: np.empty((rows, h.width), dtype=job.dtype) for h in job.hooks}
    served = [tl.resolve(h.name, model.config.n_layers, model.config.post_norms, bool(model.config.n_expert),
                          model.config.recurrent_layers) for h in job.hooks]

    def keep(b: int, ids, arrays: dict) -> None:
        for h in job.hooks:
            columns[h.name][b * ctx:(b + 1) * ctx] = arrays[h.name].reshape(ctx, h.width)
        if job.on_sequence is not None:
            job.on_sequence(ctx)

    tl.run(model, list(job.tokens), served, keep=False, stop_at_layer=job.stop_at_layer,
           return_logits=False, on_sequence=keep)
    table = {
        "sequence": pa.array(np.repeat(np.arange(job.first_sequence, job.first_sequence + n_seq, dtype=np.int64), ctx)),
        "position": pa.array(np.tile(np.arange(ctx, dtype=np.int32), n_seq)),
        "token": pa.array(job.tokens.reshape(-1).astype(np.int32)),
    }
    for h in job.hooks:
        table[h.name] = pa.FixedSizeListArray.from_arrays(pa.array(columns[h.name].reshape(-1)), h.width)
    out = Path(job.out)
    final = out / DATA / shard_name(job.index)

    def write(f) -> None:
        pq.write_table(pa.table(table), f, compression="snappy", row_group_size=64 * ctx)
        f.flush()
        faults.at("shard", job.index)

    try:
        replace_durably(final, write)
    except OSError as exc:
        raise OutputError(f"-o {str(out)!r}: cannot write {final.name} ({exc.strerror or exc}); "
                          f"free some space and rerun: complete shards are kept") from None
    return {"file": final.name, "rows": rows, "sha256": _sha256(final)}


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


# ---- the run -----------------------------------------------------------------------------------
def prepare(c: Collection) -> np.ndarray:
    """Tokenize the corpus into a temporary token file (memory stays bounded), check the output
    directory against a manifest already there, and return the sequences (a read-only
    memory map ``[n_sequences, ctx_size]``, int32).

    Raises:
        OptionError, PromptError: the corpus cannot be read or is too short for one sequence.
        OutputError: ``out`` is not a directory we may write, holds files that are not a
            collection, a collection with other settings, or a damaged shard.
    """
    from llamatrace.corpus.chunks import read_header
    from llamatrace.gguf.fetch import sha256_file
    tokenizer, config = read_header(Path(c.model.path))
    c.d_model, c.n_layers = config.dim, config.n_layers
    try:
        c.corpus_sha256 = sha256_file(c.corpus)
    except OSError as exc:
        raise OptionError(f"-f {str(c.corpus)!r}: cannot read it ({exc.strerror or exc})") from None
    made = []                      # the folders this run creates, deepest first: removed if the text fails
    for p in (c.out / DATA, c.out, *c.out.parents):
        if p.exists():
            break
        made.append(p)
    check_out_dir(c.out)
    fd, tmp = tempfile.mkstemp(prefix=".tokens.", suffix=".tmp", dir=c.out / DATA)
    n = 0
    try:
        with os.fdopen(fd, "wb") as f:
            for seq in sequences(c.corpus, tokenizer, c.packing):
                f.write(seq.tobytes())
                n += 1
        if n == 0:
            from llamatrace.errors import PromptError
            raise PromptError(f"-f {str(c.corpus)!r} has fewer tokens than one sequence of --ctx-size "
                              f"{c.packing.ctx_size}: give a longer text or a smaller --ctx-size")
    except BaseException:          # a text that is not UTF-8, too short, Ctrl-C: nothing left behind
        Path(tmp).unlink(missing_ok=True)
        for p in made:
            with contextlib.suppress(OSError):
                p.rmdir()
        raise
    c.n_sequences = n
    tokens = np.memmap(tmp, dtype=np.int32, mode="r", shape=(n, c.packing.ctx_size))
    os.unlink(tmp)                 # the map keeps the data; nothing is left behind on a crash
    c.shards = resume(c)
    return tokens


def check_out_dir(out: Path) -> None:
    """Create ``out`` and ``out/data`` if needed; refuse a file, an unwritable directory, or one
    holding anything but a collection (a manifest and shards).

    Raises:
        OutputError: as above (nothing is created then).
    """
    if out.exists() and not out.is_dir():
        raise OutputError(f"-o {str(out)!r} is a file: give a directory")
    if out.is_dir():
        data = out / DATA
        foreign = [p.name for p in out.iterdir() if not (p.name in (MANIFEST, LEGACY_MANIFEST, DATA)
                                                         or is_temp_name(p.name))]
        shards = False
        if data.exists():
            if not data.is_dir():
                foreign.append(DATA)
            else:
                names = [p.name for p in data.iterdir() if not is_temp_name(p.name)]
                foreign += [f"{DATA}/{name}" for name in names if not _is_shard_name(name)]
                shards = bool(names)
        # shards come after the first manifest: without one, a run was killed before any shard
        if foreign or (shards and not _manifest_path(out).is_file()):
            shown = ", ".join(sorted(foreign)[:3]) or "shards without a manifest"
            raise OutputError(f"-o {str(out)!r} is not empty and not a collection ({shown}): give a new or "
                              f"empty directory")
        check_writable_dir(out, f"-o {str(out)!r}")
    try:
        (out / DATA).mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise OutputError(f"-o {str(out)!r}: cannot create it ({exc.strerror or exc})") from None
    for folder in (out, out / DATA):               # what a killed run left half-written: a manifest, a shard
        for p in folder.iterdir():
            if is_temp_name(p.name) and p.is_file():
                p.unlink(missing_ok=True)


def _manifest_path(out: Path) -> Path:
    """The manifest of ``out``: ``.manifest.json``, or an older collection's ``manifest.json``."""
    legacy = out / LEGACY_MANIFEST
    return legacy if legacy.is_file() and not (out / MANIFEST).is_file() else out / MANIFEST


def _is_shard_name(name: str) -> bool:
    return name.startswith("shard-") and name.endswith(".parquet") and name[6:11].isdigit()


def resume(c: Collection) -> list[dict]:
    """The complete shards a previous run of the same settings left in ``c.out`` (checked:
    size and Parquet footer); shards it did not list are deleted, to be made again. A listed shard
    that is missing or damaged is made again with every shard after it (the kept ones are the
    first shards, in order); ``c.remade`` then says which and why.

    Raises:
        OutputError: the manifest there is for other settings.
    """
    import pyarrow as pa
    import pyarrow.parquet as pq
    path = _manifest_path(c.out)
    if not path.is_file():
        return []
    try:
        old = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise OutputError(f"{path}: not a readable manifest ({exc}); give a new -o directory") from None
    new = c.settings()
    if old.get("llamatrace_version") != __version__:    # a kernel's fix may move the last bits: no mixing
        raise OutputError(f"-o {str(c.out)!r} holds a collection made by llamatrace "
                          f"{old.get('llamatrace_version')}, this is {__version__}: their shards may differ in the "
                          f"last bits; finish it with that version, or give a new -o directory")
    for key, value in new.items():
        if old.get(key) != value:
            where, then, now = _difference(key, old.get(key), value)
            raise OutputError(f"-o {str(c.out)!r} holds a collection with other settings ({where}: "
                              f"{_brief(then)} there, {_brief(now)} now); give a new -o directory or delete "
                              f"that one")
    kept = []
    listed_before = old.get("shards", [])
    for entry in listed_before:
        shard = c.out / DATA / entry["file"]
        try:
            rows = pq.read_metadata(shard).num_rows
            problem = None if rows == entry["rows"] else f"has {rows} rows, the manifest says {entry['rows']}"
        except FileNotFoundError:
            problem = "is missing"
        except (pa.ArrowInvalid, OSError) as exc:
            if isinstance(exc, OSError) and exc.errno is not None:   # unreadable now (permissions, I/O):
                raise OutputError(f"{shard}: cannot read it ({exc.strerror or exc}); fix that and rerun: "
                                  f"the complete shards are kept") from None   # nothing deleted
            problem = f"is damaged ({' '.join(str(exc).split())[:80]})"    # pyarrow: not Parquet, bad footer
        if problem is not None:
            after = len(listed_before) - len(kept) - 1
            c.remade = f"{entry['file']} {problem}; " + \
                (f"it and the {after} listed after it are made again" if after else "it is made again")
            break
        kept.append(entry)
    listed = {e["file"] for e in kept}
    for p in (c.out / DATA).iterdir():
        if _is_shard_name(p.name) and p.name not in listed:
            try:
                p.unlink()              # written after the manifest's last update, or dropped above: made again
            except OSError as exc:
                raise OutputError(f"{p}: cannot delete it to make it again ({exc.strerror or exc})") from None
    return kept


def _difference(where: str, old, new) -> tuple[str, object, object]:
    """The first place two manifest values differ: its path (``hooks[0].layer``) and both values
    there. Lists of named settings (hooks) of different lengths are compared by their names."""
    if isinstance(old, dict) and isinstance(new, dict):
        for key in [*new, *(k for k in old if k not in new)]:
            if old.get(key) != new.get(key):
                return _difference(f"{where}.{key}", old.get(key), new.get(key))
    if isinstance(old, list) and isinstance(new, list):
        if len(old) == len(new):
            for i, (a, b) in enumerate(zip(old, new)):
                if a != b:
                    return _difference(f"{where}[{i}]", a, b)
        elif all(isinstance(x, dict) and "name" in x for x in old + new):
            return where, [x["name"] for x in old], [x["name"] for x in new]
    return where, old, new


def _brief(value, width: int = 64) -> str:
    """``value`` as JSON, cut after ``width`` characters at a comma or space where there is one."""
    text = json.dumps(value, ensure_ascii=False)
    if len(text) <= width:
        return text
    cut = max(text.rfind(", ", width // 2, width), text.rfind(" ", width // 2, width))
    return text[:cut if cut > 0 else width] + " …"


def write_manifest(c: Collection) -> None:
    """Replace ``c.out/.manifest.json`` (durably: :func:`~llamatrace.outputs.replace_durably`); an
    older collection's ``manifest.json`` goes once the new one is written.

    Raises:
        OutputError: it cannot be written (disk full …); no temporary file is left.
    """
    data = (json.dumps(c.manifest(), indent=2) + "\n").encode()
    def write(f) -> None:
        f.write(data)
        f.flush()
        faults.at("manifest", len(c.shards))

    try:
        replace_durably(c.out / MANIFEST, write)
        (c.out / LEGACY_MANIFEST).unlink(missing_ok=True)
    except OSError as exc:
        raise OutputError(f"-o {str(c.out)!r}: cannot write {MANIFEST} ({exc.strerror or exc}); free some "
                          f"space and rerun: complete shards are kept") from None


def manifest_lists_all(c: Collection) -> bool:
    """Whether the manifest on disk lists every shard: the collection is complete (a Ctrl-C that
    came after the last write, as Ray shut down, interrupted nothing)."""
    try:
        return len(json.loads(_manifest_path(c.out).read_text(encoding="utf-8")).get("shards", [])) == c.n_shards
    except (OSError, ValueError):
        return False


def execute(c: Collection, tokens: np.ndarray, model=None, on_tokens: Callable[[int], None] | None = None,
            work: Callable = write_shard) -> None:
    """Make the shards :func:`prepare` did not find complete; the manifest is rewritten after each.

    Args:
        model: the loaded model when the shards are made here (one worker, no Ray).
        on_tokens: progress, ``fn(n_tokens_done_since_last_call)``.
        work: makes one shard, :func:`write_shard` (a module-level function: workers import it).

    Raises:
        LlamatraceError: a shard could not be made (a worker's error, a worker dying
            :data:`~llamatrace.corpus.worker.MAX_TRIES` times, an unreachable Ray cluster).
    """
    spq = c.sequences_per_shard
    todo = list(range(len(c.shards), c.n_shards))
    stop = stop_layer(c.hooks, c.n_layers)
    here = c.workers == 1 and c.ray is None
    write_manifest(c)

    def payload(i: int) -> ShardJob:
        index = todo[i]
        first = index * spq
        return ShardJob(index, first, np.array(tokens[first:first + spq]), c.hooks, c.dtype, str(c.out),
                        stop, on_tokens if here else None)

    def done(i: int, entry: dict) -> None:
        c.shards.append(entry)
        write_manifest(c)
        if not here and on_tokens is not None:
            on_tokens(entry["rows"])

    run_chunks(c.model, len(todo), payload, work, done, c.workers, model, c.ray)
    for tmp in (c.out / DATA).glob(".shard-*.tmp"):     # of a worker killed while writing, its shard made again
        tmp.unlink(missing_ok=True)
