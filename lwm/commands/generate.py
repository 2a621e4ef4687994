"""Generate a video from a caption with a trained model (text-to-video).

  lwm generate --model run:runs/t2v/lm --prompt "One shape on a dark background: a red circle moving left." \\
      --frames 4 --out clip.mp4
  lwm generate --model run:runs/t2v/lm --prompt "..." --frames 1 --out frame.png

The prompt is a caption-first record up to its <vision> (what `lwm tokenize --text-first-ratio`
trains on); the model samples --frames frames of VQGAN codes (temperature --temperature, top-k
--top-k, classifier-free guidance --cfg-scale against the prompt without the caption; 1 = none)
and the VQGAN decodes them (`lwm.text_to_video`). The clip is an H.264 MP4 (4:4:4 colour below
128 pixels, where 4:2:0 would smear the colour of every edge), or a PNG for one frame. --samples
K writes K clips, OUT's name numbered (clip-0.mp4, clip-1.mp4, ..). One JSON line per file.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from lwm.commands import (
    non_negative_float,
    non_negative_int,
    output_file,
    positive_float,
    positive_int,
)
from lwm.commands.eval import add_model_source_arguments


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_source_arguments(parser)
    parser.add_argument("--prompt", required=True, help="the caption of the video to make")
    parser.add_argument("--frames", type=positive_int, default=4, help="frames (default 4)")
    parser.add_argument(
        "--out", required=True, metavar="FILE", help="the .mp4 (or, for one frame, .png) to write"
    )
    parser.add_argument("--samples", type=positive_int, default=1, help="clips to make (default 1)")
    parser.add_argument(
        "--cfg-scale",
        type=positive_float,
        default=1.0,
        help="classifier-free guidance scale (default 1: the conditional model alone)",
    )
    parser.add_argument(
        "--temperature", type=non_negative_float, default=1.0, help="0 = greedy (default 1)"
    )
    parser.add_argument(
        "--top-k",
        type=non_negative_int,
        default=0,
        help="sample from the k likeliest codes (0, or more than there are: from all)",
    )
    parser.add_argument("--seed", type=int, default=0, help="draws the sampled codes (default 0)")
    parser.add_argument(
        "--fps", type=positive_int, default=8, help="frame rate of the MP4 (default 8)"
    )


def _log(msg: str) -> None:
    print(f"lwm generate: {msg}", file=sys.stderr, flush=True)


def _targets(out: Path, samples: int) -> list[Path]:
    if samples == 1:
        return [out]
    return [out.with_name(f"{out.stem}-{i}{out.suffix}") for i in range(samples)]


def run(args: argparse.Namespace) -> int:
    from lwm.base.media import write_mp4, write_png
    from lwm.base.mesh import make_mesh
    from lwm.generate import Sampling
    from lwm.text_to_video import load_video_generator

    out = output_file("--out", args.out, (".mp4", ".png"))
    suffix = out.suffix.lower()
    problem = None
    if suffix == ".png" and args.frames != 1:
        problem = f"--out '{out}' is a PNG, which holds one frame; --frames is {args.frames}"
    elif not out.parent.is_dir():
        problem = f"--out '{out}': the folder '{out.parent}' does not exist"
    if problem:
        print(f"lwm generate: error: {problem}", file=sys.stderr)
        return 2
    try:
        gen = load_video_generator(
            args.model,
            config=args.config,
            mesh=make_mesh(args.mesh) if args.mesh else None,
            vqgan=args.vqgan,
            tokenizer=args.tokenizer,
            log=_log,
            cfg_scale=args.cfg_scale,
            sampling=Sampling(temperature=args.temperature, top_k=args.top_k),
            batch_size=args.samples,
            seed=args.seed,
        )
        _log(f"sampling {args.samples} clip(s) of {args.frames} frame(s)")
        clips = gen.frames([args.prompt] * args.samples, args.frames)
    except (ValueError, FileNotFoundError) as e:
        print(f"lwm generate: error: {' '.join(str(e).split())}", file=sys.stderr)
        return 2
    for path, clip in zip(_targets(out, args.samples), clips, strict=True):
        if suffix == ".png":
            write_png(path, clip[0])
        else:
            small = min(clip.shape[1:3]) < 128
            write_mp4(path, clip, fps=args.fps, pix_fmt="yuv444p" if small else "yuv420p")
        print(json.dumps({"prompt": args.prompt, "frames": len(clip), "out": str(path)}))
    return 0
