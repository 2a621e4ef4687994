"""A context-extension run that shows it: video needle retrieval across lengths, before and after
a longer-context stage, as LWM shows its stages (needle heatmaps over length x depth).

    python recipes/long_context.py --vqgan runs/demo/vqgan --init runs/demo/lm   # after the demo

Without --init, stage 1 starts from scratch (and without --vqgan the script trains a VQGAN as
the demo does); README.md says what each was measured to reach.

Each step is a command a user would type (printed before it runs), skipped or resumed when its
output exists:

 1. needle videos (`lwm.needle.write_needle_videos`): long videos of the demo's 32x32 world made
    of synthetic clips, each with one needle (a shape in one of --needle-colours, which no
    other shape has, for --needle-frames frames) at a depth drawn per video, asked "What
    appeared briefly?";
    --short-frames frames for stage 1, --long-frames for stage 2 (seeds evaluation never uses);
 2. the VQGAN: --vqgan, or `lwm vqgan train` as the demo trains it;
 3. `lwm tokenize --video-loss all` of both sets (the model learns the frames too, as the
    demo's does, and the answers);
 4. stage 1: `lwm train` (configs/demo.yaml: ring attention over sp, zigzag) at
    --stage1-seq tokens, which hold a --short-frames video, from scratch or from --init (the
    demo's world model: the needle's colour is found either way, its shape is learned faster);
 5. `lwm eval needle --kind video` on lengths of 1x, 4x and 16x the short videos: the heatmap
    shows where retrieval breaks beyond the trained context;
 6. stage 2: `lwm train train.init_from=run:STAGE1` at --stage2-seq tokens (a --long-frames
    video), `model.rope_theta` times --theta-factor, on the long videos;
 7. the same evaluation, and both heatmaps side by side (``needle-before-after.png``).
"""

from __future__ import annotations

import argparse
import datetime
import math
import sys
import time
from pathlib import Path

from lwm.scripting import ROOT, check_mesh, check_vqgan, demo_vqgan_command, run_step

sys.path.insert(0, str(ROOT))
from data.synthetic import DEMO_WORLD  # noqa: E402

WORLD = DEMO_WORLD
MIN_CLIP_FRAMES = 3  # data.synthetic.sample_video's shortest video


