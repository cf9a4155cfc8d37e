"""A warm's progress on stderr: a bar for a person at a terminal, log lines for a pipe or a CI log, or nothing.

Lines suit a log: one per job done and, while a long layer runs, one every ``every`` seconds, each with tiles
done/total, the encode rate and the ETA; a line also says when the first job's preparation starts (reading its
weights and setting the encoder up can take many seconds before the first tile). stdout is never touched, so
``--json`` keeps it one JSON document.
"""

from __future__ import annotations

import threading
import time
from typing import Callable, Optional

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, ProgressColumn, SpinnerColumn
from rich.progress import TimeRemainingColumn
from rich.table import Column
from rich.text import Text

__all__ = ["PROGRESS_MODES", "LINE_EVERY_S", "progress_mode", "make_progress", "WarmProgress", "LineProgress",
           "BarProgress", "clock_text"]

PROGRESS_MODES = ("auto", "bar", "lines", "none")
LINE_EVERY_S = 30.0  # lines mode: a status line at least this often while jobs run


def progress_mode(choice: str, *, terminal: bool, quiet: bool) -> str:
    """The mode to use: ``auto`` is a bar on a terminal and lines otherwise, and nothing under ``--quiet``.

    >>> progress_mode("auto", terminal=False, quiet=False), progress_mode("auto", terminal=True, quiet=True)
    ('lines', 'none')
    """
    if choice not in PROGRESS_MODES:
        raise ValueError(f"progress mode must be one of {', '.join(PROGRESS_MODES)}, got {choice!r}")
    if choice != "auto":
        return choice
    if quiet:
        return "none"
    return "bar" if terminal else "lines"


def clock_text(seconds: Optional[float]) -> str:
    """A duration for a log line: ``45 s``, ``12 min 5 s``, ``3 h 20 min``; ``?`` when unknown.

    >>> clock_text(45.2), clock_text(725), clock_text(12000), clock_text(None)
    ('45 s', '12 min 5 s', '3 h 20 min', '?')
    """
    if seconds is None:
        return "?"
    s = int(round(seconds))
    if s < 60:
        return f"{s} s"
    if s < 3600:
        return f"{s // 60} min {s % 60} s"
    return f"{s // 3600} h {s % 3600 // 60} min"


def _job_name(job) -> str:
    return f"{job.prefix} tp{job.tp_size}-rank{job.tp_rank}"


class WarmProgress:
    """What a warm tells its progress display; this base shows nothing (``--progress none``)."""

    def begin(self, jobs: list) -> None:
        """The jobs this process will run (their tiles are the total)."""

    def started(self, job) -> None:
        """``job`` starts (its weights are read and, the first time, the encoder set up)."""

    def tiles(self, job, n: int) -> None:
        """``n`` more tiles of ``job`` are quantized."""

    def done(self, job, result) -> None:
        """``job`` ended with ``result`` (hit, encoded or failed)."""

    def end(self) -> None:
        """The warm is over (also after an error): stop drawing."""


class _Counts:
    """Tiles done and the encode rate, shared by both displays."""

    def __init__(self, clock: Callable[[], float]) -> None:
        self.clock = clock
        self.total = self.done_tiles = self.encoded_tiles = self.jobs = self.jobs_done = 0
        self.start = clock()
        self.partial: dict[str, int] = {}  # tiles seen inside a running encode, per job digest

    def begin(self, jobs: list) -> None:
        self.total, self.jobs, self.start = sum(j.tiles for j in jobs), len(jobs), self.clock()

    def tiles(self, job, n: int) -> int:
        """Count ``n`` reported tiles of a running ``job``, at most up to one short of its tiles: its last tile
        counts when the job is done, so the tile count reaches the total only with the last job (an encoder that
        reports more tiles than the plan's, e.g. padding, never runs ahead). Returns the tiles counted."""
        seen = self.partial.get(job.digest, 0)
        n = max(0, min(n, job.tiles - 1 - seen))
        self.partial[job.digest] = seen + n
        self.done_tiles += n
        self.encoded_tiles += n
        return n

    def done(self, job, result) -> int:
        rest = max(0, job.tiles - self.partial.pop(job.digest, 0))  # hits, failures, encodes without tile reports
        self.done_tiles += rest
        if result.status == "encoded":
            self.encoded_tiles += rest
        self.jobs_done += 1
        return rest

    def status(self) -> str:
        elapsed = self.clock() - self.start
        rate = self.encoded_tiles / elapsed if elapsed > 0 and self.encoded_tiles else None
        left = self.total - self.done_tiles
        eta = left / rate if rate else (0.0 if left == 0 else None)
        pct = 100.0 * self.done_tiles / self.total if self.total else 100.0
        rate_text = f"{rate:,.0f} tiles/s" if rate else "? tiles/s"
        return (f"{self.done_tiles:,}/{self.total:,} tiles ({pct:.0f}%), {rate_text}, "
                f"elapsed {clock_text(elapsed)}, ETA {clock_text(eta)}")


