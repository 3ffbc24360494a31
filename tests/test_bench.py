"""`llamatrace bench`: its report, its options and its errors (no timings are asserted)."""

from __future__ import annotations

import importlib.util
import json

import pytest
from cli_helpers import assert_one_line_error, run

from llamatrace.analysis import bench
from llamatrace.kernels.int8 import amx
from llamatrace.machine import probe
from llamatrace.peers import exit_reason


def test_bench_json_reports_every_figure(capsys, tiny_model_path):
    code, out, err = run(capsys, "bench", "--model", str(tiny_model_path), "--prompt-tokens", "5",
                         "--decode-tokens", "3", "--repeats", "2", "--threads", "1", "--json")
    assert code == 0, err
    report = json.loads(out, parse_constant=lambda c: pytest.fail(f"{c} is no JSON (jq and browsers refuse it)"))
    assert (report["prompt_tokens"], report["decode_tokens"], report["repeats"], report["threads"]) == (5, 3, 2, 1)
    assert report["file_bytes"] == tiny_model_path.stat().st_size
    (ours,) = report["results"]
    assert ours["engine"] == "llamatrace f32" and ours["threading"].startswith("numba ") and ours["threading"].endswith(", 1 thread")
    assert len(ours["prefill_tok_s"]) == len(ours["decode_tok_s"]) == 2
    assert all(v > 0 for v in ours["prefill_tok_s"] + ours["decode_tok_s"])
    assert ours["load_s"] > 0 and ours["peak_rss_bytes"] > 10 * 2**20   # a child process with numpy loaded
    assert ours["compile_s"] >= 0            # the suite's earlier tests compiled the tiny model's kernels
    assert report["machine"]["threads"] == 1 and report["machine"]["read_gb_s"] > 0
    # f32 activations: no type's prefill on AMX, only the peak where the tiles are available
    assert report["machine"]["amx"] == amx.describe(()) and report["machine"]["amx_matmuls"] == []
    assert (report["machine"]["amx_gmac_s"] > 0) == amx.available().on
    assert (ours["roofline"]["prefill_of_amx_peak"] is None) == (not amx.available().on)   # not measured: null
    assert report["cost"]["macs"] > 0 and report["cost"]["weight_bytes"] < report["file_bytes"]
    roof = ours["roofline"]
    assert roof["decode_gb_s"] == pytest.approx(report["cost"]["weight_bytes"] * ours["decode_median"] / 1e9)
    assert roof["decode_of_read_bw"] == pytest.approx(roof["decode_gb_s"] / report["machine"]["read_gb_s"])
    # the f32 mode's limit: float32 multiply-adds, measured where the CPU has FMA3
    machine = report["machine"]
    assert machine["f32_isa"] == probe.fma_isa() and (machine["f32_gmac_s"] > 0) == bool(probe.fma_isa())
    if probe.fma_isa():
        assert roof["prefill_of_f32_peak"] == pytest.approx(roof["prefill_gmac_s"] / machine["f32_gmac_s"])
    assert report["machine"]["read_small_pages_gb_s"] > 0
    assert len(report["machine"]["read_between_runs_gb_s"]) == 2 and min(report["machine"]["read_between_runs_gb_s"]) > 0
    # 2 MiB pages, counted in bytes (smaps_rollup says kB), within what the process holds
    assert ours["huge_page_bytes"] % (2 << 20) == 0 and ours["huge_page_bytes"] <= ours["peak_rss_bytes"]
    # the tiny file is read whole (every weight a token), its pages counted once; the process before
    # the model holds NumPy and Numba, less than its peak
    assert ours["file_rss_bytes"] == pytest.approx(report["file_bytes"], abs=64 << 10)
    assert 10 * 2**20 < ours["before_load_rss_bytes"] < ours["peak_rss_bytes"]