def run(cmd: list[str]) -> None:
    run_step(cmd, "long_context")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="runs/long_context", help="folder of every step's output")
    p.add_argument("--vqgan", help="a trained VQGAN folder (default: train one, as the demo)")
    p.add_argument(
        "--vqgan-steps", type=int, default=500, help="training steps of the VQGAN (without --vqgan)"
    )
    p.add_argument(
        "--init",
        help="a run folder to start stage 1 from (e.g. runs/demo/lm, the demo's world model, "
        "which has learned shapes from its questions); needs the --vqgan it was trained with",
    )
    p.add_argument("--short-frames", type=int, default=15, help="frames of stage 1's videos")
    p.add_argument("--long-frames", type=int, default=60, help="frames of stage 2's videos")
    p.add_argument("--short-videos", type=int, default=1500, help="needle videos for stage 1")
    p.add_argument("--long-videos", type=int, default=400, help="needle videos for stage 2")
    p.add_argument(
        "--clip-frames",
        type=int,
        default=4,
        help=f"frames per synthetic clip, at least {MIN_CLIP_FRAMES}",
    )
    p.add_argument("--needle-frames", type=int, default=2, help="frames the needle is shown for")
    p.add_argument(
        "--needle-radius",
        default="0.3,0.35",
        help="the needle's radius range, of the frame (the world's shapes: 0.14-0.18; at "
        "0.2-0.25 stage 1 calls most square needles circles)",
    )
    p.add_argument(
        "--needle-colours",
        default="white,cyan",
        help="the needles' colours, which no shape of the haystack has ('' for any colour, "
        "which the haystack then avoids: finding the rare colour, not learned in stage 1)",
    )
    p.add_argument("--stage1-seq", type=int, default=1024, help="tokens per row in stage 1")
    p.add_argument("--stage2-seq", type=int, default=4096, help="tokens per row in stage 2")
    p.add_argument("--stage1-steps", type=int, default=500, help="training steps of stage 1")
    p.add_argument("--stage2-steps", type=int, default=150, help="training steps added by stage 2")
    p.add_argument("--stage2-batch", type=int, default=2, help="rows per batch in stage 2")
    p.add_argument("--theta-factor", type=float, default=4.0, help="stage 2's rope_theta x")
    p.add_argument("--samples", type=int, default=4, help="needle videos per heatmap cell")
    p.add_argument("--mesh", default="2,1,2,1", help="dp,fsdp,sp,tp of stage 1")
    p.add_argument(
        "--stage2-mesh",
        default="1,1,2,1",
        help="dp,fsdp,sp,tp of stage 2 (on 4 simulated devices of a 2-core machine, stage 2's "
        "4,096-token rows stopped in XLA's CPU collectives: a device never joined a ring step)",
    )
    args = p.parse_args()
    if args.init and not args.vqgan:
        p.error("--init needs --vqgan: the VQGAN whose codes the run was trained on")
    check_mesh("--mesh", args.mesh)
    check_mesh("--stage2-mesh", args.stage2_mesh)
    if args.vqgan:
        check_vqgan(args.vqgan)
    if args.clip_frames < MIN_CLIP_FRAMES:
        raise ValueError(
            f"--clip-frames {args.clip_frames} is below {MIN_CLIP_FRAMES}, the shortest clip"
        )

    from lwm.config import load_config
    from lwm.needle import NeedleReport, side_by_side, write_needle_videos

    out = Path(args.out)
    lwm = [sys.executable, "-m", "lwm"]

    def cpu_devices(mesh: str) -> list[str]:
        return ["--cpu-devices", str(math.prod(int(n) for n in mesh.split(",")))]

    cpu = cpu_devices(args.mesh)
    needle_radius = tuple(float(x) for x in args.needle_radius.split(","))
    needle_colours = [c for c in args.needle_colours.split(",") if c] or None
    video = dict(
        clip_frames=args.clip_frames,
        needle_frames=args.needle_frames,
        needle_radius=needle_radius,
        needle_colours=needle_colours,
        **WORLD,
    )
    start = time.perf_counter()

    # 1. needle videos for both stages
    sets = {"short": (args.short_frames, args.short_videos, 1000)}
    sets["long"] = (args.long_frames, args.long_videos, 1_000_000)
    for name, (frames, count, seed) in sets.items():
        folder = out / "videos" / name
        if not (folder / "manifest.jsonl").is_file():
            print(f"\n# {count} needle videos of {frames} frames -> {folder}", flush=True)
            write_needle_videos(
                folder, count=count, frames=frames, seed=seed, progress=True, **video
            )

    # 2. the VQGAN
    vqgan = Path(args.vqgan) if args.vqgan else out / "vqgan"
    if not args.vqgan:
        short = out / "videos" / "short" / "manifest.jsonl"
        run(demo_vqgan_command(lwm, cpu, vqgan, args.vqgan_steps, short))

    # 3. token datasets
    for name in sets:
        tokens = out / "tokens" / name
        if not tokens.is_dir():
            run(
                [*lwm, "tokenize", "--input", str(out / "videos" / name / "manifest.jsonl")]
                + ["--out", str(tokens), "--vqgan", str(vqgan), "--video-loss", "all", *cpu]
            )

    # 4. stage 1 at the short context
    stage1, stage2 = out / "stage1", out / "stage2"
    train = [*lwm, "train", "--config", "configs/demo.yaml"]
    run(
        [*train, *cpu, f"mesh.shape={args.mesh}"]
        + [f"data.source={out / 'tokens' / 'short'}", f"train.output_dir={stage1}"]
        + [f"train.seq_len={args.stage1_seq}", f"model.max_seq_len={args.stage1_seq}"]
        + [f"train.steps={args.stage1_steps}"]
        + ([f"train.init_from=run:{args.init}"] if args.init else [])
    )

    # 5, 7. the video needle on 1x, 4x, 16x the short videos, before and after stage 2
    lengths = [args.short_frames, 4 * args.short_frames, 16 * args.short_frames]
    lengths = sorted({*lengths, args.long_frames})

    def evaluate(model: Path, name: str) -> Path:
        target = out / name
        if not (target / "needle-video.jsonl").is_file():
            run(
                [*lwm, "eval", "needle", "--model", f"run:{model}", "--kind", "video"]
                + ["--lengths", ",".join(map(str, lengths)), "--samples", str(args.samples)]
                + ["--clip-frames", str(args.clip_frames)]
                + ["--needle-frames", str(args.needle_frames)]
                + ["--needle-radius", args.needle_radius, "--max-new-tokens", "8"]
                + (["--needle-colours", args.needle_colours] if needle_colours else [])
                + ["--prefill-chunk", "1024", "--batch-size", str(5 * args.samples)]
                + ["--out", str(target)]
            )
        return target / "needle-video.jsonl"

    before = evaluate(stage1, "needle_before")

    # 6. stage 2 at the long context, from stage 1's weights
    theta = load_config("configs/demo.yaml").model.rope_theta * args.theta_factor
    run(
        [*train, *cpu_devices(args.stage2_mesh), f"mesh.shape={args.stage2_mesh}"]
        + [f"data.source={out / 'tokens' / 'long'}", f"train.output_dir={stage2}"]
        + [f"train.init_from=run:{stage1}", f"model.rope_theta={theta}"]
        + [f"train.seq_len={args.stage2_seq}", f"model.max_seq_len={args.stage2_seq}"]
        + [f"train.steps={args.stage2_steps}", f"train.batch_size={args.stage2_batch}"]
    )
    after = evaluate(stage2, "needle_after")

    png = out / "needle-before-after.png"
    grid = f"video needle, {args.samples} per cell, {datetime.date.today().isoformat()}"
    panels = [
        (NeedleReport.read_jsonl(before), f"run:{stage1}: {args.stage1_seq} tokens "
         f"({args.short_frames} frames), {args.stage1_steps} steps\n{grid}"),
        (NeedleReport.read_jsonl(after), f"run:{stage2}: {args.stage2_seq} tokens "
         f"({args.long_frames} frames), rope_theta {theta:g}, +{args.stage2_steps} steps\n{grid}"),
    ]  # fmt: skip
    side_by_side(png, panels)
    for report, title in panels:
        print(f"\n{title}\n{report.table()}")
    print(f"\nlong_context: done in {time.perf_counter() - start:.0f} s; heatmaps: {png}")
    return 0


if __name__ == "__main__":
    from lwm.cli import run_reporting_errors

    raise SystemExit(run_reporting_errors("long_context", main, also=(ValueError,)))
