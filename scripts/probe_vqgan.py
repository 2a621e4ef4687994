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
  (chance: 1/8 for colour, 1/3 for shape);
- ``mlp`` (with ``--mlp``): what a small network that learns an embedding per code, as a world
  model does, reads from the same cells: a 32-wide embedding per code, the 3x3 cells in their
  places (``window``) or summed without their places (``bag``, as one attention head averaging
  an object's codes would see them), one hidden layer of 256, trained with AdamW on 80% of the
  videos and scored per object and frame on the rest. The linear probe needs every code of
  every cell to occur in its training half; this one shares what it learns across cells, and
  with ``--videos 2500`` it is the upper bound that matters: how much a reader of codes can get
  when told where the object is.

    python scripts/probe_vqgan.py --vqgan runs/demo/vqgan --videos 200 --frames 8
    python scripts/probe_vqgan.py --vqgan runs/demo/vqgan --videos 2500 --frames 4 \
        --max-objects 2 --radius 0.14,0.18 --travel 0.3,0.4 --mlp    # the demo's world
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from lwm.commands import fraction_range  # noqa: E402

MIN_FRAMES = 3  # data.synthetic.sample_video's shortest video


def check_probe_sizes(videos: int, frames: int, max_objects: int) -> None:
    """A `ValueError` naming the option unless the probe has videos to fit and to score (a
    single video left the fitting half empty), videos of at least `MIN_FRAMES` frames, and
    objects in them."""
    if videos < 2:
        raise ValueError(
            f"--videos {videos} is below 2: the probe fits on some and scores the rest"
        )
    if frames < MIN_FRAMES:
        raise ValueError(f"--frames {frames} is below {MIN_FRAMES}, the shortest video")
    if max_objects < 1:
        raise ValueError(f"--max-objects {max_objects} is below 1: the probe reads objects")


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
    p.add_argument("--vqgan", required=True, help="a VQGAN folder (or its training output)")
    p.add_argument("--videos", type=int, default=200, help="held-out videos to render")
    p.add_argument("--frames", type=int, default=8, help=f"frames per video, at least {MIN_FRAMES}")
    p.add_argument("--seed", type=int, default=99, help="a seed the VQGAN never trained on")
    p.add_argument("--max-distance", type=float, default=80.0, help="colour tolerance, decoded")
    p.add_argument("--max-objects", type=int, default=3, help="most shapes in a video")
    p.add_argument(
        "--radius", type=fraction_range, help="LO,HI as in lwm synthetic (0 < LO <= HI < 1)"
    )
    p.add_argument(
        "--travel", type=fraction_range, help="LO,HI as in lwm synthetic (0 < LO <= HI < 1)"
    )
    p.add_argument("--mlp", action="store_true", help="also the learned-embedding probe")
    p.add_argument("--mlp-steps", type=int, default=2000, help="training steps of --mlp")
    args = p.parse_args()
    check_probe_sizes(args.videos, args.frames, args.max_objects)
    world = {"max_objects": args.max_objects}
    if args.radius:
        world["radius"] = args.radius
    if args.travel:
        world["travel"] = args.travel

    import vqgan
    from data.synthetic import PALETTE, SHAPES, render_video, sample_video
    from data.synthetic_check import answer, observe
    from lwm.base.mesh import make_mesh

    tok = vqgan.load_tokenizer(args.vqgan, mesh=make_mesh("1,-1,1,1"))
    size = tok.resolution
    specs = [
        sample_video(args.seed, i, size=size, num_frames=args.frames, **world)
        for i in range(args.videos)
    ]
    frames = np.stack([render_video(s) for s in specs])
    chunk = 256  # frames of many videos at once would not fit a small machine's memory
    codes = np.concatenate(
        [np.asarray(tok.encode(frames[i : i + chunk])) for i in range(0, len(frames), chunk)]
    )
    decoded = np.concatenate(
        [np.asarray(tok.decode(codes[i : i + chunk])) for i in range(0, len(codes), chunk)]
    )
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
    cells, colour, shape, video_of = [], [], [], []
    for v, spec in enumerate(specs):
        for t in range(args.frames):
            for o in spec.objects:
                x, y = o.centre(t)
                cy, cx = int(y // cell) + 1, int(x // cell) + 1
                cells.append(padded[v, t, cy - 1 : cy + 2, cx - 1 : cx + 2].reshape(-1))
                colour.append(list(PALETTE).index(o.colour))
                shape.append(SHAPES.index(o.shape))
                video_of.append(v)
    cells = np.asarray(cells)  # [objects, 9]: the codes of the 3x3 cells, k = outside
    x = np.zeros((len(cells), 9 * (k + 1)))
    x[np.arange(len(cells))[:, None], cells + (k + 1) * np.arange(9)] = 1.0  # one-hot per cell
    train = np.asarray(video_of) < args.videos // 2
    result = {"measure": "probe", "objects": int(len(x))}
    for name, labels, classes in (("colour", colour, len(PALETTE)), ("shape", shape, len(SHAPES))):
        y = np.asarray(labels)
        w, b = _softmax_regression(x[train], y[train], classes)
        result[name] = round(float(((x[~train] @ w + b).argmax(1) == y[~train]).mean()), 3)
    print(json.dumps(result))
    if args.mlp:
        split = np.asarray(video_of) < int(0.8 * args.videos)
        labels = ((np.asarray(colour), len(PALETTE)), (np.asarray(shape), len(SHAPES)))
        for kind in ("window", "bag"):
            got = _mlp_probe(
                cells, labels, split, tok.codebook_size + 1, kind == "bag", args.mlp_steps
            )
            print(json.dumps({"measure": "mlp", "cells": kind, "objects": int(len(cells)), **got}))
    return 0


def _mlp_probe(windows, labels, train, vocab, bag, steps, width=32, hidden=256, batch=256):
    """Colour and shape from the codes of an object's 3x3 cells: a learned embedding per code,
    in place or summed (``bag``), one hidden layer, AdamW; accuracy on the rows not ``train``.
    ``labels``: ``(colour, classes), (shape, classes)``."""
    import jax
    import jax.numpy as jnp
    import optax

    (colour, n_colour), (shape, n_shape) = labels
    k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
    inputs = width if bag else 9 * width
    params = {
        "embed": 0.1 * jax.random.normal(k1, (vocab, width)),
        "w1": jax.random.normal(k2, (inputs, hidden)) / np.sqrt(inputs),
        "b1": jnp.zeros(hidden),
        "w2": jax.random.normal(k3, (hidden, n_colour + n_shape)) / np.sqrt(hidden),
    }

    def logits(p, w):
        e = p["embed"][w]
        h = e.sum(1) if bag else e.reshape(len(w), -1)
        return jax.nn.gelu(h @ p["w1"] + p["b1"]) @ p["w2"]

    def loss(p, w, c, s):
        z = logits(p, w)
        ce = optax.softmax_cross_entropy_with_integer_labels
        return ce(z[:, :n_colour], c).mean() + ce(z[:, n_colour:], s).mean()

    opt = optax.adamw(3e-3, weight_decay=1e-2)
    state = opt.init(params)

    @jax.jit
    def step(p, st, w, c, s):
        grads = jax.grad(loss)(p, w, c, s)
        updates, st = opt.update(grads, st, p)
        return optax.apply_updates(p, updates), st

    rng = np.random.default_rng(0)
    rows = np.flatnonzero(train)
    for _ in range(steps):
        b = rng.choice(rows, batch)
        params, state = step(params, state, windows[b], colour[b], shape[b])
    z = np.asarray(logits(params, windows[~train]))
    return {
        "colour": round(float((z[:, :n_colour].argmax(1) == colour[~train]).mean()), 3),
        "shape": round(float((z[:, n_colour:].argmax(1) == shape[~train]).mean()), 3),
        "train_objects": int(train.sum()),
    }


if __name__ == "__main__":
    from lwm.cli import run_reporting_errors

    raise SystemExit(run_reporting_errors("probe_vqgan", main, also=(ValueError,)))
