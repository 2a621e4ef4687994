"""Tokenize videos, images and text into an LWM token dataset (tfds, array_record).

  lwm tokenize --input runs/synthetic/manifest.jsonl --output runs/tokens --vqgan runs/vqgan_tiny
  lwm tokenize --input videos/ --output runs/tokens --vqgan CKPT --max-frames 32 --workers 4

INPUT is a folder (every video under it, captions from sidecar .txt files) or a JSONL manifest
with lines {"video": PATH, "text": CAPTION}, {"video": PATH, "qa": [{"question": .., "answer":
..}]}, {"image": PATH, ...} or {"text": TEXT}; relative paths are relative to the manifest.
Read OUTPUT with tfds.builder_from_directory(OUTPUT).as_data_source("train"); train on it with
`lwm train --config CONFIG data.source=OUTPUT`.

Files that fail (missing, empty, not a video, truncated, too few frames) are listed one per line
in OUTPUT.errors.txt and skipped; --strict turns any failure into exit status 1 and leaves
OUTPUT unwritten. Interrupted, the same command continues from OUTPUT.partial; OUTPUT appears
only when complete.

Many hosts (OUTPUT on a file system they all see): run the same command in every process of a
jax.distributed job (--coordinator/--num-processes/--process-id, the JAX_* environment, or a
TPU pod's hosts): each process encodes its share of the chunks on its own devices and process 0
publishes. Without JAX's coordinator (Slurm arrays, Kubernetes indexed jobs), run shard I of N
with --shard I/N, then `lwm tokenize --merge OUTPUT` once all are done. A second, unrelated
tokenize into the same OUTPUT is refused (OUTPUT.lock names the run that holds it).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from lwm.commands import add_cpu_devices, non_negative_int, positive_float, positive_int


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from data.chunk_encoder import default_workers

    parser.add_argument("--input", help="folder of videos, or a .jsonl manifest")
    parser.add_argument("--output", help="dataset folder to create")
    parser.add_argument("--vqgan", help="VQGAN checkpoint (vqgan.load_tokenizer)")
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
        help="make shard I of N (chunks c with c %% N == I) and publish nothing; then --merge",
    )
    parser.add_argument(
        "--merge",
        metavar="OUTPUT",
        help="publish OUTPUT from the chunks its shards made (no other option needed)",
    )
    parser.add_argument("--coordinator", metavar="HOST:PORT", help="jax.distributed coordinator")
    parser.add_argument("--num-processes", type=positive_int, help="processes of the job")
    parser.add_argument("--process-id", type=non_negative_int, help="this process's index")
    add_cpu_devices(parser)


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

    if args.merge:
        given = [f"--{k}" for k in ("input", "output", "vqgan", "shard") if getattr(args, k)]
        if given:
            _log(f"error: --merge takes no {', '.join(given)} (the job is in OUTPUT.partial)")
            return 2
    else:
        missing = [f"--{k}" for k in ("input", "output", "vqgan") if not getattr(args, k)]
        if missing:
            _log(f"error: the following arguments are required: {', '.join(missing)}")
            return 2
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

    output = args.merge or args.output
    lock = Path(output).with_name(Path(output).name + ".lock")
    warn = lambda msg: _log(f"warning: {msg}")  # noqa: E731
    if args.merge:
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
        output=args.output,
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
            f"interrupted; the finished chunks are in {args.output}.partial, "
            "rerun the same command to continue"
        )
        return 130
    for line in summary.lines():
        _log(line)
    return 1 if args.strict and summary.failed else 0
