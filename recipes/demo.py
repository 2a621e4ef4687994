"""The end-to-end demo, run by the README's first command: videos -> VQGAN -> token dataset ->
a world model trained with ring attention on 2 (simulated) devices -> answers to questions
about videos it has never seen, scored against a model that never sees them.

    python recipes/demo.py                      # everything under runs/demo (README: time, numbers)
    python recipes/demo.py --out runs/long --videos 8000 --lm-steps 3000 --eval-every 500  # 98%
    python recipes/demo.py --shapes-first-steps 0 --lm-steps 360   # without the shapes stage
    python recipes/demo.py --platform tpu       # on the TPU chip JAX finds (mesh 1,1,1,1)
    python recipes/demo.py --platform gpu       # on the GPU JAX finds (mesh 1,1,1,1)

Each step is a command a user would type (printed before it runs) and is skipped or resumed
when its output already exists, so rerunning the demo continues where it stopped:

 1. `lwm synthetic`: short MP4 videos of moving coloured shapes with questions whose
    answers follow from the frames (checked on the pixels), a training set and a held-out set
    of another seed;
 2. `lwm vqgan train`: the demo VQGAN (32x32 frames, 8x8 codes of 512) on the training videos;
 3. `lwm tokenize`: videos + questions to an LWM token dataset (array_record); the world model
    learns the answers and, as a world model, the video tokens too;
 4. `lwm train`: the `demo` world model (configs/demo.yaml), ring attention over `sp`, zigzag
    layout, on a (1, 1, 2, 1) mesh of 2 simulated CPU devices, with Muon on the blocks'
    matrices (`train.optimizer=muon`; AdamW on embeddings, heads and norms) and isolated question
    turns (`data.qa_turns=isolated`: each turn of a record sees the video and itself, as a
    question is asked, `--qa-turns`): first `--shapes-first-steps`
    steps on the same videos with their shape questions only (`lwm synthetic
    --also-manifest shapes.jsonl:shape` writes that manifest next to the first, `lwm tokenize`
    encodes it), the skill it learns slowest (docs/notebook.md), then `--lm-steps` on all the
    questions from those weights, with the held-out questions asked after the last step (and
    every `--eval-every` steps if given);
 5. the last of those evaluations, as `lwm eval qa` prints it (the same code; the command that
    reruns it is printed): every held-out question, per category, for the model, for the model
    shown another video (the swap ablation) and for a blind baseline (the most frequent training
    answer to the same question); `tools/plot_run.py` draws loss and accuracy per step.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import sys
import time
from pathlib import Path

from lwm.scripting import ROOT, check_mesh, check_vqgan_seed, demo_vqgan_command, run_step

sys.path.insert(0, str(ROOT))
from data.synthetic import DEMO_WORLD, world_flags  # noqa: E402

# The demo's world (`data.synthetic.DEMO_WORLD`), questions only.
WORLD = [*world_flags(DEMO_WORLD), "--no-captions"]


def run(cmd: list[str], *, env: dict[str, str], capture: bool = False) -> str:
    return run_step(cmd, "demo", env=env, capture=capture)


def tight_rows(tokens: Path, mesh: str, row: int = 1024) -> list[str]:
    """`lwm train` overrides that pack the records of the token dataset ``tokens`` as rows of
    ``row`` tokens (configs/demo.yaml's `train.seq_len`) would, with less padding: the loader
    fills rows in order with whole records, and the demo's records are of nearly one length
    (369-411 tokens with all questions, 276-289 with the shape questions), so rows of 1,024
    hold two (three) of them and 20-25% padding. Where every row of ``row`` holds the same
    number of records, the shortest row that holds as many of the longest record, rounded up
    to 32 x sp tokens, gets the same records in the same rows (the same losses, up to
    rounding) in 27% (14%) less time per step on the 2-core machine (docs/notebook.md, "The demo's
    rows"); otherwise nothing changes. Blocks of half a zigzag chunk (`block_q = block_k =
    seq_len / (4 sp)`) ran fastest at each length measured."""
    import numpy as np

    lengths = np.load(tokens / "num_tokens-train.npy")
    longest, shortest = int(lengths.max()), int(lengths.min())
    per_row = row // longest
    if per_row < 1 or (per_row + 1) * shortest <= row:
        return []  # rows of `row` hold different numbers of records: keep them
    sp = int(mesh.split(",")[2])
    unit = 32 * sp
    seq_len = -(-per_row * longest // unit) * unit
    if seq_len >= row:
        return []
    block = seq_len // (4 * sp)
    return [f"train.seq_len={seq_len}", f"model.block_q={block}", f"model.block_k={block}"]


def check_same_data(path: Path, wanted: dict[str, object], made: bool) -> None:
    """Refuse (`ValueError`) a rerun that asks for other videos than ``path`` says the folder
    holds; record them there where the videos are still to be made (``made`` False). A folder
    of an older demo, without the record, is not checked."""
    if path.is_file():
        found = json.loads(path.read_text())
        other = [
            f"{k} {found.get(k)} there, {v} here" for k, v in wanted.items() if found.get(k) != v
        ]
        if other:
            raise ValueError(
                f"--out {path.parent} holds the videos and tokens of other settings "
                f"({'; '.join(other)}): rerun with those, or give another --out"
            )
    elif not made:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(wanted, indent=1) + "\n")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="runs/demo", help="folder of every step's output")
    p.add_argument("--videos", type=int, default=2000, help="training videos")
    p.add_argument(
        "--held-out",
        type=int,
        default=100,
        help="videos to ask questions about (default 100: about 930 questions)",
    )
    p.add_argument("--frames", type=int, default=4, help="frames per video")
    p.add_argument("--vqgan-steps", type=int, default=1000, help="training steps of the VQGAN")
    p.add_argument(
        "--vqgan-seed",
        type=int,
        default=None,
        help="the VQGAN's seed (default: its config's, 0); a folder whose VQGAN trained from "
        "another seed is refused",
    )
    p.add_argument(
        "--lm-steps", type=int, default=800, help="steps of the world model on all questions"
    )
    p.add_argument(
        "--eval-every",
        type=int,
        default=None,
        help="held-out QA every N training steps (default: once, after the last step)",
    )
    p.add_argument(
        "--shapes-first-steps",
        type=int,
        default=200,
        help="train the world model this many steps on the shape questions alone first "
        "(the same videos), then the --lm-steps from those weights (0: no such stage)",
    )
    p.add_argument(
        "--optimizer",
        choices=("muon", "adamw"),
        default="muon",
        help="the world model's optimizer in both stages (train.optimizer; default muon: "
        "65%% -> 73%% held-out in the demo's steps with chained turns, docs/notebook.md)",
    )
    p.add_argument(
        "--qa-turns",
        choices=("isolated", "chained", "mixed", "mixed-alone"),
        default="isolated",
        help="how the question turns of a training record see each other (data.qa_turns; "
        "default isolated: each sees the video and itself, as a question is asked, and every "
        "answer is learned, `lwm synthetic --qa-records isolated`; chained: each sees the turns "
        "before it, and answers an earlier turn gives away are not learned; mixed: each epoch "
        "a tenth of the records chained (data.qa_chained_share), every answer learned, the "
        "rest isolated, for `lwm chat`; mixed-alone: as mixed, but in chained records the "
        "turns an earlier one narrows are context only, `lwm synthetic --qa-records alone`)",
    )
    p.add_argument(
        "--platform",
        choices=("cpu", "tpu", "gpu"),
        default="cpu",
        help="cpu: every step on simulated CPU devices, as many as the mesh has (default); "
        "tpu, gpu: on the chips JAX finds (one chip: --mesh 1,1,1,1 by default)",
    )
    p.add_argument(
        "--mesh",
        help="dp,fsdp,sp,tp of the world model (default 1,1,2,1 on a cpu; 1,1,1,1 on a chip)",
    )
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a config override for both stages of the world model's training, after the "
        "demo's own (repeatable; e.g. model.matmul_precision=highest)",
    )
    p.add_argument(
        "--videos-only",
        action="store_true",
        help="make the videos (step 1) and stop: what a machine without PyAV, which writes "
        "them, is given with the rest (a wheel of it)",
    )
    args = p.parse_args()
    if args.set:  # a wrong key is said now, not after the videos and the VQGAN
        from lwm.config import ConfigError, load_config

        try:
            load_config(ROOT / "configs/demo.yaml", args.set)  # as run_step runs it, in ROOT
        except ConfigError as e:
            p.error(f"--set: {e}")
    if args.mesh is None:
        args.mesh = "1,1,2,1" if args.platform == "cpu" else "1,1,1,1"

    out = Path(args.out)
    py = sys.executable
    lwm = [py, "-m", "lwm"]
    env = dict(os.environ)
    if not args.videos_only:  # before step 1, not in a later step after the videos
        check_mesh("--mesh", args.mesh, args.platform)
    # On a CPU every JAX verb runs on as many simulated devices as the world model's mesh has;
    # on a TPU or a GPU, on the chips JAX finds.
    cpu = ["--cpu-devices", str(math.prod(int(n) for n in args.mesh.split(",")))]
    if args.platform != "cpu":
        cpu = []
        env.pop("JAX_PLATFORMS", None)  # each step picks the accelerator
    else:
        # One thread per simulated device: with as many devices as cores, XLA's intra-op
        # thread pool only oversubscribes them (0.50 s against 0.55 s per step of stage 2 on
        # (1,1,2,1), docs/benchmarks.md).
        flag = "--xla_cpu_multi_thread_eigen=false"
        if flag not in env.get("XLA_FLAGS", ""):
            env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} {flag}".strip()
    start = time.perf_counter()
    train_videos = out / "videos" / "train" / "manifest.jsonl"
    held_out = out / "videos" / "held_out" / "manifest.jsonl"

    records = {"chained": "video", "mixed-alone": "alone"}.get(args.qa_turns, "isolated")
    qa_turns = "mixed" if args.qa_turns == "mixed-alone" else args.qa_turns
    vqgan = out / "vqgan"
    if not args.videos_only:
        check_vqgan_seed(vqgan, args.vqgan_seed)
    # The videos and token datasets under --out are reused as they are: a rerun must ask for
    # the same ones (it went on with the old ones without a word).
    check_same_data(
        out / "data.json",
        {"--videos": args.videos, "--held-out": args.held_out, "--frames": args.frames}
        | {"--qa-records (of --qa-turns)": records},
        made=train_videos.is_file(),
    )

    def videos(manifest: Path, count: int, seed: int, *extra: str) -> None:
        """`lwm synthetic` into ``manifest``'s folder (skipped when it is there)."""
        if not manifest.is_file():
            run(
                [*lwm, "synthetic", "--out", str(manifest.parent), "--count", str(count)]
                + ["--seed", str(seed), "--frames", str(args.frames), *WORLD, *extra]
                + ["--qa-records", records],
                env=env,
            )

    def tokenize(manifest: Path, output: Path) -> None:
        """`lwm tokenize` with the demo's VQGAN (resumable; skipped when complete)."""
        if not output.is_dir():
            run(
                [*lwm, "tokenize", "--input", str(manifest), "--out", str(output)]
                + ["--vqgan", str(vqgan), "--video-loss", "all", *cpu],
                env=env,
            )

    # 1. videos (with the shape questions' manifest of step 3b, written in the same pass)
    shape_videos = train_videos.parent / "shapes.jsonl"
    also = ["--also-manifest", "shapes.jsonl:shape"] if args.shapes_first_steps > 0 else []
    videos(train_videos, args.videos, 0, *also)
    videos(held_out, args.held_out, 1)
    if args.videos_only:
        print(f"demo: videos made in {time.perf_counter() - start:.0f} s under {out / 'videos'}")
        return 0

    # 2. the VQGAN (resumes from its checkpoints when rerun)
    run(
        demo_vqgan_command(lwm, cpu, vqgan, args.vqgan_steps, train_videos, args.vqgan_seed),
        env=env,
    )

    # 3. the token dataset (resumable; skipped when complete)
    tokens = out / "tokens"
    tokenize(train_videos, tokens)

    # 3b. (--shapes-first-steps) the same videos with their shape questions only, and a first
    # stage of the world model on them: shapes are the skill it learns slowest (docs/notebook.md)
    first_stage = []
    if args.shapes_first_steps > 0:
        # a second manifest in the training videos' folder; a folder of an earlier run without
        # it gets it now (its videos are not written again)
        videos(shape_videos, args.videos, 0, "--categories", "shape", "--manifest", "shapes.jsonl")
        shape_tokens = out / "shape_tokens"
        tokenize(shape_videos, shape_tokens)
        shapes = out / "shapes"
        run(
            [*lwm, "train", *cpu, "--config", "configs/demo.yaml"]
            + [f"data.source={shape_tokens}", f"train.output_dir={shapes}"]
            + [f"train.steps={args.shapes_first_steps}", f"mesh.shape={args.mesh}"]
            + [f"train.optimizer={args.optimizer}", f"data.qa_turns={qa_turns}"]
            + tight_rows(shape_tokens, args.mesh)
            + args.set,
            env=env,
        )
        first_stage = [f"train.init_from=run:{shapes}"]

    # 4. the world model (resumes from its checkpoints when rerun)
    lm = out / "lm"
    run(
        [*lwm, "train", *cpu, "--config", "configs/demo.yaml"]
        + [f"data.source={tokens}", f"train.output_dir={lm}", f"train.steps={args.lm_steps}"]
        + [
            f"mesh.shape={args.mesh}",
            f"train.optimizer={args.optimizer}",
            f"data.qa_turns={qa_turns}",
            f"eval.manifest={held_out}",
            f"eval.every={args.eval_every or args.lm_steps}",
            *first_stage,
            *tight_rows(tokens, args.mesh),
            *args.set,
        ],
        env=env,
    )

    # 5. every held-out question: model, swapped videos, blind baseline (lwm train asked them
    # after its last step, as `lwm eval qa` does; rerunning that command gives the same table)
    from lwm.qa_eval import QAReport

    results = lm / "eval" / f"qa-{args.lm_steps}.jsonl"
    report = QAReport.read_jsonl(results)
    rerun = [*lwm[1:], "eval", "qa", "--model", f"run:{lm}", "--manifest", str(held_out)]
    print(f"\nheld-out questions after step {args.lm_steps} ({results}; the same as")
    print(f"  {shlex.join(['python', *rerun, '--mesh', args.mesh, *cpu])}):")
    print(report.table())
    run([py, "tools/plot_run.py", str(lm)], env=env, capture=True)
    summary = report.summary()
    shown = [r for r in report.records if r["condition"] == "model"]
    print("\nsome held-out questions (ok = right):")
    for r in shown[:: max(1, len(shown) // 10)][:10]:
        mark = "ok " if r["correct"] else "   "
        print(f"  {mark} {r['question']:<48} expected {r['expected']!r:<18} model {r['answer']!r}")
    metrics = [json.loads(x) for x in (lm / "metrics.jsonl").read_text().splitlines()]
    train_lines = [m for m in metrics if "split" not in m]
    first, last = train_lines[0], train_lines[-1]
    print(
        f"\nworld model loss {first['loss']:.3f} -> {last['loss']:.3f} "
        f"(text {last['text_loss']:.3f}, vision {last['vision_loss']:.3f}) at step {last['step']}"
    )
    model, swapped, blind = (summary[c]["all"] for c in ("model", "swapped", "blind"))
    print(
        f"held-out accuracy: model {model['correct']}/{model['questions']} "
        f"({100 * model['accuracy']:.0f}%), videos swapped {100 * swapped['accuracy']:.0f}%, "
        f"blind baseline {100 * blind['accuracy']:.0f}% (table above; per step: {lm / 'run.png'})"
    )
    print(f"demo: done in {time.perf_counter() - start:.0f} s; everything is under {out}")
    return 0


if __name__ == "__main__":
    from lwm.cli import run_reporting_errors

    raise SystemExit(run_reporting_errors("demo", main, also=(ValueError,)))
