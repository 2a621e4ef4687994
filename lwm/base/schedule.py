"""The one learning-rate schedule of every trainer (`lwm train`, `lwm vqgan train`): a linear
warmup to the peak, then a cosine decay to ``end_ratio`` x peak at ``total_steps`` (or the peak
held constant).

The warmup starts at ``peak / warmup_steps`` (the first step already learns) and reaches the
peak at step ``warmup_steps - 1``; the decay starts at step ``warmup_steps``.
"""

from __future__ import annotations

import optax

__all__ = ["SCHEDULES", "warmup_schedule"]

SCHEDULES = ("cosine", "constant")


def warmup_schedule(
    peak: float,
    *,
    warmup_steps: int,
    total_steps: int,
    kind: str = "cosine",
    end_ratio: float = 0.0,
) -> optax.Schedule:
    """Learning rate as a function of the step (0-based), as the module docstring says."""
    if kind not in SCHEDULES:
        raise ValueError(f"unknown learning-rate schedule '{kind}'; choose cosine or constant")
    if kind == "cosine":
        after = optax.cosine_decay_schedule(
            peak, max(total_steps - warmup_steps, 1), alpha=end_ratio
        )
    else:
        after = optax.constant_schedule(peak)
    if warmup_steps <= 0:
        return after
    warmup = optax.linear_schedule(peak / warmup_steps, peak, warmup_steps - 1)
    return optax.join_schedules([warmup, after], [warmup_steps])
