"""Score text-to-video generation on the synthetic world: does the clip show what the caption says?

    python tools/eval_generate.py --model run:runs/t2v/lm --videos runs/t2v/videos/held_out/videos.jsonl \\
        --train-videos runs/t2v/videos/train/videos.jsonl --frames 4 --out runs/t2v/generate.jsonl

Every held-out video of one moving shape (no needle) gives a prompt, its caption ("One shape on
a dark background: a red circle moving left."). The model generates a clip for it
(`lwm.text_to_video`), and the clip's pixels are read as `data.synthetic_check` reads any
frames: its dominant colour (the palette colour with the most pixels) must be the caption's
(chance 1 in 8), and the object of that colour must move in the caption's direction (chance 1
in 4). Side by side, as every learning claim here is reported:

- ``model``: clips generated from the captions;
- ``unconditional``: the same model, prompted without the caption (BOS, <vision>): the input
  removed, scored against the same captions;
- ``blind``: always the most frequent colour and direction of the training videos
  (--train-videos), a baseline that never sees the prompt;
- ``reconstructed``: the held-out videos themselves through the VQGAN (encode, decode), the
  ceiling that codes of this VQGAN allow.

One JSON line per prompt and condition, then a summary line per condition, go to --out (or
stdout); the table goes to stderr.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from data.synthetic_check import colour_pixels, observe  # noqa: E402


def read_specs(path: str) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def prompts_of(specs: list[dict]) -> list[dict]:
    """The one-shape, needle-free videos: their caption, colour, direction and file."""
    out = []
    for s in specs:
        if len(s["objects"]) == 1 and s["needle"] is None:
            o = s["objects"][0]
            fields = {"caption": s["caption"], "colour": o["colour"], "direction": o["direction"]}
            out.append({**fields, "video": s["video"]})
    return out


def score_clip(clip: np.ndarray, colour: str, direction: str) -> dict:
    counts = colour_pixels(clip)
    dominant = next(iter(counts), None)
    seen = observe(clip).objects.get(dominant) if dominant else None
    moved = seen.direction if seen is not None else None
    return {
        "dominant": dominant,
        "moved": moved,
        "colour_ok": dominant == colour,
        "direction_ok": dominant == colour and moved == direction,
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="run:DIR (or a weights source with --config)")
    p.add_argument("--config", help="the model's config, when --model is a weights source")
    p.add_argument("--vqgan", help="default: the training dataset's")
    p.add_argument("--videos", required=True, help="held-out videos.jsonl of `lwm synthetic`")
    p.add_argument("--train-videos", help="training videos.jsonl, for the blind baseline")
    p.add_argument("--count", type=int, default=64, help="prompts at most (default 64)")
    p.add_argument("--frames", type=int, default=4, help="frames per generated clip (default 4)")
    p.add_argument(
        "--cfg-scale",
        type=float,
        default=1.0,
        help="classifier-free guidance against the prompt without the caption (default 1: none)",
    )
    p.add_argument(
        "--temperature", type=float, default=1.0, help="sampling temperature (0: greedy; default 1)"
    )
    p.add_argument(
        "--top-k", type=int, default=0, help="sample from the K likeliest codes (default 0: all)"
    )
    p.add_argument(
        "--batch-size", type=int, default=16, help="captions per generate call (default 16)"
    )
    p.add_argument("--seed", type=int, default=0, help="draws the sampled codes (default 0)")
    p.add_argument("--mesh", help="dp,fsdp,sp,tp (default: one device)")
    p.add_argument("--out", help="JSON lines here instead of stdout")
    args = p.parse_args()

    from lwm.base.mesh import make_mesh
    from lwm.generate import Sampling
    from lwm.text_to_video import load_video_generator

    prompts = prompts_of(read_specs(args.videos))[: args.count]
    train = prompts_of(read_specs(args.train_videos)) if args.train_videos else None
    for flag, given, found in (
        ("--videos", args.videos, prompts),
        ("--train-videos", args.train_videos, train),
    ):
        if found is not None and not found:  # before the model loads
            print(f"eval_generate: error: {flag}: no one-shape video in {given}", file=sys.stderr)
            return 2
    gen = load_video_generator(
        args.model,
        config=args.config,
        mesh=make_mesh(args.mesh) if args.mesh else None,
        vqgan=args.vqgan,
        log=lambda m: print(f"eval_generate: {m}", file=sys.stderr),
        cfg_scale=args.cfg_scale,
        sampling=Sampling(temperature=args.temperature, top_k=args.top_k),
        batch_size=args.batch_size,
        seed=args.seed,
    )
    records = []
    conditions = {
        "model": [q["caption"] for q in prompts],
        "unconditional": [None] * len(prompts),
    }
    for condition, captions in conditions.items():
        clips = gen.frames(captions, args.frames)
        for q, clip in zip(prompts, clips, strict=True):
            records.append(
                {"condition": condition, **q, **score_clip(clip, q["colour"], q["direction"])}
            )
    from lwm.base.media import read_video

    folder = Path(args.videos).parent
    real = np.stack([read_video(folder / q["video"])[: args.frames] for q in prompts])
    for q, clip in zip(prompts, gen.vqgan.decode(gen.vqgan.encode(real)), strict=True):
        records.append(
            {"condition": "reconstructed", **q, **score_clip(clip, q["colour"], q["direction"])}
        )
    if train:
        colour = Counter(t["colour"] for t in train).most_common(1)[0][0]
        direction = Counter(t["direction"] for t in train).most_common(1)[0][0]
        for q in prompts:
            ok = q["colour"] == colour
            records.append(
                {
                    "condition": "blind",
                    **q,
                    "dominant": colour,
                    "moved": direction,
                    "colour_ok": ok,
                    "direction_ok": ok and q["direction"] == direction,
                }
            )
    summaries = []
    for condition in dict.fromkeys(r["condition"] for r in records):
        rows = [r for r in records if r["condition"] == condition]
        summaries.append(
            {
                "summary": condition,
                "prompts": len(rows),
                "colour_accuracy": sum(r["colour_ok"] for r in rows) / len(rows),
                "colour_and_direction_accuracy": sum(r["direction_ok"] for r in rows) / len(rows),
                "model": args.model,
                "frames": args.frames,
                "cfg_scale": args.cfg_scale,
                "temperature": args.temperature,
            }
        )
    lines = [json.dumps(r) for r in records + summaries]
    if args.out:
        Path(args.out).write_text("\n".join(lines) + "\n")
    else:
        print("\n".join(lines))
    print(f"{'condition':<14} {'colour':>12} {'colour+direction':>18}", file=sys.stderr)
    for s in summaries:
        n = s["prompts"]
        c, d = round(s["colour_accuracy"] * n), round(s["colour_and_direction_accuracy"] * n)
        print(
            f"{s['summary']:<14} {c:>5}/{n:<3} {c / n:4.0%} {d:>8}/{n:<3} {d / n:4.0%}",
            file=sys.stderr,
        )
    return 0


if __name__ == "__main__":
    from lwm.cli import run_reporting_errors

    raise SystemExit(run_reporting_errors("eval_generate", main, also=(ValueError,)))
