"""The packed-weights cache (llamatrace.model.packcache): a load from the cache computes what a
load that packs computes, bit for bit; a damaged entry is ignored and written again; the cap
evicts the least recently used; a loader never reads an entry another process is writing; and
``--no-cache`` / ``$LLAMATRACE_NO_CACHE`` turn it off. The reference is always a load with the
cache off: the packing path every other test of the suite runs (tests/conftest.py turns the
cache off for them)."""

from __future__ import annotations

import fcntl
import json
import multiprocessing as mp
import os
import shutil

import gguf
import numpy as np
import pytest

from cli_helpers import assert_one_line_error, run
from gguf_factory import write_tiny_llama

from llamatrace.cli import main
from llamatrace.gguf import fetch
from llamatrace.kernels.types import packing
from llamatrace.model import packcache
from llamatrace.model.llama import Llama

T = gguf.GGMLQuantizationType
TOKENS = np.array([3, 17, 5, 40, 22, 9, 31])


def write_kquant_llama(path, seed: int = 0):
    """A tiny random model of mixed K-quant types: Q4_K matrices, Q6_K for layer 0's attn_v and
    layer 1's ffn_down, an F16 ffn_gate (so wq|wk|wv and w1|w3 are packed both stacked and
    alone), a Q6_K untied output and a Q4_K embedding (a lookup table, packed for f32 in q8)."""
    return write_tiny_llama(path, qtype=T.Q4_K, dim=256, hidden_dim=256, n_heads=4, n_kv_heads=2, tied=False,
                            seed=seed, extra_types={"blk.0.attn_v.weight": T.Q6_K, "blk.1.ffn_down.weight": T.Q6_K,
                                                    "blk.1.ffn_gate.weight": T.F16, "output.weight": T.Q6_K})


@pytest.fixture(scope="module")
def kquant_path(tmp_path_factory):
    return write_kquant_llama(tmp_path_factory.mktemp("kq") / "kquant.gguf")


def logits(model) -> np.ndarray:
    """float32 [8, vocab]: a 7-token prefill (the tiled kernels) and one decode step (GEMV)."""
    cache = model.new_cache(16)
    prefill = model.forward(TOKENS, 0, cache, all_logits=True)
    return np.concatenate([prefill, model.forward(np.array([11]), len(TOKENS), cache, all_logits=True)])


@pytest.mark.parametrize("mode", ["f32", "q8"])
def test_wq_wk_stack_beside_a_wv_of_another_type(kquant_path, mode):
    # layer 0's attn_v is Q6_K: wq|wk are stacked (in q8 their input quantized once), wv alone;
    # the logits are those of the three packed alone
    model = Llama.load(kquant_path, activations=mode, cache=False)
    lw0, lw1 = model.weights.layers[:2]
    assert lw0.wqkv.row_splits == (256, 128) and lw0.wv.ggml_type == T.Q6_K and lw0.wq is None
    assert lw1.wqkv.row_splits == (256, 128, 128) and lw1.wv is None
    stacked = logits(model)
    lw0.wq, lw0.wk = (packing.pack(name, model.file.tensor(name).tensor_type, model.file.tensor(name).data,
                                   *model.file.matrix_shape(name), activations=mode)
                      for name in ("blk.0.attn_q.weight", "blk.0.attn_k.weight"))
    lw0.wqkv = None
    np.testing.assert_array_equal(stacked, logits(model))


def reference(path, mode: str) -> np.ndarray:
    return logits(Llama.load(path, activations=mode, cache=False))


def maps_file(a: np.ndarray, path) -> bool:
    """Whether ``a``'s memory lies in a map of the file ``path`` (this process's /proc/self/maps)."""
    addr = a.ctypes.data
    with open("/proc/self/maps") as fh:
        for line in fh:
            span, *_, name = line.rstrip("\n").split(maxsplit=5)
            lo, hi = (int(x, 16) for x in span.split("-"))
            if lo <= addr < hi:
                return name.strip() == str(path)
    return False


def entries(folder) -> list:
    return sorted(folder.glob("*" + packcache.SUFFIX)) if folder.exists() else []


