"""Text-to-video on the synthetic world, end to end: captions -> a world model that draws them ->
clips scored on their pixels against their captions (`tools/eval_generate.py`).

    python recipes/text_to_video.py --vqgan runs/demo/vqgan            # the demo's VQGAN
    python recipes/text_to_video.py --out runs/t2v --videos 3000 --lm-steps 600

Each step is a command a user would type (printed before it runs), skipped or resumed when its
output exists:

 1. `lwm synthetic`: one moving shape per video (the demo's 32x32 world), a training set and a
    held-out set of another seed; only the caption lines of the training manifest are kept;
 2. the VQGAN: --vqgan (e.g. the demo's), or `lwm vqgan train` as the demo trains it;
 3. `lwm tokenize --text-first-ratio R`: a fraction R of the captions written before their video
    (``caption <vision> V </vision>``), the rest after it, as LWM trains both orders;
 4. `lwm train`: the demo's world model (configs/demo.yaml) on that dataset;
 5. `tools/eval_generate.py`: one clip per held-out caption; its dominant colour and motion
    against the caption's, next to the unconditional model and the blind baseline.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

from lwm.scripting import ROOT, check_mesh, check_vqgan, demo_vqgan_command, run_step

sys.path.insert(0, str(ROOT))
from data.synthetic import DEMO_WORLD, world_flags  # noqa: E402

# The demo's world with one shape per video.
WORLD = world_flags({**DEMO_WORLD, "max_objects": 1})


def run(cmd: list[str]) -> None:
    run_step(cmd, "text_to_video")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="runs/t2v", help="folder of every step's output")
    p.add_argument("--videos", type=int, default=2000, help="training videos")
    p.add_argument(
        "--held-out",
        type=int,
        default=200,
        help="held-out videos; each of one moving shape (about 45%%) gives a caption to draw",
    )
    p.add_argument("--frames", type=int, default=4, help="frames per video")
    p.add_argument("--vqgan", help="a trained VQGAN folder (default: train one, as the demo)")
    p.add_argument(
        "--vqgan-steps", type=int, default=500, help="training steps of the VQGAN (without --vqgan)"
    )
    p.add_argument(
        "--text-first-ratio",
        type=float,
        default=0.5,
        help="share of the captions written before their video (lwm tokenize)",
    )
    p.add_argument("--lm-steps", type=int, default=900, help="training steps of the world model")
    p.add_argument("--mesh", default="1,2,4,1", help="dp,fsdp,sp,tp of the world model")
    # The sampling that drew the caption's colour most often on the demo's world (README,
    # "lwm generate"): guidance 3 at temperature 0.3 (at temperature 1, 63%).
    p.add_argument(
        "--cfg-scale",
        type=float,
        default=3.0,
        help="classifier-free guidance of the clips (1: none)",
    )
    p.add_argument(
        "--temperature", type=float, default=0.3, help="sampling temperature of the clips"
    )
    p.add_argument(
        "--lm-set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a config override for the world model's `lwm train` (repeatable), "
        "e.g. model.vision_window=2",
    )
    args = p.parse_args()
    check_mesh("--mesh", args.mesh)
    if args.vqgan:
        check_vqgan(args.vqgan)

    out = Path(args.out)
    lwm = [sys.executable, "-m", "lwm"]
    cpu = ["--cpu-devices", str(math.prod(int(n) for n in args.mesh.split(",")))]
    start = time.perf_counter()
    train_dir, held_dir = out / "videos" / "train", out / "videos" / "held_out"

    # 1. videos; the training manifest keeps only the captions
    for folder, count, seed in ((train_dir, args.videos, 0), (held_dir, args.held_out, 1)):
        if not (folder / "manifest.jsonl").is_file():
            run(
                [*lwm, "synthetic", "--out", str(folder), "--count", str(count)]
                + ["--seed", str(seed), "--frames", str(args.frames), *WORLD]
            )
    captions = train_dir / "captions.jsonl"
    if not captions.is_file():
        lines = (train_dir / "manifest.jsonl").read_text().splitlines()
        kept = [x for x in lines if "text" in json.loads(x)]
        captions.write_text("\n".join(kept) + "\n")

    # 2. the VQGAN
    vqgan = Path(args.vqgan) if args.vqgan else out / "vqgan"
    if not args.vqgan:
        run(demo_vqgan_command(lwm, cpu, vqgan, args.vqgan_steps, train_dir / "manifest.jsonl"))

    # 3. the token dataset, captions before and after their videos
    tokens = out / "tokens"
    if not tokens.is_dir():
        run(
            [*lwm, "tokenize", "--input", str(captions), "--out", str(tokens)]
            + ["--vqgan", str(vqgan), "--text-first-ratio", str(args.text_first_ratio), *cpu]
        )

    # 4. the world model
    lm = out / "lm"
    run(
        [*lwm, "train", *cpu, "--config", "configs/demo.yaml"]
        + [f"data.source={tokens}", f"train.output_dir={lm}", f"train.steps={args.lm_steps}"]
        + [f"mesh.shape={args.mesh}", *args.lm_set]
    )

    # 5. clips from held-out captions, scored on their pixels
    run(
        [sys.executable, "tools/eval_generate.py", "--model", f"run:{lm}"]
        + ["--videos", str(held_dir / "videos.jsonl"), "--train-videos"]
        + [str(train_dir / "videos.jsonl"), "--frames", str(args.frames)]
        + ["--cfg-scale", str(args.cfg_scale), "--temperature", str(args.temperature)]
        + ["--count", str(args.held_out), "--out", str(out / "generate.jsonl")]
    )
    print(f"text_to_video: done in {time.perf_counter() - start:.0f} s; results in {out}")
    return 0


if __name__ == "__main__":
    from lwm.cli import run_reporting_errors

    raise SystemExit(run_reporting_errors("text_to_video", main, also=(ValueError,)))
