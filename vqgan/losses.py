"""VQGAN losses: reconstruction, PatchGAN hinge losses, a pluggable perceptual loss, PSNR.

A perceptual loss is any ``fn(x, x_hat) -> scalar`` on frames in [-1, 1]; register one with
`register_perceptual("name", fn)` and select it with ``loss.perceptual=name`` and a positive
``loss.perceptual_weight``. None ships (no pretrained network can be downloaded here), so the
default is ``none``.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from lwm.base.config import ConfigError

__all__ = [
    "PERCEPTUAL_LOSSES",
    "get_perceptual",
    "hinge_d_loss",
    "hinge_g_loss",
    "psnr",
    "recon_loss",
    "register_perceptual",
]

PerceptualFn = Callable[[jax.Array, jax.Array], jax.Array]
PERCEPTUAL_LOSSES: dict[str, PerceptualFn | None] = {"none": None}


def register_perceptual(name: str, fn: PerceptualFn) -> None:
    PERCEPTUAL_LOSSES[name] = fn


def get_perceptual(name: str) -> PerceptualFn | None:
    if name not in PERCEPTUAL_LOSSES:
        raise ConfigError(
            f"unknown perceptual loss 'loss.perceptual={name}'; registered: "
            f"{', '.join(sorted(PERCEPTUAL_LOSSES))}"
        )
    return PERCEPTUAL_LOSSES[name]


def recon_loss(x: jax.Array, x_hat: jax.Array, kind: str) -> jax.Array:
    diff = x_hat.astype(jnp.float32) - x.astype(jnp.float32)
    l1, l2 = jnp.mean(jnp.abs(diff)), jnp.mean(jnp.square(diff))
    return {"l1": l1, "l2": l2, "l1+l2": l1 + l2}[kind]


def hinge_d_loss(real_logits: jax.Array, fake_logits: jax.Array) -> jax.Array:
    """0.5 * (E[relu(1 - D(x))] + E[relu(1 + D(x_hat))])."""
    return 0.5 * (
        jnp.mean(jax.nn.relu(1.0 - real_logits)) + jnp.mean(jax.nn.relu(1.0 + fake_logits))
    )


def hinge_g_loss(fake_logits: jax.Array) -> jax.Array:
    return -jnp.mean(fake_logits)


def psnr(original: np.ndarray, reconstruction: np.ndarray) -> np.ndarray:
    """Per-frame PSNR in dB of uint8 frames ``[N, H, W, C]`` (peak 255)."""
    diff = original.astype(np.float64) - reconstruction.astype(np.float64)
    mse = np.mean(diff * diff, axis=(1, 2, 3))
    return 10.0 * np.log10(255.0**2 / np.maximum(mse, 1e-10))
