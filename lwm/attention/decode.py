"""Decode attention: a few new query tokens against a key/value cache sharded over ``sp``.

Each device attends its own slice of the cache and produces a partial output with float32
softmax statistics (running max and sum); one reduction over ``sp`` (pmax, then psum) combines
them. The cache never moves between devices, unlike the reference ring implementation, which
rotates the whole cache around the ring for every generated token.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from lwm.attention._common import attention_mask, check_qkv, default_positions
from lwm.attention.ring import _axes_size, _present
from lwm.base.mesh import BATCH_AXES, SEQUENCE_AXIS

F32 = jnp.float32


def _cache_mask(q_pos, kv_pos, slot, cache_len):
    """Slot ``j`` is valid when ``j < cache_len`` and ``kv_pos <= q_pos``."""
    mask = attention_mask(q_pos, kv_pos, None, None, causal=True)
    return mask & (slot[None, None, :] < cache_len[:, None, None])


def decode_attention_local(
    q: jax.Array,
    k_cache: jax.Array,
    v_cache: jax.Array,
    *,
    cache_len: jax.Array,
    q_positions: jax.Array,
    kv_positions: jax.Array,
    axis_name: str | None = SEQUENCE_AXIS,
    scale: float | None = None,
) -> jax.Array:
    """Per-device part of `ring_decode_attention`; call inside `shard_map` (or with
    ``axis_name=None`` on one device). ``k_cache``/``v_cache`` are this device's slice
    ``[batch, cache/sp, kv_heads, head_dim]``; ``kv_positions`` its positions."""
    b, tq, h, d = q.shape
    s_local, kvh = k_cache.shape[1], k_cache.shape[2]
    scale = d**-0.5 if scale is None else scale
    offset = 0 if axis_name is None else lax.axis_index(axis_name) * s_local
    slot = offset + jnp.arange(s_local, dtype=jnp.int32)
    qg = q.reshape(b, tq, kvh, h // kvh, d)
    s = jnp.einsum("bqhgd,bkhd->bhgqk", qg, k_cache, preferred_element_type=F32) * scale
    mask = _cache_mask(q_positions, kv_positions, slot, cache_len)[:, None, None]
    s = jnp.where(mask, s, -jnp.inf)
    m = jnp.max(s, axis=-1)
    if axis_name is not None:
        m = lax.pmax(m, axis_name)
    m_safe = jnp.where(jnp.isneginf(m), 0.0, m)
    p = jnp.exp(s - m_safe[..., None])
    lsum = jnp.sum(p, axis=-1)
    acc = jnp.einsum(
        "bhgqk,bkhd->bhgqd", p.astype(v_cache.dtype), v_cache, preferred_element_type=F32
    )
    if axis_name is not None:
        lsum, acc = lax.psum((lsum, acc), axis_name)
    out = acc / jnp.where(lsum == 0, 1.0, lsum)[..., None]
    return out.transpose(0, 3, 1, 2, 4).reshape(b, tq, h, d).astype(q.dtype)


def ring_decode_attention(
    q: jax.Array,
    k_cache: jax.Array,
    v_cache: jax.Array,
    *,
    mesh: Mesh,
    cache_len: jax.Array | int,
    q_positions: jax.Array | None = None,
    kv_positions: jax.Array | None = None,
    axis_name: str = SEQUENCE_AXIS,
    batch_axes: str | Sequence[str] | None = BATCH_AXES,
    head_axis: str | None = "tp",
    scale: float | None = None,
) -> jax.Array:
    """Attention of ``q [batch, new, heads, head_dim]`` against a cache
    ``[batch, max_len, kv_heads, head_dim]`` sharded over ``axis_name``.

    ``cache_len`` (scalar or ``[batch]``) is the number of filled slots; the new tokens are
    expected to be written already, at slots ``cache_len - new .. cache_len - 1``, which are
    also their default positions. ``kv_positions`` defaults to the slot index.
    """
    check_qkv(q, k_cache, v_cache)
    b, tq, _, _ = q.shape
    max_len = k_cache.shape[1]
    sp = mesh.shape[axis_name]
    batch_axes = _present(mesh, batch_axes)
    head_axis = _present(mesh, head_axis)
    if max_len % sp:
        raise ValueError(
            f"cache length {max_len} is not divisible by the {sp} devices of '{axis_name}'"
        )
    if k_cache.shape[2] % _axes_size(mesh, head_axis):
        raise ValueError(f"key/value heads {k_cache.shape[2]} not divisible over '{head_axis}'")
    cache_len = jnp.broadcast_to(jnp.asarray(cache_len, jnp.int32), (b,))
    if q_positions is None:
        q_positions = cache_len[:, None] - tq + jnp.arange(tq, dtype=jnp.int32)[None]
    if kv_positions is None:
        kv_positions = default_positions(b, max_len)

    x_rep = P(batch_axes, None, head_axis, None)
    x_seq = P(batch_axes, axis_name, head_axis, None)
    fn = jax.shard_map(
        lambda q, k, v, n, qp, kp: decode_attention_local(
            q, k, v, cache_len=n, q_positions=qp, kv_positions=kp, axis_name=axis_name, scale=scale
        ),
        mesh=mesh,
        in_specs=(
            x_rep,
            x_seq,
            x_seq,
            P(batch_axes),
            P(batch_axes, None),
            P(batch_axes, axis_name),
        ),
        out_specs=x_rep,
        check_vma=True,
    )
    return fn(q, k_cache, v_cache, cache_len, q_positions, kv_positions)
