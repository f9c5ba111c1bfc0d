"""How a job reports progress: lines of text (`note`) and training steps (`step`). The command line
passes one that prints to the terminal; tests and library users pass none (silence) or their own."""
from __future__ import annotations

from typing import Protocol


class Reporter(Protocol):
    def note(self, text: str) -> None:
        """One line about what the job is doing or found (a stage, a warning, a figure)."""

    def start(self, label: str, total: int) -> None:
        """A run of `total` steps begins (a progress bar named `label`)."""

    def step(self, done: int, **figures: float | str) -> None:
        """`done` steps of the current run are finished; `figures` are the latest step's."""


class Silent:
    """A Reporter that says nothing."""

    def note(self, text: str) -> None:
        pass

    def start(self, label: str, total: int) -> None:
        pass

    def step(self, done: int, **figures: float | str) -> None:
        pass
