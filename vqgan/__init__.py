"""The VQGAN video tokenizer: LWM's architecture in Flax NNX, its training, fast batched
encode/decode, and a safe import of LWM's released weights.

The one entry point for tokenizing (`lwm tokenize` calls exactly this)::

    from vqgan import load_tokenizer

    tok = load_tokenizer(path, mesh=None, dtype=None, batch_size=None)
    codes = tok.encode(frames)   # uint8 [B, T, H, W, 3], any H and W -> int32 [B, T, h, w] (numpy)
    frames = tok.decode(codes)   # int [B, T, h, w] in [0, codebook_size) -> uint8 [B, T, R, R, 3]
    tok.resolution               # R: frames are resized (short side) and centre-cropped to R x R
    tok.tokens_per_frame         # h * w (256 for LWM's 256x256 model, 64 for configs/vqgan/small)
    tok.codes_shape              # (h, w); codes are in raster order
    tok.codebook_size            # 8192 for LWM

``path`` is a folder holding ``config.yaml`` and ``model.safetensors`` (written at the end of
`lwm vqgan train` into its ``train.output_dir``, or by `lwm vqgan import`), or a training output
folder whose run has not finished (the latest orbax checkpoint under ``checkpoints/`` is used).
``mesh``: the caller's (dp, fsdp, sp, tp) mesh, whose batch axes split the frames (default: one
device);
``dtype``: compute dtype override ("bfloat16"); ``batch_size``: frames per jitted call.

Modules: `config` (typed YAML configs), `model` (encoder, decoder), `quantizer`,
`discriminator`, `losses`, `train`, `tokenizer` (`VideoTokenizer`), `weights` (safetensors,
LWM layout), `legacy_pickle` (the restricted unpickler), `preprocess`, `data` (`FrameSource`,
the training frames; where they come from is `data.vqgan_frames`).
"""

from __future__ import annotations

import os
from pathlib import Path

from jax.sharding import Mesh

from vqgan.config import VQGANConfig, load_vqgan_config
from vqgan.data import FrameSource, to_resolution
from vqgan.preprocess import resize_and_crop

# The public API: what the layers above (data/, lwm/) may use; the rest is internal.
__all__ = [
    "FrameSource",
    "VQGANConfig",
    "check_saved",
    "load_model",
    "load_tokenizer",
    "load_vqgan_config",
    "resize_and_crop",
    "to_resolution",
]


def load_model(path: str | os.PathLike, *, dtype: str | None = None):
    """The `VQGAN` model saved in ``path`` (see `load_tokenizer` for what ``path`` may be)."""
    from flax import nnx

    from vqgan.checkpoint import restore_model_params
    from vqgan.model import VQGAN
    from vqgan.weights import WEIGHTS_FILE, load_weights, read_config

    path = Path(path)
    check_saved(path)
    if (path / WEIGHTS_FILE).is_file():
        return load_weights(path, dtype=dtype)[0]
    cfg = read_config(path).model  # a training output folder: its newest checkpoint
    if dtype is not None:
        cfg = cfg.model_copy(update={"dtype": dtype})
    graphdef, state = nnx.split(nnx.eval_shape(lambda: VQGAN(cfg, rngs=nnx.Rngs(0))))
    restored = restore_model_params(path / "checkpoints", nnx.to_pure_dict(state))
    nnx.replace_by_pure_dict(state, restored)
    return nnx.merge(graphdef, state)


def check_saved(path: str | os.PathLike) -> None:
    """A `FileNotFoundError` unless ``path`` holds a VQGAN `load_model` reads: the weights
    file (with config.yaml), or a training output folder with ``checkpoints/``."""
    from vqgan.weights import WEIGHTS_FILE

    path = Path(path)
    if not ((path / WEIGHTS_FILE).is_file() or (path / "checkpoints").is_dir()):
        raise FileNotFoundError(
            f"'{path}' holds no VQGAN: expected {WEIGHTS_FILE} and config.yaml, or a training "
            "output folder with checkpoints/"
        )


def load_tokenizer(
    path: str | os.PathLike,
    *,
    mesh: Mesh | None = None,
    dtype: str | None = None,
    batch_size: int | None = None,
):
    """A `vqgan.tokenizer.VideoTokenizer` for the VQGAN saved in ``path`` (module docstring)."""
    from vqgan.tokenizer import VideoTokenizer

    return VideoTokenizer(load_model(path, dtype=dtype), mesh=mesh, batch_size=batch_size)
