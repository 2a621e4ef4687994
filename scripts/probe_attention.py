"""Does a question select the object it names? Attention from each question token to the named
object's codes, to the other object's codes and to the background, per layer and head.

`scripts/probe_world_model.py` asks what the model's states hold at an object; this asks whether
a question looks there. For held-out videos of two objects of different shapes (a synthetic
folder of `lwm synthetic`: its ``videos.jsonl`` holds every object's place and motion), each
question that names one object ("What shape is the red one?", "What colour is the moving
circle?", "Which direction does the red circle move?") is fed as `lwm ask` feeds it (the MP4
sampled and encoded as `lwm tokenize` does, then the question turn), and the attention
probabilities of every query position of the question are summed over three sets of code
cells: the named object's (cells any of its pixels cover, in every frame), the other object's,
and the rest. Every video asks about both of its objects, so a model whose attention does not
depend on which object is named puts the same mass on "own" and "other" on average, and
``own_minus_other`` is 0.

One JSON line per category and question token: its text, and for the layer and head that
separate most, ``own`` and ``other`` (mean mass), ``selectivity`` (mean own - other over mean
own + other; +1: only the named object, 0: no preference) and ``own_more`` (the share of
questions where own > other). A summary line per category gives the largest selectivity of
any token, layer and head.

    python scripts/probe_attention.py --run runs/demo/lm --vqgan runs/demo/vqgan \
        --tokenizer runs/demo/tokens --videos runs/demo/videos/held_out
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from probe_world_model import add_run_arguments, load_run_inputs  # noqa: E402

TAIL = 16  # query positions probed: the end of the prompt (the question turn and a little before)


def _named(category: str, question: str, objects: list[dict]) -> list[int]:
    """Indices of the objects a question names (by colour, by shape, or by both)."""
    pick = {
        "shape": lambda o: f"the {o['colour']} one" in question,
        "colour": lambda o: f"moving {o['shape']}" in question,
        "direction": lambda o: f"the {o['colour']} {o['shape']}" in question,
    }[category]
    return [i for i, o in enumerate(objects) if pick(o)]


def _cells(obj: dict, frames: int, size: int, grid: tuple[int, int]) -> np.ndarray:
    """``[frames, rows, cols]`` bool: the code cells any pixel of the object covers (the
    pixels `data.synthetic.render_video` draws it on)."""
    from data.synthetic import MovingShape, shape_mask

    shape = MovingShape(**{k: obj[k] for k in MovingShape.__dataclass_fields__})
    rows, cols = grid
    masks = np.stack(
        [shape_mask(shape.shape, *shape.centre(t), shape.radius, size) for t in range(frames)]
    )
    return masks.reshape(frames, rows, size // rows, cols, size // cols).any((2, 4))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_run_arguments(p)
    p.add_argument("--videos", required=True, help="a folder of lwm synthetic (videos.jsonl)")
    p.add_argument("--limit", type=int, default=0, help="at most this many videos (0: all)")
    args = p.parse_args()

    import jax
    import jax.numpy as jnp
    from flax import nnx

    from data.tokens import qa_prompt_streams
    from lwm.vision_qa import video_codes

    model, tok, codec = load_run_inputs(args)
    folder = Path(args.videos)
    records = [json.loads(line) for line in (folder / "videos.jsonl").read_text().splitlines()]
    records = [
        r
        for r in records
        if len(r["objects"]) == 2 and r["objects"][0]["shape"] != r["objects"][1]["shape"]
    ]
    if args.limit:
        records = records[: args.limit]
    if not records:
        print(f"probe_attention: no video of two different shapes in {folder}", file=sys.stderr)
        return 1

    @nnx.jit
    def attention(m, tokens, vision):
        s = tokens.shape[1]
        positions = jnp.arange(s)[None]

        def attend(q, k, v, _):
            out = m._attention(q, k, v, positions, None)
            k = jnp.repeat(k, q.shape[2] // k.shape[2], axis=2)  # grouped queries
            logits = jnp.einsum("bqhd,bshd->bhqs", q[:, -TAIL:], k) / np.sqrt(q.shape[-1])
            causal = jnp.arange(s)[None, :] <= jnp.arange(s - TAIL, s)[:, None]
            return out, jax.nn.softmax(jnp.where(causal, logits, -jnp.inf), -1)

        return m.run_layers(m.embed(tokens, vision), positions, attend)[1]  # [L, b, H, TAIL, s]

    found: dict[str, list] = {}
    for record in records:
        codes = video_codes(tok, folder / record["video"], max_frames=None)
        frames, rows, cols = codes.shape
        cells = [
            _cells(o, frames, tok.resolution, (rows, cols)).reshape(-1) for o in record["objects"]
        ]
        for qa in record["qa"]:
            if qa["category"] not in ("shape", "colour", "direction"):
                continue
            named = _named(qa["category"], qa["question"], record["objects"])
            if len(named) != 1:
                continue
            own = cells[named[0]]
            other = cells[1 - named[0]] & ~own
            tokens, vision = qa_prompt_streams(codec, codes, qa["question"])
            probs = np.asarray(
                attention(model, jnp.asarray(tokens[None]), jnp.asarray(vision[None]))
            )[:, 0]
            # the code positions in raster order (each frame's codes, then its end marker)
            at = np.flatnonzero(vision).reshape(frames, rows * cols + 1)[:, :-1].reshape(-1)
            mass = probs[..., at]  # [L, H, TAIL, codes]
            words = [codec.tokenizer.decode([int(t)]) for t in tokens[-TAIL:]]
            found.setdefault(qa["category"], []).append(
                (mass[..., own].sum(-1), mass[..., other].sum(-1), words)
            )
    jax.clear_caches()

    for category, rows_ in sorted(found.items()):
        own = np.stack([r[0] for r in rows_])  # [n, L, H, TAIL]
        other = np.stack([r[1] for r in rows_])
        words = rows_[0][2]
        best = (0.0, None)
        for j in range(TAIL):
            sel = (own[..., j] - other[..., j]).mean(0) / (
                (own[..., j] + other[..., j]).mean(0) + 1e-9
            )
            layer, head = np.unravel_index(np.abs(sel).argmax(), sel.shape)
            line = {
                "category": category,
                "position": j - TAIL,
                "token": words[j],
                "layer": int(layer),
                "head": int(head),
                "own": round(float(own[:, layer, head, j].mean()), 4),
                "other": round(float(other[:, layer, head, j].mean()), 4),
                "selectivity": round(float(sel[layer, head]), 3),
                "own_more": round(
                    float((own[:, layer, head, j] > other[:, layer, head, j]).mean()), 3
                ),
            }
            print(json.dumps(line), flush=True)
            if abs(line["selectivity"]) > abs(best[0]):
                best = (line["selectivity"], line)
        summary = {"category": category, "questions": len(rows_), "max_selectivity": best[0]}
        if best[1] is not None:
            summary.update({k: best[1][k] for k in ("token", "layer", "head", "own", "other")})
        print(json.dumps(summary), flush=True)
    return 0


if __name__ == "__main__":
    from lwm.cli import run_reporting_errors

    raise SystemExit(run_reporting_errors("probe_attention", main, also=(ValueError,)))
