"""Reading the answers of the synthetic world off the pixels, independently of the spec.

`data.synthetic` samples a spec (shapes, colours, motions, a needle) and derives its questions
and answers from the spec. This module never sees a spec: it looks at frames (rendered, or
decoded from an MP4, or reconstructed by a VQGAN) and measures what a viewer would:

- each pixel is given the nearest palette colour, or background when none is close;
- a colour present (at least ``min_pixels`` pixels) in every frame is a moving object, one
  present in exactly one frame is the needle; anything else is an inconsistency;
- an object's shape comes from its pixel mask: a square fills its bounding box, a circle fills
  about pi/4 of it and is symmetric top to bottom, a triangle (apex up) has far less mass in
  its top half than in its bottom half;
- a moving object's direction is the sign of its centroid's displacement from the first frame
  to the last along the axis where it moved.

`answer` turns an observation into the answer of any question the world asks, so a spec's
answers can be checked against the frames (`data.synthetic.sample_video` rejects a sample whose
frames do not give its answers) and a model's reconstructions can be scored.

    seen = observe(frames)                  # Observation(objects={colour: ...}, needle=...)
    answer(seen, "What colour is the moving circle?")      # "red", or None if not answerable
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import numpy as np

__all__ = ["Observation", "Seen", "answer", "classify_shape", "colour_pixels", "observe"]

# The world's vocabulary (`data.synthetic` imports these).
PALETTE: dict[str, tuple[int, int, int]] = {
    "red": (230, 40, 40),
    "green": (40, 200, 70),
    "blue": (50, 90, 240),
    "yellow": (240, 220, 40),
    "purple": (160, 70, 220),
    "orange": (250, 140, 30),
    "cyan": (40, 210, 220),
    "white": (240, 240, 240),
}
BACKGROUND: tuple[int, int, int] = (16, 16, 24)
SHAPES: tuple[str, ...] = ("circle", "square", "triangle")
DIRECTIONS: dict[str, tuple[int, int]] = {
    "left": (-1, 0),
    "right": (1, 0),
    "up": (0, -1),
    "down": (0, 1),
}
NUMBER_WORDS: tuple[str, ...] = ("zero", "one", "two", "three", "four", "five")


@dataclass(frozen=True)
class Seen:
    """One coloured object as measured: its shape (None if the mask fits no shape well) and,
    for a moving object, its direction (None if the motion is not along one axis)."""

    colour: str
    shape: str | None
    direction: str | None = None
    frames: tuple[int, ...] = ()


@dataclass(frozen=True)
class Observation:
    objects: dict[str, Seen] = field(default_factory=dict)  # moving objects by colour
    needle: Seen | None = None
    problems: tuple[str, ...] = ()  # anything a viewer could not make sense of


def _labels(frames: np.ndarray, max_distance: float) -> np.ndarray:
    """Per pixel the index of the nearest palette colour, or -1 for background / no colour."""
    colours = np.array([*PALETTE.values(), BACKGROUND], np.float32)
    d = np.abs(frames[..., None, :].astype(np.float32) - colours).max(axis=-1)
    nearest = d.argmin(axis=-1)
    ok = (np.take_along_axis(d, nearest[..., None], axis=-1)[..., 0] <= max_distance) & (
        nearest < len(PALETTE)
    )
    return np.where(ok, nearest, -1)


def colour_pixels(frames: np.ndarray, *, max_distance: float = 60.0) -> dict[str, int]:
    """Pixels of each palette colour in uint8 frames ``[T, H, W, 3]`` (all frames together),
    most first; colours with no pixel are left out."""
    labels = _labels(np.asarray(frames), max_distance)
    counts = {c: int((labels == i).sum()) for i, c in enumerate(PALETTE)}
    return dict(sorted(((c, n) for c, n in counts.items() if n), key=lambda x: -x[1]))


def classify_shape(mask: np.ndarray) -> str | None:
    """ "circle", "square" or "triangle" from a bool mask of one object, None if unclear."""
    ys, xs = np.nonzero(mask)
    if len(ys) < 4:
        return None
    h, w = ys.max() - ys.min() + 1, xs.max() - xs.min() + 1
    fill = len(ys) / float(h * w)
    mid = (ys.min() + ys.max()) / 2.0
    top, bottom = (ys < mid).sum(), (ys > mid).sum()
    balance = top / max(bottom, 1)  # ~1 for circles and squares, ~0.3-0.5 for triangles
    if fill >= 0.95 and 0.8 <= balance <= 1.25:
        return "square"
    if 0.65 <= fill < 0.93 and 0.75 <= balance <= 1.33:
        return "circle"
    if fill < 0.75 and balance < 0.65:
        return "triangle"
    return None


def _direction(masks: list[np.ndarray]) -> str | None:
    def centre(m):
        ys, xs = np.nonzero(m)
        return xs.mean(), ys.mean()

    (x0, y0), (x1, y1) = centre(masks[0]), centre(masks[-1])
    dx, dy = x1 - x0, y1 - y0
    major, minor = (dx, dy) if abs(dx) >= abs(dy) else (dy, dx)
    if abs(major) < 1.0 or abs(minor) > max(0.75, 0.3 * abs(major)):
        return None
    step = (int(np.sign(dx)), 0) if abs(dx) >= abs(dy) else (0, int(np.sign(dy)))
    return next(k for k, v in DIRECTIONS.items() if v == step)


def observe(frames: np.ndarray, *, max_distance: float = 60.0, min_pixels: int = 3) -> Observation:
    """What a viewer sees in uint8 frames ``[T, H, W, 3]`` (module docstring)."""
    frames = np.asarray(frames)
    labels = _labels(frames, max_distance)
    t = len(frames)
    objects: dict[str, Seen] = {}
    needle = None
    problems: list[str] = []
    for ci, colour in enumerate(PALETTE):
        masks = labels == ci
        present = [i for i in range(t) if masks[i].sum() >= min_pixels]
        if not present:
            continue
        shapes = {classify_shape(masks[i]) for i in present}
        shape = shapes.pop() if len(shapes) == 1 else None
        if shape is None:
            problems.append(f"{colour}: shape unclear")
        if len(present) == t:
            direction = _direction([masks[i] for i in present])
            if direction is None:
                problems.append(f"{colour}: direction unclear")
            objects[colour] = Seen(colour, shape, direction, tuple(present))
        elif len(present) == 1 and t > 1 and needle is None:
            needle = Seen(colour, shape, None, tuple(present))
        else:
            problems.append(f"{colour}: present in frames {present} of {t}")
    return Observation(objects, needle, tuple(problems))


def _article(word: str) -> str:
    return f"{'an' if word[0] in 'aeiou' else 'a'} {word}"


_PATTERNS: tuple[tuple[str, re.Pattern], ...] = (
    ("count", re.compile(r"How many shapes move in the video\?")),
    ("count_shape", re.compile(r"How many (\w+)s move in the video\?")),
    ("colour", re.compile(r"What colour is the moving (\w+)\?")),
    ("shape", re.compile(r"What shape is the (\w+) one\?")),
    ("direction", re.compile(r"Which direction does the (\w+) (\w+) move\?")),
    ("needle", re.compile(r"What appeared briefly\?")),
)


def question_category(question: str) -> str | None:
    """The category of one of the world's questions, None for any other question."""
    for name, pattern in _PATTERNS:
        if pattern.fullmatch(question):
            return name
    return None


