"""Vector quantizer: nearest-codebook lookup with straight-through gradients, the codebook and
commitment losses, codebook-usage statistics, and restarts of dead codes.

    out = quantizer(z)                     # z [..., embed_dim] -> out.quantized, out.codes, losses
    vectors = quantizer.lookup(codes)      # codes [...] int -> [..., embed_dim]
    usage = update_usage(usage, out.codes, decay=0.9)
    emb, usage, n = restart_dead_codes(emb, usage, z_flat, key, threshold=0.01)

The parameter is ``embeddings [num_embeddings, embed_dim]``, initialised uniform in
``[-1/n, 1/n]`` as in LWM. Distances are computed in float32 whatever the compute dtype.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

__all__ = [
    "QuantizerOutput",
    "VectorQuantizer",
    "code_counts",
    "nearest_codes",
    "restart_dead_codes",
    "update_usage",
    "usage_stats",
]


class QuantizerOutput(NamedTuple):
    quantized: (
        jax.Array
    )  # [..., d] float32, straight-through: forward = codebook vectors, grad -> z
    codes: jax.Array  # [...] int32
    codebook_loss: jax.Array  # mean ||sg(z) - e||^2 (moves the codebook towards the encoder)
    commitment_loss: jax.Array  # mean ||z - sg(e)||^2 (keeps the encoder near its codes)
    latents: jax.Array  # [..., d] float32: z itself (dead codes restart from these)


def nearest_codes(z: jax.Array, embeddings: jax.Array) -> jax.Array:
    """Index of the nearest codebook row (squared L2) for each vector of ``z [..., d]``.

    The products are float32-exact on every backend (``precision="highest"``), so that a frame
    gets the same codes on a TPU as on a CPU: at a TPU's default precision (operands rounded to
    bfloat16) the scores of two near codes can swap. The product is small (d is 8-256)."""
    flat = z.reshape(-1, z.shape[-1]).astype(jnp.float32)
    emb = embeddings.astype(jnp.float32)
    # ||z||^2 is the same for every code, so it does not change the argmin.
    dots = jnp.matmul(flat, emb.T, precision=jax.lax.Precision.HIGHEST)
    scores = jnp.sum(emb * emb, axis=1)[None, :] - 2.0 * dots
    return jnp.argmin(scores, axis=1).astype(jnp.int32).reshape(z.shape[:-1])


class VectorQuantizer(nnx.Module):
    def __init__(
        self, num_embeddings: int, embed_dim: int, *, param_dtype: str = "float32", rngs: nnx.Rngs
    ):
        self.num_embeddings = num_embeddings
        self.embed_dim = embed_dim
        bound = 1.0 / num_embeddings
        self.embeddings = nnx.Param(
            jax.random.uniform(
                rngs.params(), (num_embeddings, embed_dim), jnp.dtype(param_dtype), -bound, bound
            )
        )

    def codes(self, z: jax.Array) -> jax.Array:
        return nearest_codes(z, self.embeddings[...])

    def lookup(self, codes: jax.Array) -> jax.Array:
        return jnp.take(self.embeddings[...].astype(jnp.float32), codes, axis=0)

    def __call__(self, z: jax.Array) -> QuantizerOutput:
        z = z.astype(jnp.float32)
        codes = self.codes(z)
        e = self.lookup(codes)
        codebook_loss = jnp.mean(jnp.square(jax.lax.stop_gradient(z) - e))
        commitment_loss = jnp.mean(jnp.square(z - jax.lax.stop_gradient(e)))
        quantized = z + jax.lax.stop_gradient(e - z)
        return QuantizerOutput(quantized, codes, codebook_loss, commitment_loss, z)


# ---------------------------------------------------------------------------------------------
# Usage statistics and dead-code restarts (pure functions, used inside the jitted train step)


def code_counts(codes: jax.Array, num_embeddings: int) -> jax.Array:
    """How often each code occurs in ``codes`` (float32 [num_embeddings])."""
    return jnp.zeros((num_embeddings,), jnp.float32).at[codes.reshape(-1)].add(1.0)


def usage_stats(counts: jax.Array) -> dict[str, jax.Array]:
    """Perplexity (exp of the entropy of the code distribution) and the fraction of codes used."""
    p = counts / jnp.maximum(jnp.sum(counts), 1.0)
    entropy = -jnp.sum(jnp.where(p > 0, p * jnp.log(jnp.where(p > 0, p, 1.0)), 0.0))
    return {"perplexity": jnp.exp(entropy), "codebook_used": jnp.mean(counts > 0)}


def update_usage(usage: jax.Array, codes: jax.Array, decay: float) -> jax.Array:
    """Exponential moving average of per-step code counts."""
    return decay * usage + (1.0 - decay) * code_counts(codes, usage.shape[0])


def restart_dead_codes(
    embeddings: jax.Array,
    usage: jax.Array,
    z: jax.Array,
    key: jax.Array,
    threshold: float,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Replace every code whose usage EMA is below ``threshold`` by an encoder output drawn at
    random from ``z [..., d]`` (plus a little noise, so codes restarted on the same vector
    separate). Returns the new embeddings, the usage with restarted codes set to the mean
    usage (so they get a fair chance before the next check), and the number restarted."""
    flat = z.reshape(-1, z.shape[-1]).astype(jnp.float32)
    n = embeddings.shape[0]
    pick_key, noise_key = jax.random.split(key)
    picks = jax.random.randint(pick_key, (n,), 0, flat.shape[0])
    scale = 1e-2 * jnp.std(flat) + 1e-6
    candidates = flat[picks] + scale * jax.random.normal(noise_key, (n, flat.shape[1]))
    dead = usage < threshold
    new_embeddings = jnp.where(dead[:, None], candidates.astype(embeddings.dtype), embeddings)
    new_usage = jnp.where(dead, jnp.maximum(jnp.mean(usage), threshold), usage)
    return new_embeddings, new_usage, jnp.sum(dead).astype(jnp.int32)
