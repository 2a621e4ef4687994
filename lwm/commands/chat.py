"""Talk with a trained model about a video: several turns, the video encoded and prefilled once.

  lwm chat --model run:runs/demo/lm --video clip.mp4                 # questions from the terminal
  lwm chat --model run:runs/demo/lm --video clip.mp4 --question "How many shapes move?" \\
      --question "What colour is the moving circle?"
  printf 'How many shapes move?\\nWhat shape is the red one?\\n' | lwm chat --model run:DIR --video v.mp4

Each question is the next turn of one conversation (`lwm.chat`): the video's tokens are fed
once, in chunks of --prefill-chunk tokens, into a key/value cache of --max-context slots
(sharded over the mesh's sp axis with --mesh), and every turn and answer extends that cache.
Answers are JSON lines ({"question", "answer", "cut"}), or plain text in a terminal. A turn that
does not fit the context ends the conversation with one line naming both lengths (exit 2).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from lwm.commands import nonempty, positive_int
from lwm.commands.eval import add_model_arguments, load_video_qa


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_arguments(parser, batch=False, prefill_chunk="512 tokens")
    parser.add_argument("--video", help="a video (or image) file; none: a text conversation")
    parser.add_argument(
        "--question",
        action="append",
        type=nonempty,
        help="a question (repeatable); default: read stdin",
    )
    parser.add_argument(
        "--max-context", type=positive_int, default=4096, help="cache slots (tokens, default 4096)"
    )


def _log(msg: str) -> None:
    print(f"lwm chat: {msg}", file=sys.stderr, flush=True)


def _questions(args: argparse.Namespace):
    if args.question:
        yield from args.question
        return
    interactive = sys.stdin.isatty()
    while True:
        if interactive:
            print("you> ", end="", file=sys.stderr, flush=True)
        line = sys.stdin.readline()
        if not line:
            return
        if line.strip():
            yield line.strip()


def run(args: argparse.Namespace) -> int:
    from lwm.chat import ChatSession
    from lwm.vision_qa import video_codes

    if args.video and not Path(args.video).is_file():  # before the model loads
        raise FileNotFoundError(f"video '{args.video}' not found")
    try:
        qa, _ = load_video_qa(args, _log, vqgan=bool(args.video))
        codes = None
        if args.video:
            codes = video_codes(qa.vqgan, args.video, max_frames=qa.max_frames, fps=qa.fps)
            _log(f"{args.video}: {len(codes)} frames, {codes[0].size} codes each")
        chat = ChatSession(
            qa.model,
            qa.codec,
            codes,
            max_context=args.max_context,
            prefill_chunk=args.prefill_chunk or 512,
            max_new_tokens=args.max_new_tokens,
            sampling=qa.sampling,
        )
        plain = sys.stdout.isatty()
        for question in _questions(args):
            answer = chat.ask(question)
            if plain:
                print(f"lwm> {answer.text}" + (" [cut]" if answer.cut else ""), flush=True)
            else:
                record = {"question": question, "answer": answer.text, "cut": answer.cut}
                print(json.dumps(record), flush=True)
    except (ValueError, FileNotFoundError) as e:
        print(f"lwm chat: error: {' '.join(str(e).split())}", file=sys.stderr)
        return 2
    return 0
