"""Stopping a long run between its steps (`lwm train`, `lwm vqgan train`): SIGINT and SIGTERM
are noted rather than raised, so the run finishes the step it is in, saves a checkpoint, says
so and exits with the signal's status."""

from __future__ import annotations

import signal
from collections.abc import Callable

__all__ = ["StopSignals", "exit_status"]


class StopSignals:
    """SIGINT and SIGTERM noted from ``StopSignals()`` until `restore`: ``received`` is the
    name of the last one (``"SIGINT"``), None before any."""

    def __init__(self) -> None:
        self.received: str | None = None
        self._previous: dict[int, Callable | int | None] = {
            s: signal.signal(s, self._note) for s in (signal.SIGTERM, signal.SIGINT)
        }

    def _note(self, signum: int, _frame) -> None:
        self.received = signal.Signals(signum).name

    def restore(self) -> None:
        """Put back the handlers there were before."""
        for s, handler in self._previous.items():
            signal.signal(s, handler)


def exit_status(name: str) -> int:
    """A command's exit status after the signal ``name`` stopped it: 130 for SIGINT, 143 for
    SIGTERM."""
    return 128 + signal.Signals[name].value
