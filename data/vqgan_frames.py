"""The frames a VQGAN trains on, per its config's ``data`` section: synthetic videos rendered
in memory (``source: synthetic``), or the videos of a manifest read with decord (``source:
manifest``, the last ``eval_fraction`` of them held out), at the model's resolution.

    source = load_frames(cfg)        # vqgan.data.FrameSource
    vqgan.train.train(cfg, mesh=mesh, source=source)
"""

from __future__ import annotations

import numpy as np

from data.manifest import read_inputs
from data.synthetic import render_frames
from lwm.base.media import read_video
from vqgan import FrameSource, VQGANConfig, to_resolution

__all__ = ["load_frames"]


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
        items = read_inputs(d.manifest)
        videos = list(dict.fromkeys(i.path for i in items if i.kind != "text" and i.path))
        if len(videos) < 2:
            raise ValueError(f"manifest '{d.manifest}' needs at least 2 videos (train and eval)")
        n_eval = max(1, round(len(videos) * d.eval_fraction))
        frames = [to_resolution(read_video(v), res) for v in videos]
        train = np.concatenate(frames[:-n_eval])
        held_out = np.concatenate(frames[-n_eval:])
    return FrameSource(
        train=to_resolution(train, res), eval=to_resolution(held_out, res), seed=d.seed
    )
