"""Synthetic videos of moving coloured shapes, with captions and question/answer pairs whose
answers follow from the frames. Deterministic: video ``i`` of seed ``s`` is always the same.

Each video shows 1-3 shapes (circle, square, triangle) in distinct colours of `PALETTE` on a
dark background, each moving in a straight line (left, right, up or down) without leaving the
frame or touching another shape; optionally a "needle" (a shape in a colour no other shape has)
appears in exactly one frame.

    spec = sample_video(seed=0, index=3, size=64, num_frames=16)
    frames = render_video(spec)                  # uint8 [16, 64, 64, 3]
    spec.caption, spec.qa                        # "Two shapes ...", [{"question":..., "answer":...}]
    frames = render_frames(count=100, seed=0)    # uint8 [100, T, H, W, 3], for VQGAN training

    python -m data.synthetic --out runs/synthetic --count 200 --seed 0 --size 64 --frames 16

writes ``OUT/videos/00000.mp4 ...`` (H.264), ``OUT/videos.jsonl`` (every attribute of every
video) and ``OUT/manifest.jsonl``, the input of ``lwm tokenize``: per video one caption line
``{"video": "videos/00000.mp4", "text": "..."}`` and one QA line
``{"video": "videos/00000.mp4", "qa": [{"question": "...", "answer": "..."}, ...]}``.
Video paths in the manifest are relative to the manifest's directory (`read_manifest` resolves
them). Files are written under temporary names and renamed when complete.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

__all__ = [
    "BACKGROUND",
    "DIRECTIONS",
    "PALETTE",
    "SHAPES",
    "MovingShape",
    "Needle",
    "VideoSpec",
    "read_manifest",
    "render_frames",
    "render_video",
    "sample_video",
    "write_dataset",
]

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
# Radius of a circle around each shape, in units of its size parameter `radius`.
_BOUND = 1.25


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
        parts = [f"{_a(o.colour)} {o.shape} moving {o.direction}" for o in self.objects]
        listed = parts[0] if len(parts) == 1 else ", ".join(parts[:-1]) + " and " + parts[-1]
        n = len(self.objects)
        text = (
            f"{NUMBER_WORDS[n].capitalize()} shape{'s' * (n != 1)} on a dark background: {listed}."
        )
        if self.needle is not None:
            needle = f"{_a(self.needle.colour)} {self.needle.shape}".capitalize()
            text += f" {needle} appears for a single frame."
        return text

    @property
    def qa(self) -> list[dict[str, str]]:
        """Questions whose answers follow from the frames."""
        pairs: list[tuple[str, str]] = []
        counts = {s: sum(o.shape == s for o in self.objects) for s in SHAPES}
        n = len(self.objects)
        pairs.append(("How many shapes move in the video?", NUMBER_WORDS[n]))
        for shape in SHAPES:
            if counts[shape]:
                pairs.append((f"How many {shape}s are there?", NUMBER_WORDS[counts[shape]]))
        for o in self.objects:
            if counts[o.shape] == 1:
                pairs.append((f"What colour is the {o.shape}?", o.colour))
            pairs.append((f"Which direction does the {o.colour} {o.shape} move?", o.direction))
        needle = self.needle
        pairs.append(
            (
                "What appeared briefly?",
                f"{_a(needle.colour)} {needle.shape}" if needle else "nothing",
            )
        )
        return [{"question": q, "answer": a} for q, a in pairs]

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "caption": self.caption, "qa": self.qa}


def _a(word: str) -> str:
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
) -> VideoSpec:
    """The attributes of video ``index`` of the set with ``seed`` (pure function of its args)."""
    if size < 16 or num_frames < 3:
        raise ValueError(f"need size >= 16 and num_frames >= 3, got {size} and {num_frames}")
    rng = np.random.default_rng([seed, index])
    colours = list(PALETTE)
    n = int(rng.integers(1, max_objects + 1))
    objects: list[MovingShape] = []
    for _ in range(n):
        for _attempt in range(50):
            used = {o.colour for o in objects}
            colour = str(rng.choice([c for c in colours if c not in used]))
            shape = str(rng.choice(SHAPES))
            direction = str(rng.choice(list(DIRECTIONS)))
            radius = float(size * rng.uniform(0.09, 0.14))
            travel = float(size * rng.uniform(0.15, 0.35))
            start = _place(rng, size, radius, travel, direction)
            if start is None:
                continue
            candidate = MovingShape(
                shape, colour, *start, radius, direction, travel / (num_frames - 1)
            )
            if all(
                _apart(candidate.centre(t), radius, o.centre(t), o.radius)
                for o in objects
                for t in range(num_frames)
            ):
                objects.append(candidate)
                break
    needle = None
    if rng.random() < needle_prob:
        used = {o.colour for o in objects}
        for _attempt in range(50):
            frame = int(rng.integers(1, num_frames - 1))
            radius = float(size * rng.uniform(0.09, 0.14))
            margin = _BOUND * radius + 1
            x, y = (float(v) for v in rng.uniform(margin, size - margin, size=2))
            if all(_apart((x, y), radius, o.centre(frame), o.radius) for o in objects):
                colour = str(rng.choice([c for c in colours if c not in used]))
                needle = Needle(str(rng.choice(SHAPES)), colour, frame, x, y, radius)
                break
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
) -> np.ndarray:
    """Videos ``start .. start+count-1`` of ``seed``, rendered in memory: uint8 [count, T, H, W, 3]."""
    return np.stack(
        [
            render_video(
                sample_video(seed, i, size=size, num_frames=num_frames, needle_prob=needle_prob)
            )
            for i in range(start, start + count)
        ]
    )


# ---------------------------------------------------------------------------------------------
# Writing a dataset


def _write_jsonl(path: Path, rows: Sequence[dict[str, Any]]) -> None:
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            for row in rows:
                f.write(json.dumps(row) + "\n")
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


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
) -> Path:
    """Write ``count`` videos as MP4 under ``out/videos`` with ``videos.jsonl`` and
    ``manifest.jsonl`` (see the module docstring); returns the manifest's path."""
    from data.video_io import write_mp4

    out = Path(out)
    (out / "videos").mkdir(parents=True, exist_ok=True)
    specs, manifest = [], []
    indices: Any = range(count)
    if progress:
        from tqdm import tqdm

        indices = tqdm(indices, desc="synthetic videos", unit="video")
    for i in indices:
        spec = sample_video(
            seed, i, size=size, num_frames=num_frames, fps=fps, needle_prob=needle_prob
        )
        rel = f"videos/{i:05d}.mp4"
        write_mp4(out / rel, render_video(spec), fps=fps)
        specs.append({"video": rel, **spec.to_json()})
        manifest.append({"video": rel, "text": spec.caption})
        manifest.append({"video": rel, "qa": spec.qa})
    _write_jsonl(out / "videos.jsonl", specs)
    _write_jsonl(out / "manifest.jsonl", manifest)
    return out / "manifest.jsonl"


def read_manifest(path: str | os.PathLike) -> list[dict[str, Any]]:
    """The lines of a manifest, with each ``video`` resolved against the manifest's directory."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"manifest '{path}' not found")
    rows = []
    for lineno, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"manifest '{path}' line {lineno}: not valid JSON: {e}") from None
        if not isinstance(row, dict) or "video" not in row:
            raise ValueError(f"manifest '{path}' line {lineno}: expected an object with 'video'")
        row["video"] = str((path.parent / row["video"]).resolve())
        rows.append(row)
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m data.synthetic", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--out", required=True, help="output folder")
    parser.add_argument("--count", type=int, default=100, help="number of videos")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--size", type=int, default=64, help="frame height and width (even)")
    parser.add_argument("--frames", type=int, default=16, help="frames per video")
    parser.add_argument("--fps", type=int, default=8)
    parser.add_argument("--needle-prob", type=float, default=0.5)
    args = parser.parse_args(argv)
    manifest = write_dataset(
        args.out,
        args.count,
        args.seed,
        size=args.size,
        num_frames=args.frames,
        fps=args.fps,
        needle_prob=args.needle_prob,
        progress=True,
    )
    print(manifest)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