class LineProgress(WarmProgress):
    """Log lines on ``console``: one per job done, one when the first job starts, and a status line when
    ``every`` seconds passed without one (printed by a background thread, so a long layer shows life)."""

    def __init__(self, console: Console, every: float = LINE_EVERY_S, clock: Callable[[], float] = time.monotonic,
                 beat_thread: bool = True) -> None:
        self.console, self.every = console, every
        self.counts = _Counts(clock)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._last_line = clock()
        self._current = None
        self._first = True
        self._beat_thread = beat_thread

    def _print(self, text: str) -> None:
        with self._lock:
            self.console.print(Text(text), highlight=False, soft_wrap=True)
            self._last_line = self.counts.clock()

    def _prefix(self) -> str:
        return f"[{self.counts.jobs_done}/{self.counts.jobs} jobs]"

    def begin(self, jobs: list) -> None:
        self.counts.begin(jobs)
        self._last_line = self.counts.clock()
        if self._beat_thread and self.every > 0 and jobs:
            self._thread = threading.Thread(target=self._beat, name="exl3tool-progress", daemon=True)
            self._thread.start()

    def started(self, job) -> None:
        self._current = job
        if self._first:
            self._first = False
            self._print(f"{self._prefix()} preparing {_job_name(job)} ({job.tiles:,} tiles): reading its weights "
                        "and setting the encoder up")

    def tiles(self, job, n: int) -> None:
        with self._lock:
            self.counts.tiles(job, n)

    def done(self, job, result) -> None:
        with self._lock:
            self.counts.done(job, result)
        took = f" in {result.seconds:.1f} s" if result.seconds else ""
        error = f": {result.error}" if result.error else ""
        self._print(f"{self._prefix()} {result.status} {_job_name(job)}{took}{error}; {self.counts.status()}")

    def _beat(self) -> None:
        while not self._stop.wait(min(1.0, self.every)):
            self.beat()

    def beat(self) -> bool:
        """Print a status line if ``every`` seconds passed since the last line; whether it did."""
        if self.counts.clock() - self._last_line < self.every:
            return False
        job = self._current
        what = f"working on {_job_name(job)}" if job is not None else "preparing"
        with self._lock:
            status = self.counts.status()
        self._print(f"{self._prefix()} {what}; {status}")
        return True

    def end(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)


class _RateColumn(ProgressColumn):
    """Encoding rate in tiles per second."""

    def render(self, task) -> Text:
        return Text(f"{task.speed:,.0f} tiles/s" if task.speed else "", style="cyan")


class EndOfName:
    """A job name drawn in the width it is given, its START elided (``…layers.61.mlp.experts.7.down_proj
    tp8-rank3``): every layer of a model shares its first words, the end tells them apart."""

    def __init__(self, text: str, head: str = "") -> None:
        self.text, self.head = text, head  # ``head`` (``preparing ``) is always shown whole

    def __rich_console__(self, console, options):
        room = options.max_width
        # the head only when the name's end still fits beside it (never "preparing …_proj"): the name comes first
        head = self.head if room - len(self.head) >= min(len(self.text), NAME_END) else ""
        yield Text(head + elide_start(self.text, room - len(head)), no_wrap=True, overflow="crop")

    def __rich_measure__(self, console, options):
        from rich.measure import Measurement

        return Measurement(len(self.head) + min(len(self.text), 8), len(self.head) + len(self.text))


NAME_END = 24  # what a job name needs to be told apart: ``mlp.down_proj tp8-rank3``


def elide_start(text: str, width: int) -> str:
    """``text`` in ``width`` characters: whole when it fits, else ``…`` and its end, from a name's part (after a
    ``.``) when one starts in the last ``width`` characters.

    >>> elide_start("language_model.model.layers.12.mlp.down_proj tp2-rank1", 30)
    '…12.mlp.down_proj tp2-rank1'
    """
    if len(text) <= width:
        return text
    if width <= 0:
        return ""
    end = text[len(text) - max(width - 1, 0):]
    dot = end.find(".")
    return "…" + (end[dot + 1:] if 0 <= dot < len(end) - 1 else end)


class _NameColumn(ProgressColumn):
    """The job's name, start elided to the column's width."""

    def render(self, task) -> EndOfName:
        return EndOfName(task.description, task.fields.get("head", ""))


class _JobsColumn(ProgressColumn):
    """Jobs done / total."""

    def render(self, task) -> Text:
        return Text(f"{task.fields.get('jobs_done', 0)}/{task.fields.get('jobs', 0)} jobs", style="green")


class BarProgress(WarmProgress):
    """A Rich bar on ``console`` that fits its width: the job name loses its start (shared by every layer), never
    the figures; jobs done/total beside tiles done/total; it says "preparing" until a job's first tiles arrive."""

    def __init__(self, console: Console) -> None:
        # below 100 columns the rate goes, below 80 the bar: the job name's end keeps room to be read
        columns = [SpinnerColumn(), _NameColumn(table_column=Column(ratio=1, no_wrap=True, min_width=8)),
                   *([BarColumn(bar_width=12)] if console.width >= 80 else []), _JobsColumn(), MofNCompleteColumn(),
                   *([_RateColumn()] if console.width >= 100 else []), TimeRemainingColumn()]
        self.progress = Progress(*columns, console=console, transient=True, expand=True)
        self.task = None
        self.counts = _Counts(time.monotonic)

    def begin(self, jobs: list) -> None:
        self.counts.begin(jobs)
        if jobs:
            self.progress.start()
            self.task = self.progress.add_task("starting", total=self.counts.total, jobs_done=0, jobs=len(jobs))

    def started(self, job) -> None:
        if self.task is not None:
            self.progress.update(self.task, description=_job_name(job), head="preparing ")

    def tiles(self, job, n: int) -> None:
        if self.task is not None:
            if job.digest not in self.counts.partial:
                self.progress.update(self.task, description=_job_name(job), head="")
            self.progress.advance(self.task, self.counts.tiles(job, n))

    def done(self, job, result) -> None:
        if self.task is not None:
            self.progress.advance(self.task, self.counts.done(job, result))
            self.progress.update(self.task, jobs_done=self.counts.jobs_done)

    def end(self) -> None:
        self.progress.stop()


def make_progress(mode: str, console: Console) -> WarmProgress:
    """The display for a resolved mode (see ``progress_mode``)."""
    if mode == "bar":
        return BarProgress(console)
    if mode == "lines":
        return LineProgress(console)
    return WarmProgress()
