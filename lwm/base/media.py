"""Reading videos (decord) and writing MP4/PNG files (PyAV, Pillow), atomically.

    frames = read_video("clip.mp4")                 # uint8 [T, H, W, 3]
    frames = read_video("clip.mp4", max_frames=8)   # 8 frames evenly spaced, as LWM samples
    write_mp4("out.mp4", frames, fps=8)             # H.264, yuv420p
    write_png("grid.png", image)                    # uint8 [H, W, 3]

Writers go to a temporary name beside the target and rename it when complete, so a failed
write never leaves a half-written file under the real name.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from lwm.base.files import atomic_path

__all__ = ["LOSSLESS", "VideoError", "frames_at", "read_video", "write_mp4", "write_png"]

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp", ".webp")


class VideoError(ValueError):
    """A video or image file cannot be read or written; the message names the file."""


def read_video(path: str | os.PathLike, max_frames: int | None = None) -> np.ndarray:
    """All frames of a video (or one image as a one-frame video) as uint8 ``[T, H, W, 3]``.

    With ``max_frames``, a longer video is sampled at ``max_frames`` evenly spaced frames
    (``np.linspace(0, T - 1, max_frames)``, as LWM's vision chat does)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"video '{path}' not found")
    if path.suffix.lower() in IMAGE_SUFFIXES:
        from PIL import Image

        try:
            with Image.open(path) as image:
                return np.asarray(image.convert("RGB"))[None]
        except OSError as e:
            raise VideoError(f"cannot read image '{path}': {e}") from None
    import decord

    decord.logging.set_level(decord.logging.QUIET)
    try:
        with quiet_stderr():
            reader = decord.VideoReader(str(path), ctx=decord.cpu(0))
    except (decord.DECORDError, RuntimeError) as e:  # decord raises RuntimeError on bad files
        raise VideoError(f"cannot read video '{path}': {decord_problem(e)}") from None
    total = len(reader)
    if total == 0:
        raise VideoError(f"video '{path}' has no frames")
    if max_frames is None or total <= max_frames:
        indices = list(range(total))
    else:
        indices = np.linspace(0, total - 1, max_frames, dtype=int).tolist()
    return frames_at(reader, path, indices)


def frames_at(reader: object, path: Path, indices: list[int]) -> np.ndarray:
    """Frames ``indices`` of ``path`` as uint8 ``[N, H, W, 3]``, read with its open decord
    ``reader``. For some widths (16, 24, 48) decord copies rows with the decoder's padded line
    size and fails; those frames are decoded with PyAV instead. A file neither can decode, or
    that gives fewer frames than asked, is a `VideoError` naming it."""
    import decord

    try:
        frames = reader.get_batch(indices).asnumpy()  # type: ignore[attr-defined]
        if frames.ndim == 4 and frames.shape[-1] == 3:
            return _check_count(frames, path, indices)
    except decord.DECORDError:
        pass
    return _check_count(_read_with_pyav(path, indices), path, indices)


def _check_count(frames: np.ndarray, path: Path, indices: list[int]) -> np.ndarray:
    if frames.ndim != 4 or frames.shape[0] != len(indices) or frames.shape[-1] != 3:
        raise VideoError(
            f"video '{path}': asked for {len(indices)} frames, the decoder gave shape "
            f"{frames.shape}"
        )
    return frames


def _read_with_pyav(path: Path, indices: list[int]) -> np.ndarray:
    import av

    wanted = set(indices)
    try:
        with av.open(str(path)) as container:
            decoded = [
                frame.to_ndarray(format="rgb24")
                for i, frame in enumerate(container.decode(video=0))
                if i in wanted
            ]
    except av.error.FFmpegError as e:
        problem = " ".join(str(e).split())[:200]
        raise VideoError(f"cannot read video '{path}': {problem}") from None
    by_index = dict(zip(sorted(wanted), decoded, strict=False))
    if len(by_index) < len(wanted):
        raise VideoError(f"video '{path}' has fewer frames than its header says")
    return np.stack([by_index[i] for i in indices])


def _check_frames(frames: np.ndarray, what: str) -> np.ndarray:
    frames = np.asarray(frames)
    if frames.dtype != np.uint8 or frames.ndim != 4 or frames.shape[-1] != 3:
        raise VideoError(
            f"{what}: expected uint8 frames [T, H, W, 3], got {frames.dtype} {frames.shape}"
        )
    return frames


# `write_mp4` options for lossless H.264: decoded, the frames up to the RGB <-> YUV rounding (at
# most 2 levels). Training data is written so: x264's lossy output was not the same from run to
# run on the development machine (a few videos in 30 differed, by up to 11 levels).
LOSSLESS: dict[str, Any] = {"crf": 0, "pix_fmt": "yuv444p"}


def write_mp4(
    path: str | os.PathLike,
    frames: np.ndarray,
    fps: int = 8,
    crf: int = 12,
    pix_fmt: str = "yuv420p",
) -> None:
    """Write uint8 ``[T, H, W, 3]`` frames as an H.264 MP4 (H and W must be even). ``pix_fmt``
    ``yuv444p`` keeps full-resolution colour (at 32x32, 4:2:0 smears the colour of every edge
    pixel); ``yuv420p`` is what every player reads. ``**LOSSLESS`` (CRF 0, 4:4:4) is lossless."""
    import av

    path = Path(path)
    frames = _check_frames(frames, f"writing '{path}'")
    _, height, width, _ = frames.shape
    if height % 2 or width % 2:
        raise VideoError(f"writing '{path}': H.264 needs even frame sizes, got {height}x{width}")
    with atomic_path(path) as tmp, av.open(str(tmp), mode="w", format="mp4") as container:
        stream = container.add_stream("libx264", rate=fps)
        stream.width, stream.height = width, height
        stream.pix_fmt = pix_fmt
        # Low CRF: the flat colours of the synthetic videos survive compression nearly intact.
        stream.options = {"crf": str(crf), "preset": "medium"}
        for frame in frames:
            for packet in stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)


def write_png(path: str | os.PathLike, image: np.ndarray) -> None:
    """Write a uint8 ``[H, W, 3]`` image as PNG."""
    from PIL import Image

    path = Path(path)
    image = np.asarray(image)
    if image.dtype != np.uint8 or image.ndim != 3 or image.shape[-1] != 3:
        raise VideoError(
            f"writing '{path}': expected uint8 [H, W, 3], got {image.dtype} {image.shape}"
        )
    with atomic_path(path) as tmp:
        Image.fromarray(image).save(tmp, format="PNG")


@contextlib.contextmanager
def quiet_stderr() -> Iterator[None]:
    """Silence the native decoder's own log lines (the error line we write says it better)."""
    try:
        saved = os.dup(2)
    except OSError:
        yield
        return
    try:
        with open(os.devnull, "wb") as null:
            os.dup2(null.fileno(), 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def decord_problem(error: Exception) -> str:
    """What decord's error on opening a file says of it, in short (with its logging quiet it
    often says only "Error reading PATH...")."""
    detail = str(error).rpartition("Error: ")[2] if "Error: " in str(error) else ""
    return " ".join(detail.split())[:200] or "unknown format, or the file is damaged"
