"""Shared pieces of the attention ops: masks from positions and segment ids, block liveness,
varying-manual-axes bookkeeping for ``shard_map(check_vma=True)``, and input checks."""

from __future__ import annotations

from collections.abc import Iterable

import jax
import jax.numpy as jnp
import numpy as np

from data.batches import MAX_TURNS, TURN_FLAG, segment_documents, segments_see

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


def axis_size(axis_name: str | None) -> int:
    """Devices along the ring's mesh axis (1 when there is none: the whole sequence is local)."""
    return 1 if axis_name is None else jax.lax.axis_size(axis_name)


def one_document_order(layout, q, k, q_pos, kv_pos, q_seg, kv_seg) -> str | None:
    """`Spec.order` of a call: ``layout`` when no positions and no segment ids are given (one
    document in that order, self-attention), else None (positions and segment ids decide)."""
    given = (q_pos, kv_pos, q_seg, kv_seg)
    return layout if all(x is None for x in given) and q.shape[1] == k.shape[1] else None


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
    """Boolean mask ``[batch, q, kv]``: causal by position, segments that see each other
    (`data.batches.segments_see`: equal ids, or a key of turn 0 of the query's document).
    None = all True."""
    mask = None
    if causal:
        mask = kv_pos[:, None, :] <= q_pos[:, :, None]
    if q_seg is not None:
        same = segments_see(q_seg[:, :, None], kv_seg[:, None, :])
        mask = same if mask is None else mask & same
    return mask


def _by_document(seg, xp):
    """A row's indices sorted by document (`data.batches.segment_documents`), then index, and
    the documents in that order."""
    doc = segment_documents(seg, xp)
    order = xp.lexsort((xp.arange(seg.shape[0]), doc))
    return order, doc[order]


def keys_precede_queries(positions, segment_ids, xp=jnp):
    """Whether in every row each key a query sees (causal by position, `segments_see`) is at
    the query's index or before it, as a scalar bool: where it holds, ``in_order`` may be
    given (`lwm.attention.blockwise_attention`). Positions and segment ids ``[batch, len]``
    (segment ids may be None), traced (``xp=jnp``) or on the host (``xp=np``, as `lwm train`
    checks each batch before it runs). Checked by two conditions that together imply it, in
    O(len log len): within each segment id positions increase strictly with the index, and
    each document's turn 0 comes before its other turns (`data.batches.turn_segment_ids`).
    Rows of documents packed one after another pass, with their padding where it counts its
    positions (as `lwm train`'s loader writes it); padding all at one position does not, since
    its queries see every padding key."""
    if segment_ids is None:
        segment_ids = xp.zeros_like(positions)

    def row(pos, seg):
        index = xp.arange(pos.shape[0])
        order = xp.lexsort((index, seg))  # by segment, then index
        s, p = seg[order], pos[order]
        increasing = xp.all((s[1:] != s[:-1]) | (p[1:] > p[:-1]))
        first = (seg < TURN_FLAG) | ((seg & MAX_TURNS) == 0)  # turn 0, or no turns
        order, d = _by_document(seg, xp)
        f = first[order]
        turn0_first = ~xp.any((d[1:] == d[:-1]) & ~f[:-1] & f[1:])
        return increasing & turn0_first

    if xp is np:
        return bool(all(row(p, s) for p, s in zip(positions, segment_ids, strict=True)))
    return jnp.all(jax.vmap(row)(positions, segment_ids))


def look_back(segment_ids, length: int, xp=jnp):
    """How far back, in tokens and counting itself, any query's visible keys can be in rows
    where `keys_precede_queries` holds: the most, over queries, of its index less the first
    index of its document (`data.batches.segment_documents`: a turn sees its document's turn 0,
    which comes first) plus one; ``length`` where there are no segment ids. An upper bound:
    its first key need not be visible. Traced (``xp=jnp``) or on the host (``xp=np``)."""
    if segment_ids is None:
        return length

    def row(seg):
        index = xp.arange(seg.shape[0])
        order, d = _by_document(seg, xp)
        start = xp.concatenate([xp.ones(1, bool), d[1:] != d[:-1]])
        where = xp.where(start, index, 0)
        first = np.maximum.accumulate(where) if xp is np else jax.lax.cummax(where)
        return xp.max(order - order[first]) + 1

    if xp is np:
        return int(max(row(s) for s in segment_ids))
    return jnp.max(jax.vmap(row)(segment_ids))