def test_compile_timer_counts_compiles_only():
    from numba import njit

    def add_one(x):
        return x + 1
    with bench.compile_timer() as compiling:
        fn = njit(add_one)              # no cache: compiled here, for this type
        assert fn(1) == 2
    first = compiling.seconds()
    with bench.compile_timer() as again:
        assert fn(2) == 3               # compiled already
    assert first > 0 and again.seconds() == 0.0


def test_bench_table(capsys, tiny_model_path):
    code, out, err = run(capsys, "bench", "--model", str(tiny_model_path), "--prompt-tokens", "4",
                         "--decode-tokens", "2", "--repeats", "1")
    assert code == 0, err
    assert "prefill tok/s" in out and "decode tok/s" in out and "peak RSS" in out and "llamatrace" in out
    assert "limits on" in out and "GB/s of weights" in out and "of the read bandwidth" in out
    # the AMX peak beside the others where the tiles are available, and which prefill runs, and why
    assert ("of the AMX peak" in out) == ("AMX int8" in out) == amx.available().on
    assert f"AMX prefill: {amx.describe(())}" in " ".join(out.split())
    # the f32 engine's prefill against the float32 peak, not the int8 one
    flat = " ".join(out.split())
    assert (f"G/s ({probe.fma_isa()})" in flat) == ("of the float32 peak" in flat) == bool(probe.fma_isa())
    assert "llamatrace f32: prefill" in flat and "of the int8 peak" not in flat
    assert "peers:" not in flat                      # no peer ran: no peers' threads in the header


def test_bench_runs_each_activations_mode_as_an_engine(capsys, tiny_model_path):
    code, out, err = run(capsys, "bench", "--model", str(tiny_model_path), "--prompt-tokens", "4",
                         "--decode-tokens", "2", "--repeats", "1", "--threads", "1",
                         "--activations", "f32", "--activations", "q8", "--json")
    assert code == 0, err
    f32, q8 = json.loads(out)["results"]
    assert (f32["engine"], q8["engine"]) == ("llamatrace f32", "llamatrace q8")
    assert "f32 activations" in f32["version"] and "q8 activations" in q8["version"]
    assert len(q8["decode_tok_s"]) == 1 and q8["decode_tok_s"][0] > 0
    assert_one_line_error(*run(capsys, "bench", "-m", str(tiny_model_path), "--activations", "int4"),
                          "--activations int4", "f32, q8")


def test_bench_refuses_unknown_engines_and_bad_counts(capsys, tiny_model_path):
    assert_one_line_error(*run(capsys, "bench", "-m", str(tiny_model_path), "--against", "vllm"), "vllm", "llama.cpp")
    assert_one_line_error(*run(capsys, "bench", "-m", str(tiny_model_path), "--repeats", "0"), "--repeats")
    assert_one_line_error(*run(capsys, "bench", "-m", str(tiny_model_path), "--threads", "0"), "--threads 0")


