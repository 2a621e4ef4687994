"""Does a world model answer from the video or copy an earlier turn? In `lwm synthetic`'s
default layout a training record holds all of a video's turns, and "Which direction does the
red circle move?" names the shape that "What shape is the red one?" asks (`--qa-records kind`
keeps them apart: `data.synthetic.VideoSpec.qa_records`). For every held-out shape question,
asked in a fresh `lwm.chat.ChatSession`: first; after a turn "Which direction does the COLOUR
SHAPE move?" that names the right shape; after one that names a wrong shape (then counted when
the model repeats that wrong shape). One JSON line.

    python scripts/probe_copying.py runs/long      # a demo output folder: lm, tokens, videos
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SHAPES = ("circle", "square", "triangle")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("demo", help="a scripts/demo.py output folder (lm, tokens, videos/held_out)")
    args = p.parse_args()
    root = Path(args.demo)

    from lwm.chat import ChatSession
    from lwm.runs import load_run
    from lwm.vision_qa import TrainingInputs, video_qa_for

    _, model = load_run(root / "lm", mesh=None)
    qa = video_qa_for(model, TrainingInputs.of(str(root / "tokens")), max_new_tokens=16)
    manifest = root / "videos" / "held_out" / "manifest.jsonl"
    counts = {"shape_questions": 0, "asked_first": 0, "after_the_right_shape": 0}
    counts["repeats_a_wrong_shape_named_before"] = 0
    for line in manifest.read_text().splitlines():
        item = json.loads(line)
        turns = {t["question"]: t["answer"] for t in item["qa"]}
        if not any(q.startswith("What shape is the") for q in turns):
            continue  # a record without shape questions
        codes = qa.codes(manifest.parent / item["video"])

        def chat(*questions: str, codes=codes) -> str:
            session = ChatSession(model, qa.codec, codes, max_context=1024, prefill_chunk=256)
            return [session.ask(q).text for q in questions][-1]

        for question, shape in turns.items():
            if not question.startswith("What shape is the"):
                continue
            colour = question.split()[4]
            direction = f"Which direction does the {colour} {shape} move?"
            wrong = [s for s in SHAPES if s != shape][counts["shape_questions"] % 2]
            counts["asked_first"] += chat(question) == shape
            counts["after_the_right_shape"] += chat(direction, question) == shape
            named_wrong = direction.replace(shape, wrong)
            counts["repeats_a_wrong_shape_named_before"] += chat(named_wrong, question) == wrong
            counts["shape_questions"] += 1
    print(json.dumps(counts))
    return 0


if __name__ == "__main__":
    from lwm.cli import run_reporting_errors

    raise SystemExit(run_reporting_errors("probe_copying", main, also=(ValueError,)))