# ---- same numbers, cold, warm and off --------------------------------------------------------------
@pytest.mark.parametrize("mode", ["f32", "q8"])
@pytest.mark.parametrize("which", ["kquant", "smollm2"])
def test_cold_warm_and_no_cache_loads_give_the_same_logits(packed, request, mode, which):
    path = request.getfixturevalue("kquant_path" if which == "kquant" else "smollm2_path")
    ref = reference(path, mode)
    assert entries(packed) == []                                 # cache=False wrote nothing
    cold = Llama.load(path, activations=mode)
    assert (cold.pack_cache.read, cold.pack_cache.written) == (False, True)
    assert [p.name for p in entries(packed)] == [cold.pack_cache.path.name]
    assert cold.pack_cache.path.name.startswith(f"{path.stem}.{mode}.")
    warm = Llama.load(path, activations=mode)
    assert (warm.pack_cache.read, warm.pack_cache.written) == (True, False)
    w2 = warm.weights.layers[0].w2
    # the cold load packed into the entry's own pages (then renamed), the warm one maps the entry
    assert maps_file(w2.qs, warm.pack_cache.path) and maps_file(cold.weights.layers[0].w2.qs, cold.pack_cache.path)
    assert w2.qs.flags.writeable        # a private map: Numba's kernels take the arrays they were compiled for
    for model in (cold, warm):
        np.testing.assert_array_equal(logits(model), ref)


def test_each_activations_mode_has_its_own_entry(packed, kquant_path):
    a = Llama.load(kquant_path, activations="f32")
    b = Llama.load(kquant_path, activations="q8")
    assert a.pack_cache.written and b.pack_cache.written and a.pack_cache.path != b.pack_cache.path
    assert b.weights.layers[0].w2.act8 and not a.weights.layers[0].w2.act8
    # the untied embedding is a lookup table in either mode: packed for f32 in the q8 entry too
    assert not b.weights.tok_embeddings.act8


def test_a_rewritten_file_is_not_served_its_old_entry(packed, tmp_path):
    path = write_kquant_llama(tmp_path / "m.gguf", seed=1)
    Llama.load(path, activations="q8")
    st = os.stat(path)
    write_kquant_llama(path, seed=2)                  # same header and size, other weights
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))   # a clock that moves on
    assert os.stat(path).st_size == st.st_size
    model = Llama.load(path, activations="q8")
    assert not model.pack_cache.read
    np.testing.assert_array_equal(logits(model), reference(path, "q8"))


# ---- damaged entries --------------------------------------------------------------------------------
def _truncate(p, size):
    os.truncate(p, size - 100)


def _bad_magic(p, size):
    with open(p, "r+b") as fh:
        fh.write(b"NOTPACK!")


def _bad_trailer(p, size):
    with open(p, "r+b") as fh:
        fh.seek(size - 1)
        last = fh.read(1)
        fh.seek(size - 1)
        fh.write(bytes([last[0] ^ 0xFF]))


def _bad_header(p, size):
    _, at, _ = _layout(p)
    with open(p, "r+b") as fh:
        fh.seek(at)
        fh.write(b"{not json")


