"""`VideoTokenizer`: jitted, batched, sharded encode of uint8 video frames to codes and back.

    tok = load_tokenizer("runs/vqgan_small")          # see vqgan/__init__.py
    codes = tok.encode(frames)     # uint8 [B, T, H, W, 3] -> int32 [B, T, h, w]  (numpy)
    frames = tok.decode(codes)     # int32 [B, T, h, w]    -> uint8 [B, T, R, R, 3] (numpy)

Frames of any size are preprocessed on the device as LWM does (short side resized to the
resolution R, centre crop, x/127.5 - 1). All B*T frames are processed in chunks of
``batch_size`` frames (padded to a full chunk, so one compiled program serves every call of
the same frame size); each chunk is sharded over the mesh's batch axes ('dp', 'fsdp') and the
parameters are replicated. Chunks are dispatched before any result is fetched, so host-side
padding and transfers overlap the device work.
"""

from __future__ import annotations

import functools
import hashlib
import math
from collections.abc import Callable

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, SingleDeviceSharding
from jax.sharding import PartitionSpec as P

from lwm.base.mesh import BATCH_AXES, batch_devices
from vqgan.model import VQGAN
from vqgan.preprocess import postprocess, preprocess

__all__ = ["VideoTokenizer"]


class VideoTokenizer:
    """A VQGAN wrapped for tokenizing videos. Build one with `vqgan.load_tokenizer`."""

    def __init__(self, model: VQGAN, *, mesh: Mesh | None = None, batch_size: int | None = None):
        self.config = model.cfg
        self.mesh = mesh
        if mesh is None:  # one device, nothing sharded
            data, replicated = 1, SingleDeviceSharding(jax.local_devices()[0])
            self._batch: jax.sharding.Sharding = replicated
        else:
            data = batch_devices(mesh)
            replicated = NamedSharding(mesh, P())
            self._batch = NamedSharding(mesh, P(BATCH_AXES))
        wanted = batch_size if batch_size is not None else max(8, data)
        self.batch_size = math.ceil(wanted / data) * data  # frames per jitted call
        graphdef, state = nnx.split(model)
        self._params = jax.device_put(state, replicated)
        res = self.config.resolution

        def encode_chunk(params, frames):
            m = nnx.merge(graphdef, params)
            return m.encode(preprocess(frames, res)).codes

        def decode_chunk(params, codes):
            m = nnx.merge(graphdef, params)
            return postprocess(m.decode_codes(codes))

        out = self._batch
        self._encode = jax.jit(encode_chunk, out_shardings=out)
        self._decode = jax.jit(decode_chunk, out_shardings=out)

    # -- properties -------------------------------------------------------------------------

    @property
    def resolution(self) -> int:
        """Height and width of the frames the model sees (and `decode` returns)."""
        return self.config.resolution

    @property
    def codes_shape(self) -> tuple[int, int]:
        """(h, w) of one frame's code grid."""
        return self.config.codes_per_side, self.config.codes_per_side

    @property
    def tokens_per_frame(self) -> int:
        return self.config.tokens_per_frame

    @functools.cached_property
    def fingerprint(self) -> str:
        """Which weights these are, whatever file they came from: a sha256 (16 hex digits) of
        every parameter's name, dtype, shape and bytes. A dataset records it (`lwm tokenize`),
        so a VQGAN folder that trained on since is not taken for the one its codes came from."""
        digest = hashlib.sha256()
        leaves = jax.tree_util.tree_flatten_with_path(nnx.to_pure_dict(self._params))[0]
        for name, leaf in sorted((jax.tree_util.keystr(k), v) for k, v in leaves):
            value = np.asarray(jax.device_get(leaf))
            digest.update(f"{name} {value.dtype} {value.shape};".encode())
            digest.update(np.ascontiguousarray(value).tobytes())
        return digest.hexdigest()[:16]

    @property
    def codebook_size(self) -> int:
        return self.config.num_embeddings

    # -- the jitted per-chunk programs (for benchmarks: device arrays in, device arrays out) --

    def encode_chunk(self, frames: jax.Array) -> jax.Array:
        """uint8 ``[batch_size, H, W, 3]`` (sharded like `place`) -> int32 ``[batch_size, h, w]``."""
        return self._encode(self._params, frames)

    def decode_chunk(self, codes: jax.Array) -> jax.Array:
        """int32 ``[batch_size, h, w]`` -> uint8 ``[batch_size, R, R, 3]``."""
        return self._decode(self._params, codes)

    def place(self, chunk: np.ndarray) -> jax.Array:
        """Put one chunk on the devices, sharded over the batch axes."""
        return jax.device_put(chunk, self._batch)

    # -- the public API ---------------------------------------------------------------------

    def encode(self, frames: np.ndarray | jax.Array) -> np.ndarray:
        """uint8 frames ``[B, T, H, W, 3]`` (any H, W) -> int32 codes ``[B, T, h, w]``."""
        frames = np.asarray(frames)
        if frames.ndim != 5 or frames.shape[-1] != 3 or frames.dtype != np.uint8:
            raise ValueError(
                f"encode expects uint8 frames [B, T, H, W, 3], got {frames.dtype} {frames.shape}"
            )
        b, t = frames.shape[:2]
        flat = frames.reshape(b * t, *frames.shape[2:])
        codes = self._chunked(self.encode_chunk, flat, self.codes_shape, np.int32)
        return codes.reshape(b, t, *self.codes_shape)

    def decode(self, codes: np.ndarray | jax.Array) -> np.ndarray:
        """int codes ``[B, T, h, w]`` in ``[0, codebook_size)`` -> uint8 ``[B, T, R, R, 3]``."""
        codes = np.asarray(codes)
        if codes.ndim != 4 or codes.shape[2:] != self.codes_shape:
            raise ValueError(
                f"decode expects codes [B, T, {self.codes_shape[0]}, {self.codes_shape[1]}], "
                f"got {codes.shape}"
            )
        if not np.issubdtype(codes.dtype, np.integer):
            raise ValueError(f"decode expects integer codes, got {codes.dtype}")
        if codes.size and (codes.min() < 0 or codes.max() >= self.codebook_size):
            raise ValueError(
                f"codes must lie in [0, {self.codebook_size}), got [{codes.min()}, {codes.max()}]"
            )
        b, t = codes.shape[:2]
        flat = codes.reshape(b * t, *self.codes_shape).astype(np.int32)
        shape = (self.resolution, self.resolution, self.config.num_channels)
        frames = self._chunked(self.decode_chunk, flat, shape, np.uint8)
        return frames.reshape(b, t, *shape)

    def _chunked(
        self,
        fn: Callable[[jax.Array], jax.Array],
        items: np.ndarray,
        out_tail: tuple[int, ...],
        out_dtype: type,
    ) -> np.ndarray:
        n, size = len(items), self.batch_size
        pending = []
        for start in range(0, n, size):
            chunk = items[start : start + size]
            if len(chunk) < size:
                pad = np.zeros((size - len(chunk), *chunk.shape[1:]), chunk.dtype)
                chunk = np.concatenate([chunk, pad])
            pending.append(fn(self.place(chunk)))  # dispatched asynchronously
        if not pending:
            return np.zeros((0, *out_tail), out_dtype)
        return np.concatenate([np.asarray(jax.device_get(p)) for p in pending])[:n]
