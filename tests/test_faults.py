"""Fault injection (issue 33): `perplexity` and `collect` with `--workers 2` and on a local Ray
cluster, a party SIGKILLed at each point of its life, the disk full, an actor without the model.

Every case ends in one of two ways: exit 0 with results byte-identical to an undisturbed
`--workers 1` run, or a non-zero exit (one `error:` line naming the cause, or the driver's own
SIGKILL) after which the same command, rerun, completes identically. The kills happen at the
named points of :mod:`llamatrace.corpus.faults` (``LLAMATRACE_FAULT``), never after a sleep; each
fires once (``LLAMATRACE_FAULT_ONCE``), and the test checks that it did fire.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from cli_helpers import one_error_line
from llamatrace.cli import main

pytestmark = pytest.mark.model

REPO = Path(__file__).resolve().parents[1]
CORPUS = Path(__file__).parent / "golden" / "corpus.txt"
TIMINGS = {"seconds", "tokens_per_s", "workers", "threads", "ray", "tokens_made"}
# 3 chunks of 64 tokens; 3 shards of 2 sequences of 32 tokens (one cheap hook: one block runs)
PERPLEXITY = ["perplexity", "-f", str(CORPUS), "-c", "64", "--chunks", "3", "--json"]
COLLECT = ["collect", "--hook", "blocks.0.hook_resid_post", "--ctx-size", "32", "--shard-mb", "0.2", "--json"]
WORKERS = ["--workers", "2"]


@pytest.fixture(scope="module")
def small_corpus(tmp_path_factory) -> Path:
    """Six sequences of 32 tokens for `collect` (the first lines of the perplexity corpus)."""
    path = tmp_path_factory.mktemp("corpus") / "corpus.txt"
    path.write_text(CORPUS.read_text(encoding="utf-8")[:1000], encoding="utf-8")
    return path


def command(name: str, small_corpus: Path, out: Path | None, model: Path) -> list[str]:
    base = PERPLEXITY if name == "perplexity" else [*COLLECT, "-f", str(small_corpus), "-o", str(out)]
    return [*base, "-m", str(model)]


def result(name: str, stdout: str, out: Path | None) -> dict:
    """What must not change: the JSON's results (not timings), and every file of a collection."""
    summary = {k: v for k, v in json.loads(stdout).items() if k not in TIMINGS | {"output"}}
    if name == "collect":
        summary["files"] = {str(p.relative_to(out)): p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file()}
    return summary


@pytest.fixture(scope="module")
def reference(small_corpus, smollm2_path, tmp_path_factory) -> dict:
    """One undisturbed in-process `--workers 1` run of each command."""
    import io
    from contextlib import redirect_stdout
    want = {}
    for name in ("perplexity", "collect"):
        out = tmp_path_factory.mktemp("ref") / "acts"
        buffer = io.StringIO()
        with redirect_stdout(buffer):
            assert main(command(name, small_corpus, out, smollm2_path)) == 0
        want[name] = result(name, buffer.getvalue(), out)
    assert len(want["collect"]["files"]) == 1 + want["collect"]["n_shards"] and want["collect"]["n_shards"] == 3
    return want


@pytest.fixture(scope="module")
def ray_cluster():
    """A local Ray cluster (2 CPUs) for the module: in-process runs use it (`--ray local` finds
    Ray initialised); subprocess drivers join it with `--ray auto` and RAY_ADDRESS."""
    import ray

    from llamatrace.corpus.ray_runner import quiet_error_listener
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, logging_level="ERROR")
    undo = quiet_error_listener()            # as the CLI does when it starts Ray: stdout is for data
    yield ray.get_runtime_context().gcs_address
    ray.shutdown()
    undo()


def runner_args(runner: str, request) -> tuple[list[str], dict]:
    if runner == "workers":
        return WORKERS, {}
    address = request.getfixturevalue("ray_cluster")
    return [*WORKERS, "--ray", "auto"], {"RAY_ADDRESS": address}


def arm(monkeypatch, tmp_path, fault: str) -> Path:
    once = tmp_path / "fired"
    monkeypatch.setenv("LLAMATRACE_FAULT", fault)
    monkeypatch.setenv("LLAMATRACE_FAULT_ONCE", str(once))
    return once


def run_here(capsys, args: list[str]) -> tuple[int, str, str]:
    code = main(args)
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def run_cli(args: list[str], env: dict, stdout=subprocess.PIPE, cwd: Path | None = None) -> subprocess.CompletedProcess:
    """`llamatrace ARGS` as a process of its own (its own session: nothing it starts outlives it), in ``cwd``."""
    proc = subprocess.Popen([sys.executable, "-m", "llamatrace", *args], stdout=stdout, stderr=subprocess.PIPE,
                            text=True, env={**os.environ, "PYTHONPATH": str(REPO), **env}, start_new_session=True,
                            cwd=cwd)
    out, err = proc.communicate(timeout=600)
    try:
        os.killpg(proc.pid, signal.SIGKILL)           # what a SIGKILLed driver could not stop
    except ProcessLookupError:
        pass
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def assert_rerun_completes(name, args, out, env, reference) -> None:
    again = run_cli(args, env)
    assert again.returncode == 0, again.stderr
    assert result(name, again.stdout, out) == reference[name]