def test_bench_says_how_to_install_a_missing_peer(capsys, tiny_model_path, monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llama_cpp" else real(name, *a))
    assert_one_line_error(*run(capsys, "bench", "-m", str(tiny_model_path), "--against", "llama.cpp"),
                          "llama-cpp-python is not installed", 'pip install -e ".[llamacpp]"')


def test_prompt_ids_avoid_the_special_tokens_and_repeat():
    ids = bench.prompt_ids(49152, 128)
    assert ids == bench.prompt_ids(49152, 128) and len(ids) == 128
    assert min(ids) >= 100 and max(ids) < 49152 - 300


def test_a_peer_killed_by_a_signal_is_named_and_sigill_says_rebuild():
    import signal
    ill = exit_reason("llama.cpp", -signal.SIGILL)
    assert "SIGILL" in ill and "GGML_NATIVE=ON" in ill and "\n" not in ill
    assert "killed by SIGKILL" in exit_reason("llama.cpp", -signal.SIGKILL)
    assert "exit code 1" in exit_reason("hf", 1)


def test_compare_probes_llamacpp_in_a_child_so_sigill_is_one_line(monkeypatch, tiny_model_path):
    """A llama.cpp built for instructions this CPU lacks must not kill our process."""
    import pytest

    from llamatrace.errors import PeerError
    from llamatrace.peers import llamacpp
    monkeypatch.setattr(llamacpp, "_PROBE", "import os, signal\nos.kill(os.getpid(), signal.SIGILL)\n")
    with pytest.raises(PeerError, match="SIGILL.*GGML_NATIVE=ON"):
        llamacpp.check_runs_here(str(tiny_model_path), 1)
    monkeypatch.setattr(llamacpp, "_PROBE", "import sys\nsys.exit(1)\n")
    llamacpp.check_runs_here(str(tiny_model_path), 1)     # other failures: reported by the real run


def test_a_prompt_longer_than_the_context_names_the_bench_options_not_ctx_size(capsys, tiny_model_path):
    code, out, err = run(capsys, "bench", "-m", tiny_model_path, "--prompt-tokens", "100000")
    assert_one_line_error(code, out, err, "--prompt-tokens 100000", "context length")
    assert "--ctx-size" not in err and "Error:" not in err
    # the tiny model holds 64 positions: with 64 decode steps, it is the decode tokens that must give way
    code, out, err = run(capsys, "bench", "-m", tiny_model_path, "--prompt-tokens", "1", "--decode-tokens", "64")
    assert_one_line_error(code, out, err, "use at most 55 decode tokens")
    code, out, err = run(capsys, "bench", "-m", tiny_model_path, "--prompt-tokens", "60", "--decode-tokens", "60")
    assert_one_line_error(code, out, err, "use at most 55 prompt tokens and 1 decode token")


def test_a_bench_child_that_died_before_a_send_is_named_not_a_broken_pipe(tiny_model_path):
    # issue 33: the send to a dead child raised BrokenPipeError, which the CLI took for a closed stdout
    from llamatrace.analysis.bench import _Worker
    from llamatrace.errors import PeerError
    child = _Worker("llamatrace", str(tiny_model_path), 1, 64)
    child.proc.kill()
    child.proc.join()
    with pytest.raises(PeerError, match="the llamatrace process was killed by SIGKILL"):
        child.run([1, 2, 3], 1)


SMAPS_ROLLUP = """\
55d4c8a6e000-7ffc1b7f1000 ---p 00000000 00:00 0                          [rollup]
Rss:             5123456 kB
Pss:             5120000 kB
Anonymous:        412000 kB
LazyFree:              0 kB
AnonHugePages:      6144 kB
ShmemPmdMapped:     2048 kB
FilePmdMapped:   4716544 kB
Shared_Hugetlb:        0 kB
Private_Hugetlb:       0 kB
"""


def test_huge_page_bytes_adds_the_anonymous_file_and_shared_2mib_mappings():
    # 6144 + 2048 + 4716544 kB (the 8B-shaped Q4_K_M file's packed weights mapped from the cache)
    assert bench.huge_page_bytes(SMAPS_ROLLUP) == (6144 + 2048 + 4716544) * 1024
    assert bench.huge_page_bytes("Rss: 10 kB\nHugetlb: 4 kB\n") == 0
    assert bench.process_huge_page_bytes() >= 0


SMAPS = """\
7f0000000000-7f0000200000 r--s 00000000 08:01 1234                       /models/a b.gguf
Size:               2048 kB
Rss:                1024 kB
Pss:                1024 kB
7f0000200000-7f0000300000 r--s 00200000 08:01 1234                       /models/a b.gguf
Rss:                 512 kB
7f0000300000-7f0000400000 rw-p 00000000 00:00 0
Rss:                 900 kB
7f0000400000-7f0000500000 r--s 00000000 08:01 99                         /models/a b.gguf.ltpack
Rss:                 700 kB
"""


def test_mapped_file_bytes_adds_the_rss_of_that_files_maps_only():
    assert bench.mapped_file_bytes(SMAPS, "/models/a b.gguf") == (1024 + 512) * 1024
    assert bench.mapped_file_bytes(SMAPS, "/models/a b.gguf.ltpack") == 700 * 1024
    assert bench.mapped_file_bytes(SMAPS, "/models/other.gguf") == 0


def test_our_decode_is_timed_as_the_peers_with_each_steps_sampling(monkeypatch, tiny_model_path):
    """A fake clock: each forward pass takes 10 s, each greedy pick 1 s. The peers' loops time a
    step's forward and argmax; ours must too (it timed only the forward passes)."""
    import time

    from llamatrace.model import sampling

    now = [0.0]
    monkeypatch.setattr(time, "perf_counter", lambda: now[0])
    engine = bench._Llamatrace(str(tiny_model_path), 1, 32, "f32")
    forward, pick = engine.model.forward, sampling.Sampler.__call__

    def slow_forward(*args, **kwargs):
        now[0] += 10.0
        return forward(*args, **kwargs)

    def slow_pick(self, logits):
        now[0] += 1.0
        return pick(self, logits)

    monkeypatch.setattr(engine.model, "forward", slow_forward)
    monkeypatch.setattr(sampling.Sampler, "__call__", slow_pick)
    assert engine.run([5, 6, 7], 4) == (11.0, 44.0)


def test_ratios_to_llamacpp_pair_the_runs_of_a_round(capsys, monkeypatch, tiny_model_path):
    """Round by round, each engine's rate over llama.cpp's of the same round: the JSON's lists and the
    table's line (llama.cpp stood in for by a second llamatrace engine, renamed)."""
    real = bench.run_bench

    def with_a_peer(*args, **kwargs):
        report = real(*args, **kwargs)
        ours, peer = report.results
        peer.engine = "llama.cpp"
        # the ratio of the medians (prefill 2 / 1) is not the median of the rounds' ratios (1.0)
        ours.prefill_tok_s, peer.prefill_tok_s = [1.0, 2.0, 3.0], [1.0, 4.0, 1.0]
        ours.decode_tok_s, peer.decode_tok_s = [2.0, 2.0, 2.0], [1.0, 2.0, 8.0]
        return report

    monkeypatch.setattr(bench, "run_bench", with_a_peer)
    args = ("bench", "-m", str(tiny_model_path), "--prompt-tokens", "4", "--decode-tokens", "2", "--repeats", "1",
            "--threads", "1", "--activations", "f32", "--activations", "q8")
    code, out, err = run(capsys, *args, "--json")
    assert code == 0, err
    ours, peer = json.loads(out)["results"]
    assert ours["per_round_vs_llama_cpp"] == {"prefill": [1.0, 0.5, 3.0], "decode": [2.0, 1.0, 0.25]}
    assert "per_round_vs_llama_cpp" not in peer
    code, out, err = run(capsys, *args)
    assert code == 0, err
    flat = " ".join(out.split())
    assert "2.00 / 1.00" in flat and "1.00 / 1.00" in flat   # the table: ratios of the medians (llama.cpp's own 1)
    assert ("llamatrace f32 ÷ llama.cpp round by round (each run against llama.cpp's of the same round): "
            "prefill 1.00 (0.50–3.00), decode 1.00 (0.25–2.00)") in flat


def test_q8_on_a_file_without_int8_products_is_held_against_the_float32_peak(capsys, tmp_path):
    """q8 rounds activations only before the matmuls of Q4_0 … MXFP4 weights: on an F32 file its
    products are float32 ones, and the int8 peak said '1 %' of a limit that was never its own."""
    from gguf_factory import T, write_tiny_llama
    path = write_tiny_llama(tmp_path / "f32.gguf", qtype=T.F32)
    code, out, err = run(capsys, "bench", "-m", path, "--activations", "q8", "--prompt-tokens", "4",
                         "--decode-tokens", "2", "--repeats", "1")
    assert code == 0, err
    flat = " ".join(out.split())
    assert "of the int8 peak" not in flat
    if probe.fma_isa():
        assert "of the float32 peak: no F32 matrix has an int8 product" in flat
