"""Training metrics: one JSON line per logged step in ``OUTPUT/metrics.jsonl`` (appended, so a
resumed run continues the file) and the same scalars in TensorBoard, under ``SPLIT/NAME``.

    writer = MetricsWriter(out)                      # lwm train: OUTPUT/tensorboard
    writer.write(step, {"loss": 2.1})                # {"step": 10, "loss": 2.1}
    writer.write(step, {"psnr": 25.0}, split="eval") # {"step": 10, "split": "eval", ...}
    writer.close()
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

__all__ = ["MetricsWriter", "percent"]


def percent(fraction: float) -> int:
    """``fraction`` as a whole percentage, halves rounded up (5 of 40 is 13%, as 11 of 40 is
    28%; Python's own rounding takes halves to the even neighbour, 12% and 28%)."""
    return math.floor(round(100 * fraction, 9) + 0.5)  # 57 / 200 * 100 is 28.4999...


def summary_writer(logdir: Path) -> Any:
    """tensorboardX's ``SummaryWriter`` for ``logdir``, imported without PyTorch: its package
    imports torch wherever torch is installed (2.4 s of every `lwm train` or `lwm vqgan train`
    start on a 2-core machine) only to accept torch tensors, and these writers log floats. A
    ``None`` in ``sys.modules`` makes ``import torch`` fail for the length of that import; a
    process that had already imported torch keeps it, and one that imports it later gets it."""
    import sys

    hide = "torch" not in sys.modules
    if hide:
        sys.modules["torch"] = None  # type: ignore[assignment]
    try:
        from tensorboardX import SummaryWriter
    finally:
        if hide:
            del sys.modules["torch"]
    return SummaryWriter(str(logdir))


class MetricsWriter:
    """JSONL and TensorBoard scalars. ``enabled=False`` (every process but 0 of a multi-host
    run) writes nothing; ``tensorboard``: the folder name under ``output_dir``;
    ``always_split``: name the split on every line (otherwise only when it is not ``train``)."""

    def __init__(
        self,
        output_dir: str | Path,
        enabled: bool = True,
        *,
        tensorboard: str = "tensorboard",
        always_split: bool = False,
    ):
        self.enabled = enabled
        self.always_split = always_split
        self.jsonl = None
        self.tb = None
        if not enabled:
            return
        output_dir = Path(output_dir)
        output_dir.mkdir(parents=True, exist_ok=True)
        self.jsonl = open(output_dir / "metrics.jsonl", "a")  # noqa: SIM115
        self.tb = summary_writer(output_dir / tensorboard)

    def write(self, step: int, metrics: dict[str, float], split: str = "train") -> None:
        if not self.enabled:
            return
        tag = {"split": split} if self.always_split or split != "train" else {}
        self.jsonl.write(json.dumps({"step": step, **tag, **metrics}) + "\n")
        self.jsonl.flush()
        for key, value in metrics.items():
            self.tb.add_scalar(f"{split}/{key}", value, step)
        self.tb.flush()

    def close(self) -> None:
        if self.jsonl is not None:
            self.jsonl.close()
        if self.tb is not None:
            self.tb.close()
