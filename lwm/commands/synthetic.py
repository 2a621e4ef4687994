"""Write synthetic videos of moving coloured shapes (H.264 MP4, 4:4:4) with a manifest of
captions and questions whose answers follow from the frames (`data.synthetic`):

  lwm synthetic --out runs/synthetic --count 200 --seed 0 --size 64 --frames 16

OUT/videos/NNNNN.mp4, OUT/videos.jsonl (every attribute of every video) and OUT/manifest.jsonl
(the input of `lwm tokenize`; its path is printed). A world that cannot be drawn (shapes too
large for the frame) is one error line. `--manifest shapes.jsonl --categories shape` adds a
second manifest to the same folder without rendering its videos again, and a rerun of a run
that was stopped keeps the videos it finished (OUT/videos.progress.jsonl until it ends).
"""

from __future__ import annotations

import argparse
import sys

from lwm.commands import (
    even_positive_int,
    fraction,
    fraction_range,
    non_negative_int,
    output_folder,
    positive_int,
)


def _also(text: str) -> tuple[str, tuple[str, ...]]:
    name, sep, cats = text.partition(":")
    if not sep or not name or not cats:
        raise argparse.ArgumentTypeError(
            f"expected FILE:CATEGORIES (e.g. shapes.jsonl:shape), got {text!r}"
        )
    return name, tuple(cats.split(","))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from data.synthetic import CATEGORIES, QA_LAYOUTS, RADIUS, TRAVEL

    parser.add_argument("--out", required=True, metavar="DIR", help="output folder")
    parser.add_argument(
        "--count", type=positive_int, default=100, help="number of videos (default 100)"
    )
    parser.add_argument(
        "--seed",
        type=int,
        default=0,
        help="draws every video (another seed, other videos; default 0)",
    )
    parser.add_argument(
        "--size",
        type=even_positive_int,
        default=64,
        help="frame height and width (even, at least 16; default 64)",
    )
    parser.add_argument(
        "--frames", type=positive_int, default=16, help="frames per video (at least 3; default 16)"
    )
    parser.add_argument("--fps", type=positive_int, default=8, help="frames per second (default 8)")
    parser.add_argument(
        "--needle-prob",
        type=fraction,
        default=0.5,
        help="share of the videos with a needle: a shape in a colour no other has, in one frame "
        "(default 0.5)",
    )
    parser.add_argument(
        "--max-objects",
        type=positive_int,
        default=3,
        help="moving shapes per video, at most (default 3)",
    )
    parser.add_argument(
        "--radius",
        type=fraction_range,
        default=RADIUS,
        help=f"LO,HI: shape radius as a fraction of --size (default {RADIUS[0]},{RADIUS[1]})",
    )
    parser.add_argument(
        "--travel",
        type=fraction_range,
        default=TRAVEL,
        help=f"LO,HI: distance moved, fraction of --size (default {TRAVEL[0]},{TRAVEL[1]})",
    )
    parser.add_argument(
        "--no-captions", action="store_true", help="only QA lines in the manifest, no captions"
    )
    parser.add_argument(
        "--qa-records",
        choices=QA_LAYOUTS,
        default="video",
        help="QA training records: video, one per video with all its turns in a drawn order "
        "and the turns an earlier one gives away not learned (default); kind, one per kind of "
        "question; isolated, as video with every turn learned, for training with "
        "data.qa_turns=isolated (each turn sees the video, not the other turns) or mixed; "
        "alone, as isolated with the turns an earlier one narrows marked learn: alone (not "
        "learned where data.qa_turns=mixed chains the record)",
    )
    parser.add_argument(
        "--categories",
        help="only the questions of these categories, comma-separated (of "
        + ", ".join(CATEGORIES)
        + "; default: all), e.g. shape for a shapes-first training stage",
    )
    parser.add_argument(
        "--manifest",
        default="manifest.jsonl",
        help="the manifest's file name in OUT (default manifest.jsonl); videos that OUT "
        "already holds with the same attributes are kept, not rendered again, so "
        "`--categories shape --manifest shapes.jsonl` adds a manifest to a folder of videos",
    )
    parser.add_argument(
        "--workers",
        type=non_negative_int,
        default=None,
        help="processes that draw and render the videos (default: one per CPU core for 64 "
        "videos or more, else none); the output is the same for any number",
    )
    parser.add_argument(
        "--also-manifest",
        action="append",
        default=[],
        metavar="FILE:CATEGORIES",
        type=_also,
        help="also write FILE in OUT, a manifest of the same videos with only the questions "
        "of CATEGORIES (comma-separated), e.g. shapes.jsonl:shape; repeatable",
    )


def run(args: argparse.Namespace) -> int:
    from data.synthetic import write_dataset
    from data.workers import usable_cores

    output_folder("--out", args.out)
    names = [name for name, _ in args.also_manifest]
    if len(set(names)) != len(names):
        print(f"lwm synthetic: error: --also-manifest names a file twice: {names}", file=sys.stderr)
        return 2
    workers = args.workers
    if workers is None:
        workers = usable_cores() if args.count >= 64 else 0
    try:
        manifest = write_dataset(
            args.out,
            args.count,
            args.seed,
            size=args.size,
            num_frames=args.frames,
            fps=args.fps,
            needle_prob=args.needle_prob,
            progress=True,
            captions=not args.no_captions,
            qa_layout=args.qa_records,
            categories=tuple(args.categories.split(",")) if args.categories else None,
            manifest_name=args.manifest,
            also=dict(args.also_manifest),
            workers=workers,
            max_objects=args.max_objects,
            radius=args.radius,
            travel=args.travel,
        )
    except ValueError as e:
        print(f"lwm synthetic: error: {' '.join(str(e).split())}", file=sys.stderr)
        return 2
    print(manifest)
    return 0
