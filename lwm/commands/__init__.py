"""One thin module per `lwm` verb: `add_arguments(parser)` and `run(args) -> int`; and the
argument types the verbs share."""

from __future__ import annotations

import argparse
from pathlib import Path


class UsageError(ValueError):
    """A flag's value that the verb cannot use (an output path that is a folder, say):
    reported as one line, exit status 2 (`lwm.cli.user_errors`)."""


def _number(kind, text: str, ok, expected: str):
    try:
        value = kind(text)
    except ValueError:
        value = None
    if value is None or not ok(value):
        raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}")
    return value


def positive_int(text: str) -> int:
    return _number(int, text, lambda v: v >= 1, "a positive integer")


def non_negative_int(text: str) -> int:
    return _number(int, text, lambda v: v >= 0, "an integer >= 0")


def add_cpu_devices(parser: argparse.ArgumentParser) -> None:
    """`--cpu-devices N`: the verb runs on N simulated devices of the host CPU (`lwm.cli` sets
    them up before JAX starts)."""
    parser.add_argument(
        "--cpu-devices",
        type=positive_int,
        metavar="N",
        help="run on N devices of the host CPU (simulated; no XLA_FLAGS needed), e.g. 8 for "
        "mesh.shape=1,2,4,1 on a laptop",
    )


def positive_float(text: str) -> float:
    return _number(float, text, lambda v: v > 0, "a positive number")


def fraction(text: str) -> float:
    """A number in [0, 1] (a probability)."""
    return _number(float, text, lambda v: 0 <= v <= 1, "a number from 0 to 1")


def fraction_range(text: str) -> tuple[float, float]:
    """``LO,HI`` with 0 < LO <= HI < 1: a range of sizes as fractions of a frame (the
    synthetic world's ``radius`` and ``travel``)."""
    try:
        lo, hi = (float(v) for v in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected LO,HI (two numbers), got {text!r}") from None
    if not 0 < lo <= hi < 1:
        raise argparse.ArgumentTypeError(f"expected 0 < LO <= HI < 1, got {text!r}")
    return lo, hi


def non_negative_float(text: str) -> float:
    return _number(float, text, lambda v: v >= 0, "a number >= 0")


def top_p(text: str) -> float:
    return _number(float, text, lambda v: 0 < v <= 1, "a number above 0 and at most 1")


def even_positive_int(text: str) -> int:
    return _number(int, text, lambda v: v >= 2 and v % 2 == 0, "an even integer >= 2")


def nonempty(text: str) -> str:
    if not text.strip():
        raise argparse.ArgumentTypeError("expected some text, got an empty string")
    return text


def output_file(flag: str, path: str | Path, suffixes: tuple[str, ...] = ()) -> Path:
    """``path`` checked before any work as a file a verb may write: not a folder, and with one
    of ``suffixes`` where given (else `UsageError` naming ``flag``)."""
    path = Path(path)
    if path.is_dir():
        raise UsageError(f"{flag} '{path}' is a folder; give a file name")
    if suffixes and path.suffix.lower() not in suffixes:
        raise UsageError(f"{flag} '{path}' must end in {' or '.join(suffixes)}")
    if path.parent.exists() and not path.parent.is_dir():
        raise UsageError(f"{flag} '{path}': '{path.parent}' is a file, not a folder")
    return path


def output_folder(flag: str, path: str | Path) -> Path:
    """``path`` checked before any work as a folder a verb may write into (made if missing)."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise UsageError(f"{flag} '{path}' is a file; give a folder")
    return path
