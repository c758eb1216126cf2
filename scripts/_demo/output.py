"""The demo's output, plain text with no library: lines stamped with the time since the start,
the checks as they are made (``ok`` or ``FAIL``), the progress and the summary.

On a terminal the progress is one line redrawn in place; elsewhere (CI, a pipe) a line about
once a second, with no escape codes.
"""

from __future__ import annotations

import contextlib
import shutil
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TextIO

Show = Callable[[int, int, int | None, int], None]
"""Called with (completed, submitted, paused, workers alive)."""

BAR = 30


@dataclass
class Line:
    """One row of the final summary."""

    what: str
    value: str
    ok: bool | None = None
    """None: information, not a check."""


class Output:
    """Where the demo writes: ``stream`` (stdout), live when it is a terminal."""

    def __init__(self, started: float, stream: TextIO | None = None) -> None:
        self.started = started
        self.stream = stream or sys.stdout
        self.live = self.stream.isatty()
        self._drawn = False
        """A progress line is on the screen, to clear before anything else is written."""

    def print(self, text: str = "") -> None:
        self._clear()
        self.stream.write(text + "\n")
        self.stream.flush()

    def say(self, message: str) -> None:
        """A line with the time since the start."""
        self.print(f"[{time.monotonic() - self.started:5.1f}s] {message}")

    def note(self, message: str) -> None:
        self.print(f"       {message}")

    def check(self, failures: list[str], ok: bool, good: str, bad: str) -> None:
        """One check, printed as it is made; what failed is added to ``failures``."""
        self.print(f"  {'ok  ' if ok else 'FAIL'} {good if ok else bad}")
        if not ok:
            failures.append(bad)

    def summary(self, title: str, lines: list[Line], elapsed: float, passed: bool) -> None:
        rows = [*lines, Line("elapsed", f"{elapsed:.1f}s"), Line("result", "")]
        width = max(len(line.what) for line in rows)
        self.print()
        self.print(title)
        for line in rows[:-1]:
            mark = "" if line.ok is None else ("ok" if line.ok else "FAIL")
            self.print(f"  {mark:<4}  {line.what:<{width}}  {line.value}")
        self.print(f"        {'result':<{width}}  {'PASSED' if passed else 'FAILED'}")

    @contextlib.contextmanager
    def progress(self, total: int) -> Iterator[Show]:
        """A function to show the progress with: the line redrawn on a terminal, else a plain
        line about once a second (and the last one at the end)."""
        printed = 0.0
        pending: str | None = None

        def show(done: int, submitted: int, paused: int | None, alive: int) -> None:
            nonlocal printed, pending
            counts = progress_line(done, submitted, paused, alive, total)
            if self.live:
                filled = BAR * done // max(total, 1)
                bar = "#" * filled + "." * (BAR - filled)
                line = f"tasks [{bar}] {counts}"
                columns = shutil.get_terminal_size().columns
                self.stream.write("\r" + line[: columns - 1] + "\x1b[K")
                self.stream.flush()
                self._drawn = True
                return
            pending = counts
            if time.monotonic() - printed >= 1.0:
                printed = time.monotonic()
                self.say(pending)
                pending = None

        try:
            yield show
        finally:
            if pending is not None:
                self.say(pending)
            if self._drawn:
                self.stream.write("\n")
                self._drawn = False

    def _clear(self) -> None:
        if self._drawn:
            self.stream.write("\r\x1b[K")
            self._drawn = False


def progress_line(done: int, submitted: int, paused: int | None, alive: int, total: int) -> str:
    """Completed, paused, in flight (submitted - completed - paused: in the queues or in a
    handler), submitted and workers alive. The count of paused tasks can lag a moment behind
    the results: never show more paused than not completed, nor fewer than 0 in flight."""
    if paused is None:  # it could not be read this time
        shown, in_flight = "?", "?"
    else:
        paused = min(paused, submitted - done)
        shown, in_flight = str(paused), str(submitted - done - paused)
    return (
        f"completed {done:3d}/{total}, paused {shown:>3}, in flight {in_flight:>3}, "
        f"submitted {submitted:3d}, workers alive {alive}"
    )
