"""Frames in and out of the VQGAN: LWM's preprocessing, in JAX so it runs inside the jitted
encode on the device.

LWM (`vision_chat.py`) resizes each frame so its short side is the model's resolution (PIL's
bicubic filter, the long side ``int(size * long / short)``), centre-crops a square (the box
rounded as PIL rounds it) and maps uint8 to ``x / 127.5 - 1``. Here the resize is
`jax.image.resize` with bicubic antialiasing (what PIL's bicubic does when shrinking) and the
result is rounded to integers as PIL's uint8 output is. Frames already at the resolution pass
unchanged.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

__all__ = ["crop_offsets", "postprocess", "preprocess", "resize_and_crop", "resized_shape"]


def resized_shape(height: int, width: int, size: int) -> tuple[int, int]:
    """(height, width) after resizing the short side to ``size`` (LWM's rounding)."""
    if width < height:
        return int(size * height / width), size
    return size, int(size * width / height)


def crop_offsets(height: int, width: int, size: int) -> tuple[int, int]:
    """(top, left) of the centred ``size`` square, rounded as PIL's ``crop`` rounds its box."""
    return round((height - size) / 2), round((width - size) / 2)


def resize_and_crop(frames: jax.Array, size: int) -> jax.Array:
    """uint8 ``[N, H, W, C]`` -> uint8 ``[N, size, size, C]`` (short side resized, centre crop)."""
    n, height, width, c = frames.shape
    new_h, new_w = resized_shape(height, width, size)
    if (new_h, new_w) != (height, width):
        x = jax.image.resize(
            frames.astype(jnp.float32), (n, new_h, new_w, c), method="bicubic", antialias=True
        )
        frames = jnp.clip(jnp.round(x), 0, 255).astype(jnp.uint8)
    top, left = crop_offsets(new_h, new_w, size)
    return frames[:, top : top + size, left : left + size, :]


def preprocess(frames: jax.Array, size: int) -> jax.Array:
    """uint8 ``[N, H, W, C]`` -> float32 ``[N, size, size, C]`` in [-1, 1], as LWM."""
    return resize_and_crop(frames, size).astype(jnp.float32) / 127.5 - 1.0


def postprocess(x: jax.Array) -> jax.Array:
    """Model output in [-1, 1] -> uint8 (rounded; LWM's scripts truncate,
    ``((x + 1) * 127.5).astype(np.uint8)``, so their pixels can be one lower)."""
    return jnp.clip(jnp.round((x.astype(jnp.float32) + 1.0) * 127.5), 0, 255).astype(jnp.uint8)
