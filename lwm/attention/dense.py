"""Dense attention: the O(seq^2)-memory reference every other implementation is tested against."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from lwm.attention._common import attention_mask, check_qkv, check_segments, default_positions


def dense_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    causal: bool = True,
    q_positions: jax.Array | None = None,
    kv_positions: jax.Array | None = None,
    q_segment_ids: jax.Array | None = None,
    kv_segment_ids: jax.Array | None = None,
    scale: float | None = None,
) -> jax.Array:
    """Softmax attention computed in float32, returned in ``q.dtype``.

    ``q [batch, q_len, heads, head_dim]``, ``k, v [batch, kv_len, kv_heads, head_dim]``
    (grouped-query when ``heads`` is a multiple of ``kv_heads``). A query attends a key when
    ``kv_pos <= q_pos`` (if ``causal``) and the segment ids are equal. Queries with no key to
    attend return zeros.
    """
    check_qkv(q, k, v)
    check_segments(q_segment_ids, kv_segment_ids)
    b, sq, h, d = q.shape
    kvh = k.shape[2]
    scale = d**-0.5 if scale is None else scale
    if q_positions is None:
        q_positions = default_positions(b, sq)
    if kv_positions is None:
        kv_positions = default_positions(b, k.shape[1])

    qf = q.astype(jnp.float32).reshape(b, sq, kvh, h // kvh, d)
    s = jnp.einsum("bqhgd,bkhd->bhgqk", qf, k.astype(jnp.float32)) * scale
    mask = attention_mask(q_positions, kv_positions, q_segment_ids, kv_segment_ids, causal)
    if mask is not None:
        s = jnp.where(mask[:, None, None], s, -jnp.inf)
    m = jnp.max(s, axis=-1, keepdims=True)
    m = jnp.where(jnp.isneginf(m), 0.0, m)
    p = jnp.exp(s - m)
    denom = jnp.sum(p, axis=-1, keepdims=True)
    p = p / jnp.where(denom == 0, 1.0, denom)
    out = jnp.einsum("bhgqk,bkhd->bqhgd", p, v.astype(jnp.float32))
    return out.reshape(b, sq, h, d).astype(q.dtype)
