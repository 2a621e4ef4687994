"""Frames for VQGAN training: synthetic videos rendered in memory, or the videos of a manifest
(read with decord), brought to the model's resolution once, split into training and held-out
frames.

The batch of step ``s`` is drawn with ``np.random.default_rng([seed, s])``: a pure function of
the step, so a resumed run sees exactly the batches an uninterrupted one would.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import numpy as np

from data.synthetic import read_manifest, render_frames
from data.video_io import read_video
from vqgan.config import VQGANConfig
from vqgan.preprocess import resize_and_crop

__all__ = ["FrameSource", "load_frames"]


@dataclass
class FrameSource:
    train: np.ndarray  # uint8 [N, R, R, 3]
    eval: np.ndarray  # uint8 [M, R, R, 3], held-out videos
    seed: int

    def batch(self, step: int, batch_size: int) -> np.ndarray:
        rng = np.random.default_rng([self.seed, step])
        return self.train[rng.integers(0, len(self.train), batch_size)]


def _to_resolution(frames: np.ndarray, size: int) -> np.ndarray:
    if frames.shape[1:3] == (size, size):
        return frames
    fn = jax.jit(resize_and_crop, static_argnums=1)
    return np.concatenate(
        [np.asarray(fn(frames[i : i + 256], size)) for i in range(0, len(frames), 256)]
    )


def load_frames(cfg: VQGANConfig) -> FrameSource:
    d, res = cfg.data, cfg.model.resolution
    if d.source == "synthetic":
        size = d.frame_size or res
        kw = dict(size=size, num_frames=d.num_frames, needle_prob=d.needle_prob)
        train = render_frames(d.videos, d.seed, **kw).reshape(-1, size, size, 3)
        # Held-out: the next videos of the same seed, never seen in training.
        held_out = render_frames(d.eval_videos, d.seed, start=d.videos, **kw)
        held_out = held_out.reshape(-1, size, size, 3)
    else:
        assert d.manifest is not None
        videos = list(dict.fromkeys(row["video"] for row in read_manifest(d.manifest)))
        if len(videos) < 2:
            raise ValueError(f"manifest '{d.manifest}' needs at least 2 videos (train and eval)")
        n_eval = max(1, round(len(videos) * d.eval_fraction))
        frames = [_to_resolution(read_video(v), res) for v in videos]
        train = np.concatenate(frames[:-n_eval])
        held_out = np.concatenate(frames[-n_eval:])
    return FrameSource(
        train=_to_resolution(train, res), eval=_to_resolution(held_out, res), seed=d.seed
    )
