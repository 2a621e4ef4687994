"""Frames for VQGAN training (`FrameSource`): training and held-out frames at the model's
resolution, and the batch of every step.

The batch of step ``s`` is drawn with ``np.random.default_rng([seed, s])``: a pure function of
the step, so a resumed run sees exactly the batches an uninterrupted one would. Where the
frames come from (synthetic videos, a manifest of MP4s) is the data layer's business:
`data.vqgan_frames.load_frames`.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import numpy as np

from vqgan.preprocess import resize_and_crop

__all__ = ["FrameSource", "to_resolution"]


@dataclass
class FrameSource:
    train: np.ndarray  # uint8 [N, R, R, 3]
    eval: np.ndarray  # uint8 [M, R, R, 3], held-out videos
    seed: int

    def batch(self, step: int, batch_size: int) -> np.ndarray:
        rng = np.random.default_rng([self.seed, step])
        return self.train[rng.integers(0, len(self.train), batch_size)]


def to_resolution(frames: np.ndarray, size: int) -> np.ndarray:
    """uint8 ``[N, H, W, 3]`` frames resized (short side) and centre-cropped to ``size``, as
    the VQGAN preprocesses them."""
    if frames.shape[1:3] == (size, size):
        return frames
    fn = jax.jit(resize_and_crop, static_argnums=1)
    return np.concatenate(
        [np.asarray(fn(frames[i : i + 256], size)) for i in range(0, len(frames), 256)]
    )