def _bad_first_page(p, size):
    """The header's offset pointing elsewhere."""
    with open(p, "r+b") as fh:
        fh.seek(len(packcache.MAGIC))
        fh.write((size // 2).to_bytes(8, "little"))


def _empty(p, size):
    os.truncate(p, 0)


def _other_mode(p, size):
    """The f32 entry of the same file under the q8 entry's name: another key inside."""
    other = next(q for q in p.parent.glob("*" + packcache.SUFFIX) if q != p)
    shutil.copyfile(other, p)


def _layout(p) -> tuple[dict, int, int]:
    """The entry's header, the offset of its header and that of its first array."""
    with open(p, "rb") as fh:
        fh.seek(len(packcache.MAGIC))
        at, header_len = int.from_bytes(fh.read(8), "little"), int.from_bytes(fh.read(8), "little")
        fh.seek(at)
        return json.loads(fh.read(header_len)), at, packcache._DATA_ALIGN


def _changed_bytes(p, size):
    """A few bytes inside the first matrix's quants inverted: a bad sector, a stray write."""
    header, _, data_start = _layout(p)
    offset, _, shape, _ = header["weights"][0]["arrays"][0]
    at = data_start + offset + int(np.prod(shape)) // 2
    with open(p, "r+b") as fh:
        fh.seek(at)
        inverted = bytes(b ^ 0xFF for b in fh.read(8))
        fh.seek(at)
        fh.write(inverted)


def _zeroed_data(p, size):
    """Every array's bytes zero, the header and the trailer left whole."""
    _, _, data_start = _layout(p)
    with open(p, "r+b") as fh:
        fh.seek(data_start)
        fh.write(bytes(size - 16 - data_start))


def _crafted_shape(p, size):
    """The first matrix's quant array given its dims in another order: same size, same header length."""
    header, at, _ = _layout(p)
    text = json.dumps(header)
    shape = header["weights"][0]["arrays"][0][2]
    assert shape[0] != shape[1]
    swapped = json.dumps([shape[1], shape[0], *shape[2:]])
    crafted = text.replace(json.dumps(shape), swapped, 1).encode()
    assert len(crafted) == len(text) and crafted != text.encode()
    with open(p, "r+b") as fh:
        fh.seek(at)
        fh.write(crafted)


DAMAGES = [_changed_bytes, _zeroed_data, _crafted_shape]


@pytest.mark.parametrize("damage", [_truncate, _bad_magic, _bad_trailer, _bad_header, _bad_first_page, _empty, _other_mode, *DAMAGES])
def test_a_damaged_entry_is_ignored_and_written_again(packed, kquant_path, damage):
    ref = reference(kquant_path, "q8")
    Llama.load(kquant_path, activations="f32")        # a second entry, for _other_mode
    entry = Llama.load(kquant_path, activations="q8").pack_cache.path
    size = entry.stat().st_size
    damage(entry, size)
    with pytest.warns(UserWarning, match="packed-weights cache entry .* is damaged") as caught:
        model = Llama.load(kquant_path, activations="q8")
    assert len(caught) == 1
    assert (model.pack_cache.read, model.pack_cache.written) == (False, True)
    np.testing.assert_array_equal(logits(model), ref)
    assert entry.stat().st_size == size
    again = Llama.load(kquant_path, activations="q8")
    assert again.pack_cache.read
    np.testing.assert_array_equal(logits(again), ref)


# ---- the cap ----------------------------------------------------------------------------------------
def test_evict_removes_the_least_recently_used_down_to_the_cap(packed):
    packed.mkdir(parents=True)
    sizes = {"a": 300, "b": 200, "c": 100}
    for age, (name, size) in enumerate(sizes.items()):       # a the oldest, c the newest
        p = packed / f"{name}{packcache.SUFFIX}"
        p.write_bytes(bytes(size))
        os.utime(p, ns=(10**18, 10**18 + age * 10**9))
    assert packcache.evict(350) == [packed / f"a{packcache.SUFFIX}"]
    assert [p.name for p in entries(packed)] == [f"b{packcache.SUFFIX}", f"c{packcache.SUFFIX}"]
    # keep= survives however old: the entry just written
    assert packcache.evict(100, keep=packed / f"b{packcache.SUFFIX}") == [packed / f"c{packcache.SUFFIX}"]


def test_evict_clears_partial_files_only_when_no_writer_holds_them(packed):
    packed.mkdir(parents=True)
    dead, alive = (packed / f"{n}{packcache.SUFFIX}{packcache.PARTIAL}" for n in ("dead", "alive"))
    dead.write_bytes(b"half")
    alive.write_bytes(b"half")
    fd = os.open(alive, os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)                # a writer at work
        packcache.evict(10**12)
        assert not dead.exists() and alive.read_bytes() == b"half"
    finally:
        os.close(fd)


def test_a_load_evicts_older_entries_beyond_the_cap(packed, kquant_path, monkeypatch):
    first = Llama.load(kquant_path, activations="f32").pack_cache.path
    os.utime(first, ns=(10**18, 10**18))               # long ago
    size = first.stat().st_size
    monkeypatch.setenv(packcache.ENV_CAP, f"{(size + 1000) / 1e9:.12f}")
    second = Llama.load(kquant_path, activations="q8").pack_cache
    assert second.written and second.path.stat().st_size < size      # fp16 scales in q8: both don't fit
    assert entries(packed) == [second.path]


def test_a_read_makes_an_entry_the_most_recently_used(packed, kquant_path):
    entry = Llama.load(kquant_path, activations="q8").pack_cache.path
    os.utime(entry, ns=(10**18, 10**18))
    assert Llama.load(kquant_path, activations="q8").pack_cache.read
    assert entry.stat().st_mtime_ns > 10**18


def test_an_entry_over_the_cap_is_not_written(packed, kquant_path, monkeypatch):
    monkeypatch.setenv(packcache.ENV_CAP, "0.000001")      # 1000 bytes
    with pytest.warns(UserWarning, match=r"cache is skipped: .* over the cap of 0.001 MB \(\$LLAMATRACE_PACKED_CACHE_GB\)"):
        model = Llama.load(kquant_path, activations="q8")
    assert not model.pack_cache.written and entries(packed) == []
    np.testing.assert_array_equal(logits(model), reference(kquant_path, "q8"))


@pytest.mark.parametrize("value", ["lots", "-1", "nan", "inf"])
def test_a_malformed_cap_is_one_error_line(packed, kquant_path, monkeypatch, capsys, value):
    monkeypatch.setenv(packcache.ENV_CAP, value)
    assert_one_line_error(*run(capsys, "generate", "--raw", "-n", "1", "-m", kquant_path, "hi"),
                          packcache.ENV_CAP, repr(value))


# ---- concurrent loaders -----------------------------------------------------------------------------
def test_a_loader_neither_reads_nor_writes_an_entry_another_process_is_writing(packed, kquant_path):
    ref = reference(kquant_path, "q8")
    entry = Llama.load(kquant_path, activations="q8").pack_cache.path
    partial = entry.with_name(entry.name + packcache.PARTIAL)
    half = entry.read_bytes()[:entry.stat().st_size // 2]
    entry.unlink()
    partial.write_bytes(half)                          # a writer halfway through
    fd = os.open(partial, os.O_RDWR)
    fcntl.flock(fd, fcntl.LOCK_EX)
    try:
        model = Llama.load(kquant_path, activations="q8")
        assert (model.pack_cache.read, model.pack_cache.written) == (False, False)
        np.testing.assert_array_equal(logits(model), ref)
        assert partial.read_bytes() == half and not entry.exists()
    finally:
        os.close(fd)                                   # the writer dies: its lock goes with it
    model = Llama.load(kquant_path, activations="q8")  # takes the dead writer's file over
    assert model.pack_cache.written and not partial.exists()
    again = Llama.load(kquant_path, activations="q8")
    assert again.pack_cache.read
    np.testing.assert_array_equal(logits(again), ref)


def _load_together(path: str, barrier, results) -> None:
    """A worker's load (the corpus runner's ModelSpec.load), started with the others'."""
    from llamatrace.corpus.worker import ModelSpec
    barrier.wait()
    model = ModelSpec(path, "q8").load()
    results.put((model.pack_cache.read, model.pack_cache.written, logits(model)))


def test_processes_loading_together_all_get_the_same_weights(packed, kquant_path):
    ref = reference(kquant_path, "q8")
    ctx = mp.get_context("spawn")
    barrier, results = ctx.Barrier(3), ctx.Queue()
    workers = [ctx.Process(target=_load_together, args=(str(kquant_path), barrier, results)) for _ in range(3)]
    for w in workers:
        w.start()
    got = [results.get(timeout=600) for _ in workers]
    for w in workers:
        w.join()
    assert all(w.exitcode == 0 for w in workers)
    for _, _, y in got:
        np.testing.assert_array_equal(y, ref)
    assert not list(packed.glob("*" + packcache.PARTIAL))        # each writer renamed its file or never made one
    assert len(entries(packed)) == 1
    assert Llama.load(kquant_path, activations="q8").pack_cache.read


# ---- switching it off -------------------------------------------------------------------------------
def test_no_cache_option_reads_and_writes_nothing(packed, kquant_path, capsys):
    code, out, err = run(capsys, "generate", "--raw", "-n", "1", "-m", kquant_path, "--no-cache", "hi")
    assert code == 0, err
    assert entries(packed) == [] and packcache.ENV_NO_CACHE not in os.environ   # off for that command only
    code, out2, err = run(capsys, "generate", "--raw", "-n", "1", "-m", kquant_path, "hi")
    assert code == 0 and out2 == out and len(entries(packed)) == 1


def test_the_environment_variable_turns_it_off(packed, kquant_path, monkeypatch):
    monkeypatch.setenv(packcache.ENV_NO_CACHE, "1")
    model = Llama.load(kquant_path)
    assert model.pack_cache.path is None and entries(packed) == []
    assert Llama.load(kquant_path, cache=True).pack_cache.written      # an explicit argument wins


@pytest.mark.parametrize("command", ["generate", "trace", "diagram", "compare", "lens", "attention", "perplexity",
                                     "collect", "imatrix", "bench", "quantize"])
def test_every_command_that_loads_a_model_takes_no_cache(capsys, command):
    assert main([command, "--help"]) == 0
    assert "--no-cache" in capsys.readouterr().out


# ---- what the CLI says ------------------------------------------------------------------------------
def generate(capsys, path, *options) -> tuple[list[int], list[str]]:
    """``generate`` 8 tokens of "hi" from ``path``: (the ids, the ``warning:`` lines on stderr)."""
    code, out, err = run(capsys, "generate", "--raw", "-n", "8", "--json", "-m", path, *options, "hi")
    assert code == 0 and "Traceback" not in err, err
    return json.loads(out)["ids"], [ln for ln in err.splitlines() if ln.startswith("warning:")]


@pytest.mark.parametrize("damage", DAMAGES)
def test_generate_from_a_damaged_entry_warns_once_rebuilds_it_and_answers_right(packed, kquant_path, capsys, damage):
    want = generate(capsys, kquant_path, "--no-cache")
    assert generate(capsys, kquant_path) == want                     # writes the entry
    (entry,) = entries(packed)
    damage(entry, entry.stat().st_size)
    damaged = entry.stat().st_ino
    ids, (line, *more) = generate(capsys, kquant_path)
    assert ids == want[0] and more == []
    assert "damaged" in line and str(entry) in line
    rebuilt = entry.stat().st_ino
    assert rebuilt != damaged                                        # written anew (renamed over it)
    assert generate(capsys, kquant_path) == want                     # and read: kept, no warning
    assert entries(packed) == [entry] and entry.stat().st_ino == rebuilt


def test_a_failed_write_is_one_warning_line(packed, kquant_path, capsys):
    packed.parent.mkdir(parents=True)
    packed.write_bytes(b"a file where the folder should be")
    ids, (line, *more) = generate(capsys, kquant_path)
    assert ids == generate(capsys, kquant_path, "--no-cache")[0] and more == []
    assert "could not write" in line and str(packed) in line and "--no-cache" in line


def test_a_disk_without_room_skips_the_cache_with_one_warning_line(packed, kquant_path, capsys, monkeypatch):
    # a small file system: 1 GB, 0.5 GB free, less than the 2 GiB the cache leaves free
    monkeypatch.setattr(packcache.shutil, "disk_usage", lambda path: shutil._ntuple_diskusage(10**9, 5 * 10**8, 5 * 10**8))
    ids, (line, *more) = generate(capsys, kquant_path)
    assert ids == generate(capsys, kquant_path, "--no-cache")[0] and more == [] and entries(packed) == []
    assert "skipped" in line and "500 MB free" in line and "2 GiB" in line and fetch.ENV_CACHE in line


# ---- what is refused is never packed ----------------------------------------------------------------
@pytest.mark.parametrize("bad_rope, named", [
    (dict(extra_kv={"llama.rope.scaling.type": "dynamic"}), "llama.rope.scaling.type"),     # the type key
    (dict(extra_kv={"llama.rope.scaling.type": "longrope"},                               # LongRoPE's factors
          extra_tensors={"rope_factors_long.weight": np.ones(3), "rope_factors_short.weight": np.ones(3)}),
     "'rope_factors_short.weight' holds 3 values"),
])
def test_bad_rope_scaling_is_refused_before_anything_is_cached(bad_rope, named, packed, tmp_path, capsys):
    # refused from the metadata and the factor tensors, before the weights (gigabytes for a real
    # file) are packed and written to the cache, or the vocabulary is
    path = write_tiny_llama(tmp_path / "bad-rope.gguf", **bad_rope)
    assert_one_line_error(*run(capsys, "generate", "--raw", "-n", "1", "-m", path, "hi"), named)
    cache = packed.parent
    assert not cache.exists() or [p for p in cache.rglob("*") if p.is_file()] == []


def test_a_file_with_tensors_never_read_is_refused_and_nothing_is_cached(packed, tmp_path, capsys):
    # the check runs after block 0 is packed: the half-made entry is dropped with the error (the
    # vocabulary's cache, made before, is a valid entry of its own)
    path = write_tiny_llama(tmp_path / "bias.gguf", extra_tensors={"blk.1.attn_output.bias": np.ones(64)})
    assert_one_line_error(*run(capsys, "generate", "--raw", "-n", "1", "-m", path, "hi"),
                          "'blk.1.attn_output.bias' is not part of the llama forward pass")
    leftovers = [p for p in packed.rglob("*") if p.is_file() and p.suffix != ".tokenizer"] if packed.exists() else []
    assert entries(packed) == [] and leftovers == []


def test_the_fingerprint_covers_every_kernel_room():
    """A change to any kernel module, in whichever room of ``kernels/`` it stands, keys new entries:
    the fingerprint reads them all (a flat ``glob`` missed ``types/packing.py`` once the rooms came)."""
    from pathlib import Path

    from llamatrace.kernels import tiles
    from llamatrace.kernels.int8 import act8
    from llamatrace.kernels.types import packing, q4
    files = {p.resolve() for p in packcache._fingerprint_files()}
    assert {Path(m.__file__).resolve() for m in (tiles, act8, packing, q4)} <= files
