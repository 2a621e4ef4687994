"""Shared pieces of the attention ops: masks from positions and segment ids, block liveness,
varying-manual-axes bookkeeping for ``shard_map(check_vma=True)``, and input checks."""

from __future__ import annotations

from collections.abc import Iterable

import jax
import jax.numpy as jnp
import numpy as np

# Padding keys get this position so that causal masking hides them from every real query.
PAD_KV_POSITION = np.iinfo(np.int32).max // 2
# Padding queries and keys get segment ids that match nothing real and not each other.
PAD_Q_SEGMENT = -2
PAD_KV_SEGMENT = -1


def vma_of(x: jax.Array | None) -> frozenset[str]:
    """Mesh axes over which ``x`` varies inside ``shard_map`` (empty outside it)."""
    if x is None:
        return frozenset()
    aval = jax.typeof(x)
    vma = getattr(aval, "vma", None)
    if vma is None:
        mat = getattr(aval, "mat", None) or getattr(aval, "manual_axis_type", None)
        vma = getattr(mat, "varying", frozenset())
    return frozenset(vma)


def union_vma(xs: Iterable[jax.Array | None]) -> frozenset[str]:
    out: frozenset[str] = frozenset()
    for x in xs:
        out = out | vma_of(x)
    return out


def make_varying(x: jax.Array, vma: frozenset[str]) -> jax.Array:
    """Mark ``x`` as varying over ``vma`` (needed for scan/cond carries under check_vma)."""
    missing = tuple(sorted(vma - vma_of(x)))
    if missing:
        x = jax.lax.pcast(x, missing, to="varying")
    return x


def full(shape: tuple[int, ...], value: float, dtype, vma: frozenset[str]) -> jax.Array:
    return make_varying(jnp.full(shape, value, dtype), vma)


def attention_mask(
    q_pos: jax.Array,
    kv_pos: jax.Array,
    q_seg: jax.Array | None,
    kv_seg: jax.Array | None,
    causal: bool,
) -> jax.Array | None:
    """Boolean mask ``[batch, q, kv]``: causal by position, equal segment ids. None = all True."""
    mask = None
    if causal:
        mask = kv_pos[:, None, :] <= q_pos[:, :, None]
    if q_seg is not None:
        same = q_seg[:, :, None] == kv_seg[:, None, :]
        mask = same if mask is None else mask & same
    return mask


def block_is_live(q_pos, kv_pos, q_seg, kv_seg, causal: bool, xp=jnp):
    """Whether a (query block, key block) pair may hold an unmasked entry.

    Conservative: from the ranges of positions and segment ids in each block, so it never skips
    a needed block; exact for contiguous causal blocks. Works on jnp (traced) or np arrays.
    Returns a Python ``True`` when nothing can be masked, so callers can drop the branch.
    """
    live = True
    if causal:
        live = xp.max(q_pos) >= xp.min(kv_pos)
    if q_seg is not None:
        overlap = (xp.max(q_seg) >= xp.min(kv_seg)) & (xp.max(kv_seg) >= xp.min(q_seg))
        live = overlap if live is True else live & overlap
    return live


DEAD, PARTIAL, FULL = 0, 1, 2


def block_kind(q_pos, kv_pos, q_seg, kv_seg, causal: bool, xp=jnp):
    """How much of a (query block, key block) pair is unmasked, from the ranges of positions
    and segment ids: `DEAD` (nothing: skip it), `FULL` (everything: no mask needed) or
    `PARTIAL`. Conservative: FULL and DEAD are only claimed when certain. Returns a Python
    `FULL` when nothing can be masked at all, so callers can drop the branches."""
    if not causal and q_seg is None:
        return FULL
    live = block_is_live(q_pos, kv_pos, q_seg, kv_seg, causal, xp)
    full = True
    if causal:
        full = xp.min(q_pos) >= xp.max(kv_pos)
    if q_seg is not None:
        one = (xp.min(q_seg) == xp.max(q_seg)) & (xp.min(kv_seg) == xp.max(kv_seg))
        same = one & (xp.min(q_seg) == xp.min(kv_seg))
        full = same if full is True else full & same
    return xp.where(live, xp.where(full, FULL, PARTIAL), DEAD)


def default_positions(batch: int, seq: int) -> jax.Array:
    """Positions ``0 .. seq-1`` of every row: int32 ``[batch, seq]`` (one unpacked sequence)."""
    return jnp.broadcast_to(jnp.arange(seq, dtype=jnp.int32), (batch, seq))


def check_qkv(q: jax.Array, k: jax.Array, v: jax.Array) -> None:
    """Validate ``q [b, s, h, d]``, ``k, v [b, s, kv_h, d]`` with h a multiple of kv_h."""
    if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
        raise ValueError(
            f"attention expects q, k, v of rank 4 [batch, seq, heads, head_dim]; got shapes "
            f"{q.shape}, {k.shape}, {v.shape}"
        )
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape; got {k.shape} and {v.shape}")
    if q.shape[0] != k.shape[0] or q.shape[3] != k.shape[3]:
        raise ValueError(f"q {q.shape} and k {k.shape} disagree on batch or head_dim")
    if q.shape[2] % k.shape[2]:
        raise ValueError(
            f"query heads ({q.shape[2]}) must be a multiple of key/value heads ({k.shape[2]})"
        )


def check_segments(q_seg: jax.Array | None, kv_seg: jax.Array | None) -> None:
    if (q_seg is None) != (kv_seg is None):
        raise ValueError("pass both q_segment_ids and kv_segment_ids, or neither")
