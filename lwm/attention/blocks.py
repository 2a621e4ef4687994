"""The XLA block kernel of blockwise and ring attention (`model.attention_kernel: xla`; the
Pallas one, `lwm.attention.pallas`, has the same contract): queries and keys cut into blocks,
and one local shard of queries against one chunk of keys and values, forward (`fwd_chunk`:
online softmax into float32 statistics) and backward (`bwd_chunk`: from the global
log-sum-exp). Block pairs whose mask is empty are skipped (`lax.switch`); fully visible pairs
skip the mask. Every accumulator is a loop carry updated in place, one block at a time (no
chunk-sized copies besides the accumulators themselves). `lwm.attention.blockwise` runs it
over the key chunks of one device or around the ring.

Internal layouts (``nq``/``nk`` = number of blocks, ``g`` = query heads per kv head):
  queries  [nq, batch, kv_heads, g, block_q, head_dim]
  keys     [nk, batch, kv_heads, block_k, head_dim]
  positions / segment ids [n, batch, block]
"""

from __future__ import annotations

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
    full,
    union_vma,
)

F32 = jnp.float32


class QBlocks(NamedTuple):
    q: jax.Array  # [nq, b, kvh, g, bq, d]; the Pallas kernel's one chunk: [b, kvh, g, nq, bq, d]
    pos: jax.Array  # [nq, b, bq]
    seg: jax.Array | None


class KVBlocks(NamedTuple):
    k: jax.Array  # [nk, b, kvh, bk, d]; the Pallas kernel's one chunk: [b, kvh, nk, bk, d]
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
    kernel: str = "xla"  # "xla" (this module) or "pallas" (`lwm.attention.pallas`)
    interpret: bool = False  # run the Pallas kernels in interpret mode (not on a TPU)
    # The token order when no positions and no segment ids were given ("contiguous" or
    # "zigzag": one document in that layout's order), else None. Only the cuDNN kernel reads
    # it: it then knows which block pairs are live without looking (`lwm.attention.cudnn`).
    order: str | None = None
    # Positions and segment ids were given, and the caller expects that no query sees a key at
    # a later index (documents packed one after another, each in order: `keys_precede_queries`).
    # Only the cuDNN kernel reads it, on one device: it checks it once per call and, where it
    # holds, schedules every call when tracing.
    in_order: bool = False
    # With ``in_order``: no query looks back more than this many tokens, itself included
    # (`lwm.attention.look_back`; 0: unknown). The cuDNN kernel then skips the key pieces out
    # of reach (checked with the order).
    reach: int = 0
    # The Pallas kernel on one chunk takes q, k, v, the output and the gradients with the
    # sequence minor (`seq_minor_q`): heads narrower than a TPU's 128 lanes.
    seq_minor: bool = False


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


