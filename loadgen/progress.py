"""A live progress line (rich): sent / done / failed / in flight / current completion rate."""

import collections
import sys
import time

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn


class Counters:
    """Shared counters the runner updates; ``rate`` is completions per second over the last ``window_s``."""

    def __init__(self, window_s: float = 5.0) -> None:
        self.sent = 0
        self.done = 0
        self.failed = 0
        self._recent: collections.deque[float] = collections.deque()
        self._window = window_s
        self._start = time.monotonic()

    def finished(self, ok: bool) -> None:
        self.done += 1
        self.failed += not ok
        self._recent.append(time.monotonic())

    @property
    def in_flight(self) -> int:
        return self.sent - self.done

    def rate(self) -> float:
        now = time.monotonic()
        while self._recent and self._recent[0] < now - self._window:
            self._recent.popleft()
        # Early in the run the window is not full yet: divide by the time there has been.
        return len(self._recent) / max(min(self._window, now - self._start), 1e-3)


class LiveProgress:
    """Shows the bar while the run goes; by requests when the total is known, else by elapsed seconds."""

    def __init__(self, counters: Counters, total_requests: int | None, duration_s: float | None, enabled: bool) -> None:
        self.counters = counters
        self.by_time = total_requests is None
        self.total = duration_s if self.by_time else total_requests
        self.start = time.monotonic()
        enabled = enabled and sys.stderr.isatty()
        self.progress = Progress(
            SpinnerColumn(), TextColumn("[bold]loadgen"), BarColumn(),
            TextColumn("{task.fields[elapsed]}") if self.by_time else MofNCompleteColumn(), TimeElapsedColumn(),
            TextColumn("{task.fields[stats]}"), console=Console(stderr=True), disable=not enabled, transient=False,
        )
        self.task = self.progress.add_task("run", total=self.total, stats="", elapsed="")

    def __enter__(self) -> "LiveProgress":
        self.progress.start()
        return self

    def __exit__(self, *exc) -> None:
        self.refresh()
        self.progress.stop()

    def refresh(self) -> None:
        c = self.counters
        stats = (f"sent {c.sent}  done {c.done}  failed {c.failed}  in flight {c.in_flight}  "
                 f"{c.rate():.1f} req/s")
        elapsed = time.monotonic() - self.start
        completed = min(elapsed, self.total) if self.by_time else c.done
        self.progress.update(self.task, completed=completed, stats=stats, elapsed=f"{elapsed:.0f}/{self.total:.0f} s"
                             if self.by_time else "")
