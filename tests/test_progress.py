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
