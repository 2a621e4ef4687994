"""Blockwise (flash-style) attention: online softmax over key blocks, custom VJP.

The kernel is written once, for a local shard of queries against one chunk of keys and values
(`fwd_chunk`, `bwd_chunk`). Single-device blockwise attention runs it against the whole key
sequence; ring attention (`lwm.attention.ring`) runs it once per ring step against the chunk
that is visiting. Softmax statistics and accumulators are float32 whatever the input dtype;
only the outputs and the log-sum-exp are saved for the backward pass, so memory is
O(seq x block), not O(seq^2). Block pairs whose mask is empty are skipped with `lax.cond`.

Internal layouts (``nq``/``nk`` = number of blocks, ``g`` = query heads per kv head):
  queries  [nq, batch, kv_heads, g, block_q, head_dim]
  keys     [nk, batch, kv_heads, block_k, head_dim]
  positions / segment ids [n, batch, block]
"""

from __future__ import annotations

from functools import partial
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from lwm.attention._common import (
    FULL,
    PAD_KV_POSITION,
    PAD_KV_SEGMENT,
    PAD_Q_SEGMENT,
    attention_mask,
    block_kind,
    check_qkv,
    check_segments,
    default_positions,
    full,
    make_varying,
    union_vma,
)

F32 = jnp.float32


class QBlocks(NamedTuple):
    q: jax.Array  # [nq, b, kvh, g, bq, d]
    pos: jax.Array  # [nq, b, bq]
    seg: jax.Array | None


class KVBlocks(NamedTuple):
    k: jax.Array  # [nk, b, kvh, bk, d]
    v: jax.Array
    pos: jax.Array  # [nk, b, bk]
    seg: jax.Array | None


class Stats(NamedTuple):
    acc: jax.Array  # [nq, b, kvh, g, bq, d] float32, un-normalised output
    m: jax.Array  # [nq, b, kvh, g, bq] float32, running max
    lsum: jax.Array  # [nq, b, kvh, g, bq] float32, running sum of exp


class Spec(NamedTuple):
    """Static facts of one attention call, shared by forward and backward."""

    causal: bool
    scale: float
    block_q: int
    block_k: int
    precision: lax.Precision | None
    kv_len: int  # keys and values per call (per device under ring attention), before padding


def _pad(x: jax.Array | None, axis: int, size: int, value) -> jax.Array | None:
    if x is None or x.shape[axis] == size:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, size - x.shape[axis])
    return jnp.pad(x, widths, constant_values=value)


def _blocks_1d(x: jax.Array | None, n: int, block: int) -> jax.Array | None:
    """[b, n*block] -> [n, b, block]."""
    if x is None:
        return None
    return x.reshape(x.shape[0], n, block).transpose(1, 0, 2)


def effective_blocks(q_len: int, kv_len: int, block_q: int, block_k: int) -> tuple[int, int]:
    if block_q <= 0 or block_k <= 0:
        raise ValueError(f"block sizes must be positive; got block_q={block_q}, block_k={block_k}")
    return min(block_q, q_len), min(block_k, kv_len)


def needs_segments(kv_len: int, block_k: int, causal: bool, q_seg) -> bool:
    return q_seg is None and not causal and kv_len % block_k != 0


