"""One thin module per `lwm` verb: `add_arguments(parser)` and `run(args) -> int`; the
parser every verb gets (`Parser`), the options the verbs share (one name for one thing in
every verb: `--config FILE`, `--out`, `--vqgan DIR`, `--mesh DP,FSDP,SP,TP`, `--cpu-devices
N`) and the argument types they share.

A verb with subcommands keeps their parsers in ``SUBCOMMANDS`` (name -> parser) and parses
with `parse_subcommand`; a verb may define ``parse_args(parser, argv)`` to parse its own way.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

MESH_METAVAR = "DP,FSDP,SP,TP"


class UsageError(ValueError):
    """A flag's value that the verb cannot use (an output path that is a folder, say):
    reported as one line, exit status 2 (`lwm.cli.user_errors`)."""


def deprecated(prog: str, old: str, new: str) -> None:
    """The one-line notice of a spelling that still works for one release:
    ``PROG: warning: OLD is deprecated, use NEW``."""
    print(f"{prog}: warning: {old} is deprecated, use {new}", file=sys.stderr, flush=True)


class Parser(argparse.ArgumentParser):
    """The parser of an `lwm` verb (and of its subcommands, which argparse makes of the same
    class): a usage error is one line, ``PROG: error: ...`` and status 2, and an option's old
    spelling (`rename`) still works, with a one-line notice (`deprecated`)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.renamed: dict[str, str] = {}

    def rename(self, old: str, new: str) -> None:
        """Accept option ``old`` (no longer listed by --help) as ``new``, with a notice."""
        self.renamed[old] = new

    def _with_new_names(self, args: Sequence[str] | None) -> list[str]:
        args = list(sys.argv[1:] if args is None else args)
        told = set()
        for i, arg in enumerate(args):
            if arg == "--":
                break
            old, sep, value = arg.partition("=")
            new = self.renamed.get(old)
            if new is None:
                continue
            args[i] = f"{new}{sep}{value}"
            if old not in told:
                told.add(old)
                deprecated(self.prog, old, new)
        return args

    # Both: Python 3.11 reaches the second through the first, later versions do not.
    def parse_known_args(self, args=None, namespace=None):
        return super().parse_known_args(self._with_new_names(args), namespace)

    def parse_known_intermixed_args(self, args=None, namespace=None):
        return super().parse_known_intermixed_args(self._with_new_names(args), namespace)

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see '{self.prog} --help')\n")


def parse_subcommand(
    parser: argparse.ArgumentParser,
    subcommands: dict[str, argparse.ArgumentParser],
    argv: Sequence[str],
) -> argparse.Namespace:
    """``argv`` of a verb with ``subcommands``: argparse cannot intermix options and
    positionals over subcommands, so the subcommand's own parser parses the rest (intermixed,
    like every other verb); ``args.subcommand`` names it."""
    if argv and argv[0] in subcommands:
        args = subcommands[argv[0]].parse_intermixed_args(list(argv[1:]))
        args.subcommand = argv[0]
        return args
    return parser.parse_args(list(argv))


# config keys that a verb's own option sets: option -> key
CONFIG_SHORTHANDS = {"--mesh": "mesh.shape", "--out": "train.output_dir"}


def add_config_arguments(
    parser: argparse.ArgumentParser, example: str, *, out: bool = False, **config
) -> None:
    """The options of a verb that reads a config file: ``--config FILE`` (``config``: more
    keywords of its add_argument, e.g. required=True), ``KEY=VALUE`` overrides, ``--mesh``
    (short for ``mesh.shape=``), with ``out`` ``--out`` (short for ``train.output_dir=``),
    and ``--cpu-devices``."""
    parser.add_argument(
        "--config", metavar="FILE", help=f"YAML config file, e.g. {example}", **config
    )
    parser.add_argument(
        "overrides",
        nargs="*",
        metavar="KEY=VALUE",
        help="config overrides, e.g. train.steps=100 model.num_layers=4",
    )
    if out:
        parser.add_argument(
            "--out",
            metavar="DIR",
            help="the run's folder: checkpoints and metrics (short for train.output_dir=...; "
            "default: the config's)",
        )
    add_mesh(parser, "the device mesh (short for mesh.shape=...; default: the config's)")
    add_cpu_devices(parser)


def config_overrides(args: argparse.Namespace) -> list[str]:
    """The verb's config overrides, with its shorthands (`CONFIG_SHORTHANDS`: ``--mesh`` as
    ``mesh.shape=``, ``--out`` as ``train.output_dir=``) last; an option and the override of
    its key both given: a `UsageError` naming them."""
    overrides = list(args.overrides)
    for option, key in CONFIG_SHORTHANDS.items():
        value = getattr(args, option[2:], None)
        if value is None:
            continue
        given = [o for o in overrides if o.partition("=")[0].strip() == key]
        if given:
            raise UsageError(f"{option} {value} and {given[0]} both set {key}; give one")
        overrides.append(f"{key}={value}")
    return overrides


def add_mesh(parser: argparse.ArgumentParser, help: str) -> None:
    """`--mesh DP,FSDP,SP,TP`: the device mesh (one axis may be -1: the devices left)."""
    parser.add_argument("--mesh", metavar=MESH_METAVAR, help=help)


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
        "--mesh 1,2,4,1 on a laptop",
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
