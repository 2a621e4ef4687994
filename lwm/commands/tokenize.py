"""Tokenize videos, images and text into an LWM token dataset (tfds, array_record).

  lwm tokenize --input runs/synthetic/manifest.jsonl --out runs/tokens --vqgan runs/vqgan_tiny
  lwm tokenize --input videos/ --out runs/tokens --vqgan CKPT --max-frames 32 --workers 4
  lwm tokenize merge --out runs/tokens      (after the shards of a job: see below)

INPUT is a folder (every video under it, captions from sidecar .txt files) or a JSONL manifest
with lines {"video": PATH, "text": CAPTION}, {"video": PATH, "qa": [{"question": .., "answer":
..}]}, {"image": PATH, ...} or {"text": TEXT}; relative paths are relative to the manifest.
Read OUT with tfds.builder_from_directory(OUT).as_data_source("train"); train on it with
`lwm train --config CONFIG data.source=OUT`.

Files that fail (missing, empty, not a video, truncated, too few frames) are listed one per line
in OUT.errors.txt and skipped; --strict turns any failure into exit status 1 and leaves OUT
unwritten. Interrupted, the same command continues from OUT.partial; OUT appears only when
complete.

Many hosts (OUT on a file system they all see): run the same command in every process of a
jax.distributed job (--coordinator/--num-processes/--process-id, the JAX_* environment, or a
TPU pod's hosts): each process encodes its share of the chunks on its own devices and process 0
publishes. Without JAX's coordinator (Slurm arrays, Kubernetes indexed jobs), run shard I of N
with --shard I/N, then `lwm tokenize merge --out OUT` once all are done. A second, unrelated
tokenize into the same OUT is refused (OUT.lock names the run that holds it).

Old spellings that still work for one release, with a deprecation notice: --output (now
--out), and `lwm tokenize --merge OUT` (now `lwm tokenize merge --out OUT`).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from lwm.commands import (
    add_cpu_devices,
    deprecated,
    non_negative_int,
    positive_float,
    positive_int,
)

SUBCOMMANDS: dict[str, argparse.ArgumentParser] = {}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from data.chunk_encoder import default_workers

    parser.add_argument(
        "--input", required=True, metavar="PATH", help="folder of videos, or a .jsonl manifest"
    )
    parser.add_argument("--out", required=True, metavar="DIR", help="dataset folder to create")
    parser.rename("--output", "--out")
    parser.add_argument(
        "--vqgan", required=True, metavar="DIR", help="VQGAN folder (vqgan.load_tokenizer)"
    )
    parser.add_argument(
        "--tokenizer",
        metavar="DIR",
        help="Hugging Face tokenizer folder (default: the project's data/tokenizer)",
    )
    parser.add_argument("--fps", type=positive_float, help="sample frames at this rate")
    parser.add_argument(
        "--max-frames", type=positive_int, metavar="N", help="at most N evenly spaced frames"
    )
    parser.add_argument(
        "--min-frames",
        type=positive_int,
        default=1,
        metavar="N",
        help="a video with fewer frames (after sampling) is a failure (default 1)",
    )
    parser.add_argument(
        "--workers",
        type=non_negative_int,
        default=None,
        help="decoding processes (0: decode in the main process; default: one per CPU core "
        f"less one, at least 2: {default_workers()} here)",
    )
    parser.add_argument(
        "--batch-frames",
        type=positive_int,
        default=64,
        help="frames per VQGAN encode batch (default 64)",
    )
    parser.add_argument(
        "--chunk-size",
        type=positive_int,
        default=256,
        help="items per resumable chunk and output shard (default 256)",
    )
    parser.add_argument(
        "--strict", action="store_true", help="any failed item: exit 1, write no dataset"
    )
    parser.add_argument(
        "--video-loss",
        choices=("captioned", "all", "none"),
        default="captioned",
        help="records whose video tokens are learned: captioned (and video-only) records, as "
        "LWM (default), all (QA records too), none",
    )
    parser.add_argument(
        "--text-first-ratio",
        type=float,
        default=0.0,
        metavar="R",
        help="write a fraction R of the captioned videos caption first (caption <vision> V "
        "</vision>), as LWM trains both orders, for text-to-video generation (default 0)",
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument(
        "--shard",
        type=_shard,
        metavar="I/N",
        help="make shard I of N (chunks c with c %% N == I) and publish nothing; then "
        "`lwm tokenize merge --out OUT`",
    )
    parser.add_argument("--coordinator", metavar="HOST:PORT", help="jax.distributed coordinator")
    parser.add_argument("--num-processes", type=positive_int, help="processes of the job")
    parser.add_argument("--process-id", type=non_negative_int, help="this process's index")
    add_cpu_devices(parser)

    merge = type(parser)(
        prog=f"{parser.prog} merge",
        description="Publish the dataset OUT from the chunks its shards (--shard I/N) made in "
        "OUT.partial, once every chunk is done.",
    )
    merge.add_argument("--out", required=True, metavar="DIR", help="the dataset folder to publish")
    merge.add_argument(
        "--strict", action="store_true", help="any failed item: exit 1, write no dataset"
    )
    SUBCOMMANDS["merge"] = merge


def parse_args(parser: argparse.ArgumentParser, argv: Sequence[str]) -> argparse.Namespace:
    """`lwm tokenize ...`, or `lwm tokenize merge ...` (`lwm tokenize --merge OUT`, its old
    spelling, with a deprecation notice)."""
    argv = list(argv)
    old = [i for i, a in enumerate(argv) if a == "--merge" or a.startswith("--merge=")]
    if argv[:1] == ["merge"]:
        argv = argv[1:]
    elif old:
        deprecated(parser.prog, "--merge OUT", "lwm tokenize merge --out OUT")
        for i in old:
            argv[i] = "--out" + argv[i][len("--merge") :]
    else:
        args = parser.parse_intermixed_args(argv)
        args.subcommand = None
        return args
    args = SUBCOMMANDS["merge"].parse_intermixed_args(argv)
    args.subcommand = "merge"
    return args


def _shard(text: str) -> tuple[int, int]:
    try:
        i, n = (int(part) for part in text.split("/"))
    except ValueError:
        i, n = -1, 0
    if not 0 <= i < n:
        raise argparse.ArgumentTypeError(f"expected I/N with 0 <= I < N, got {text!r}")
    return i, n


def _log(msg: str) -> None:
    print(f"lwm tokenize: {msg}", file=sys.stderr, flush=True)


def run(args: argparse.Namespace) -> int:
    from data.manifest import ManifestError
    from data.tokenize_dataset import NothingTokenizedError, TokenizeError

    try:
        return _run(args)
    except (TokenizeError, ManifestError) as e:
        _log(f"error: {e}")
        # refused input is status 2 (nothing written); a job that ran and made nothing, 1
        return 1 if isinstance(e, NothingTokenizedError) else 2


def _run(args: argparse.Namespace) -> int:
    import jax

    from data.tokenize_dataset import TokenizeOptions, merge_dataset, tokenize_dataset
    from lwm.base.config import DistributedConfig
    from lwm.base.distributed import init_distributed
    from lwm.base.lock import output_lock
    from lwm.base.mesh import make_mesh

    output = args.out
    lock = Path(output).with_name(Path(output).name + ".lock")
    warn = lambda msg: _log(f"warning: {msg}")  # noqa: E731
    if args.subcommand == "merge":
        with output_lock(lock, what=f"'{output}'", warn=warn):
            summary = merge_dataset(output, strict=args.strict, log=_log)
        for line in summary.lines():
            _log(line)
        return 1 if args.strict and summary.failed else 0

    init_distributed(
        DistributedConfig(
            coordinator_address=args.coordinator,
            num_processes=args.num_processes,
            process_id=args.process_id,
        )
    )
    distributed = jax.process_count() > 1
    member = jax.process_index() if distributed else (args.shard[0] if args.shard else 0)
    opts = TokenizeOptions(
        input=args.input,
        output=args.out,
        vqgan=args.vqgan,
        tokenizer=args.tokenizer,
        fps=args.fps,
        max_frames=args.max_frames,
        min_frames=args.min_frames,
        workers=args.workers,
        batch_frames=args.batch_frames,
        chunk_size=args.chunk_size,
        strict=args.strict,
        progress=not args.no_progress,
        video_loss=args.video_loss,
        text_first_ratio=args.text_first_ratio,
        shard=args.shard,
    )
    # The VQGAN splits each chunk of frames over this process's devices (one mesh, built here).
    mesh = make_mesh("1,-1,1,1", devices=jax.local_devices())
    try:
        with output_lock(lock, what=f"'{output}'", member=member, warn=warn):
            summary = tokenize_dataset(opts, log=_log, mesh=mesh, distributed=distributed)
    except KeyboardInterrupt:
        _log(
            f"interrupted; the finished chunks are in {args.out}.partial, "
            "rerun the same command to continue"
        )
        return 130
    for line in summary.lines():
        _log(line)
    return 1 if args.strict and summary.failed else 0
