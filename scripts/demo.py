"""The end-to-end demo, run by the README's first command: videos -> VQGAN -> token dataset ->
a world model trained with ring attention on 8 (simulated) devices -> answers to questions
about videos it has never seen.

    python scripts/demo.py                 # everything under runs/demo (about 10 min, 2 cores)
    python scripts/demo.py --out /tmp/d --videos 64 --lm-steps 60      # smaller, faster

Each step is a command a user would type (printed before it runs) and is skipped or resumed
when its output already exists, so rerunning the demo continues where it stopped:

 1. `python -m data.synthetic`: short MP4 videos of moving coloured shapes, with captions and
    question/answer pairs whose answers follow from the frames (a training set and a held-out
    set).
 2. `lwm vqgan train`: the small VQGAN (32x32 frames, 8x8 codes, 512 codes) from scratch.
 3. `lwm tokenize`: videos + captions + QA to an LWM token dataset (array_record).
 4. `lwm train`: the `tiny` world model on that dataset, ring attention over `sp`, zigzag
    layout, on a (1, 2, 4, 1) mesh of 8 simulated CPU devices.
 5. `lwm ask`: questions about the held-out videos; prints each answer and the accuracy.

A few minutes of CPU training gives a model that has learnt the format (answers are short
phrases of the right kind, and stop); how often they are right is what the accuracy line says.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run(cmd: list[str], *, env: dict[str, str], capture: bool = False) -> str:
    print(f"\n$ {shlex.join(cmd)}", flush=True)
    t0 = time.perf_counter()
    result = subprocess.run(
        cmd, cwd=ROOT, env=env, text=True, stdout=subprocess.PIPE if capture else None
    )
    if result.returncode != 0:
        print(f"demo: step failed (exit {result.returncode}): {shlex.join(cmd)}", file=sys.stderr)
        sys.exit(result.returncode)
    print(f"  ({time.perf_counter() - t0:.0f} s)", flush=True)
    return result.stdout or ""


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="runs/demo")
    p.add_argument("--videos", type=int, default=160, help="training videos")
    p.add_argument("--held-out", type=int, default=16, help="videos to ask questions about")
    p.add_argument("--frames", type=int, default=8, help="frames per video")
    p.add_argument("--vqgan-steps", type=int, default=500)
    p.add_argument("--lm-steps", type=int, default=150)
    p.add_argument("--mesh", default="1,2,4,1", help="dp,fsdp,sp,tp of the world model")
    args = p.parse_args()

    out = Path(args.out)
    py = sys.executable
    lwm = [py, "-m", "lwm"]
    env = dict(os.environ)
    env["XLA_FLAGS"] = (
        env.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    ).strip()
    env.setdefault("JAX_PLATFORMS", "cpu")
    start = time.perf_counter()

    # 1. videos
    for name, count, seed in (("train", args.videos, 0), ("held_out", args.held_out, 1)):
        if not (out / "videos" / name / "manifest.jsonl").is_file():
            run(
                [
                    py,
                    "-m",
                    "data.synthetic",
                    "--out",
                    str(out / "videos" / name),
                    "--count",
                    str(count),
                    "--seed",
                    str(seed),
                    "--size",
                    "32",
                    "--frames",
                    str(args.frames),
                ],
                env=env,
            )

    # 2. the VQGAN (resumes from its checkpoints when rerun)
    vqgan = out / "vqgan"
    run(
        [
            *lwm,
            "vqgan",
            "train",
            "--config",
            "configs/vqgan/small.yaml",
            f"train.output_dir={vqgan}",
            f"train.steps={args.vqgan_steps}",
            f"data.num_frames={args.frames}",
        ],
        env=env,
    )

    # 3. the token dataset (resumable; skipped when complete)
    tokens = out / "tokens"
    if not tokens.is_dir():
        run(
            [
                *lwm,
                "tokenize",
                "--input",
                str(out / "videos" / "train" / "manifest.jsonl"),
                "--output",
                str(tokens),
                "--vqgan",
                str(vqgan),
                "--max-frames",
                str(args.frames),
            ],
            env=env,
        )

    # 4. the world model (resumes from its checkpoints when rerun)
    lm = out / "lm"
    run(
        [
            *lwm,
            "train",
            "--config",
            "configs/tiny.yaml",
            f"data.source={tokens}",
            f"train.output_dir={lm}",
            f"train.steps={args.lm_steps}",
            f"mesh.shape={args.mesh}",
            "model.attention=ring",
            "train.seq_len=1024",
            "train.batch_size=8",
            "train.learning_rate=2e-3",
            "train.warmup_steps=10",
            "train.log_every=10",
            "train.save_every=50",
            "model.block_q=128",
            "model.block_k=128",
        ],
        env=env,
    )

    # 5. questions about videos the model has never seen
    report = run(
        [
            *lwm,
            "ask",
            "--model",
            f"run:{lm}",
            "--vqgan",
            str(vqgan),
            "--manifest",
            str(out / "videos" / "held_out" / "manifest.jsonl"),
            "--max-frames",
            str(args.frames),
        ],
        env=env,
        capture=True,
    )
    lines = [json.loads(x) for x in report.splitlines() if x.startswith("{")]
    for rec in lines[:-1][:12]:
        mark = "ok " if rec.get("correct") else "   "
        print(
            f"  {mark} Q: {rec['question']}\n      expected: {rec['expected']!r:24} "
            f"model: {rec['answer']!r}"
        )
    summary = lines[-1]
    print(
        f"\nheld-out accuracy: {summary['correct']}/{summary['questions']} "
        f"({100 * summary['accuracy']:.0f}%)"
    )
    metrics = [json.loads(x) for x in (lm / "metrics.jsonl").read_text().splitlines()]
    first, last = metrics[0], metrics[-1]
    print(
        f"world model loss {first['loss']:.3f} -> {last['loss']:.3f} "
        f"(text {last['text_loss']:.3f}, vision {last['vision_loss']:.3f}) "
        f"at step {last['step']}"
    )
    print(f"demo: done in {time.perf_counter() - start:.0f} s; everything is under {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
