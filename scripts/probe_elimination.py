"""Does a world model answer a binding question from the video, or from another turn?

For every held-out video of two objects of different shapes (`data.synthetic` manifests), ask
each object's colour ("what colour is the moving circle?") and shape ("what shape is the red
one?") twice: as the first turn, as `lwm ask` asks it, and after the other object's question
of the same kind with its right answer. A model that binds from the video scores the same
both ways; one that learned to answer by elimination from earlier turns (chained training
records, docs/qa.md "Isolated turns") scores far higher the second way. One JSON line per
(kind, way):

    python scripts/probe_elimination.py --model run:runs/long/lm \\
        --videos runs/long/videos/held_out
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from data.tokens import qa_prompt, qa_prompt_streams  # noqa: E402
from lwm.vision_qa import load_video_qa  # noqa: E402


def two_shape_videos(folder: Path) -> list[tuple[Path, list[tuple[str, str]]]]:
    """(video, [(colour, shape), (colour, shape)]) of each video of two different shapes in an
    `lwm synthetic` folder (its ``videos.jsonl`` lists every object of every video)."""
    out = []
    for line in (folder / "videos.jsonl").read_text().splitlines():
        item = json.loads(line)
        objects = [(o["colour"], o["shape"]) for o in item["objects"]]
        if len(objects) == 2 and objects[0][1] != objects[1][1]:
            out.append((folder / item["video"], objects))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="run:DIR of a world model")
    p.add_argument(
        "--videos", required=True, type=Path, help="held-out `lwm synthetic` folder (videos.jsonl)"
    )
    p.add_argument("--limit", type=int, default=None, help="at most this many videos")
    p.add_argument("--vqgan", help="VQGAN folder (default: the model's training dataset's)")
    args = p.parse_args()
    if not (args.videos / "videos.jsonl").is_file():
        sys.exit(f"probe_elimination: error: '{args.videos}' has no videos.jsonl (lwm synthetic)")
    qa, _ = load_video_qa(args.model, vqgan=args.vqgan, log=lambda *a: None)
    codec, eos = qa.codec, [qa.codec.eos_id]
    videos = two_shape_videos(args.videos)[: args.limit]
    for kind in ("colour", "shape"):
        first, after, gold = [], [], []
        for video, objects in videos:
            codes = qa.codes(video)
            for me, other in ((0, 1), (1, 0)):
                (colour, shape), (o_colour, o_shape) = objects[me], objects[other]
                if kind == "colour":
                    q, a = f"What colour is the moving {shape}?", colour
                    q0, a0 = f"What colour is the moving {o_shape}?", o_colour
                else:
                    q, a = f"What shape is the {colour} one?", shape
                    q0, a0 = f"What shape is the {o_colour} one?", o_shape
                first.append(qa_prompt_streams(codec, codes, q))
                tokens, vision = qa_prompt_streams(codec, codes, q0)
                more = np.asarray(codec.encode(f" {a0}") + eos + codec.encode(qa_prompt(q)))
                after.append(
                    (
                        np.concatenate([tokens, more]),
                        np.concatenate([vision, np.zeros(len(more), bool)]),
                    )
                )
                gold.append(a)
        for way, prompts in (("first turn", first), ("after the other's answer", after)):
            answers = []
            for start in range(0, len(prompts), qa.batch_size):
                answers += qa.answer_prompts(prompts[start : start + qa.batch_size])
            right = sum(ans.text == g for ans, g in zip(answers, gold, strict=True))
            print(json.dumps({"kind": kind, "asked": way, "right": right, "of": len(gold)}))


if __name__ == "__main__":
    from lwm.cli import run_reporting_errors

    raise SystemExit(run_reporting_errors("probe_elimination", main, also=(ValueError,)))