DEAD, PARTIAL, FULL = 0, 1, 2


def block_is_live(q_pos, kv_pos, q_seg, kv_seg, causal: bool, xp=jnp):
    """Whether a (query block, key block) pair may hold an unmasked entry (`block_kind` is not
    `DEAD`). Works on jnp (traced) or np arrays; a Python ``True`` when nothing can be masked."""
    kind = block_kind(q_pos, kv_pos, q_seg, kv_seg, causal, xp)
    return True if kind is FULL else kind != DEAD


def _kind_from_ranges(q_lo, q_hi, k_lo, k_hi, segs, causal: bool, xp):
    """`block_kind` from the ranges of positions (and of segment ids: ``segs`` = ``(q_lo, q_hi,
    k_lo, k_hi)`` of the ids, then the same of their `data.batches.segment_documents`, or
    None) of the query and key blocks; elementwise over arrays of ranges."""
    live = full = True
    if causal:
        live, full = q_hi >= k_lo, q_lo >= k_hi
    if segs is not None:
        qs_lo, qs_hi, ks_lo, ks_hi, qd_lo, qd_hi, kd_lo, kd_hi = segs
        overlap = (qd_hi >= kd_lo) & (kd_hi >= qd_lo)
        same = (qs_lo == qs_hi) & (ks_lo == ks_hi) & (qs_lo == ks_lo)
        live = overlap if live is True else live & overlap
        full = same if full is True else full & same
    if live is True and full is True:
        return FULL
    return xp.where(live, xp.where(full, FULL, PARTIAL), DEAD)


def block_kind(q_pos, kv_pos, q_seg, kv_seg, causal: bool, xp=jnp):
    """How much of a (query block, key block) pair is unmasked, from the ranges of positions
    and segment ids: `DEAD` (nothing: skip it), `FULL` (everything: no mask needed) or
    `PARTIAL`. Conservative: FULL and DEAD are only claimed when certain. Returns a Python
    `FULL` when nothing can be masked at all, so callers can drop the branches."""
    segs = None
    if q_seg is not None:
        ids = (q_seg, kv_seg, segment_documents(q_seg, xp), segment_documents(kv_seg, xp))
        segs = tuple(f(x) for x in ids for f in (xp.min, xp.max))
    ranges = (xp.min(q_pos), xp.max(q_pos), xp.min(kv_pos), xp.max(kv_pos))
    return _kind_from_ranges(*ranges, segs, causal, xp)


def kind_table(q_pos, q_seg, kv_pos, kv_seg, causal: bool) -> jax.Array:
    """`block_kind` of every (query block, key block) pair as int32 ``[batch, nq, nk]``, from
    blocked positions and segment ids (``[nq, batch, block_q]`` and ``[nk, batch, block_k]``)."""

    def ranges(x, side):
        lo, hi = jnp.min(x, axis=-1).T, jnp.max(x, axis=-1).T  # [batch, n]
        return (lo[:, :, None], hi[:, :, None]) if side == "q" else (lo[:, None], hi[:, None])

    segs = None
    if q_seg is not None:
        docs = (segment_documents(q_seg, jnp), segment_documents(kv_seg, jnp))
        segs = (*ranges(q_seg, "q"), *ranges(kv_seg, "k"))
        segs += (*ranges(docs[0], "q"), *ranges(docs[1], "k"))
    kind = _kind_from_ranges(*ranges(q_pos, "q"), *ranges(kv_pos, "k"), segs, causal, jnp)
    shape = (q_pos.shape[1], q_pos.shape[0], kv_pos.shape[0])
    return jnp.broadcast_to(jnp.asarray(kind, jnp.int32), shape)


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
