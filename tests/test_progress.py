"""``cli.progress.CountBar``'s log lines: the time left from the pace after the workers' first units,
never from the start-up before them (a model load, workers or Ray actors starting)."""

from __future__ import annotations

from types import SimpleNamespace

from llamatrace.cli import progress as P


def _lines(monkeypatch, parallel: int, events: list[tuple[float, int]], total: int) -> list[str]:
    """The status lines of a bar fed ``(time, done)`` updates after a start at time 0."""
    clock = iter([0.0] + [t for t, _ in events])
    monkeypatch.setattr(P, "time", SimpleNamespace(perf_counter=lambda: next(clock)))
    lines: list[str] = []
    monkeypatch.setattr(P, "status", lines.append)
    bar = P.CountBar("imatrix m.gguf", "chunks", "evaluated", parallel=parallel)
    bar.lines = True                     # as in a log: no terminal
    bar.update(0, total)
    for _, done in events:
        bar.update(done, total)
    return lines


def test_four_workers_first_results_arrive_together_and_start_the_pace(monkeypatch):
    # 10 s of start-up, then 4 chunks every 2 s (one per worker): 0.5 s a chunk
    events = [(10.0 + 2 * (i // 4) + 0.001 * (i % 4), i + 1) for i in range(40)]
    lines = _lines(monkeypatch, 4, events, 40)
    assert lines[0] == "evaluated 4 of 40 chunks (10 %) in 0:10"            # the first batch: no pace yet
    assert lines[1] == "evaluated 8 of 40 chunks (20 %) in 0:12, about 0:16 left"   # 32 × 0.5 s
    assert lines[-1].startswith("evaluated 36 of 40 chunks (90 %) in 0:26, about 0:02 left")


def test_one_worker_starts_the_pace_at_its_first_unit(monkeypatch):
    # 30 s to load, then a chunk every 3 s: the old estimate, from the start, said 2:15 left after one
    events = [(30.0 + 3 * i, i + 1) for i in range(10)]
    lines = _lines(monkeypatch, 1, events, 10)
    assert lines[0] == "evaluated 1 of 10 chunks (10 %) in 0:30"
    assert lines[1] == "evaluated 2 of 10 chunks (20 %) in 0:33, about 0:24 left"   # 8 × 3 s


def test_a_detail_ends_the_log_line(monkeypatch):
    clock = iter([0.0, 3.0, 6.0])
    monkeypatch.setattr(P, "time", SimpleNamespace(perf_counter=lambda: next(clock)))
    lines: list[str] = []
    monkeypatch.setattr(P, "status", lines.append)
    bar = P.CountBar("perplexity m.gguf", "chunks", "m.gguf: evaluated", detail=True)
    bar.lines = True
    bar.update(0, 4, "PPL …")
    bar.update(1, 4, "PPL 12.5000")
    bar.update(2, 4, "PPL 11.2500")
    assert lines == ["m.gguf: evaluated 1 of 4 chunks (25 %) in 0:03 · PPL 12.5000",
                     "m.gguf: evaluated 2 of 4 chunks (50 %) in 0:06, about 0:06 left · PPL 11.2500"]


def test_perplexity_and_collect_say_how_far_they_are_in_a_log(capsys, tiny_model_path, tmp_path, monkeypatch):
    """Their bars drew nothing when stderr was no terminal (a log, nohup, CI): a whole run in silence."""
    from pathlib import Path
    monkeypatch.delenv("LLAMATRACE_QUIET")              # the suite's quiet turns status lines off

    from cli_helpers import run
    corpus = Path(__file__).parent / "golden" / "corpus.txt"
    code, out, err = run(capsys, "perplexity", "-f", corpus, "-m", tiny_model_path, "-c", "16", "--chunks", "10")
    assert code == 0, err
    assert f"{Path(tiny_model_path).name}: evaluated 5 of 10 chunks (50 %)" in err and " · PPL " in err, err
    code, out, err = run(capsys, "collect", "-f", corpus, "-m", tiny_model_path, "--hook", "l_out@0",
                         "--ctx-size", "16", "--shard-mb", "0.01", "-o", tmp_path / "acts")
    assert code == 0, err
    assert "collected " in err and " tokens (50 %) in " in err and " tok/s" in err, err
