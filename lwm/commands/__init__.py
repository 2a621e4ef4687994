"""One thin module per `lwm` verb: `add_arguments(parser)` and `run(args) -> int`; and the
argument types the verbs share."""

from __future__ import annotations

import argparse


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