def head_major_q(x: jax.Array, kv_heads: int, block: int) -> jax.Array:
    """[b, s, h, d] -> [b, kv_heads, h/kv_heads, nq, block, d] (zero-padded): the heads' own
    order, a transpose that XLA folds into the projection that makes ``x`` (no copy), and
    then a free reshape. The layout of the Pallas kernel's single-chunk path."""
    b, s, h, d = x.shape
    n = -(-s // block)
    x = _pad(x, 1, n * block, 0)
    return x.transpose(0, 2, 1, 3).reshape(b, kv_heads, h // kv_heads, n, block, d)


def merge_head_major_q(x: jax.Array, length: int) -> jax.Array:
    """[b, kvh, g, nq, bq, d] -> [b, length, kvh*g, d]."""
    b, kvh, g, n, bq, d = x.shape
    return x.reshape(b, kvh * g, n * bq, d).transpose(0, 2, 1, 3)[:, :length]


def head_major_kv(x: jax.Array, block: int) -> jax.Array:
    """[b, s, kvh, d] -> [b, kvh, nk, block, d]: `head_major_q` with one head per group."""
    return head_major_q(x, x.shape[2], block)[:, :, 0]


def merge_head_major_kv(x: jax.Array, length: int) -> jax.Array:
    """[b, kvh, nk, bk, d] -> [b, length, kvh, d]: `merge_head_major_q` of one head per group."""
    return merge_head_major_q(x[:, :, None], length)


def seq_minor_q(x: jax.Array, kv_heads: int, block: int) -> jax.Array:
    """[b, s, h, d] -> [b, kv_heads, h/kv_heads, d, s'] (``s`` zero-padded to blocks): the
    layout a TPU gives ``[.., s, d]`` arrays of heads narrower than its 128 lanes (the sequence
    in the lanes, so that ``d`` is not padded to 128), which XLA then hands over without a
    copy. The layout of the Pallas kernel's single-chunk path for such heads."""
    b, s, h, d = x.shape
    x = _pad(x, 1, -(-s // block) * block, 0)
    return x.transpose(0, 2, 3, 1).reshape(b, kv_heads, h // kv_heads, d, -1)


def merge_seq_minor_q(x: jax.Array, length: int) -> jax.Array:
    """[b, kvh, g, d, s'] -> [b, length, kvh*g, d]."""
    b, kvh, g, d, s = x.shape
    return x.reshape(b, kvh * g, d, s).transpose(0, 3, 1, 2)[:, :length]


def seq_minor_kv(x: jax.Array, block: int) -> jax.Array:
    """[b, s, kvh, d] -> [b, kvh, d, s']: `seq_minor_q` with one head per group."""
    return seq_minor_q(x, x.shape[2], block)[:, :, 0]


def merge_seq_minor_kv(x: jax.Array, length: int) -> jax.Array:
    """[b, kvh, d, s'] -> [b, length, kvh, d]."""
    return merge_seq_minor_q(x[:, :, None], length)


def split_q(
    q: jax.Array,
    pos: jax.Array,
    seg: jax.Array | None,
    kv_heads: int,
    block: int,
    head_major: bool = False,
    seq_minor: bool = False,
) -> QBlocks:
    """The queries blocked (``head_major``: as `head_major_q`, or with ``seq_minor`` as
    `seq_minor_q`; else as `blocks_q`), with their positions and segment ids ``[nq, b, bq]``."""
    n = -(-q.shape[1] // block)
    pos = _blocks_1d(_pad(pos, 1, n * block, -1), n, block)
    seg = _blocks_1d(_pad(seg, 1, n * block, PAD_Q_SEGMENT), n, block)
    if seq_minor:
        blocked = seq_minor_q(q, kv_heads, block)
    elif head_major:
        blocked = head_major_q(q, kv_heads, block)
    else:
        blocked = blocks_q(q, kv_heads, block)
    return QBlocks(blocked, pos, seg)


def merge_q(x: jax.Array, length: int) -> jax.Array:
    """[nq, b, kvh, g, bq, d] -> [b, length, kvh*g, d]."""
    n, b, kvh, g, bq, d = x.shape
    return x.transpose(1, 0, 4, 2, 3, 5).reshape(b, n * bq, kvh * g, d)[:, :length]


def split_kv(
    k: jax.Array,
    v: jax.Array,
    pos: jax.Array,
    seg: jax.Array | None,
    block: int,
    head_major: bool = False,
    seq_minor: bool = False,
) -> KVBlocks:
    """Keys and values blocked (``head_major``: as `head_major_kv`, or with ``seq_minor`` as
    `seq_minor_kv`; else ``[nk, b, kvh, bk, d]``), with their positions and segment ids ``[nk,
    b, bk]``."""
    b, s, kvh, d = k.shape
    n = -(-s // block)

    def blocks(x):
        if seq_minor:
            return seq_minor_kv(x, block)
        if head_major:
            return head_major_kv(x, block)
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
    if a.dtype != F32 and jax.default_backend() == "cpu":
        # XLA's CPU runtime lacks some bf16 x bf16 -> f32 dots (the backward's dK/dV product
        # with batch > 1 fails with "Unsupported element type for DotThunk"); bf16 -> f32 is
        # exact and the sums are float32 either way, so the result is the same.
        a, b = a.astype(F32), b.astype(F32)
    return jnp.einsum(subscripts, a, b, preferred_element_type=F32, precision=spec.precision)


def fwd_chunk(qs: QBlocks, kv: KVBlocks, stats: Stats, spec: Spec) -> Stats:
    """Fold one chunk of keys/values into the running softmax statistics of every query block."""

    def q_step(i, stats):
        # One query block; its statistics are read from and written back into the loop carry
        # (updated in place), rather than scanned over as inputs and stacked as new outputs,
        # which would hold two copies of the accumulator.
        q, qp = qs.q[i], qs.pos[i]
        qsg = None if qs.seg is None else qs.seg[i]

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

        carry, _ = lax.scan(k_step, tuple(x[i] for x in stats), (kv.k, kv.v, kv.pos, kv.seg))
        return Stats(*(x.at[i].set(c) for x, c in zip(stats, carry, strict=True)))

    return lax.fori_loop(0, qs.q.shape[0], q_step, stats)


def bwd_chunk(
    qs: QBlocks,
    do: jax.Array,
    lse: jax.Array,
    delta: jax.Array,
    kv: KVBlocks,
    grads: tuple[jax.Array, jax.Array, jax.Array],
    spec: Spec,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Add one key/value chunk's gradient contributions to ``grads`` = (dQ blocked like the
    queries, dK and dV blocked like the keys; float32) and return them. The accumulators are
    loop carries updated in place, so no chunk-sized gradient is made besides them."""
    zeros_k = full(kv.k.shape[1:], 0.0, F32, union_vma((kv.k, qs.q)))

    def q_step(i, carry):
        # Every accumulator is a loop carry updated in place, block by block (see `fwd_chunk`).
        q, do_b, lse_b, delta_b, qp = qs.q[i], do[i], lse[i], delta[i], qs.pos[i]
        qsg = None if qs.seg is None else qs.seg[i]

        def k_step(j, carry):
            dq_b, dk, dv = carry
            k, v, kp = kv.k[j], kv.v[j], kv.pos[j]
            ksg = None if kv.seg is None else kv.seg[j]

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
                return dq_b, jnp.swapaxes(dk_c, -1, -2), jnp.swapaxes(dv_c, -1, -2)

            kind = block_kind(qp, kp, qsg, ksg, spec.causal)
            dq_b, dk_c, dv_c = _by_kind(kind, compute, lambda d: (d, zeros_k, zeros_k), dq_b)
            # Added outside the branches: an update inside a conditional would copy the whole
            # accumulator; here XLA updates it in place.
            return dq_b, dk.at[j].add(dk_c), dv.at[j].add(dv_c)

        dk, dv, dq = carry
        dq_b, dk, dv = lax.fori_loop(0, kv.k.shape[0], k_step, (dq[i], dk, dv))
        return dk, dv, dq.at[i].set(dq_b)

    dq, dk, dv = grads
    dk, dv, dq = lax.fori_loop(0, qs.q.shape[0], q_step, (dk, dv, dq))
    return dq, dk, dv
