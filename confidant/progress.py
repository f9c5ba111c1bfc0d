"""A dependency-free progress line: redrawn in place on a terminal, one line every few steps otherwise."""
from __future__ import annotations

import sys
import time


class Progress:
    def __init__(self, total: int, label: str, stream=None, every: int = 10):
        self.total = total
        self.label = label
        self.stream = stream or sys.stderr
        self.tty = self.stream.isatty()
        self.every = every
        self.start = time.perf_counter()

    def update(self, done: int, **figures: float | str) -> None:
        parts = " ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in figures.items())
        width = 24
        filled = int(width * done / max(self.total, 1))
        bar = "#" * filled + "." * (width - filled)
        elapsed = time.perf_counter() - self.start
        eta = elapsed / max(done, 1) * (self.total - done)
        line = f"{self.label} [{bar}] {done}/{self.total} {parts} | {elapsed:.0f}s, eta {eta:.0f}s"
        if self.tty:
            self.stream.write("\r" + line + "\033[K")
            if done == self.total:
                self.stream.write("\n")
        elif done == 1 or done == self.total or done % self.every == 0:
            self.stream.write(line + "\n")
        self.stream.flush()


class TerminalReporter:
    """A `jobs.common.report.Reporter` for the terminal: notes as lines on stderr, steps as a `Progress` bar."""

    def __init__(self, stream=None):
        self.stream = stream or sys.stderr
        self.bar: Progress | None = None

    def note(self, text: str) -> None:
        print(text, file=self.stream, flush=True)

    def start(self, label: str, total: int) -> None:
        self.bar = Progress(total, label, stream=self.stream)

    def step(self, done: int, **figures: float | str) -> None:
        if self.bar is not None:
            self.bar.update(done, **figures)
