"""Synthetic videos of moving coloured shapes, with captions and question/answer pairs whose
answers follow from the frames. Deterministic: video ``i`` of seed ``s`` is always the same.

Each video shows 1 to ``max_objects`` shapes (circle, square, triangle) in distinct colours of
`PALETTE` on a dark background, each moving in a straight line (left, right, up or down)
without leaving the frame or touching another shape; optionally a "needle" (a shape in a colour
no other shape has) appears in exactly one frame. Sizes and distances are fractions of the
frame (``radius``, ``travel``): shapes must stay large enough for the video tokenizer's code
grid to tell them apart (docs/vqgan.md says what a VQGAN keeps).

Every kept video is checked against its own pixels: `data.synthetic_check` measures the
rendered frames without the spec (colours present, shape of each mask, direction of motion,
what is there for one frame) and a draw whose frames do not give every answer is redrawn.

    spec = sample_video(seed=0, index=3, size=64, num_frames=16)
    frames = render_video(spec)                  # uint8 [16, 64, 64, 3]
    spec.caption, spec.qa                        # "Two shapes ...", [{"question", "answer", "category"}]
    frames = render_frames(count=100, seed=0)    # uint8 [100, T, H, W, 3], for VQGAN training

    lwm synthetic --out runs/synthetic --count 200 --seed 0 --size 64 --frames 16

writes ``OUT/videos/00000.mp4 ...`` (lossless H.264, 4:4:4), ``OUT/videos.jsonl`` (every
attribute of every video) and ``OUT/manifest.jsonl``, the input of ``lwm tokenize``: per video one caption line
``{"video": "videos/00000.mp4", "text": "..."}`` (not with ``--no-captions``) and its QA lines
``{"video": "videos/00000.mp4", "qa": [{"question": "...", "answer": "...", "category": "..."}]}``,
one per training record (`lwm tokenize` encodes the video once): by default one record of all
the video's turns in a drawn order; ``qa_layout="kind"`` (``--qa-records kind``) one record
per kind of question (`VideoSpec.qa_records`). Categories (`CATEGORIES`): ``count``,
``count_shape``, ``colour``, ``shape``, ``direction``, ``needle``. Video paths in the manifest are relative
to the manifest's directory (`data.manifest.read_inputs` reads them). Files are written under temporary
names and renamed when complete; ``OUT/videos.progress.jsonl`` lists the videos a run has made
(and those it is about to replace) until it ends, so a rerun after a stop keeps them.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from data.synthetic_check import (
    BACKGROUND,
    DIRECTIONS,
    NUMBER_WORDS,
    PALETTE,
    SHAPES,
    answer,
    observe,
    question_category,
)
from data.tokens import LEARN_ALONE
from lwm.base.files import write_jsonl

__all__ = [
    "BACKGROUND",
    "CATEGORIES",
    "DEMO_WORLD",
    "QA_LAYOUTS",
    "DIRECTIONS",
    "PALETTE",
    "SHAPES",
    "MovingShape",
    "NARROWED_BY",
    "Needle",
    "VideoSpec",
    "render_frames",
    "render_video",
    "sample_video",
    "with_article",
    "world_flags",
    "write_dataset",
]

# The kinds of question (`VideoSpec.qa_records`: one training record each, in this order).
CATEGORIES = ("count", "count_shape", "colour", "shape", "direction", "needle")
# How a video's questions become training records (`VideoSpec.qa_records`).
QA_LAYOUTS = ("video", "kind", "isolated", "alone")
# Which earlier turns of a record narrow the answers a turn can have, by category: an earlier
# count_shape answer bounds the count, the colour of one object excludes it for the other
# (colours are distinct) and for the needle, a "moving circle" asked about means a circle
# moves, and so on. A direction is drawn for each object on its own, so nothing narrows it.
# The alone layout marks such turns ``"learn": "alone"`` (`qa_records`).
NARROWED_BY: dict[str, frozenset[str]] = {
    "count": frozenset({"count_shape", "colour", "shape", "direction"}),
    "count_shape": frozenset({"count", "count_shape", "colour", "shape", "direction"}),
    "colour": frozenset({"colour", "shape", "direction", "needle"}),
    "shape": frozenset({"count_shape", "colour", "shape", "direction"}),
    "direction": frozenset(),
    "needle": frozenset({"colour", "shape", "direction"}),
}
# Radius of a circle around each shape, in units of its size parameter `radius`.
_BOUND = 1.25
# Shape sizes and distances travelled over the whole video, as fractions of the frame size.
RADIUS: tuple[float, float] = (0.09, 0.14)
TRAVEL: tuple[float, float] = (0.15, 0.35)
# The demo's world (`sample_video` keywords), used by recipes/demo.py and everything built on
# its models (needle evaluation, the context-extension and text-to-video scripts, probes):
# 32x32 frames (8x8 codes of the demo VQGAN) with up to two shapes, as large as two still fit
# with room to move, so that a circle and a square differ in more than a few pixels.
DEMO_WORLD: dict[str, Any] = {
    "size": 32,
    "radius": (0.14, 0.18),
    "travel": (0.3, 0.4),
    "max_objects": 2,
}


def world_flags(world: dict[str, Any]) -> list[str]:
    """``world`` (`sample_video` keywords such as `DEMO_WORLD`) as `lwm synthetic` options."""
    flags = []
    for key, value in world.items():
        text = ",".join(map(str, value)) if isinstance(value, tuple) else str(value)
        flags += [f"--{key.replace('_', '-')}", text]
    return flags


@dataclass(frozen=True)
class MovingShape:
    """A shape moving at constant velocity; (x, y) is its centre in frame 0, in pixels."""

    shape: str
    colour: str
    x: float
    y: float
    radius: float
    direction: str
    speed: float  # pixels per frame

    def centre(self, t: int) -> tuple[float, float]:
        dx, dy = DIRECTIONS[self.direction]
        return self.x + dx * self.speed * t, self.y + dy * self.speed * t


@dataclass(frozen=True)
class Needle:
    """A shape shown in exactly one frame."""

    shape: str
    colour: str
    frame: int
    x: float
    y: float
    radius: float


@dataclass(frozen=True)
class VideoSpec:
    """Everything about one synthetic video: enough to render it and to ask about it."""

    seed: int
    index: int
    size: int
    num_frames: int
    fps: int
    objects: tuple[MovingShape, ...]
    needle: Needle | None

    @property
    def caption(self) -> str:
        """One sentence naming every object (left to right as they start) and the needle."""
        ordered = sorted(self.objects, key=lambda o: (o.x, o.y))
        parts = [f"{with_article(o.colour)} {o.shape} moving {o.direction}" for o in ordered]
        listed = parts[0] if len(parts) == 1 else ", ".join(parts[:-1]) + " and " + parts[-1]
        n = len(self.objects)
        text = (
            f"{NUMBER_WORDS[n].capitalize()} shape{'s' * (n != 1)} on a dark background: {listed}."
        )
        if self.needle is not None:
            needle = f"{with_article(self.needle.colour)} {self.needle.shape}".capitalize()
            text += f" {needle} appears for a single frame."
        return text

    def qa_records(
        self, layout: str = "video", categories: tuple[str, ...] | None = None
    ) -> list[list[dict[str, str]]]:
        """The questions about this video, each with its answer and its category, as the
        training records that hold them (`QA_LAYOUTS`):

        - ``video``: one record of all the video's turns in an order drawn for this video, so
          every kind of question is the first turn (where `lwm ask` puts a question) in some
          videos. A later turn can read its answer off an earlier one ("which direction does
          the red circle move" names what "what shape is the red one" asks): such turns are
          marked ``"learn": False`` (context only, their answers get no loss), so the answers
          learned are read from the video, not copied;
        - ``isolated``: the record of ``video`` with every answer learned: for training with
          ``data.qa_turns: isolated``, where each turn sees the video and not the other turns,
          so nothing can be copied or inferred from another answer (such as the colour of one
          of two objects once the other's is known) and every question is learned as the
          first turn, as `lwm ask` asks it, or ``mixed`` (a share of records chained);
        - ``alone``: the record of ``isolated``, but a later turn that an earlier one narrows
          (`NARROWED_BY`) is marked ``"learn": "alone"``: where the record is chained (the
          chained share of ``data.qa_turns: mixed``) it is context only, so the answers
          learned after other turns (every direction, and the turns nothing before narrows)
          are read from the video, not inferred. Measured against ``isolated`` under
          ``mixed`` in docs/notebook.md ("Answers learned only when asked alone"): it does not make
          conversations better;
        - ``kind``: one record per kind of question, in `CATEGORIES` order, its turns in a
          drawn order: every kind is the first turn of its record, and no answer can be read
          off an earlier turn. Six records per video hold fewer answers per video token.

        Categories: ``count`` (moving shapes), ``count_shape`` (moving shapes of each kind,
        zero included), ``colour`` (of the one moving shape of a kind), ``shape`` (of the
        moving object of a colour), ``direction`` (of each object, named by colour and shape),
        ``needle`` (what appeared for one frame, or "nothing"). On the demo's world and budget
        ``video`` scores higher held-out (docs/notebook.md, "Records that ask as inference asks").
        ``categories``: only the questions of these categories (e.g. ``("shape",)`` for a
        shapes-first training stage), laid out and marked as if they were all there are."""
        if layout not in QA_LAYOUTS:
            raise ValueError(f"unknown QA layout {layout!r}; choose one of {', '.join(QA_LAYOUTS)}")
        _check_categories(categories)
        rng = np.random.default_rng([self.seed, self.index, 1])
        counts = {s: sum(o.shape == s for o in self.objects) for s in SHAPES}
        n = self.needle
        turns = [("How many shapes move in the video?", NUMBER_WORDS[len(self.objects)])]
        turns += [(f"How many {s}s move in the video?", NUMBER_WORDS[counts[s]]) for s in SHAPES]
        turns += [
            (f"What colour is the moving {o.shape}?", o.colour)
            for o in self.objects
            if counts[o.shape] == 1
        ]
        turns += [(f"What shape is the {o.colour} one?", o.shape) for o in self.objects]
        turns += [
            (f"Which direction does the {o.colour} {o.shape} move?", o.direction)
            for o in self.objects
        ]
        turns.append(
            ("What appeared briefly?", f"{with_article(n.colour)} {n.shape}" if n else "nothing")
        )
        dicts = [
            {"question": q, "answer": a, "category": question_category(q) or "other", "learn": True}
            for q, a in turns
        ]
        if categories is not None:
            dicts = [d for d in dicts if d["category"] in categories]
            if not dicts:
                return []
        if layout in ("video", "isolated", "alone"):
            record = [dicts[i] for i in rng.permutation(len(dicts))]
            if layout == "isolated":
                return [record]
            mark = _mark_narrowed if layout == "alone" else _mark_given_away
            return [mark(record, self)]
        by_category: dict[str, list[dict[str, str]]] = {c: [] for c in CATEGORIES}
        for turn in dicts:
            by_category[turn["category"]].append(turn)
        return [
            [record[i] for i in rng.permutation(len(record))]
            for record in by_category.values()
            if record
        ]

    @property
    def qa(self) -> list[dict[str, str]]:
        """Every question about this video with its answer and category, in the drawn order
        of the ``video`` layout (`qa_records`)."""
        return self.qa_records("video")[0]

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "caption": self.caption, "qa": self.qa}


def _check_categories(categories: tuple[str, ...] | None) -> None:
    unknown = sorted(set(categories or ()) - set(CATEGORIES))
    if unknown:
        raise ValueError(
            f"unknown question categories {', '.join(unknown)}; known: {', '.join(CATEGORIES)}"
        )


def _mark_narrowed(record: list[dict[str, Any]], spec: VideoSpec) -> list[dict[str, Any]]:
    """``record`` with ``"learn": "alone"`` on each turn whose answers an earlier turn's
    category narrows (`NARROWED_BY`)."""
    for k, turn in enumerate(record):
        if any(t["category"] in NARROWED_BY.get(turn["category"], ()) for t in record[:k]):
            turn["learn"] = LEARN_ALONE
    return record


def _mark_given_away(record: list[dict[str, Any]], spec: VideoSpec) -> list[dict[str, Any]]:
    """``record`` with ``"learn": False`` on each colour or shape turn whose answer an earlier
    turn gives away (an earlier question or answer names the object's colour and shape
    together): the turn stays as context, but its answer teaches copying, not seeing."""
    named: list[set[str]] = []
    for turn in record:
        words = set(re.findall(r"[a-z]+", f"{turn['question']} {turn['answer']}".lower()))
        if turn["category"] in ("colour", "shape"):
            about = [o for o in spec.objects if {o.colour, o.shape} <= words]
            turn["learn"] = not any({o.colour, o.shape} <= w for o in about for w in named)
        named.append(words)
    return record


def with_article(word: str) -> str:
    """``word`` with its indefinite article: "a red", "an orange"."""
    return f"{'an' if word[0] in 'aeiou' else 'a'} {word}"


# ---------------------------------------------------------------------------------------------
# Sampling


def _place(rng: np.random.Generator, size: int, radius: float, travel: float, direction: str):
    """A start centre such that the shape stays inside the frame for the whole motion."""
    dx, dy = DIRECTIONS[direction]
    margin = _BOUND * radius + 1
    lo_x, hi_x = margin + max(0.0, -dx * travel), size - margin - max(0.0, dx * travel)
    lo_y, hi_y = margin + max(0.0, -dy * travel), size - margin - max(0.0, dy * travel)
    if lo_x > hi_x or lo_y > hi_y:
        return None
    return float(rng.uniform(lo_x, hi_x)), float(rng.uniform(lo_y, hi_y))


def _pick(rng: np.random.Generator, options) -> str:
    """``rng.choice(options)`` (the same draw from the same stream), without its array
    conversion: sampling runs it tens of thousands of times per dataset."""
    return str(options[int(rng.integers(len(options)))])


def _apart(a: tuple[float, float], ra: float, b: tuple[float, float], rb: float) -> bool:
    return float(np.hypot(a[0] - b[0], a[1] - b[1])) >= _BOUND * (ra + rb) + 2


def sample_video(
    seed: int,
    index: int,
    *,
    size: int = 64,
    num_frames: int = 16,
    fps: int = 8,
    needle_prob: float = 0.5,
    max_objects: int = 3,
    radius: tuple[float, float] = RADIUS,
    travel: tuple[float, float] = TRAVEL,
) -> VideoSpec:
    """The attributes of video ``index`` of the set with ``seed`` (pure function of its args).

    The number of objects is drawn first (1 to ``max_objects``), then their shapes, colours,
    sizes (``radius`` x frame size), motions (``travel`` x frame size over the video) and
    places, so that no two ever come close; then, with ``needle_prob``, a needle. A draw is
    kept only if its rendered frames give every answer of `VideoSpec.qa` when measured by
    `data.synthetic_check` (which never sees the spec); otherwise the next draw is tried."""
    if size < 16 or num_frames < 3:
        raise ValueError(f"need size >= 16 and num_frames >= 3, got {size} and {num_frames}")
    # How many objects and whether there is a needle are drawn once, so that the retries below
    # (objects that do not fit, frames that do not give the answers) do not bias them.
    impossible = ValueError(
        f"could not draw an answerable video of {size}x{size} pixels with up to {max_objects} "
        f"shapes of radius {radius} x size; use larger frames or smaller shapes"
    )
    # Even the smallest shape, moving the shortest distance, must fit (`_place`): otherwise
    # no draw can succeed, and the answer is known without trying 5,000 of them.
    if 2 * (_BOUND * radius[0] * size + 1) + travel[0] * size > size:
        raise impossible
    first = np.random.default_rng([seed, index])
    n = int(first.integers(1, max_objects + 1))
    needle = bool(first.random() < needle_prob)
    for attempt in range(5000):
        rng = np.random.default_rng([seed, index, attempt])
        spec = _draw(rng, seed, index, size, num_frames, fps, n, needle, radius, travel)
        if spec is not None and not check_spec(spec):
            return spec
    raise impossible


def check_spec(spec: VideoSpec) -> list[str]:
    """Problems of ``spec``: each question whose answer its rendered frames do not give (as
    measured by `data.synthetic_check.observe`), and anything the measurement found unclear.
    Empty when every answer follows from the frames."""
    seen = observe(render_video(spec))
    problems = list(seen.problems)
    for turn in spec.qa:
        got = answer(seen, turn["question"])
        if got != turn["answer"]:
            problems.append(f"{turn['question']!r}: frames give {got!r}, spec {turn['answer']!r}")
    return problems


def _draw(rng, seed, index, size, num_frames, fps, n, with_needle, radius, travel):
    """One draw of a video with ``n`` objects (and a needle), or None if they did not fit."""
    colours = list(PALETTE)
    objects: list[MovingShape] = []
    for _ in range(n):
        for _attempt in range(50):
            used = {o.colour for o in objects}
            colour = _pick(rng, [c for c in colours if c not in used])
            shape = _pick(rng, SHAPES)
            direction = _pick(rng, list(DIRECTIONS))
            r = float(size * rng.uniform(*radius))
            distance = float(size * rng.uniform(*travel))
            start = _place(rng, size, r, distance, direction)
            if start is None:
                continue
            candidate = MovingShape(
                shape, colour, *start, r, direction, distance / (num_frames - 1)
            )
            if all(
                _apart(candidate.centre(t), r, o.centre(t), o.radius)
                for o in objects
                for t in range(num_frames)
            ):
                objects.append(candidate)
                break
        else:
            return None
    needle = None
    if with_needle:
        used = {o.colour for o in objects}
        for _attempt in range(50):
            frame = int(rng.integers(1, num_frames - 1))
            r = float(size * rng.uniform(*radius))
            margin = _BOUND * r + 1
            x, y = (float(v) for v in rng.uniform(margin, size - margin, size=2))
            if all(_apart((x, y), r, o.centre(frame), o.radius) for o in objects):
                colour = _pick(rng, [c for c in colours if c not in used])
                needle = Needle(_pick(rng, SHAPES), colour, frame, x, y, r)
                break
        else:
            return None
    return VideoSpec(seed, index, size, num_frames, fps, tuple(objects), needle)


# ---------------------------------------------------------------------------------------------
# Rendering


def shape_mask(
    shape: str, x: float, y: float, radius: float, size: int
) -> np.ndarray:  # bool [size, size]
    """Pixels (centres at i + 0.5) covered by ``shape`` centred at (x, y)."""
    coords = np.arange(size, dtype=np.float32) + 0.5
    dx = coords[None, :] - x
    dy = coords[:, None] - y
    if shape == "circle":
        return dx * dx + dy * dy <= radius * radius
    if shape == "square":
        half = 0.85 * radius
        return (np.abs(dx) <= half) & (np.abs(dy) <= half)
    if shape == "triangle":  # apex up, base at y + 0.8 r
        rel = (dy + radius) / (1.8 * radius)
        return (rel >= 0) & (rel <= 1) & (np.abs(dx) <= rel * radius)
    raise ValueError(f"unknown shape {shape!r}; known: {', '.join(SHAPES)}")


def render_video(spec: VideoSpec) -> np.ndarray:
    """The frames of ``spec`` as uint8 ``[num_frames, size, size, 3]``."""
    frames = np.empty((spec.num_frames, spec.size, spec.size, 3), np.uint8)
    frames[...] = BACKGROUND
    for t in range(spec.num_frames):
        for o in spec.objects:
            frames[t][shape_mask(o.shape, *o.centre(t), o.radius, spec.size)] = PALETTE[o.colour]
        n = spec.needle
        if n is not None and n.frame == t:
            frames[t][shape_mask(n.shape, n.x, n.y, n.radius, spec.size)] = PALETTE[n.colour]
    return frames


def render_frames(
    count: int,
    seed: int,
    *,
    size: int = 64,
    num_frames: int = 16,
    needle_prob: float = 0.5,
    start: int = 0,
    **world: Any,
) -> np.ndarray:
    """Videos ``start .. start+count-1`` of ``seed``, rendered in memory: uint8 [count, T, H, W, 3].
    ``world``: `sample_video`'s ``max_objects``, ``radius``, ``travel``."""
    return np.stack(
        [
            render_video(
                sample_video(
                    seed, i, size=size, num_frames=num_frames, needle_prob=needle_prob, **world
                )
            )
            for i in range(start, start + count)
        ]
    )


# ---------------------------------------------------------------------------------------------
# Writing a dataset


def write_dataset(
    out: str | os.PathLike,
    count: int,
    seed: int = 0,
    *,
    size: int = 64,
    num_frames: int = 16,
    fps: int = 8,
    needle_prob: float = 0.5,
    progress: bool = False,
    captions: bool = True,
    qa_layout: str = "video",
    categories: tuple[str, ...] | None = None,
    manifest_name: str = "manifest.jsonl",
    also: dict[str, tuple[str, ...]] | None = None,
    workers: int = 0,
    **world: Any,
) -> Path:
    """Write ``count`` videos as MP4 under ``out/videos`` with ``videos.jsonl`` and
    ``manifest.jsonl`` (see the module docstring); returns the manifest's path. ``world``:
    `sample_video`'s ``max_objects``, ``radius``, ``travel``. ``captions=False`` leaves the
    caption lines out of the manifest (``videos.jsonl`` still has every caption); ``qa_layout``:
    how questions become records (`QA_LAYOUTS`, `VideoSpec.qa_records`); ``categories``: only
    the questions of these categories (`CATEGORIES`; a video without any has no QA line).
    ``manifest_name``: the manifest's file name in ``out``, so that one folder of videos can
    have several manifests (e.g. ``shapes.jsonl`` with ``categories=("shape",)``): a video
    that ``out/videos.jsonl`` already lists with the same attributes, and whose MP4 is there,
    is not rendered again. ``also``: more manifests of the same videos, written in the same
    pass, by file name, each with only the questions of its categories (``{"shapes.jsonl":
    ("shape",)}``): what a second call with that name and those categories would write. A
    call stopped part way leaves `LEDGER`, by which the next call keeps what it made.
    ``workers`` > 0: that many processes draw and render the videos (each video's draw depends
    only on ``seed`` and its index, so the output is the same as with none)."""

    out = Path(out)
    also = dict(also or {})
    if manifest_name in also:
        raise ValueError(f"manifest {manifest_name!r} is asked for twice")
    # every manifest by file name, with its categories; the main one last (written last, so
    # that its existence means the others are there too)
    manifests = {**also, manifest_name: categories}
    for name in manifests:
        if not name.endswith(".jsonl") or Path(name).name != name:
            raise ValueError(f"manifest name {name!r} is not a file name ending in .jsonl")
    written = _written_videos(out)

    draw = _VideoMaker(
        out, seed, dict(size=size, num_frames=num_frames, fps=fps, needle_prob=needle_prob, **world)
    )
    for cats in manifests.values():
        _check_categories(cats)  # an unknown category fails before any output
    if count:
        draw.spec(0)  # a world that cannot be drawn fails before any output
    (out / "videos").mkdir(parents=True, exist_ok=True)
    specs: list[dict[str, Any]] = []
    lines: dict[str, list[dict[str, Any]]] = {name: [] for name in manifests}
    tasks = [(i, written.get(_video_path(i))) for i in range(count)]
    pool = None
    if workers > 0 and count > 1:
        from data.workers import spawn_pool

        pool = spawn_pool(workers)
        made: Any = pool.imap(draw, tasks, chunksize=max(1, min(16, count // (4 * workers))))
    else:
        made = map(draw, tasks)
    if progress:
        from tqdm import tqdm

        made = tqdm(made, total=count, desc="synthetic videos", unit="video")
    ledger = (out / LEDGER).open("a", encoding="utf-8")
    try:
        for i, (spec, line) in enumerate(made):
            rel = _video_path(i)
            specs.append(line)
            ledger.write(json.dumps(line) + "\n")  # done: a rerun after a stop keeps it
            ledger.flush()
            for name, cats in manifests.items():
                if captions:
                    lines[name].append({"video": rel, "text": spec.caption})
                records = spec.qa_records(qa_layout, cats)
                lines[name].extend({"video": rel, "qa": record} for record in records)
    finally:
        ledger.close()
        if pool is not None:
            pool.terminate()
    write_jsonl(out / "videos.jsonl", specs)
    for name, manifest in lines.items():
        write_jsonl(out / name, manifest)
    (out / LEDGER).unlink()
    return out / manifest_name


def _video_path(i: int) -> str:
    return f"videos/{i:05d}.mp4"


class _VideoMaker:
    """Draws video ``i`` of a dataset and writes its MP4 unless the one there is it already;
    a picklable callable, so worker processes can make videos too."""

    def __init__(self, out: Path, seed: int, draw: dict[str, Any]):
        self.out, self.seed, self.draw = out, seed, draw

    def spec(self, i: int) -> VideoSpec:
        return sample_video(self.seed, i, **self.draw)

    def __call__(self, task: tuple[int, dict[str, Any] | None]) -> tuple[VideoSpec, dict]:
        """``task``: the index and the line ``videos.jsonl`` has for it (or None); returns the
        spec and its line."""
        from lwm.base.media import LOSSLESS, write_mp4

        i, written = task
        spec = self.spec(i)
        rel = _video_path(i)
        line = json.loads(json.dumps({"video": rel, **spec.to_json()}))  # as it is read back
        if written != line or not (self.out / rel).is_file():
            # Whatever was said of this file before no longer holds once it is replaced: the
            # ledger says so first (one write, appended; the main process adds the new line
            # after the video is written), so a run stopped in between renders it again.
            fd = os.open(self.out / LEDGER, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o666)
            try:
                os.write(fd, (json.dumps({"video": rel, "stale": True}) + "\n").encode())
            finally:
                os.close(fd)
            # lossless, so every run trains the VQGAN and world model on the same pixels
            write_mp4(self.out / rel, render_video(spec), fps=self.draw["fps"], **LOSSLESS)
        return spec, line


# Videos made, and about to be replaced, by a run not yet finished (`write_dataset` removes it
# when it has written videos.jsonl): what a rerun after a stop may keep.
LEDGER = "videos.progress.jsonl"


def _written_videos(out: Path) -> dict[str, dict[str, Any]]:
    """The line of each video whose MP4 is known to be what the line says, by video path:
    ``out/videos.jsonl`` (none if it is missing or unreadable), then, in order, what the ledger
    of a run that did not finish says (up to its first unreadable line, e.g. one cut by a
    kill): videos made, and videos about to be replaced (forgotten)."""
    try:
        lines = [json.loads(x) for x in (out / "videos.jsonl").read_text().splitlines() if x]
        written = {line["video"]: line for line in lines}
    except (OSError, ValueError, KeyError, TypeError):
        written = {}
    try:
        ledger = (out / LEDGER).read_text(encoding="utf-8").splitlines()
    except OSError:
        return written
    for text in ledger:
        try:
            line = json.loads(text)
            video = line["video"]
        except (ValueError, KeyError, TypeError):
            break
        if line.get("stale"):
            written.pop(video, None)
        else:
            written[video] = line
    return written
