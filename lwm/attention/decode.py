"""Decode attention: a few new query tokens against a key/value cache sharded over ``sp``.

Each device attends its own slice of the cache, block by block and only as far as the cache is
filled, and produces a partial output with float32 softmax statistics (running max and sum);
one reduction over ``sp`` (pmax, then psum) combines them. The cache never moves between
devices, unlike the reference ring implementation, which rotates the whole cache around the
ring for every generated token.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from lwm.attention._common import (
    attention_mask,
    check_qkv,
    default_positions,
    full,
    union_vma,
)
from lwm.attention.ring import _axes_size, _present
from lwm.base.mesh import BATCH_AXES, SEQUENCE_AXIS

F32 = jnp.float32


# Scores per step of the loop over the filled part of the cache: a block holds this many
# (query, slot) pairs, e.g. 512 slots for a prefill chunk of 1,024 tokens; one new token reads
# its whole slice at once (a loop over small blocks costs more than it skips).
BLOCK_SCORES = 512 * 1024


def _block_size(s_local: int, block: int) -> int:
    """The largest divisor of ``s_local`` up to ``block``; the whole slice when that divisor
    would be so small that the loop's overhead outweighs the slots it skips."""
    size = next(d for d in range(min(block, s_local), 0, -1) if s_local % d == 0)
    return size if size * 4 >= min(block, s_local) else s_local


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
    block: int | None = None,
) -> jax.Array:
    """Per-device part of `ring_decode_attention`; call inside `shard_map` (or with
    ``axis_name=None`` on one device). ``k_cache``/``v_cache`` are this device's slice
    ``[batch, cache/sp, kv_heads, head_dim]``; ``kv_positions`` its positions.

    The slice is read in blocks of ``block`` slots (default: ``BLOCK_SCORES`` / new tokens)
    with an online softmax (float32 running max and sum), and only the blocks that hold a
    filled slot (below the longest row's ``cache_len``) are read: a prompt chunk costs what the
    filled cache holds, not the cache's size, and the temporaries are one block's."""
    b, tq, h, d = q.shape
    s_local, kvh = k_cache.shape[1], k_cache.shape[2]
    scale = d**-0.5 if scale is None else scale
    offset = 0 if axis_name is None else lax.axis_index(axis_name) * s_local
    size = _block_size(s_local, block or max(1, BLOCK_SCORES // tq))
    qg = q.reshape(b, tq, kvh, h // kvh, d)

    def scores(k, kv_pos, slot):  # masked: causal by position, and only filled slots
        s = jnp.einsum("bqhgd,bkhd->bhgqk", qg, k, preferred_element_type=F32) * scale
        mask = attention_mask(q_positions, kv_pos, None, None, causal=True)
        mask = mask & (slot[None, None, :] < cache_len[:, None, None])
        return jnp.where(mask[:, None, None], s, -jnp.inf)

    def weighted(p, v):
        return jnp.einsum("bhgqk,bkhd->bhgqd", p.astype(v.dtype), v, preferred_element_type=F32)

    if size == s_local:  # one block: the slice directly (no loop, no slicing, no rescaling)
        s = scores(k_cache, kv_positions, offset + jnp.arange(s_local, dtype=jnp.int32))
        m = jnp.max(s, axis=-1)
        if axis_name is not None:
            m = lax.pmax(m, axis_name)
        p = jnp.exp(s - jnp.where(jnp.isneginf(m), 0.0, m)[..., None])
        lsum, acc = jnp.sum(p, axis=-1), weighted(p, v_cache)
        if axis_name is not None:
            lsum, acc = lax.psum((lsum, acc), axis_name)
        return _finish(acc, lsum, q)

    filled = jnp.clip(jnp.max(cache_len) - offset, 0, s_local)
    blocks = (filled + size - 1) // size

    def attend(m, lsum, acc, k, v, kv_pos, slot):
        s = scores(k, kv_pos, slot)
        m_new = jnp.maximum(m, jnp.max(s, axis=-1))
        m_safe = jnp.where(jnp.isneginf(m_new), 0.0, m_new)
        p = jnp.exp(s - m_safe[..., None])
        correction = jnp.exp(jnp.where(jnp.isneginf(m), m_safe, m) - m_safe)
        lsum = lsum * correction + jnp.sum(p, axis=-1)
        return m_new, lsum, acc * correction[..., None] + weighted(p, v)

    def body(carry):
        i, *stats = carry
        at = i * size
        k, v, kv_pos = (
            lax.dynamic_slice_in_dim(x, at, size, axis=1) for x in (k_cache, v_cache, kv_positions)
        )
        slot = offset + at + jnp.arange(size, dtype=jnp.int32)
        return i + 1, *attend(*stats, k, v, kv_pos, slot)

    stats = (b, kvh, h // kvh, tq)
    # the loop's carry varies over every mesh axis its inputs vary over (check_vma)
    vma = union_vma((q, k_cache, v_cache, cache_len, q_positions, kv_positions))
    init = (
        jnp.int32(0),
        full(stats, -jnp.inf, F32, vma),
        full(stats, 0.0, F32, vma),
        full((*stats, d), 0.0, F32, vma),
    )
    _, m, lsum, acc = lax.while_loop(lambda c: c[0] < blocks, body, init)
    if axis_name is not None:  # rescale every device's part to the global max, then sum
        m_all = lax.pmax(m, axis_name)
        m_safe = jnp.where(jnp.isneginf(m_all), 0.0, m_all)
        correction = jnp.exp(jnp.where(jnp.isneginf(m), m_safe, m) - m_safe)
        lsum, acc = lax.psum((lsum * correction, acc * correction[..., None]), axis_name)
    return _finish(acc, lsum, q)


def _finish(acc: jax.Array, lsum: jax.Array, q: jax.Array) -> jax.Array:
    out = acc / jnp.where(lsum == 0, 1.0, lsum)[..., None]
    return out.transpose(0, 3, 1, 2, 4).reshape(q.shape).astype(q.dtype)


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
    block: int | None = None,
) -> jax.Array:
    """Attention of ``q [batch, new, heads, head_dim]`` against a cache
    ``[batch, max_len, kv_heads, head_dim]`` sharded over ``axis_name``.

    ``cache_len`` (scalar or ``[batch]``) is the number of filled slots; the new tokens are
    expected to be written already, at slots ``cache_len - new .. cache_len - 1``, which are
    also their default positions. ``kv_positions`` defaults to the slot index. Slots at or
    past the longest row's ``cache_len`` are never read (``block``: `decode_attention_local`).
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
            q,
            k,
            v,
            cache_len=n,
            q_positions=qp,
            kv_positions=kp,
            axis_name=axis_name,
            scale=scale,
            block=block,
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


def write_cache_local(
    cache: jax.Array, new: jax.Array, start: jax.Array, *, axis_name: str | None = SEQUENCE_AXIS
) -> jax.Array:
    """Write ``new [batch, n, kv_heads, head_dim]`` at the global slots ``start[row] ..
    start[row] + n - 1`` of a cache whose slice on this device is ``cache [batch, cache/sp,
    ...]``; call inside `shard_map` (or with ``axis_name=None`` on one device).

    Each device reads, updates and writes back one window of ``n`` slots of its own slice
    (the slots of the chunk that fall into it, if any), so a write costs O(n), not O(cache),
    and nothing moves between devices. Needs ``n <= cache/sp``."""
    local_len, n = cache.shape[1], new.shape[1]
    offset = 0 if axis_name is None else lax.axis_index(axis_name) * local_len
    new = new.astype(cache.dtype)

    def row(cache, new, start):
        local = start - offset  # where the chunk starts in this slice; may lie outside it
        at = jnp.clip(local, 0, local_len - n)  # a window of n slots covering the overlap
        source = at + jnp.arange(n, dtype=jnp.int32) - local  # the new token of each slot
        inside = ((source >= 0) & (source < n))[:, None, None]
        taken = jnp.take(new, jnp.clip(source, 0, n - 1), axis=0)
        window = lax.dynamic_slice_in_dim(cache, at, n, axis=0)
        return lax.dynamic_update_slice_in_dim(cache, jnp.where(inside, taken, window), at, 0)

    return jax.vmap(row)(cache, new, start)


def ring_write_cache(
    cache: jax.Array,
    new: jax.Array,
    start: jax.Array | int,
    *,
    mesh: Mesh | None,
    axis_name: str = SEQUENCE_AXIS,
    batch_axes: str | Sequence[str] | None = BATCH_AXES,
    head_axis: str | None = "tp",
) -> jax.Array:
    """`write_cache_local` on a cache ``[batch, max_len, kv_heads, head_dim]`` sharded over
    ``axis_name`` (``mesh=None``: one device). ``start`` is a scalar or one slot per row. When
    the chunk is longer than a device's slice, falls back to a select over the whole cache."""
    b, max_len = cache.shape[:2]
    n = new.shape[1]
    start = jnp.broadcast_to(jnp.asarray(start, jnp.int32), (b,))
    if mesh is None:
        return write_cache_local(cache, new, start, axis_name=None)
    sp = mesh.shape[axis_name]
    if n > max_len // sp:
        slot = jnp.arange(max_len, dtype=jnp.int32)[None]
        write = ((slot >= start[:, None]) & (slot < start[:, None] + n))[..., None, None]
        source = jnp.clip(slot - start[:, None], 0, n - 1)
        taken = jnp.take_along_axis(new.astype(cache.dtype), source[..., None, None], axis=1)
        return jnp.where(write, taken, cache)
    batch_axes = _present(mesh, batch_axes)
    head_axis = _present(mesh, head_axis)
    x_seq = P(batch_axes, axis_name, head_axis, None)
    fn = jax.shard_map(
        lambda c, x, s: write_cache_local(c, x, s, axis_name=axis_name),
        mesh=mesh,
        in_specs=(x_seq, P(batch_axes, None, head_axis, None), P(batch_axes)),
        out_specs=x_seq,
        check_vma=True,
    )
    return fn(cache, new, start)
