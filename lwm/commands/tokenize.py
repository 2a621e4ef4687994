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
"""

from __future__ import annotations

import argparse
import sys

from lwm.commands import non_negative_int, positive_float, positive_int


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--input", required=True, help="folder of videos, or a .jsonl manifest")
    parser.add_argument("--output", required=True, help="dataset folder to create")
    parser.add_argument("--vqgan", required=True, help="VQGAN checkpoint (vqgan.load_tokenizer)")
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
        default=2,
        help="decoding processes (0: decode in the main process; default 2)",
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
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")


def run(args: argparse.Namespace) -> int:
    from data.manifest import ManifestError
    from data.tokenize_dataset import TokenizeError, TokenizeOptions, tokenize_dataset
    from lwm.base.mesh import make_mesh

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
    )
    try:
        # The VQGAN splits each chunk of frames over every device (one mesh, built here).
        summary = tokenize_dataset(opts, mesh=make_mesh("1,-1,1,1"))
    except (TokenizeError, ManifestError) as e:
        print(f"lwm tokenize: error: {e}", file=sys.stderr)
        return 2 if isinstance(e, ManifestError) else 1
    except KeyboardInterrupt:
        print(
            f"lwm tokenize: interrupted; the finished chunks are in {args.output}.partial, "
            "rerun the same command to continue",
            file=sys.stderr,
        )
        return 130
    for line in summary.lines():
        print(f"lwm tokenize: {line}", file=sys.stderr)
    return 1 if args.strict and summary.failed else 0