def blocks_q(x: jax.Array, kv_heads: int, block: int) -> jax.Array:
    """[b, s, h, d] -> [nq, b, kv_heads, h/kv_heads, block, d] (zero-padded)."""
    b, s, h, d = x.shape
    n = -(-s // block)
    x = _pad(x, 1, n * block, 0)
    return x.reshape(b, n, block, kv_heads, h // kv_heads, d).transpose(1, 0, 3, 4, 2, 5)


def split_q(
    q: jax.Array, pos: jax.Array, seg: jax.Array | None, kv_heads: int, block: int
) -> QBlocks:
    n = -(-q.shape[1] // block)
    pos = _blocks_1d(_pad(pos, 1, n * block, -1), n, block)
    seg = _blocks_1d(_pad(seg, 1, n * block, PAD_Q_SEGMENT), n, block)
    return QBlocks(blocks_q(q, kv_heads, block), pos, seg)


def merge_q(x: jax.Array, length: int) -> jax.Array:
    """[nq, b, kvh, g, bq, d] -> [b, length, kvh*g, d]."""
    n, b, kvh, g, bq, d = x.shape
    return x.transpose(1, 0, 4, 2, 3, 5).reshape(b, n * bq, kvh * g, d)[:, :length]


def split_kv(
    k: jax.Array, v: jax.Array, pos: jax.Array, seg: jax.Array | None, block: int
) -> KVBlocks:
    b, s, kvh, d = k.shape
    n = -(-s // block)

    def blocks(x):
        x = _pad(x, 1, n * block, 0)
        return x.reshape(b, n, block, kvh, d).transpose(1, 0, 3, 2, 4)

    pos = _blocks_1d(_pad(pos, 1, n * block, PAD_KV_POSITION), n, block)
    seg = _blocks_1d(_pad(seg, 1, n * block, PAD_KV_SEGMENT), n, block)
    return KVBlocks(blocks(k), blocks(v), pos, seg)


def merge_kv(x: jax.Array, length: int) -> jax.Array:
    """[nk, b, kvh, bk, d] -> [b, length, kvh, d]."""
    n, b, kvh, bk, d = x.shape
    return x.transpose(1, 0, 3, 2, 4).reshape(b, n * bk, kvh, d)[:, :length]


def init_stats(qs: QBlocks, vma: frozenset[str]) -> Stats:
    shape = qs.q.shape
    return Stats(
        acc=full(shape, 0.0, F32, vma),
        m=full(shape[:-1], -jnp.inf, F32, vma),
        lsum=full(shape[:-1], 0.0, F32, vma),
    )


def finalize_stats(stats: Stats) -> tuple[jax.Array, jax.Array]:
    """Normalised output (float32) and log-sum-exp; rows with no key give 0 and lse=+inf."""
    empty = stats.lsum == 0
    out = stats.acc / jnp.where(empty, 1.0, stats.lsum)[..., None]
    lse = jnp.where(empty, jnp.inf, stats.m + jnp.log(jnp.where(empty, 1.0, stats.lsum)))
    return out, lse


def _scores(q, k, qp, kp, qsg, ksg, spec: Spec, masked: bool):
    s = jnp.einsum("bhgqd,bhkd->bhgqk", q, k, preferred_element_type=F32, precision=spec.precision)
    s = s * spec.scale
    mask = attention_mask(qp, kp, qsg, ksg, spec.causal) if masked else None
    if mask is not None:
        s = jnp.where(mask[:, None, None], s, -jnp.inf)
    return s


def _by_kind(kind, compute, skip, operand):
    """``compute(operand, masked)`` for live blocks (without the mask when the whole block is
    visible), ``skip(operand)`` for dead ones."""
    if kind is FULL:
        return compute(operand, False)
    branches = [skip, lambda x: compute(x, True), lambda x: compute(x, False)]
    return lax.switch(kind, branches, operand)


def _mm(spec: Spec, subscripts: str, a, b):
    return jnp.einsum(subscripts, a, b, preferred_element_type=F32, precision=spec.precision)


def fwd_chunk(qs: QBlocks, kv: KVBlocks, stats: Stats, spec: Spec) -> Stats:
    """Fold one chunk of keys/values into the running softmax statistics of every query block."""

    def q_step(_, xs):
        q, qp, qsg, acc, m, lsum = xs

        def k_step(carry, ys):
            k, v, kp, ksg = ys

            def compute(carry, masked):
                acc, m, lsum = carry
                s = _scores(q, k, qp, kp, qsg, ksg, spec, masked)
                m_new = jnp.maximum(m, jnp.max(s, axis=-1))
                m_safe = jnp.where(jnp.isneginf(m_new), 0.0, m_new) if masked else m_new
                p = jnp.exp(s - m_safe[..., None])
                alpha = jnp.exp(m - m_safe)
                lsum = alpha * lsum + jnp.sum(p, axis=-1)
                pv = _mm(spec, "bhgqk,bhkd->bhgqd", p.astype(v.dtype), v)
                return alpha[..., None] * acc + pv, m_new, lsum

            kind = block_kind(qp, kp, qsg, ksg, spec.causal)
            return _by_kind(kind, compute, lambda c: c, carry), None

        carry, _ = lax.scan(k_step, (acc, m, lsum), (kv.k, kv.v, kv.pos, kv.seg))
        return None, carry

    _, out = lax.scan(q_step, None, (qs.q, qs.pos, qs.seg, *stats))
    return Stats(*out)


def bwd_chunk(
    qs: QBlocks,
    do: jax.Array,
    lse: jax.Array,
    delta: jax.Array,
    kv: KVBlocks,
    dq: jax.Array,
    spec: Spec,
    vma: frozenset[str],
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Gradient contributions of one key/value chunk.

    Returns the updated query-gradient accumulator (blocked like the queries) and this chunk's
    key and value gradients (blocked like the keys), all float32.
    """
    kblock_shape = kv.k.shape[1:]
    zeros_k = full(kblock_shape, 0.0, F32, vma)

    def q_step(carry, xs):
        dk, dv = carry
        q, do_b, lse_b, delta_b, qp, qsg, dq_b = xs

        def k_step(dq_b, ys):
            k, v, kp, ksg = ys

            def compute(dq_b, masked):
                s = _scores(q, k, qp, kp, qsg, ksg, spec, masked)
                p = jnp.exp(s - lse_b[..., None])
                dp = _mm(spec, "bhgqd,bhkd->bhgqk", do_b, v)
                ds = (p * (dp - delta_b[..., None])) * spec.scale
                dq_b = dq_b + _mm(spec, "bhgqk,bhkd->bhgqd", ds.astype(k.dtype), k)
                # dK and dV as [d, k] products, then a transpose of the small result:
                # contracting the score block over queries directly makes XLA transpose the
                # whole [q, k] block, which cost more than any one matmul here.
                dk_c = _mm(spec, "bhgqd,bhgqk->bhdk", q, ds.astype(q.dtype))
                dv_c = _mm(spec, "bhgqd,bhgqk->bhdk", do_b, p.astype(do_b.dtype))
                return dq_b, (jnp.swapaxes(dk_c, -1, -2), jnp.swapaxes(dv_c, -1, -2))

            kind = block_kind(qp, kp, qsg, ksg, spec.causal)
            return _by_kind(kind, compute, lambda d: (d, (zeros_k, zeros_k)), dq_b)

        dq_b, (dk_c, dv_c) = lax.scan(k_step, dq_b, (kv.k, kv.v, kv.pos, kv.seg))
        return (dk + dk_c, dv + dv_c), dq_b

    zeros_kv = full(kv.k.shape, 0.0, F32, vma)
    (dk, dv), dq = lax.scan(
        q_step, (zeros_kv, zeros_kv), (qs.q, do, lse, delta, qs.pos, qs.seg, dq)
    )
    return dq, dk, dv


# ----------------------------------------------------------------------------------------------
# The shared driver: one chunk per ring step. ``axis_name=None`` is plain blockwise attention.


def _ring_perm(n: int) -> list[tuple[int, int]]:
    return [(i, (i + 1) % n) for i in range(n)]


def _axis_size(axis_name: str | None) -> int:
    return 1 if axis_name is None else lax.axis_size(axis_name)


def _send(tree, axis_name: str, n: int):
    perm = _ring_perm(n)
    return jax.tree.map(lambda x: lax.ppermute(x, axis_name, perm), tree)


def _prepare(q, k, v, q_pos, kv_pos, q_seg, kv_seg, spec: Spec):
    vma = union_vma((q, k, v, q_pos, kv_pos, q_seg, kv_seg))
    # Tie the positions and segment ids to the activations. Otherwise, when attention runs in
    # a scan over layers that is differentiated, JAX hoists everything that depends only on
    # them (the per-block masks) out of the layer loop and stores it for every block pair:
    # O(seq^2) memory (33 GiB per device for LWM-7B at 32K tokens on 8 devices).
    q, k, v, q_pos, kv_pos, q_seg, kv_seg = jax.lax.optimization_barrier(
        (q, k, v, q_pos, kv_pos, q_seg, kv_seg)
    )
    # Everything carried through scans must vary over the same mesh axes (check_vma).
    qs = jax.tree.map(
        lambda x: make_varying(x, vma), split_q(q, q_pos, q_seg, k.shape[2], spec.block_q)
    )
    kv = jax.tree.map(lambda x: make_varying(x, vma), split_kv(k, v, kv_pos, kv_seg, spec.block_k))
    return qs, kv, vma


def _forward(q, k, v, q_pos, kv_pos, q_seg, kv_seg, spec: Spec, axis_name: str | None):
    """Output (input dtype), log-sum-exp, and the blocked queries and own key/value chunk,
    which are all the backward pass needs."""
    qs, kv, vma = _prepare(q, k, v, q_pos, kv_pos, q_seg, kv_seg, spec)
    own_kv = kv
    stats = init_stats(qs, vma)
    n = _axis_size(axis_name)
    if n > 1:

        def step(carry, _):
            kv, stats = carry
            incoming = _send(kv, axis_name, n)  # issued before compute, so they can overlap
            return (incoming, fwd_chunk(qs, kv, stats, spec)), None

        (kv, stats), _ = lax.scan(step, (kv, stats), None, length=n - 1)
    stats = fwd_chunk(qs, kv, stats, spec)  # the last chunk: nothing left to send
    out, lse = finalize_stats(stats)
    return merge_q(out, q.shape[1]).astype(q.dtype), lse, qs, own_kv


def _backward(res, dout, spec: Spec, axis_name: str | None):
    qs, kv, out, lse = res
    vma = union_vma(jax.tree.leaves(res))
    kvh = kv.k.shape[2]
    do = blocks_q(dout, kvh, spec.block_q)
    # delta_i = sum_d dout_id * out_id, per query row, blocked like the queries.
    rows = jnp.sum(dout.astype(F32) * out.astype(F32), axis=-1, keepdims=True)
    delta = blocks_q(rows, kvh, spec.block_q)[..., 0]
    dq = full(qs.q.shape, 0.0, F32, vma)
    n = _axis_size(axis_name)
    if n > 1:

        def step(carry, _):
            kv, dk, dv, dq = carry
            incoming = _send(kv, axis_name, n)
            dq, dk_c, dv_c = bwd_chunk(qs, do, lse, delta, kv, dq, spec, vma)
            # The gradients of a chunk travel with it and arrive home after the last step.
            dk, dv = _send((dk + dk_c, dv + dv_c), axis_name, n)
            return (incoming, dk, dv, dq), None

        zeros_kv = full(kv.k.shape, 0.0, F32, vma)
        (kv, dk, dv, dq), _ = lax.scan(step, (kv, zeros_kv, zeros_kv, dq), None, length=n - 1)
        dq, dk_c, dv_c = bwd_chunk(qs, do, lse, delta, kv, dq, spec, vma)
        dk, dv = _send((dk + dk_c, dv + dv_c), axis_name, n)
    else:
        dq, dk, dv = bwd_chunk(qs, do, lse, delta, kv, dq, spec, vma)
    return (
        merge_q(dq, out.shape[1]).astype(out.dtype),
        merge_kv(dk, spec.kv_len).astype(kv.k.dtype),
        merge_kv(dv, spec.kv_len).astype(kv.v.dtype),
    )


@partial(jax.custom_vjp, nondiff_argnums=(7, 8))
def attention_core(q, k, v, q_pos, kv_pos, q_seg, kv_seg, spec: Spec, axis_name: str | None):
    """Blockwise attention of local queries against keys that are local (``axis_name=None``)
    or sharded over ``axis_name`` and passed around the ring. Inputs must be prepared by the
    public wrappers (positions given, segment ids made where padding needs them)."""
    return _forward(q, k, v, q_pos, kv_pos, q_seg, kv_seg, spec, axis_name)[0]


def _core_fwd(q, k, v, q_pos, kv_pos, q_seg, kv_seg, spec, axis_name):
    out, lse, qs, own_kv = _forward(q, k, v, q_pos, kv_pos, q_seg, kv_seg, spec, axis_name)
    return out, (qs, own_kv, out, lse)


def _core_bwd(spec, axis_name, res, dout):
    dq, dk, dv = _backward(res, dout, spec, axis_name)
    return dq, dk, dv, None, None, None, None


attention_core.defvjp(_core_fwd, _core_bwd)


def prepare_inputs(
    q,
    k,
    v,
    *,
    causal,
    q_positions,
    kv_positions,
    q_segment_ids,
    kv_segment_ids,
    block_q,
    block_k,
    scale,
    precision,
):
    """Validate, fill defaults, and make the static `Spec` (for local shards under ring
    attention: lengths are what one kernel call sees)."""
    check_qkv(q, k, v)
    check_segments(q_segment_ids, kv_segment_ids)
    b, sq, _, d = q.shape
    sk = k.shape[1]
    if q_positions is None:
        q_positions = default_positions(b, sq)
    if kv_positions is None:
        kv_positions = default_positions(b, sk)
    bq, bk = effective_blocks(sq, sk, block_q, block_k)
    if needs_segments(sk, bk, causal, q_segment_ids):
        q_segment_ids = jnp.zeros((b, sq), jnp.int32)
        kv_segment_ids = jnp.zeros((b, sk), jnp.int32)
    spec = Spec(
        causal=bool(causal),
        scale=float(d**-0.5 if scale is None else scale),
        block_q=bq,
        block_k=bk,
        precision=precision,
        kv_len=sk,
    )
    args = (
        q,
        k,
        v,
        jnp.asarray(q_positions, jnp.int32),
        jnp.asarray(kv_positions, jnp.int32),
        None if q_segment_ids is None else jnp.asarray(q_segment_ids, jnp.int32),
        None if kv_segment_ids is None else jnp.asarray(kv_segment_ids, jnp.int32),
    )
    return args, spec


def blockwise_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    causal: bool = True,
    q_positions: jax.Array | None = None,
    kv_positions: jax.Array | None = None,
    q_segment_ids: jax.Array | None = None,
    kv_segment_ids: jax.Array | None = None,
    block_q: int = 512,
    block_k: int = 512,
    scale: float | None = None,
    precision: lax.Precision | None = None,
) -> jax.Array:
    """Memory-efficient attention on one device; same semantics as `dense_attention`.

    Sequence lengths need not be multiples of the blocks (inputs are padded internally).
    """
    args, spec = prepare_inputs(
        q,
        k,
        v,
        causal=causal,
        q_positions=q_positions,
        kv_positions=kv_positions,
        q_segment_ids=q_segment_ids,
        kv_segment_ids=kv_segment_ids,
        block_q=block_q,
        block_k=block_k,
        scale=scale,
        precision=precision,
    )
    return attention_core(*args, spec, None)


def attention_flops(
    batch: int, q_len: int, kv_len: int, heads: int, head_dim: int, causal: bool
) -> float:
    """Matmul FLOPs of the attention forward pass (QK^T and PV), halved when causal."""
    flops = 4.0 * batch * heads * q_len * kv_len * head_dim
    return flops / 2 if causal else flops