def _number(n: int) -> str | None:
    return NUMBER_WORDS[n] if n < len(NUMBER_WORDS) else None


def answer(seen: Observation, question: str) -> str | None:
    """The answer ``seen`` gives to one of the world's questions; None when the frames do not
    settle it (an unclear shape or direction, no such object, two objects that fit)."""
    objects = list(seen.objects.values())
    for name, pattern in _PATTERNS:
        m = pattern.fullmatch(question)
        if m is None:
            continue
        if name == "count":
            return _number(len(objects))
        if name == "count_shape":
            if any(o.shape is None for o in objects):
                return None
            return _number(sum(o.shape == m.group(1) for o in objects))
        if name == "colour":
            fits = [o for o in objects if o.shape == m.group(1)]
            unclear = any(o.shape is None for o in objects)
            return fits[0].colour if len(fits) == 1 and not unclear else None
        if name == "shape":
            o = seen.objects.get(m.group(1))
            return o.shape if o is not None else None
        if name == "direction":
            o = seen.objects.get(m.group(1))
            return o.direction if o is not None and o.shape == m.group(2) else None
        if name == "needle":
            if seen.needle is None:
                return "nothing"
            if seen.needle.shape is None:
                return None
            return f"{_article(seen.needle.colour)} {seen.needle.shape}"
    return None
