"""Evaluate a trained model.

  lwm eval qa --model run:runs/demo/lm --manifest held_out/manifest.jsonl
  lwm eval qa --model run:runs/demo/lm --manifest held_out/manifest.jsonl \\
      --train-manifest train/manifest.jsonl --out qa.jsonl

`needle`: needle-in-a-haystack on a grid of lengths x depths (`lwm.needle`): --kind text (LWM's
"special magic number" in a haystack of --lengths tokens), multi (--needles inserted, --asked
asked) or video (a long video of --lengths frames of synthetic clips with one needle shown for
--needle-frames frames); answers as JSON lines and a heatmap PNG in --out.

  lwm eval needle --model run:runs/demo/lm --kind text --lengths 500,1000,2000 --out runs/needle
  lwm eval needle --model run:runs/demo/lm --kind video --lengths 4,8,16 --samples 4 --out runs/needle

`qa`: every question of a QA manifest, scored per category under three conditions: the model
with the right video, the model with another video of the set (the swap ablation: answers are
scored against the right video's answers), and a blind baseline that never sees a video (the
most frequent answer per question text in --train-manifest; by default the manifest the run's
training dataset was tokenized from). One JSON line per question and condition, then a summary
line, go to stdout (or --out); the table goes to stderr. Each question is asked alone, as
`lwm ask` asks it; with --chat each video's questions are asked in one conversation, in the
manifest's order, each after the model's own earlier answers, as `lwm chat` asks them (in the
swap ablation, one conversation about the other video).

Videos are sampled as the run's training dataset was (its metadata) unless --max-frames/--fps
say otherwise; --vqgan and --tokenizer default to the dataset's too. Each --kind of `needle`
takes only its own options (--haystack: text and multi; --needles, --asked: multi; --vqgan,
--clip-frames and the other shape options: video); one given for another kind is an error. --model takes run:DIR (an
`lwm train` output) or any weights source with --config (hf:, lwm:/params::, orbax:).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

from data.synthetic import DEMO_WORLD
from lwm.commands import (
    add_cpu_devices,
    add_mesh,
    fraction_range,
    non_negative_float,
    output_file,
    output_folder,
    parse_subcommand,
    positive_float,
    positive_int,
    top_p,
)

SUBCOMMANDS: dict[str, argparse.ArgumentParser] = {}


def add_model_source_arguments(p: argparse.ArgumentParser, *, vqgan: bool = True) -> None:
    """The options of every verb that runs a trained model: which model, VQGAN (``vqgan``:
    here; else the verb adds it where it fits), tokenizer and mesh."""
    p.add_argument("--model", required=True, help="run:DIR, or hf:/lwm:/orbax: with --config")
    p.add_argument(
        "--config", metavar="FILE", help="model config (needed unless --model is run:DIR)"
    )
    if vqgan:
        p.add_argument(
            "--vqgan", metavar="DIR", help="VQGAN folder (default: the one of the training dataset)"
        )
    p.add_argument(
        "--tokenizer", metavar="DIR", help="text tokenizer folder (default: the training dataset's)"
    )
    add_mesh(p, "the device mesh to shard the model over (default: 1 device)")
    add_cpu_devices(p)


def add_model_arguments(
    p: argparse.ArgumentParser,
    *,
    videos: bool = True,
    batch: bool = True,
    prefill_chunk: str = "the whole prompt at once",
) -> None:
    """The options `lwm ask`, `lwm chat` and `lwm eval` share: which model, how videos become
    prompts (``videos``: from video files), how answers are decoded (``batch``: several
    prompts per call; ``prefill_chunk``: what its default is)."""
    add_model_source_arguments(p, vqgan=videos)
    if videos:
        p.add_argument(
            "--max-frames",
            type=positive_int,
            metavar="N",
            help="frames per video, evenly spaced (default: as the training dataset was sampled)",
        )
        p.add_argument(
            "--fps", type=positive_float, help="frame rate to sample at (default: as in training)"
        )
    p.add_argument(
        "--max-new-tokens",
        type=positive_int,
        default=16,
        metavar="N",
        help="the most tokens an answer may have (default 16)",
    )
    p.add_argument("--temperature", type=non_negative_float, default=0.0, help="0 = greedy")
    p.add_argument(
        "--top-p",
        type=top_p,
        default=1.0,
        help="sample from the likeliest tokens whose probabilities sum to this (default 1: all)",
    )
    if batch:
        p.add_argument(
            "--batch-size",
            type=positive_int,
            default=32,
            metavar="N",
            help="prompts per generate call (default 32)",
        )
    p.add_argument(
        "--prefill-chunk",
        type=positive_int,
        metavar="N",
        help="prefill prompts in chunks of N tokens (bounds memory by the cache, not the prompt; "
        f"default: {prefill_chunk})",
    )


# `lwm eval needle`'s options that one --kind uses or some: option -> (dest, kinds, default)
NEEDLE_OPTIONS: dict[str, tuple[str, tuple[str, ...], object]] = {}


def _needle_option(
    group, option: str, kinds: tuple[str, ...], default=None, *, help: str, **kwargs
) -> None:
    """An option of the needle kinds ``kinds`` only: given with another --kind, an error."""
    action = group.add_argument(option, default=argparse.SUPPRESS, help=help, **kwargs)
    NEEDLE_OPTIONS[option] = (action.dest, kinds, default)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="subcommand", required=True, metavar="SUBCOMMAND")
    p = sub.add_parser(
        "qa",
        help="QA accuracy per category: model, swapped videos, blind",
        description="QA accuracy per category: model, swapped videos, blind",
    )
    add_model_arguments(p)
    p.add_argument(
        "--manifest", required=True, metavar="FILE", help="JSONL with QA lines (held-out videos)"
    )
    p.add_argument(
        "--train-manifest",
        help="training QA manifest for the blind baseline (default: the dataset's input)",
    )
    p.add_argument("--no-swap", action="store_true", help="skip the video-swap ablation")
    p.add_argument(
        "--chat",
        action="store_true",
        help="ask each video's questions one after another in one conversation, in the "
        "manifest's order, each after the model's own earlier answers (as `lwm chat` does; "
        "default: each question alone, as `lwm ask` does)",
    )
    p.add_argument("--out", metavar="FILE", help="write the JSON lines here instead of stdout")
    SUBCOMMANDS["qa"] = p

    p = sub.add_parser(
        "needle",
        help="needle in a haystack (text, multi, video): a heatmap",
        description="needle in a haystack (text, multi, video): a heatmap",
    )
    add_model_arguments(p, videos=False)
    p.add_argument(
        "--kind",
        choices=("text", "multi", "video"),
        default="text",
        help="text: one number hidden in text; multi: --needles hidden, --asked asked; video: "
        "frames of another shape's colour among the clips' frames (default text)",
    )
    p.add_argument(
        "--lengths",
        type=_numbers(int),
        required=True,
        help="context lengths: prompt tokens (text, multi) or frames (video), e.g. 1000,4000",
    )
    p.add_argument(
        "--depths",
        type=_numbers(float),
        default=[0.0, 0.25, 0.5, 0.75, 1.0],
        help="needle depths in [0, 1] (default 0,0.25,0.5,0.75,1)",
    )
    p.add_argument("--samples", type=positive_int, default=1, help="cases per cell (default 1)")
    p.add_argument(
        "--seed", type=int, default=0, help="draws the needles and their places (default 0)"
    )
    p.add_argument(
        "--out", required=True, metavar="DIR", help="folder for needle-KIND.jsonl and .png"
    )
    NEEDLE_OPTIONS.clear()
    text = p.add_argument_group("--kind text and multi")
    _needle_option(
        text,
        "--haystack",
        ("text", "multi"),
        metavar="FILE",
        help="text file of the haystack (default: lwm/haystack.txt)",
    )
    multi = p.add_argument_group("--kind multi")
    _needle_option(
        multi, "--needles", ("multi",), 4, type=positive_int, help="needles inserted (default 4)"
    )
    _needle_option(
        multi, "--asked", ("multi",), 2, type=positive_int, help="needles asked (default 2)"
    )
    video = p.add_argument_group("--kind video")
    _needle_option(
        video,
        "--vqgan",
        ("video",),
        metavar="DIR",
        help="VQGAN folder (default: the one of the training dataset)",
    )
    _needle_option(
        video,
        "--clip-frames",
        ("video",),
        4,
        type=positive_int,
        help="frames per clip (at least 3; default 4)",
    )
    _needle_option(
        video, "--needle-frames", ("video",), 1, type=positive_int, help="needle frames (default 1)"
    )
    _needle_option(
        video,
        "--max-objects",
        ("video",),
        DEMO_WORLD["max_objects"],
        type=positive_int,
        help="shapes per clip (default: the demo's world)",
    )
    _needle_option(
        video,
        "--radius",
        ("video",),
        tuple(DEMO_WORLD["radius"]),
        type=fraction_range,
        help="LO,HI, shape radius range (default: the demo's world)",
    )
    _needle_option(
        video,
        "--needle-radius",
        ("video",),
        type=fraction_range,
        help="LO,HI, the needle's radius range (default: --radius)",
    )
    _needle_option(
        video,
        "--needle-colours",
        ("video",),
        type=_names,
        help="the needle's colours, which no shape of the haystack has (e.g. white,cyan; "
        "default: any colour, which the haystack then avoids)",
    )
    SUBCOMMANDS["needle"] = p


def _numbers(kind):
    def parse(text: str) -> list:
        try:
            values = [kind(x) for x in text.split(",") if x.strip()]
        except ValueError:
            values = []
        if not values:
            raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}")
        return values

    return parse


def _names(text: str) -> list[str]:
    names = [x.strip() for x in text.split(",") if x.strip()]
    if not names:
        raise argparse.ArgumentTypeError(f"expected comma-separated names, got {text!r}")
    return names


def parse_args(parser: argparse.ArgumentParser, argv: Sequence[str]) -> argparse.Namespace:
    return parse_subcommand(parser, SUBCOMMANDS, argv)


def load_video_qa(args: argparse.Namespace, log, *, vqgan: bool = True):
    """`lwm.vision_qa.load_video_qa` with the options of `add_model_arguments`; the mesh is
    built here, once, and passed down. ``vqgan=False``: text prompts only."""
    from lwm.base.mesh import make_mesh
    from lwm.generate import Sampling
    from lwm.vision_qa import load_video_qa as load

    return load(
        args.model,
        config=args.config,
        mesh=make_mesh(args.mesh) if args.mesh else None,
        vqgan=args.vqgan if vqgan else False,
        tokenizer=args.tokenizer,
        max_frames=getattr(args, "max_frames", None),
        fps=getattr(args, "fps", None),
        log=log,
        max_new_tokens=args.max_new_tokens,
        sampling=Sampling(temperature=args.temperature, top_p=args.top_p),
        batch_size=getattr(args, "batch_size", 1),
        prefill_chunk=args.prefill_chunk,
        prompt=getattr(args, "prompt", "record"),
    )


def _log(msg: str) -> None:
    print(f"lwm eval: {msg}", file=sys.stderr, flush=True)


def run(args: argparse.Namespace) -> int:
    if args.subcommand == "needle":
        return _needle(args)
    from lwm.qa_eval import BlindBaseline, evaluate, read_questions, swap_videos

    if args.out:
        output_file("--out", args.out)
    for flag, path in (("--manifest", args.manifest), ("--train-manifest", args.train_manifest)):
        if path and not Path(path).exists():  # before the model loads, naming the flag
            raise FileNotFoundError(f"{flag} '{path}' not found")
    try:
        questions = read_questions(args.manifest)
        try:  # before the model loads: the ablation's own check
            if not args.no_swap:
                swap_videos([q.video for q in questions])
        except ValueError:
            raise ValueError(
                f"--manifest '{args.manifest}' asks about one video; the video-swap ablation "
                "needs two: ask about another video too, or give --no-swap"
            ) from None
        qa, inputs = load_video_qa(args, _log)
        train_manifest = args.train_manifest or inputs.get("manifest")
        blind = None
        if train_manifest:
            blind = BlindBaseline.from_manifest(train_manifest)
        else:
            _log("no training manifest (--train-manifest): the blind baseline is left out")
        _log(f"{len(questions)} questions about {len({q.video for q in questions})} videos")
        answer = qa.answer_in_conversations if args.chat else qa.answer
        report = evaluate(questions, answer, blind=blind, swap=not args.no_swap)
    except (ValueError, FileNotFoundError) as e:
        print(f"lwm eval: error: {' '.join(str(e).split())}", file=sys.stderr)
        return 2
    if args.out:
        report.write_jsonl(args.out)
    else:
        for r in report.records:
            print(json.dumps(r))
        print(json.dumps(report.summary()))
    print(report.table(), file=sys.stderr)
    return 0


def _needle(args: argparse.Namespace) -> int:
    import datetime

    from lwm.needle import (
        Haystack,
        check_grid,
        check_needle_colours,
        evaluate_needles,
        text_cases,
        video_cases,
    )

    for option, (dest, kinds, default) in NEEDLE_OPTIONS.items():
        if not hasattr(args, dest):
            setattr(args, dest, default)
        elif args.kind not in kinds:
            print(
                f"lwm eval: error: {option} is an option of --kind {' and '.join(kinds)}, "
                f"not of --kind {args.kind}",
                file=sys.stderr,
            )
            return 2
    output_folder("--out", args.out)
    what = None
    if args.kind == "multi" and args.asked > args.needles:
        what = f"--asked {args.asked} is more than --needles {args.needles}"
    elif args.kind == "video" and args.clip_frames < 3:  # the synthetic world's least
        what = f"--clip-frames must be at least 3 (a clip's motion), not {args.clip_frames}"
    try:
        check_grid(args.lengths, args.depths)  # the cases check it too, after the model loads
    except ValueError as e:
        what = str(e)
    if what:
        print(f"lwm eval: error: {what}", file=sys.stderr)
        return 2
    try:  # before the model loads
        check_needle_colours(args.needle_colours)
    except ValueError as e:
        print(f"lwm eval: error: --needle-colours: {e}", file=sys.stderr)
        return 2
    try:
        common = dict(lengths=args.lengths, depths=args.depths, samples=args.samples)
        if args.kind != "video":  # its lengths and haystack checked before the model loads
            from lwm.vision_qa import text_codec_for

            codec = text_codec_for(args.model, config=args.config, tokenizer=args.tokenizer)
            multi = args.kind == "multi"
            cases = text_cases(
                codec,
                **common,
                needles=args.needles if multi else 1,
                asked=args.asked if multi else 1,
                haystack=Haystack.from_file(codec, args.haystack),
                seed=args.seed,
            )
        qa, _ = load_video_qa(args, _log, vqgan=args.kind == "video")
        if args.kind == "video":
            cases = video_cases(
                qa.codec,
                qa.vqgan,
                **common,
                seed=args.seed,
                size=qa.vqgan.resolution,
                clip_frames=args.clip_frames,
                needle_frames=args.needle_frames,
                max_objects=args.max_objects,
                radius=args.radius,
                travel=DEMO_WORLD["travel"],
                needle_radius=args.needle_radius,
                needle_colours=args.needle_colours,
            )
        report = evaluate_needles(qa, cases, log=_log)
    except (ValueError, FileNotFoundError) as e:
        print(f"lwm eval: error: {' '.join(str(e).split())}", file=sys.stderr)
        return 2
    out = Path(args.out)
    jsonl, png = out / f"needle-{args.kind}.jsonl", out / f"needle-{args.kind}.png"
    report.write_jsonl(jsonl)
    today = datetime.date.today().isoformat()
    grid = f"{len(args.lengths)} lengths x {len(args.depths)} depths, {args.samples} per cell"
    report.heatmap(png, title=f"{args.kind} needle: {args.model}\n{grid}, {today}")
    print(report.table(), file=sys.stderr)
    print(json.dumps(report.summary()))
    _log(f"wrote {jsonl} and {png}")
    return 0
