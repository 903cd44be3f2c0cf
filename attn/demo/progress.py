"""A one-line progress bar for the demo's training loop (no dependency)."""

from __future__ import annotations

import sys
import time
from typing import TextIO

__all__ = ["ProgressBar"]


class ProgressBar:
    """Draws ``label [#####-----] step/total loss x.xxx`` on a stream.

    On a terminal the line is redrawn in place, at most ten times a second; elsewhere (a
    log file, a pipe) one line is written at each quarter of the way, so logs stay short.

    Example::

        bar = ProgressBar(total=100, label="train")
        for step in range(1, 101):
            bar.update(step, loss=0.5)
        bar.close()
    """

    def __init__(self, total: int, *, label: str, stream: TextIO | None = None, width: int = 30) -> None:
        if total <= 0:
            raise ValueError(f"ProgressBar total must be positive, got {total}")
        self.total = total
        self.label = label
        self.stream = sys.stderr if stream is None else stream
        self.width = width
        self.interactive = bool(getattr(self.stream, "isatty", lambda: False)())
        self._last_draw = 0.0
        self._next_quarter = 1
        self._start = time.perf_counter()
        self._drawn = False

    def _line(self, step: int, loss: float) -> str:
        done = self.width * step // self.total
        bar = "#" * done + "-" * (self.width - done)
        elapsed = time.perf_counter() - self._start
        return f"{self.label} [{bar}] {step}/{self.total} loss {loss:.3f} {elapsed:.1f}s"

    def update(self, step: int, loss: float) -> None:
        """Shows that ``step`` of ``total`` is done, with the latest loss."""
        if self.interactive:
            now = time.perf_counter()
            if step == self.total or now - self._last_draw >= 0.1:
                self._last_draw = now
                self.stream.write("\r" + self._line(step, loss))
                self.stream.flush()
                self._drawn = True
        elif step * 4 >= self._next_quarter * self.total:
            while step * 4 >= self._next_quarter * self.total:
                self._next_quarter += 1
            self.stream.write(self._line(step, loss) + "\n")
            self.stream.flush()

    def close(self) -> None:
        """Ends the bar's line on a terminal."""
        if self.interactive and self._drawn:
            self.stream.write("\n")
            self.stream.flush()
            self._drawn = False
