"""What a VQGAN's codes keep of the synthetic world: can the questions still be answered?

Renders held-out synthetic videos at the VQGAN's resolution, encodes and decodes them, and
prints one JSON line per measurement:

- ``psnr``: reconstruction PSNR (dB) of the decoded frames;
- ``decoded``: per question category, the share of questions whose answer the decoded frames
  still give when measured as the rendered ones are (`data.synthetic_check`, which never sees
  the spec), next to the same share for the rendered frames (1.0 by construction);
- ``probe``: a linear probe from codes to each object's colour and shape: the codes of the 3x3
  grid cells around the object's centre (one-hot per cell, so the arrangement counts), a
  multinomial logistic regression trained on half the videos and scored on the other half
  (chance: 1/8 for colour, 1/3 for shape).

    python scripts/probe_vqgan.py --vqgan runs/demo/vqgan --videos 200 --frames 8
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _softmax_regression(x, y, classes, steps=500, lr=2.0, l2=1e-4):
    w = np.zeros((x.shape[1], classes))
    b = np.zeros(classes)
    onehot = np.eye(classes)[y]
    for _ in range(steps):
        z = x @ w + b
        z -= z.max(axis=1, keepdims=True)
        p = np.exp(z)
        p /= p.sum(axis=1, keepdims=True)
        g = (p - onehot) / len(x)
        w -= lr * (x.T @ g + l2 * w)
        b -= lr * g.sum(axis=0)
    return w, b


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--vqgan", required=True)
    p.add_argument("--videos", type=int, default=200)
    p.add_argument("--frames", type=int, default=8)
    p.add_argument("--seed", type=int, default=99, help="a seed the VQGAN never trained on")
    p.add_argument("--max-distance", type=float, default=80.0, help="colour tolerance, decoded")
    p.add_argument("--max-objects", type=int, default=3)
    p.add_argument("--radius", default=None, help="LO,HI as in lwm synthetic")
    args = p.parse_args()

    import vqgan
    from data.synthetic import PALETTE, SHAPES, render_video, sample_video
    from data.synthetic_check import answer, observe
    from lwm.base.mesh import make_mesh

    tok = vqgan.load_tokenizer(args.vqgan, mesh=make_mesh("1,-1,1,1"))
    size = tok.resolution
    world = {"max_objects": args.max_objects}
    if args.radius:
        world["radius"] = tuple(float(v) for v in args.radius.split(","))
    specs = [
        sample_video(args.seed, i, size=size, num_frames=args.frames, **world)
        for i in range(args.videos)
    ]
    frames = np.stack([render_video(s) for s in specs])
    codes = np.asarray(tok.encode(frames))
    decoded = np.asarray(tok.decode(codes))
    mse = np.mean((decoded.astype(np.float64) - frames) ** 2)
    print(json.dumps({"measure": "psnr", "db": round(float(10 * np.log10(255**2 / mse)), 2)}))

    right: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for spec, video in zip(specs, decoded, strict=True):
        seen = observe(video, max_distance=args.max_distance)
        for turn in spec.qa:
            r = right[turn["category"]]
            r[0] += answer(seen, turn["question"]) == turn["answer"]
            r[1] += 1
    print(
        json.dumps(
            {
                "measure": "decoded",
                "answerable": {c: round(a / n, 3) for c, (a, n) in sorted(right.items())},
                "questions": {c: n for c, (_, n) in sorted(right.items())},
            }
        )
    )

    grid = codes.shape[-1]
    cell = size / grid
    k = tok.codebook_size
    padded = np.pad(codes, [(0, 0), (0, 0), (1, 1), (1, 1)], constant_values=k)  # k = outside
    feats, colour, shape, video_of = [], [], [], []
    for v, spec in enumerate(specs):
        for t in range(args.frames):
            for o in spec.objects:
                x, y = o.centre(t)
                cy, cx = int(y // cell) + 1, int(x // cell) + 1
                window = padded[v, t, cy - 1 : cy + 2, cx - 1 : cx + 2].reshape(-1)
                feats.append(window + (k + 1) * np.arange(9))
                colour.append(list(PALETTE).index(o.colour))
                shape.append(SHAPES.index(o.shape))
                video_of.append(v)
    x = np.zeros((len(feats), 9 * (k + 1)))
    x[np.arange(len(feats))[:, None], np.asarray(feats)] = 1.0
    train = np.asarray(video_of) < args.videos // 2
    result = {"measure": "probe", "objects": int(len(x))}
    for name, labels, k in (("colour", colour, len(PALETTE)), ("shape", shape, len(SHAPES))):
        y = np.asarray(labels)
        w, b = _softmax_regression(x[train], y[train], k)
        result[name] = round(float(((x[~train] @ w + b).argmax(1) == y[~train]).mean()), 3)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
