"""Decoding the media of an `Item` into frames at the VQGAN's resolution (runs in workers).

Videos are read with decord. Frame sampling:

- ``fps``: keep frames at that rate (frame ``floor(k * native_fps / fps)`` for k = 0, 1, ..;
  all frames when the video's rate is at most ``fps`` or unknown);
- ``max_frames``: then, if more remain, keep ``max_frames`` of them evenly spaced
  (``np.linspace(0, n - 1, max_frames)``, as LWM samples);
- ``min_frames``: a video left with fewer frames is a failure ("fewer frames than asked").

Images (Pillow) are one frame. Every frame is then resized (short side to the resolution) and
centre-cropped with the VQGAN package's own `vqgan.preprocess.resize_and_crop`, so the codes are
the ones the VQGAN gives when it preprocesses frames itself.

`decode_item` never raises for a bad file: it returns a `Decoded` whose ``error`` is one line
naming the file and the problem (missing, empty, not a video, truncated, too few frames).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import numpy as np

from data.manifest import Item
from lwm.base.media import decord_problem, frames_at, quiet_stderr

__all__ = ["Decoded", "DecodeOptions", "decode_item", "sample_indices"]

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp", ".webp", ".gif", ".tif", ".tiff")
_RESIZE_GROUP = 16  # frames per jitted resize call (one compiled program per frame size)


@dataclass(frozen=True)
class DecodeOptions:
    resolution: int
    fps: float | None = None
    max_frames: int | None = None
    min_frames: int = 1
    # Decoding threads per video (decord's ``num_threads``); 0: decord's choice, one per core.
    # Worker processes, which already take a core each, decode with one (`DecodeStream`).
    decoder_threads: int = 0


@dataclass
class Decoded:
    """The frames of one item (uint8 ``[T, R, R, 3]``; None for text) or its error line."""

    index: int
    frames: np.ndarray | None = None
    error: str | None = None
    source_frames: int = 0  # frames in the file before sampling


class DecodeError(Exception):
    pass


def sample_indices(
    total: int, native_fps: float | None, fps: float | None, max_frames: int | None
) -> list[int]:
    """Indices of the frames to keep out of ``total`` (see the module docstring)."""
    indices = np.arange(total)
    if fps is not None and native_fps and math.isfinite(native_fps) and native_fps > fps:
        step = native_fps / fps
        indices = np.floor(np.arange(0, total / step) * step).astype(int)
        indices = indices[indices < total]
    if max_frames is not None and len(indices) > max_frames:
        indices = indices[np.linspace(0, len(indices) - 1, max_frames).astype(int)]
    return [int(i) for i in indices]


def decode_item(index: int, item: Item, options: DecodeOptions) -> Decoded:
    """Read, sample, resize and crop the frames of ``item`` (never raises for bad input)."""
    if item.kind == "text":
        return Decoded(index)
    assert item.path is not None
    try:
        frames, total = _read(Path(item.path), item.kind, options)
        return Decoded(index, frames, source_frames=total)
    except DecodeError as e:
        return Decoded(index, error=f"{item.path}: {e}")
    except Exception as e:  # a decoder's unexpected failure is still one item's failure
        problem = " ".join(str(e).split())[:300] or type(e).__name__
        return Decoded(index, error=f"{item.path}: cannot decode ({problem})")


def _read(path: Path, kind: str, options: DecodeOptions) -> tuple[np.ndarray, int]:
    if not path.exists():
        raise DecodeError("file not found")
    if not path.is_file():
        raise DecodeError("not a file")
    if path.stat().st_size == 0:
        raise DecodeError("empty file (0 bytes)")
    if kind == "image" or path.suffix.lower() in IMAGE_SUFFIXES:
        return _resize(_read_image(path), options.resolution), 1
    return _read_video(path, options)


def _read_image(path: Path) -> np.ndarray:
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(path) as image:
            return np.asarray(image.convert("RGB"))[None]
    except (UnidentifiedImageError, OSError) as e:
        raise DecodeError(f"not a readable image ({' '.join(str(e).split())[:200]})") from None


def _read_video(path: Path, options: DecodeOptions) -> tuple[np.ndarray, int]:
    import decord

    decord.logging.set_level(decord.logging.QUIET)
    try:
        with quiet_stderr():
            reader = decord.VideoReader(
                str(path), ctx=decord.cpu(0), num_threads=options.decoder_threads
            )
    except Exception as e:
        raise DecodeError(f"not a readable video ({decord_problem(e)})") from None
    total = len(reader)
    if total == 0:
        raise DecodeError("the video has no frames")
    indices = sample_indices(total, reader.get_avg_fps(), options.fps, options.max_frames)
    if len(indices) < options.min_frames:
        raise DecodeError(
            f"only {len(indices)} frame{'s' * (len(indices) != 1)} after sampling, fewer than "
            f"--min-frames {options.min_frames}"
        )
    out = []
    for start in range(0, len(indices), _RESIZE_GROUP):  # bounded full-size frames in memory
        group = indices[start : start + _RESIZE_GROUP]
        try:
            with quiet_stderr():
                frames = frames_at(reader, path, group)
        except Exception as e:
            problem = " ".join(str(e).split(": ")[-1].split())[:200]
            raise DecodeError(
                f"decoding failed at frame {group[0]}, the file may be truncated ({problem})"
            ) from None
        out.append(_resize(frames, options.resolution))
    return np.concatenate(out), total


@cache
def _resize_fn(size: int):
    import jax

    from vqgan import resize_and_crop

    return jax.jit(lambda x: resize_and_crop(x, size))


def _resize(frames: np.ndarray, size: int) -> np.ndarray:
    """uint8 ``[T, H, W, 3]`` -> ``[T, size, size, 3]`` with the VQGAN's resize and crop."""
    if frames.shape[1:3] == (size, size):
        return np.ascontiguousarray(frames)
    fn = _resize_fn(size)
    out = []
    for start in range(0, len(frames), _RESIZE_GROUP):
        group = frames[start : start + _RESIZE_GROUP]
        n = len(group)
        if n < _RESIZE_GROUP:
            pad = np.zeros((_RESIZE_GROUP - n, *group.shape[1:]), group.dtype)
            group = np.concatenate([group, pad])
        out.append(np.asarray(fn(group))[:n])
    return np.concatenate(out)
