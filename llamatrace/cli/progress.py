"""Progress of a long job counted in units (the matrices ``quantize -f`` measures, the chunks
``imatrix``, ``expert-load`` and ``perplexity`` run, the tokens ``collect`` makes): a bar on a
terminal, and in a log or a pipe, where no bar is drawn, a status line now and then
(:class:`CountBar`). Both are status lines (:mod:`llamatrace.cli.app`): ``--quiet`` turns them off."""

from __future__ import annotations

import time

from llamatrace.cli.app import err, quiet, status, status_bar


def clock(seconds: float) -> str:
    """``m:ss``, or ``h:mm:ss`` from an hour."""
    m, s = divmod(int(round(seconds)), 60)
    return f"{m // 60}:{m % 60:02d}:{s:02d}" if m >= 60 else f"{m}:{s:02d}"


class CountBar:
    """A transient progress bar of the units done, with the time spent and the time left (what
    rich estimates from the recent pace). In a log or a pipe, where no bar is drawn, a status
    line instead at each tenth of the total and at least every :attr:`LOG_EVERY_S` seconds
    (``measured 22 of 211 matrices (10 %) in 1:45, about 15:10 left``: the time left at the pace
    so far); none at the end, where the command's summary follows. Use it as a ``with`` block.

    The first :meth:`update` starts the clock; what is done by then (resumed from an earlier run)
    counts as done, not in the pace. The time left is the pace from the first units done (the
    first of each of ``parallel`` workers, which arrive together) to the last: the start-up before
    them, a model load or workers starting, is no part of it, so a line gives none until more have
    come.

    Attributes:
        done, total: the last :meth:`update`'s.
        ran: units done since the first :meth:`update` (by this run).
    """

    LOG_EVERY_S = 30.0

    def __init__(self, title: str, unit: str, verb: str, parallel: int = 1, detail: bool = False) -> None:
        """``title`` heads the bar (``Measuring base.gguf``), ``unit`` follows the count
        (``matrices``), ``verb`` starts a log line (``measured``); ``parallel``: the workers the
        units are made by; ``detail``: a column for :meth:`update`'s ``detail`` (``PPL 12.3``),
        which the log lines end with too."""
        from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeElapsedColumn, TimeRemainingColumn
        extra = [TextColumn("{task.fields[detail]}", markup=False)] if detail else []
        self.progress = status_bar(TextColumn("{task.description}", markup=False), BarColumn(), MofNCompleteColumn(),
                                   TextColumn(unit, markup=False), *extra, TimeElapsedColumn(), TimeRemainingColumn())
        self.title, self.unit, self.verb, self.detail = title, unit, verb, detail
        self.lines = not quiet() and not err.is_terminal
        self.task = None
        self.done = self.total = self.ran = 0
        self.t0 = self.last_line = 0.0
        self.parallel = max(1, parallel)
        self.first: tuple[float, int] | None = None      # (when, ran) once each worker's first unit is done

    def update(self, done: int, total: int, detail: str = "") -> None:
        """``done`` of ``total`` units are done (a ``progress(done, total)`` callback); ``detail``:
        what the bar's detail column shows now."""
        now = time.perf_counter()
        fields = {"detail": detail} if self.detail else {}
        if self.task is None:
            self.task = self.progress.add_task(self.title, total=total, completed=done, **fields)
            self.t0 = self.last_line = now
        else:
            self.ran += done - self.done
            if self.first is None and self.ran >= min(self.parallel, total - done + self.ran):
                self.first = (now, self.ran)
            self.progress.update(self.task, completed=done, **fields)
            tenth = total > 0 and done * 10 // total > self.done * 10 // total
            if self.lines and self.ran > 0 and done < total and (tenth or now - self.last_line >= self.LOG_EVERY_S):
                since, ran_then = self.first or (now, self.ran)
                left = f", about {clock((now - since) / (self.ran - ran_then) * (total - done))} left" \
                    if self.ran > ran_then else ""
                status(f"{self.verb} {done} of {total} {self.unit} ({100 * done // total} %) "
                       f"in {clock(now - self.t0)}{left}" + (f" · {detail}" if detail else ""))
                self.last_line = now
        self.done, self.total = done, total

    def __enter__(self) -> "CountBar":
        self.progress.start()
        return self

    def __exit__(self, *exc) -> None:
        self.progress.stop()
