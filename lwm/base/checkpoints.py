"""The newest checkpoint of a run that restores (`restore_first`), for `lwm train` and
`lwm vqgan train` and the readers of their runs: a damaged checkpoint (a file cut short or
missing) is reported and, for training, which redoes its steps, set aside as
``STEP.damaged-TIME``; one that holds another model or another form of state is not damage
(`CheckpointMismatchError`), so nothing is renamed and nothing trained over it."""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

__all__ = ["CheckpointMismatchError", "restore_first"]

T = TypeVar("T")


class CheckpointMismatchError(ValueError):
    """A checkpoint holds parameters of other shapes, or a state of another tree structure,
    than the config asks for: not damage, so nothing is renamed and nothing is trained over
    it."""


def restore_first(
    manager: Any,
    restore: Callable[[int], T],
    log: Callable[[str], None],
    *,
    set_aside: bool,
    is_primary: bool = True,
) -> tuple[int, T] | None:
    """``(step, restore(step))`` for the newest step of the orbax ``manager`` that restores,
    or None. Damaged ones are logged and, with ``set_aside``, renamed ``STEP.damaged-TIME``
    (by the primary process) out of the way of the steps about to be redone; a reader leaves
    the run as it is."""
    damaged: list[int] = []
    _quiet_reads_after_a_failed_restore()  # before: the reads may end before orbax raises
    try:
        for step in sorted(manager.all_steps(), reverse=True):
            try:
                return step, restore(step)
            except Exception as e:  # orbax raises many types for a truncated or missing file
                reason = " ".join(str(e).split())[:300]
                if "not compatible with the stored shape" in reason:
                    raise CheckpointMismatchError(
                        f"checkpoint {step} in '{manager.directory}' holds parameters of "
                        f"other shapes than the config asks for ({reason})"
                    ) from None
                if "tree structures do not match" in reason:
                    raise CheckpointMismatchError(
                        f"checkpoint {step} in '{manager.directory}' holds a state of another "
                        f"form than the config asks for (another optimizer?) ({reason})"
                    ) from None
                log(
                    f"checkpoint {step} cannot be restored ({type(e).__name__}: {reason}); "
                    "trying the previous one"
                )
                damaged.append(step)
        return None
    finally:
        if damaged and set_aside:
            if is_primary:
                root = Path(manager.directory)
                for step in damaged:
                    (root / str(step)).rename(root / f"{step}.damaged-{int(time.time())}")
            manager.reload()


class _DropUnretrievedReadErrors(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()  # a read's future, or the task that awaited it
        return not message.startswith(
            ("Future exception was never retrieved", "Task exception was never retrieved")
        )


def _quiet_reads_after_a_failed_restore() -> None:
    """When a restore fails, orbax closes its event loop while tensorstore still reads the
    checkpoint's other arrays; each read that ends then reports "RuntimeError: Event loop is
    closed" as an unraisable exception, or asyncio logs "Future (or Task) exception was never
    retrieved" with the read's error (a traceback on stderr each, many for a large model), some
    before orbax's error reaches us. Those alone are dropped; every other unraisable exception goes
    to the hook before, and asyncio's other messages are logged."""
    previous = sys.unraisablehook
    if getattr(previous, "_lwm_quiet", False):
        return

    def hook(unraisable) -> None:
        exc = unraisable.exc_value
        if isinstance(exc, RuntimeError) and str(exc) == "Event loop is closed":
            return
        previous(unraisable)

    hook._lwm_quiet = True  # type: ignore[attr-defined]
    sys.unraisablehook = hook
    logging.getLogger("asyncio").addFilter(_DropUnretrievedReadErrors())
