"""Ask a trained model questions about videos (greedy answers by default).

  lwm ask --model run:runs/demo/lm --vqgan runs/demo/vqgan \\
      --video clip.mp4 --question "What colour is the square?"
  lwm ask --model run:runs/demo/lm --vqgan runs/demo/vqgan --manifest held_out/manifest.jsonl

With --manifest, every QA line ({"video": path, "qa": [{"question", "answer"}, ...]}) is asked
and the exact-match accuracy against the given answers is printed (one JSON line per question,
then a summary line). --model takes run:DIR (an `lwm train` output; its config is used) or any
weights source with --config (hf:, lwm:/params::, orbax:).
"""

from __future__ import annotations

import argparse
import json
import sys


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, help="run:DIR, or hf:/lwm:/orbax: with --config")
    parser.add_argument("--config", help="model config (needed unless --model is run:DIR)")
    parser.add_argument("--vqgan", required=True, help="VQGAN folder (as for lwm tokenize)")
    parser.add_argument("--tokenizer", help="text tokenizer folder (default: the project's)")
    parser.add_argument("--video", help="a video (or image) file")
    parser.add_argument("--question", action="append", default=[], help="may be repeated")
    parser.add_argument("--manifest", help="JSONL with QA lines: evaluate exact-match accuracy")
    parser.add_argument("--max-frames", type=int, default=8)
    parser.add_argument("--fps", type=float, default=None)
    parser.add_argument("--max-new-tokens", type=int, default=16)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--mesh", help="dp,fsdp,sp,tp to shard the model over (default: 1 device)")


def _questions(args) -> list[tuple[str, str, str | None]]:
    if args.manifest:
        from data.synthetic import read_manifest

        rows = []
        for line in read_manifest(args.manifest):
            for turn in line.get("qa") or []:
                rows.append((line["video"], turn["question"], turn["answer"]))
        if not rows:
            raise ValueError(f"manifest '{args.manifest}' has no QA lines")
        return rows
    if not args.video or not args.question:
        raise ValueError("give --video and --question, or --manifest")
    return [(args.video, q, None) for q in args.question]


def run(args: argparse.Namespace) -> int:
    from data.tokens import TextCodec
    from lwm.config import load_config
    from lwm.generate import Sampling
    from lwm.mesh import make_mesh
    from lwm.vision_qa import answer_questions
    from lwm.weights import load_model
    from vqgan import load_tokenizer

    try:
        rows = _questions(args)
    except ValueError as e:
        print(f"lwm ask: error: {e}", file=sys.stderr)
        return 2
    mesh = make_mesh(args.mesh) if args.mesh else None
    if args.model.startswith("run:"):
        from lwm.runs import load_run

        _, model = load_run(args.model[4:], mesh=mesh)
    else:
        if not args.config:
            print("lwm ask: error: --config is needed with a non-run --model", file=sys.stderr)
            return 2
        model = load_model(args.model, load_config(args.config).model, mesh=mesh)
    codec = TextCodec.load(args.tokenizer)
    vqgan = load_tokenizer(args.vqgan)
    answers = answer_questions(
        model,
        codec,
        vqgan,
        [(v, q) for v, q, _ in rows],
        max_frames=args.max_frames,
        fps=args.fps,
        max_new_tokens=args.max_new_tokens,
        sampling=Sampling(temperature=args.temperature, top_p=args.top_p),
    )
    correct = 0
    for (video, question, expected), got in zip(rows, answers, strict=True):
        record = {"video": str(video), "question": question, "answer": got}
        if expected is not None:
            record["expected"] = expected
            record["correct"] = got.strip().lower() == expected.strip().lower()
            correct += record["correct"]
        print(json.dumps(record))
    if args.manifest:
        print(
            json.dumps(
                {
                    "questions": len(rows),
                    "correct": correct,
                    "accuracy": round(correct / len(rows), 4),
                }
            )
        )
    return 0
