"""The `lwm` command line: a registry of verbs, each a thin module under `lwm.commands`.

Every verb names the same thing the same way (`lwm.commands`): ``--config FILE``, ``--out``,
``--vqgan DIR``, ``--mesh DP,FSDP,SP,TP``, ``--cpu-devices N``. Bare ``lwm`` lists the verbs
(on stderr) and exits 2, as a verb given too little does; ``lwm --help`` lists them on stdout
and exits 0; ``lwm --version`` prints the version.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Callable, Sequence
from types import ModuleType

from lwm.base.lock import LockedError
from lwm.commands import Parser
from lwm.config import ConfigError

# verb -> (module with `add_arguments(parser)` and `run(args) -> int`, one-line help), in the
# order of the pipeline: videos, their tokenizer, tokens, training, then the trained model.
# Modules are imported only when their verb runs, so a verb pays only for its own imports.
COMMANDS: dict[str, tuple[str, str]] = {
    "synthetic": ("lwm.commands.synthetic", "synthetic videos of moving shapes with QA manifests"),
    "vqgan": ("lwm.commands.vqgan", "the VQGAN video tokenizer: train, encode, decode, import"),
    "tokenize": ("lwm.commands.tokenize", "videos, images and text to an LWM token dataset"),
    "train": ("lwm.commands.train", "train the model (sharded, checkpointed, resumable)"),
    "info": (
        "lwm.commands.info",
        "show a config's parameter counts, FLOPs per token and per-device memory",
    ),
    "ask": ("lwm.commands.ask", "answer questions about a video with a trained model"),
    "chat": ("lwm.commands.chat", "a conversation about a video (one cache, many turns)"),
    "eval": (
        "lwm.commands.eval",
        "evaluate a model: QA accuracy per category vs blind and swapped",
    ),
    "generate": ("lwm.commands.generate", "generate a video from a caption (text-to-video)"),
}


def version() -> str:
    """The installed package's version (``lwm.__version__`` where it is not installed)."""
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as installed

    try:
        return installed("lwm-jax")
    except PackageNotFoundError:
        import lwm

        return getattr(lwm, "__version__", "unknown")


def user_errors() -> tuple[type[BaseException], ...]:
    """Errors caused by the user's input: reported as one line, exit status 2, no traceback.
    (`lwm.base.mesh` imports JAX, so it is imported here, when a verb runs, and not with this
    module: `lwm tokenize`'s decoding workers import this module again when the console script
    starts them, and need no JAX.)"""
    from lwm.base.mesh import MeshError
    from lwm.commands import UsageError
    from lwm.runs import CheckpointMismatchError
    from lwm.weights.common import WeightsError

    return (
        ConfigError,
        MeshError,
        FileNotFoundError,
        LockedError,  # the output is in use by another run
        WeightsError,  # weights to load that are missing or do not fit the config
        CheckpointMismatchError,
        UsageError,  # a flag's value the verb cannot use
    )


def _listing() -> str:
    width = max(len(name) for name in COMMANDS)
    verbs = "\n".join(f"  {name:<{width}}  {help_}" for name, (_, help_) in COMMANDS.items())
    return (
        f"commands, in the order of the pipeline:\n{verbs}\n\n"
        "Run 'lwm COMMAND --help' for a command's options."
    )


def _top_parser() -> Parser:
    parser = Parser(
        prog="lwm",
        usage="lwm [-h] [--version] COMMAND [ARGS ...]",
        description="Long-video world model: configs, training and inference.",
        epilog=_listing(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"lwm {version()}")
    parser.add_argument(
        "command", choices=list(COMMANDS), metavar="COMMAND", help="one of the commands below"
    )
    parser.add_argument("args", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    return parser


def verb_parser(name: str) -> tuple[ModuleType, Parser]:
    """The module of verb ``name`` and its parser (with its subcommands' in the module's
    ``SUBCOMMANDS``)."""
    module_name, help_ = COMMANDS[name]
    module = importlib.import_module(module_name)
    parser = Parser(
        prog=f"lwm {name}",
        description=module.__doc__ or help_,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    module.add_arguments(parser)
    return module, parser


def all_parsers() -> dict[str, Parser]:
    """Every verb's parser and every subcommand's, by their names (``lwm vqgan encode``)."""
    parsers = {}
    for name in COMMANDS:
        module, parser = verb_parser(name)
        parsers[parser.prog] = parser
        for sub in getattr(module, "SUBCOMMANDS", {}).values():
            parsers[sub.prog] = sub
    return parsers


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `lwm` console script; returns the exit status (bare `lwm`: the
    verbs on stderr, and 2)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    top_parser = _top_parser()
    if not argv:
        print(f"usage: {top_parser.usage}\n\n{_listing()}", file=sys.stderr)
        return 2
    top = top_parser.parse_args(argv)
    module, parser = verb_parser(top.command)
    # A verb with subcommands parses its own arguments (argparse cannot intermix subparsers).
    parse = getattr(module, "parse_args", None)
    args = parse(parser, top.args) if parse else parser.parse_intermixed_args(top.args)
    from lwm.base.compile_cache import use_compilation_cache
    from lwm.base.mesh import use_cpu_devices

    def run() -> int:
        if getattr(args, "cpu_devices", None):
            use_cpu_devices(args.cpu_devices)
        use_compilation_cache()  # compiled programs kept for the next command
        return int(module.run(args))

    return run_reporting_errors(f"lwm {top.command}", run)


def tracebacks_asked() -> bool:
    """Whether the environment asks for tracebacks (``LWM_TRACEBACK`` set, not ``0``)."""
    return os.environ.get("LWM_TRACEBACK", "") not in ("", "0")


def note_failure(error: BaseException) -> None:
    """With ``LWM_TRACEBACK=1``, print ``error``'s traceback on stderr: for a measurement that
    a script records as failed (one line in its JSON) and goes on from, so that a run that
    cannot be repeated (a long run on an accelerator) keeps where the failure came from."""
    if tracebacks_asked():
        import traceback

        traceback.print_exception(error, file=sys.stderr)
        sys.stderr.flush()


def run_reporting_errors(
    who: str, run: Callable[[], int | None], also: tuple[type[BaseException], ...] = ()
) -> int:
    """``run()``'s exit status (None: 0), with the errors of the user's input
    (`user_errors`, ``also``, or a path of the wrong kind) as one line ``WHO: error: ...`` and
    status 2, Ctrl-C as ``WHO: interrupted`` and 130, and a reader that left the pipe as
    status 1: how every `lwm` verb, and the scripts under recipes/, benchmarks/ and tools/, end. With the environment
    variable ``LWM_TRACEBACK=1`` an input error is raised instead, traceback and all (the
    scripts take any ``ValueError`` for one, so a fault of their own would lose its place)."""
    try:
        status = run()
        sys.stdout.flush()  # a reader that left early shows here, not at exit
        return int(status or 0)
    except (*user_errors(), *also) as e:
        if tracebacks_asked():
            raise
        message = " ".join(str(e).split())
        print(f"{who}: error: {message}", file=sys.stderr)
        return 2
    except (IsADirectoryError, NotADirectoryError, FileExistsError, PermissionError) as e:
        # a path given where another kind of thing is, or one that may not be written
        message = f"'{e.filename}': {e.strerror}" if e.filename else " ".join(str(e).split())
        print(f"{who}: error: {message}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C: what is finished stays (a rerun continues from it)
        print(f"\n{who}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # the reader left (`lwm info ... | head`): stop without a trace
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