# ---- a worker or actor killed: the run completes, identical ------------------------------------
WORKER_KILLS = [("perplexity", "load:*:kill"), ("perplexity", "compute:1:kill"), ("perplexity", "done:0:kill-worker"),
                ("collect", "load:*:kill"), ("collect", "compute:1:kill"), ("collect", "done:0:kill-worker"),
                ("collect", "shard:1:kill"), ("collect", "manifest:1:kill-worker")]


@pytest.mark.parametrize("runner", ["workers", "ray"])
@pytest.mark.parametrize("name,fault", WORKER_KILLS)
def test_a_killed_worker_costs_a_retry_not_a_chunk(name, fault, runner, request, reference, small_corpus,
                                                   smollm2_path, tmp_path, monkeypatch, capsys):
    extra, env = runner_args(runner, request)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    once = arm(monkeypatch, tmp_path, fault)
    out = tmp_path / "acts"
    code, stdout, err = run_here(capsys, [*command(name, small_corpus, out, smollm2_path), *extra])
    assert once.exists(), f"{fault} never fired"
    assert code == 0, err
    assert result(name, stdout, out) == reference[name]


# ---- the driver killed: the rerun completes, identical ------------------------------------------
DRIVER_KILLS = [("perplexity", "send:0:kill"), ("perplexity", "sent:1:kill"), ("perplexity", "done:0:kill"),
                ("collect", "send:0:kill"), ("collect", "sent:1:kill"), ("collect", "done:0:kill"),
                ("collect", "manifest:1:kill")]


@pytest.mark.parametrize("runner", ["workers", "ray"])
@pytest.mark.parametrize("name,fault", DRIVER_KILLS)
def test_a_killed_driver_is_resumed_by_the_same_command(name, fault, runner, request, reference, small_corpus,
                                                        smollm2_path, tmp_path):
    extra, env = runner_args(runner, request)
    out = tmp_path / "acts"
    args = [*command(name, small_corpus, out, smollm2_path), *extra]
    once = tmp_path / "fired"
    killed = run_cli(args, {**env, "LLAMATRACE_FAULT": fault, "LLAMATRACE_FAULT_ONCE": str(once)}, cwd=tmp_path)
    assert once.exists() and killed.returncode == -signal.SIGKILL, killed.stderr
    assert killed.stdout == ""
    if name == "perplexity" and fault != "sent:1:kill":
        # it keeps no state: nothing on stdout (above) or where it ran, and its rerun is a fresh run, checked once
        assert sorted(p.name for p in tmp_path.iterdir()) == ["fired"]
        return
    assert_rerun_completes(name, args, out, env, reference)


# ---- the disk full: one error line, then the rerun completes ------------------------------------
@pytest.mark.parametrize("runner", ["workers", "ray"])
@pytest.mark.parametrize("fault", ["shard:1:enospc", "manifest:1:enospc"])
def test_a_full_disk_under_collect_is_one_error_line_and_a_rerun_completes(fault, runner, request, reference,
                                                                           small_corpus, smollm2_path, tmp_path,
                                                                           monkeypatch, capsys):
    extra, env = runner_args(runner, request)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    out = tmp_path / "acts"
    args = [*command("collect", small_corpus, out, smollm2_path), *extra]
    once = arm(monkeypatch, tmp_path, fault)
    code, stdout, err = run_here(capsys, args)
    assert once.exists() and code == 2, err
    assert "No space left on device" in one_error_line(err) and stdout == ""
    monkeypatch.delenv("LLAMATRACE_FAULT")
    code, stdout, err = run_here(capsys, args)
    assert code == 0, err
    assert result("collect", stdout, out) == reference["collect"]


@pytest.mark.parametrize("runner", ["workers", "ray"])
def test_a_full_disk_under_perplexity_is_one_error_line_and_a_rerun_completes(runner, request, reference,
                                                                              smollm2_path, tmp_path):
    extra, env = runner_args(runner, request)
    args = [*command("perplexity", None, None, smollm2_path), *extra]
    with open("/dev/full", "w") as full:                 # its output goes to stdout: a full device
        failed = run_cli(args, env, stdout=full)
    assert failed.returncode == 2
    assert "No space left on device" in one_error_line(failed.stderr)
    assert_rerun_completes("perplexity", args, None, env, reference)


# ---- an actor that cannot load the model: its node and the cause ---------------------------------
@pytest.mark.parametrize("name", ["perplexity", "collect"])
def test_a_ray_actor_without_the_model_names_its_node_and_the_cause(name, ray_cluster, reference, small_corpus,
                                                                    smollm2_path, tmp_path, monkeypatch, capsys):
    import socket
    out = tmp_path / "acts"
    args = [*command(name, small_corpus, out, smollm2_path), *WORKERS, "--ray", "local"]
    monkeypatch.setenv("LLAMATRACE_FAULT", "load:*:missing")      # every actor: the model is not on its node
    code, stdout, err = run_here(capsys, args)
    line = one_error_line(err)
    assert code == 2 and "model file not found" in line and f"Ray node {socket.gethostname()}" in line, err
    monkeypatch.delenv("LLAMATRACE_FAULT")
    code, stdout, err = run_here(capsys, args)
    assert code == 0, err
    assert result(name, stdout, out) == reference[name]
