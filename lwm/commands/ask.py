"""Ask a trained model questions about a video (greedy answers by default).

  lwm ask --model run:runs/demo/lm --video clip.mp4 --question "What colour is the moving square?"
  lwm ask --model run:runs/demo/lm --video clip.mp4 --question "..." --question "..."

Each question is asked on its own, right after the video, where training records put their
first turn (the synthetic world draws the order of a record's turns per video, so any kind of
question is the first in some records). One JSON
line per question: the answer, and "cut": true when it did not end within --max-new-tokens.
The video is sampled as the run's training dataset was, and --vqgan and --tokenizer default to
that dataset's (see `lwm eval qa` for scoring a whole manifest). ``--prompt lwm`` asks with
the prompt of LWM's own ``vision_chat.py`` (`data.tokens.lwm_chat_prompt_streams`), for weights
LWM trained.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from lwm.commands import nonempty
from lwm.commands.eval import add_model_arguments, load_video_qa


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_arguments(parser)
    parser.add_argument("--video", required=True, help="a video (or image) file")
    parser.add_argument(
        "--question",
        action="append",
        required=True,
        type=nonempty,
        help="a question (may be repeated)",
    )
    parser.add_argument(
        "--prompt",
        choices=("record", "lwm"),
        default="record",
        help="record: the prompt our QA records train on (video, then USER: q ASSISTANT:); lwm: "
        "the prompt of LWM's vision_chat.py (system sentence, question, then video), for "
        "LWM's released chat weights (default record)",
    )


def _log(msg: str) -> None:
    print(f"lwm ask: {msg}", file=sys.stderr, flush=True)


def run(args: argparse.Namespace) -> int:
    if not Path(args.video).is_file():  # before the model loads
        raise FileNotFoundError(f"video '{args.video}' not found")
    try:
        qa, _ = load_video_qa(args, _log)
        answers = qa.answer([(args.video, q) for q in args.question])
    except (ValueError, FileNotFoundError) as e:
        print(f"lwm ask: error: {' '.join(str(e).split())}", file=sys.stderr)
        return 2
    for question, a in zip(args.question, answers, strict=True):
        print(
            json.dumps({"video": args.video, "question": question, "answer": a.text, "cut": a.cut})
        )
    return 0
