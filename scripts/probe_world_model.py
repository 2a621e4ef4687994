"""What a trained world model's own states keep of each object: colour and shape, per layer.

`scripts/probe_vqgan.py` asks whether the VQGAN's codes keep what the questions ask; this asks
whether the world model has learned to read it. It renders synthetic videos of a seed no run
trained on, encodes them with the run's VQGAN, feeds each video as a QA prompt would (BOS,
``<vision>`` codes ``</vision>``) through the model of an `lwm train` run, and fits a linear
probe (multinomial logistic regression, trained on 80% of the videos, scored on the rest) from
the model's states at each object's cells to the object's colour and shape. One JSON line per
feature:

- ``value L{i} centre``: the attention values of layer ``i`` at the code cell under the
  object's centre (what an answer token can read there);
- ``value L{i} 3x3 mean``: those values averaged over the 3x3 cells around it (what one head
  spreading its attention over the object reads);
- ``hidden centre``: the final normalised hidden state at that cell;
- ``code centre`` and ``codes 3x3 mean`` (one-hot): the same probe on the codes themselves,
  for scale (what a linear reader of the input gets).

Chance is 1/8 for colour and 1/3 for shape. A reader of the codes told where the object is gets
96% and 93% (`probe_vqgan.py --mlp` on the demo VQGAN, docs/qa.md).

    python scripts/probe_world_model.py --run runs/demo/lm --vqgan runs/demo/vqgan \
        --tokenizer runs/demo/tokens --videos 600
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from probe_vqgan import check_probe_sizes  # noqa: E402

from data.synthetic import DEMO_WORLD  # noqa: E402
from lwm.commands import fraction_range  # noqa: E402


def add_run_arguments(p: argparse.ArgumentParser) -> None:
    """``--run``, ``--vqgan`` and ``--tokenizer``: what a probe of a trained run loads."""
    p.add_argument("--run", required=True, help="an lwm train run (its newest checkpoint)")
    p.add_argument("--vqgan", required=True, help="the run's VQGAN folder (what its dataset used)")
    p.add_argument(
        "--tokenizer",
        required=True,
        help="the text tokenizer folder, or the run's token dataset (its metadata names it)",
    )


def load_run_inputs(args: argparse.Namespace):
    """``(model, vqgan tokenizer, text codec)`` of `add_run_arguments`; a token dataset given
    as ``--tokenizer`` stands for the text tokenizer its metadata names."""
    import vqgan
    from data.tokens import TextCodec
    from lwm.runs import load_run
    from lwm.vision_qa import TrainingInputs

    _, model = load_run(args.run, mesh=None)
    tokenizer = TrainingInputs.of(args.tokenizer).get("tokenizer") or args.tokenizer
    return model, vqgan.load_tokenizer(args.vqgan), TextCodec.load(str(tokenizer))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_run_arguments(p)
    p.add_argument(
        "--videos", type=int, default=600, help="videos rendered and probed, 80%% fit (default 600)"
    )
    p.add_argument("--frames", type=int, default=4, help="frames per video (default 4)")
    p.add_argument("--seed", type=int, default=5, help="a seed no run trained on")
    w = DEMO_WORLD  # the default: the demo's world
    p.add_argument(
        "--max-objects",
        type=int,
        default=w["max_objects"],
        help="objects per video at most, as in lwm synthetic (default: the demo's)",
    )
    p.add_argument(
        "--radius",
        type=fraction_range,
        default=tuple(w["radius"]),
        help="LO,HI as in lwm synthetic",
    )
    p.add_argument(
        "--travel",
        type=fraction_range,
        default=tuple(w["travel"]),
        help="LO,HI as in lwm synthetic",
    )
    args = p.parse_args()
    check_probe_sizes(args.videos, args.frames, args.max_objects)

    import jax
    import jax.numpy as jnp
    from flax import nnx
    from probe_vqgan import _softmax_regression

    from data.synthetic import PALETTE, SHAPES, render_video, sample_video
    from data.tokens import video_prompt_streams

    model, tok, codec = load_run_inputs(args)
    world = {
        "max_objects": args.max_objects,
        "radius": args.radius,
        "travel": args.travel,
    }
    size, n = tok.resolution, args.videos
    specs = [
        sample_video(args.seed, i, size=size, num_frames=args.frames, **world) for i in range(n)
    ]
    frames = np.stack([render_video(s) for s in specs])
    codes = np.concatenate(
        [np.asarray(tok.encode(frames[i : i + 256])) for i in range(0, len(frames), 256)]
    )
    streams = [video_prompt_streams(codec, c) for c in codes]
    tokens = np.stack([s[0] for s in streams])
    vision = np.stack([s[1] for s in streams])
    start = int(np.flatnonzero(vision[0])[0])  # the first code
    rows_per_frame, cols = codes.shape[-2:]
    per_frame = rows_per_frame * cols + 1  # codes, then the frame's marker

    @nnx.jit
    def states(m, t, v):
        b, s = t.shape
        positions = jnp.broadcast_to(jnp.arange(s), (b, s))

        def attend(q, k, val, _):
            return m._attention(q, k, val, positions, None), val

        return m.run_layers(m.embed(t, v), positions, attend)

    hidden, values = [], []
    for i in range(0, n, 50):
        h, v = states(model, jnp.asarray(tokens[i : i + 50]), jnp.asarray(vision[i : i + 50]))
        hidden.append(np.asarray(h))
        values.append(np.asarray(v).reshape(*v.shape[:3], -1))  # [layers, b, seq, kv*dim]
    hidden, values = np.concatenate(hidden), np.concatenate(values, axis=1)
    jax.clear_caches()

    cell = size / cols
    objects = np.asarray(
        [
            (v, t, int(o.centre(t)[1] // cell), int(o.centre(t)[0] // cell))
            + (list(PALETTE).index(o.colour), SHAPES.index(o.shape))
            for v, spec in enumerate(specs)
            for t in range(args.frames)
            for o in spec.objects
        ]
    )
    video, frame, row, col = objects[:, :4].T
    train = video < int(0.8 * n)

    def at(dy: int, dx: int) -> np.ndarray:
        r = np.clip(row + dy, 0, rows_per_frame - 1)
        c = np.clip(col + dx, 0, cols - 1)
        return start + frame * per_frame + r * cols + c

    def probe(x: np.ndarray, name: str, onehot: bool = False) -> None:
        # Dense states are standardised; one-hot codes are fitted as probe_vqgan.py fits them.
        fit = {"steps": 500, "lr": 2.0, "l2": 1e-4} if onehot else {"steps": 300, "lr": 0.5}
        if not onehot:
            x = (x - x[train].mean(0)) / (x[train].std(0) + 1e-6)
        out = {"feature": name, "objects": int(len(x)), "train_objects": int(train.sum())}
        for label, column, classes in (("colour", 4, len(PALETTE)), ("shape", 5, len(SHAPES))):
            y = objects[:, column]
            w, b = _softmax_regression(x[train], y[train], classes, **{"l2": 1e-3, **fit})
            out[label] = round(float(((x[~train] @ w + b).argmax(1) == y[~train]).mean()), 3)
        print(json.dumps(out), flush=True)

    window = [(dy, dx) for dy in (-1, 0, 1) for dx in (-1, 0, 1)]
    # The same probe on the codes themselves (one-hot), for scale: what the input gives.
    onehot = np.eye(tok.codebook_size, dtype=np.float32)
    flat = tokens.reshape(-1)
    probe(onehot[flat[video * tokens.shape[1] + at(0, 0)]], "code centre (one-hot)", True)
    probe(
        np.mean([onehot[flat[video * tokens.shape[1] + at(dy, dx)]] for dy, dx in window], axis=0),
        "codes 3x3 mean (one-hot)",
        True,
    )
    for layer, v in enumerate(values):
        probe(v[video, at(0, 0)], f"value L{layer} centre")
        probe(
            np.mean([v[video, at(dy, dx)] for dy, dx in window], axis=0), f"value L{layer} 3x3 mean"
        )
    probe(hidden[video, at(0, 0)], "hidden centre")
    return 0


if __name__ == "__main__":
    from lwm.cli import run_reporting_errors

    raise SystemExit(run_reporting_errors("probe_world_model", main, also=(ValueError,)))
