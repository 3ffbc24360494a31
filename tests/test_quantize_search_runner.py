"""The recipe search's measurements on the corpus runner: `--workers` and `--ray` measure what one
process measures (the same floats: each group is computed by the same code on the same inputs),
and write the same file; Ctrl-C and a killed driver keep what was measured, and the same command
resumes, measuring only the groups that are missing.

The reference is the one-process run (whose measurements tests/test_quantize_search.py checks
against ggml's quantizers and the written file): here what is tested is that distributing and
interrupting the work changes nothing.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from cli_helpers import run
from gguf_factory import T, write_tiny_llama

from llamatrace.quantize import search as S

REPO = Path(__file__).resolve().parents[1]
CORPUS = Path(__file__).parent / "golden" / "corpus.txt"
N_GROUPS = 16                      # 2 layers × 7 matrices, the embedding, the output


@pytest.fixture(scope="module")
def tiny_base(tmp_path_factory) -> Path:
    """A tiny F16 llama (2 layers, dim 64, untied output)."""
    return write_tiny_llama(tmp_path_factory.mktemp("search-runner") / "tiny-f16.gguf", qtype=T.F16, tied=False)


def args(base: Path, out: Path, *extra) -> list:
    return ["quantize", base, out, "--target-bpw", "6", "-f", CORPUS, "--ctx-size", 32, "--chunks", 2,
            "--candidates", "Q4_0,Q5_0,Q8_0", "--json", *extra]


def saved(out: Path) -> dict:
    """The measurements file the search keeps beside OUT."""
    return json.loads(out.with_name(out.name + ".measurements.json").read_text())


def quantize(capsys, base: Path, out: Path, *extra) -> tuple[dict, bytes, dict]:
    code, stdout, err = run(capsys, *args(base, out, *extra))
    assert code == 0, err
    return json.loads(stdout), out.read_bytes(), saved(out)


@pytest.fixture(scope="module")
def reference(tiny_base, tmp_path_factory) -> tuple[bytes, dict]:
    """One undisturbed in-process run: OUT's bytes, its measurements file."""
    from llamatrace.cli import main
    out = tmp_path_factory.mktemp("reference") / "out.gguf"
    assert main([str(a) for a in args(tiny_base, out)]) == 0
    return out.read_bytes(), saved(out)


def test_workers_and_ray_measure_and_write_what_one_process_does(tiny_base, reference, tmp_path, capsys,
                                                                 monkeypatch):
    one_bytes, one = reference
    assert len(one["delta"]) == N_GROUPS and one["base_kld"] is not None
    doc, two_bytes, two = quantize(capsys, tiny_base, tmp_path / "two.gguf", "--workers", "2")
    assert doc["measurements"]["measured"] == N_GROUPS and doc["measurements"]["workers"] == 2
    assert two == one                                  # every ΔKLD and the base KLD: the same floats
    assert two_bytes == one_bytes
    monkeypatch.setenv("RAY_ADDRESS", "127.0.0.1:1")   # `local` starts a cluster here whatever it says
    _, ray_bytes, on_ray = quantize(capsys, tiny_base, tmp_path / "ray.gguf", "--workers", "2", "--ray", "local")
    assert on_ray == one and ray_bytes == one_bytes


def test_ctrl_c_keeps_the_measurements_and_the_same_command_resumes(tiny_base, reference, tmp_path, capsys,
                                                                    monkeypatch):
    """Ctrl-C (a KeyboardInterrupt where the 6th group is measured) → exit 130, the 5 measured
    groups kept; the rerun measures the other 11 and writes the reference's file."""
    one_bytes, one = reference
    out = tmp_path / "out.gguf"
    measure_group, calls = S.measure_group, []

    def interrupted_at_the_sixth(*a, **k):
        calls.append(1)
        if len(calls) == 6:
            raise KeyboardInterrupt
        return measure_group(*a, **k)

    monkeypatch.setattr(S, "measure_group", interrupted_at_the_sixth)
    code, stdout, err = run(capsys, *args(tiny_base, out))
    assert code == 130 and stdout == ""
    assert "interrupted" in err and f"5 of {N_GROUPS} matrices measured" in err, err
    assert not out.exists()
    kept = saved(out)
    assert len(kept["delta"]) == 5 and kept["base_kld"] == one["base_kld"]
    assert kept["delta"] == {g: one["delta"][g] for g in kept["delta"]}
    monkeypatch.setattr(S, "measure_group", measure_group)
    doc, again_bytes, again = quantize(capsys, tiny_base, out)
    assert (doc["measurements"]["measured"], doc["measurements"]["resumed"]) == (N_GROUPS - 5, 5)
    assert again == one and again_bytes == one_bytes


def test_a_killed_driver_with_workers_is_resumed_by_the_same_command(tiny_base, reference, tmp_path):
    """The driver SIGKILLed when group 3's result arrives (fault point ``done``): the groups it
    had saved are kept; the rerun on 2 workers measures only the rest and writes the same file."""
    one_bytes, one = reference
    out = tmp_path / "out.gguf"
    cli = [sys.executable, "-m", "llamatrace", *[str(a) for a in args(tiny_base, out, "--workers", "2")]]
    once = tmp_path / "fired"
    env = {**os.environ, "PYTHONPATH": str(REPO), "LLAMATRACE_FAULT": "done:3:kill", "LLAMATRACE_FAULT_ONCE": str(once)}
    proc = subprocess.Popen(cli, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            start_new_session=True)
    _, err = proc.communicate(timeout=600)
    try:
        os.killpg(proc.pid, signal.SIGKILL)            # its workers, which a SIGKILLed driver could not stop
    except ProcessLookupError:
        pass
    assert once.exists() and proc.returncode == -signal.SIGKILL, err
    # groups 0-2 at most, saved in group order: none (no file yet) when group 3 came back first
    kept = saved(out) if out.with_name(out.name + ".measurements.json").exists() else {"delta": {}}
    k = len(kept["delta"])
    assert k <= 3 and not out.exists()
    assert kept["delta"] == {g: one["delta"][g] for g in kept["delta"]}
    again = subprocess.run(cli, capture_output=True, text=True, timeout=600,
                           env={**os.environ, "PYTHONPATH": str(REPO)})
    assert again.returncode == 0, again.stderr
    doc = json.loads(again.stdout)
    assert (doc["measurements"]["measured"], doc["measurements"]["resumed"]) == (N_GROUPS - k, k)
    assert saved(out) == one and out.read_bytes() == one_bytes
