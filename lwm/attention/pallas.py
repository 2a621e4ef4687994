"""Pallas block kernels for blockwise and ring attention (``model.attention_kernel: pallas``).

The same contract as the XLA kernel in `lwm.attention.blocks`: one local shard of queries
against one chunk of keys and values, with the mask given by positions and segment ids. Written
for TPUs (Mosaic): every tile is ``[block, head_dim]`` in VMEM, per-row statistics are kept
``[block_q, 128]`` wide (one row per sublane, broadcast over the lanes), query positions and
segment ids come broadcast over the 128 lanes and key ones over 8 sublanes, as in JAX's own TPU
flash attention. Elsewhere (tests on a CPU) the kernels run in Pallas interpret mode.

- Layouts: the ring's steps take the shared blocked layout of `lwm.attention.blocks`
  (``[nq, b, kvh, g, bq, d]``, which its running statistics share); single-device attention
  (one chunk) takes the heads' own order (``[b, kvh, g, nq, bq, d]``, `blocks.head_major_q`), a
  transpose of ``[b, s, h, d]`` that XLA folds into the projections around attention, so that
  no copy of q, k, v or the output is made (the forward then plans less temporary memory than
  JAX's splash attention fed by the same projections; `_dims`, `_grid_specs`).
- Forward (`fwd_chunk`): a flash-attention pass of the query blocks over the chunk's key blocks,
  returning the chunk's normalised output and log-sum-exp, which are folded into the ring's
  running statistics outside the kernel, as one more "key" of weight ``exp(lse)``.
- Backward (`bwd_chunk`): two kernels, one for dQ (key blocks innermost) and one for dK and dV
  (query blocks and the query heads of a key/value head innermost), both from the **global**
  log-sum-exp and ``delta = rowsum(dO * O)``, so they are exact inside the ring.

Which (query block, key block) pairs to compute is decided outside the kernels, from the ranges
of positions and segment ids (`lwm.attention._common.kind_table`, the XLA kernel's test), and
passed as a scalar-prefetched table: dead pairs are skipped, fully visible ones skip the mask.
In the zigzag layout every ring step's pair of half-shards is full, causal-diagonal or empty,
so with blocks that tile the halves (`lwm.attention.layout.ring_block_size`) nothing is
computed that the XLA kernel skips.

Why not the kernels that ship with JAX (`jax.experimental.pallas.ops.tpu`): flash attention
masks causally by index within the call and splash attention by static masks, while our masks
come from positions (documents packed into a row restart theirs; a ring step's chunks sit at
offsets only the positions know). The layouts and the tile-level tricks follow theirs: segment
ids broadcast over lanes/sublanes, ``[block_q, 128]`` statistics, and the backward reading its
log-sum-exp as a ``[1, block_q]`` row (splash attention's).
"""

from __future__ import annotations

import math
from functools import partial

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from data.batches import segments_see
from lwm.attention._common import DEAD, FULL, PARTIAL, kind_table

F32 = jnp.float32
LANES = 128
SUBLANES = 8
_NT = (((1,), (1,)), ((), ()))  # a @ b.T


def _lanes(x: jax.Array, n: int) -> jax.Array:
    """A ``[rows, 128]`` lane-broadcast statistic as ``[rows, n]``."""
    if n % LANES == 0:
        return jnp.tile(x, (1, n // LANES))
    if n < LANES:
        return x[:, :n]
    return jnp.broadcast_to(x[:, :1], (x.shape[0], n))


def _q_lanes(x: jax.Array) -> jax.Array:
    """``[n, b, block]`` -> ``[n, b, block, 128]``."""
    return jnp.broadcast_to(x[..., None], (*x.shape, LANES))


def _kv_sublanes(x: jax.Array) -> jax.Array:
    """``[n, b, block]`` -> ``[n, b, 8, block]``."""
    n, b, block = x.shape
    return jnp.broadcast_to(x[:, :, None, :], (n, b, SUBLANES, block))


def _mask(qp_ref, kp_ref, qs_ref, ks_ref, causal: bool, bk: int):
    """``[block_q, block_k]`` visibility of one tile, from positions and segment ids."""
    mask = None
    if causal:
        mask = kp_ref[:1, :] <= _lanes(qp_ref[...], bk)
    if qs_ref is not None:
        same = segments_see(_lanes(qs_ref[...], bk), ks_ref[:1, :])
        mask = same if mask is None else mask & same
    return mask


def _when_live(kind, compute) -> None:
    """``compute(masked)`` once per live tile: without the mask when the tile is fully visible."""

    @pl.when(kind == FULL)
    def _():
        compute(False)

    @pl.when(kind == PARTIAL)
    def _():
        compute(True)


def _split_refs(refs, has_seg: bool, n_out: int):
    """A kernel's refs after the positions: the segment-id refs (or None), its ``n_out``
    outputs and its scratch buffers."""
    if has_seg:
        qs_ref, ks_ref, *rest = refs
    else:
        qs_ref, ks_ref, rest = None, None, list(refs)
    return qs_ref, ks_ref, rest[:n_out], rest[n_out:]


# -- forward -------------------------------------------------------------------------------------


def _fwd_kernel(
    kinds_ref, fetch_ref, q_ref, k_ref, v_ref, qp_ref, kp_ref, *refs, scale, causal, has_seg
):
    qs_ref, ks_ref, (o_ref, lse_ref), (m_sc, l_sc, acc_sc) = _split_refs(refs, has_seg, 2)
    b, qi, ki, nk = pl.program_id(0), pl.program_id(3), pl.program_id(4), pl.num_programs(4)
    bk, d = k_ref.shape

    @pl.when(ki == 0)
    def _():
        m_sc[...] = jnp.full(m_sc.shape, -jnp.inf, F32)
        l_sc[...] = jnp.zeros(l_sc.shape, F32)
        acc_sc[...] = jnp.zeros(acc_sc.shape, F32)

    def compute(masked: bool) -> None:
        s = lax.dot_general(q_ref[...], k_ref[...], _NT, preferred_element_type=F32) * scale
        if masked:
            s = jnp.where(_mask(qp_ref, kp_ref, qs_ref, ks_ref, causal, bk), s, -jnp.inf)
        m_prev = m_sc[...]
        m_next = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))  # [bq, 128]
        # A row with nothing visible yet keeps exp() finite.
        m_next_safe = jnp.where(m_next == -jnp.inf, 0.0, m_next) if masked else m_next
        p = jnp.exp(s - _lanes(m_next_safe, bk))
        alpha = jnp.exp(m_prev - m_next_safe)
        l_sc[...] = alpha * l_sc[...] + jnp.sum(p, axis=1, keepdims=True)
        m_sc[...] = m_next
        v = v_ref[...]
        pv = lax.dot(p.astype(v.dtype), v, preferred_element_type=F32)
        acc_sc[...] = acc_sc[...] * _lanes(alpha, d) + pv

    _when_live(kinds_ref[b, qi, ki], compute)

    @pl.when(ki == nk - 1)
    def _():
        lsum = l_sc[...]
        empty = lsum == 0.0
        o_ref[...] = (acc_sc[...] / _lanes(jnp.where(empty, 1.0, lsum), d)).astype(o_ref.dtype)
        lse = m_sc[...] + jnp.log(jnp.where(empty, 1.0, lsum))
        # [block_q, 128] lanes -> the [1, block_q] row the output keeps (an aligned transpose)
        lse_ref[...] = jnp.transpose(jnp.where(empty, -jnp.inf, lse))[:1, :]


def fetch_table(kinds: jax.Array, across_rows: bool) -> jax.Array:
    """For every tile of ``kinds [batch, rows, n]`` (the inner grid axis last), the block of
    the inner axis to fetch: its own if the tile is live, else the next live one, so that a
    run of dead tiles issues no copies and prefetches what the next live tile needs (the
    pipeline skips a copy when the block index does not change). ``across_rows``: the next
    row follows in the grid (else the same row comes round again: wrap within it)."""
    b, rows, n = kinds.shape
    if across_rows:
        return fetch_table(kinds.reshape(b, 1, rows * n), False).reshape(b, rows, n) % n
    none = rows * n + n
    idx = jnp.where(kinds != DEAD, jnp.arange(n, dtype=jnp.int32), none)
    nxt = lax.cummin(idx, axis=2, reverse=True)
    nxt = jnp.where(nxt == none, nxt[:, :, :1], nxt)  # past the last live tile: the first
    return jnp.where(nxt == none, 0, nxt).astype(jnp.int32)


def _dims(qs, kv, head_major: bool) -> tuple[int, ...]:
    """``(nq, b, kvh, g, bq, d, nk, bk)`` of blocked queries and keys in either layout
    (``head_major``: ``q [b, kvh, g, nq, bq, d]``, ``k [b, kvh, nk, bk, d]``; else ``q [nq, b,
    kvh, g, bq, d]``, ``k [nk, b, kvh, bk, d]``)."""
    nq, b = qs.pos.shape[:2]
    kvh, g = qs.q.shape[1:3] if head_major else qs.q.shape[2:4]
    bq, d = qs.q.shape[-2:]
    return nq, b, kvh, g, bq, d, kv.pos.shape[0], kv.k.shape[-2]


def _grid_specs(qs, kv, inner_q: bool, head_major: bool = False):
    """Block specs of the blocked inputs for a grid of ``(b, kvh, g, nq, nk)`` (``inner_q``:
    ``(b, kvh, nk, g, nq)``), in either layout (`_dims`). Index maps receive the prefetched
    kind and fetch tables and take the block of the inner axis from the fetch table
    (`fetch_table`)."""
    bq, d = qs.q.shape[-2:]
    bk = kv.k.shape[-2]

    def ids(fn):
        if inner_q:
            return lambda b, h, ki, g, qi, kinds, fetch: fn(b, h, g, fetch[b, ki, qi], ki)
        return lambda b, h, g, qi, ki, kinds, fetch: fn(b, h, g, qi, fetch[b, qi, ki])

    if head_major:
        q_at = ids(lambda b, h, g, qi, ki: (b, h, g, qi, 0, 0))
        kv_at = ids(lambda b, h, g, qi, ki: (b, h, ki, 0, 0))
    else:
        q_at = ids(lambda b, h, g, qi, ki: (qi, b, h, g, 0, 0))
        kv_at = ids(lambda b, h, g, qi, ki: (ki, b, h, 0, 0))
    q_spec = pl.BlockSpec((None, None, None, None, bq, d), q_at)
    q_row = pl.BlockSpec((None, None, None, None, 1, bq), q_spec.index_map)
    kv_spec = pl.BlockSpec((None, None, None, bk, d), kv_at)
    qt_spec = pl.BlockSpec((None, None, bq, LANES), ids(lambda b, h, g, qi, ki: (qi, b, 0, 0)))
    kt_spec = pl.BlockSpec((None, None, SUBLANES, bk), ids(lambda b, h, g, qi, ki: (ki, b, 0, 0)))
    tokens = [_q_lanes(qs.pos), _kv_sublanes(kv.pos)]
    token_specs = [qt_spec, kt_spec]
    if qs.seg is not None:
        tokens += [_q_lanes(qs.seg), _kv_sublanes(kv.seg)]
        token_specs += [qt_spec, kt_spec]
    return q_spec, q_row, kv_spec, tokens, token_specs


def _out(shape: tuple[int, ...], like: jax.Array, dtype=F32) -> jax.ShapeDtypeStruct:
    """A kernel output (float32 unless ``dtype``) that varies over the same mesh axes as
    ``like`` (shard_map)."""
    mat = getattr(jax.typeof(like), "manual_axis_type", None)
    return jax.ShapeDtypeStruct(shape, dtype, manual_axis_type=mat)


def _params(interpret: bool, semantics: tuple[str, ...], qs, kv, matmuls: int, arrays):
    """pallas_call's keywords: interpret mode, or the TPU compiler's grid semantics and a cost
    estimate for XLA's scheduler (an upper bound: every tile counted, though dead ones are
    skipped at run time; ``matmuls`` of ``[block_q, block_k, head_dim]`` per tile)."""
    if interpret:
        return dict(interpret=True)
    bq, d = qs.q.shape[-2:]
    tiles = math.prod(qs.q.shape[:-2]) * kv.pos.shape[0]
    bk = kv.k.shape[-2]
    cost = pl.CostEstimate(
        flops=2 * matmuls * tiles * bq * bk * d,
        transcendentals=tiles * bq * bk,
        bytes_accessed=sum(x.size * x.dtype.itemsize for x in arrays),
    )
    return dict(
        compiler_params=pltpu.CompilerParams(dimension_semantics=semantics), cost_estimate=cost
    )


def flash_chunk(qs, kv, spec, dtype=F32, head_major: bool = False) -> tuple[jax.Array, jax.Array]:
    """This chunk's normalised attention output ``[nq, b, kvh, g, bq, d]`` (float32, or
    ``dtype``: with one chunk, the final output in the inputs' dtype) and log-sum-exp
    ``[nq, b, kvh, g, bq]`` (``-inf`` for rows that see no key of the chunk); with
    ``head_major`` (`_dims`), ``[b, kvh, g, nq, bq, d]`` and ``[b, kvh, g, nq, bq]``."""
    nq, b, kvh, g, bq, d, nk, _ = _dims(qs, kv, head_major)
    kinds = kind_table(qs.pos, qs.seg, kv.pos, kv.seg, spec.causal)
    q_spec, q_row, kv_spec, tokens, token_specs = _grid_specs(qs, kv, False, head_major)
    kernel = partial(_fwd_kernel, scale=spec.scale, causal=spec.causal, has_seg=qs.seg is not None)
    out, lse = pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=2,
            grid=(b, kvh, g, nq, nk),
            in_specs=[q_spec, kv_spec, kv_spec, *token_specs],
            out_specs=[q_spec, q_row],
            scratch_shapes=[
                pltpu.VMEM((bq, LANES), F32),
                pltpu.VMEM((bq, LANES), F32),
                pltpu.VMEM((bq, d), F32),
            ],
        ),
        out_shape=[_out(qs.q.shape, qs.q, dtype), _out((*qs.q.shape[:-2], 1, bq), qs.q)],
        **_params(
            spec.interpret, ("parallel",) * 4 + ("arbitrary",), qs, kv, 2, (qs.q, kv.k, kv.v, qs.q)
        ),
    )(kinds, fetch_table(kinds, across_rows=True), qs.q, kv.k, kv.v, *tokens)
    return out, lse[..., 0, :]


def fwd_chunk(qs, kv, stats, spec):
    """`lwm.attention.blocks.fwd_chunk` with the Pallas kernel: the chunk's output and
    log-sum-exp folded into the running statistics (exactly: online softmax over the chunk as
    one key of weight ``exp(lse)`` and value ``out``)."""
    out, lse = flash_chunk(qs, kv, spec)
    m_new = jnp.maximum(stats.m, lse)
    m_safe = jnp.where(jnp.isneginf(m_new), 0.0, m_new)
    a, c = jnp.exp(stats.m - m_safe), jnp.exp(lse - m_safe)
    return type(stats)(
        acc=stats.acc * a[..., None] + out * c[..., None], m=m_new, lsum=stats.lsum * a + c
    )


# -- backward ------------------------------------------------------------------------------------


def _scores_and_probs(q_ref, k_ref, qp_ref, kp_ref, qs_ref, ks_ref, lse_ref, masked, scale, causal):
    bk = k_ref.shape[0]
    s = lax.dot_general(q_ref[...], k_ref[...], _NT, preferred_element_type=F32) * scale
    if masked:
        s = jnp.where(_mask(qp_ref, kp_ref, qs_ref, ks_ref, causal, bk), s, -jnp.inf)
    return jnp.exp(s - _column(lse_ref))


def _column(ref) -> jax.Array:
    """A ``[1, block_q]`` per-row statistic as a ``[block_q, 1]`` column (as splash attention
    reads its log-sum-exp)."""
    return jnp.expand_dims(ref[0], -1)


def _ds(p, do_ref, v_ref, delta_ref, scale):
    dp = lax.dot_general(do_ref[...], v_ref[...], _NT, preferred_element_type=F32)
    return p * (dp - _column(delta_ref)) * scale


def _dq_kernel(
    kinds_ref,
    fetch_ref,
    q_ref,
    k_ref,
    v_ref,
    do_ref,
    lse_ref,
    delta_ref,
    qp_ref,
    kp_ref,
    *refs,
    scale,
    causal,
    has_seg,
):
    qs_ref, ks_ref, (dq_ref,), (dq_sc,) = _split_refs(refs, has_seg, 1)
    b, qi, ki, nk = pl.program_id(0), pl.program_id(3), pl.program_id(4), pl.num_programs(4)

    @pl.when(ki == 0)
    def _():
        dq_sc[...] = jnp.zeros(dq_sc.shape, F32)

    def compute(masked: bool) -> None:
        p = _scores_and_probs(
            q_ref, k_ref, qp_ref, kp_ref, qs_ref, ks_ref, lse_ref, masked, scale, causal
        )
        ds = _ds(p, do_ref, v_ref, delta_ref, scale)
        k = k_ref[...]
        dq_sc[...] += lax.dot(ds.astype(k.dtype), k, preferred_element_type=F32)

    _when_live(kinds_ref[b, qi, ki], compute)

    @pl.when(ki == nk - 1)
    def _():
        dq_ref[...] = dq_sc[...].astype(dq_ref.dtype)


def _dkv_kernel(
    kinds_ref,
    fetch_ref,
    q_ref,
    k_ref,
    v_ref,
    do_ref,
    lse_ref,
    delta_ref,
    qp_ref,
    kp_ref,
    *refs,
    scale,
    causal,
    has_seg,
):
    qs_ref, ks_ref, (dk_ref, dv_ref), (dk_sc, dv_sc) = _split_refs(refs, has_seg, 2)
    b, ki, g, qi = pl.program_id(0), pl.program_id(2), pl.program_id(3), pl.program_id(4)
    first = (g == 0) & (qi == 0)
    last = (g == pl.num_programs(3) - 1) & (qi == pl.num_programs(4) - 1)

    @pl.when(first)
    def _():
        dk_sc[...] = jnp.zeros(dk_sc.shape, F32)
        dv_sc[...] = jnp.zeros(dv_sc.shape, F32)

    def compute(masked: bool) -> None:
        p = _scores_and_probs(
            q_ref, k_ref, qp_ref, kp_ref, qs_ref, ks_ref, lse_ref, masked, scale, causal
        )
        do = do_ref[...]
        dv_sc[...] += lax.dot(p.T.astype(do.dtype), do, preferred_element_type=F32)
        ds = _ds(p, do_ref, v_ref, delta_ref, scale)
        q = q_ref[...]
        dk_sc[...] += lax.dot(ds.T.astype(q.dtype), q, preferred_element_type=F32)

    _when_live(kinds_ref[b, qi, ki], compute)

    @pl.when(last)
    def _():
        dk_ref[...] = dk_sc[...].astype(dk_ref.dtype)
        dv_ref[...] = dv_sc[...].astype(dv_ref.dtype)


def bwd_chunk(qs, do, lse, delta, kv, grads, spec, head_major: bool = False):
    """`lwm.attention.blocks.bwd_chunk` with the Pallas kernels: this chunk's gradient
    contributions added to ``grads`` = (dQ, dK, dV), float32, blocked. ``grads=None`` (one
    chunk: nothing to add to) returns the kernels' gradients in the inputs' dtypes, so that no
    float32 copy of the queries, keys and values is ever made. ``head_major``: every blocked
    array in that layout (`_dims`), the gradients too."""
    final = grads is None
    dq_dtype, kv_dtype = (qs.q.dtype, kv.k.dtype) if final else (F32, F32)
    nq, b, kvh, g, bq, d, nk, bk = _dims(qs, kv, head_major)
    kinds = kind_table(qs.pos, qs.seg, kv.pos, kv.seg, spec.causal)
    stats = [lse[..., None, :], delta[..., None, :]]  # [nq, b, kvh, g, 1, bq], or head-major
    has_seg = qs.seg is not None
    common = dict(scale=spec.scale, causal=spec.causal, has_seg=has_seg)

    q_spec, q_row, kv_spec, tokens, token_specs = _grid_specs(qs, kv, False, head_major)
    dq_c = pl.pallas_call(
        partial(_dq_kernel, **common),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=2,
            grid=(b, kvh, g, nq, nk),
            in_specs=[q_spec, kv_spec, kv_spec, q_spec, q_row, q_row, *token_specs],
            out_specs=q_spec,
            scratch_shapes=[pltpu.VMEM((bq, d), F32)],
        ),
        out_shape=_out(qs.q.shape, qs.q, dq_dtype),
        **_params(
            spec.interpret,
            ("parallel",) * 4 + ("arbitrary",),
            qs,
            kv,
            3,
            (qs.q, kv.k, kv.v, do, qs.q),
        ),
    )(kinds, fetch_table(kinds, across_rows=True), qs.q, kv.k, kv.v, do, *stats, *tokens)

    q_spec, q_row, kv_spec, tokens, token_specs = _grid_specs(qs, kv, True, head_major)
    # The query heads of a key/value head come round between key blocks unless there is one.
    fetch_q = fetch_table(kinds.transpose(0, 2, 1), across_rows=g == 1)
    dk, dv = pl.pallas_call(
        partial(_dkv_kernel, **common),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=2,
            grid=(b, kvh, nk, g, nq),
            in_specs=[q_spec, kv_spec, kv_spec, q_spec, q_row, q_row, *token_specs],
            out_specs=[kv_spec, kv_spec],
            scratch_shapes=[pltpu.VMEM((bk, d), F32), pltpu.VMEM((bk, d), F32)],
        ),
        out_shape=[_out(kv.k.shape, kv.k, kv_dtype)] * 2,
        **_params(
            spec.interpret,
            ("parallel",) * 3 + ("arbitrary",) * 2,
            qs,
            kv,
            4,
            (qs.q, kv.k, kv.v, do, kv.k, kv.v),
        ),
    )(kinds, fetch_q, qs.q, kv.k, kv.v, do, *stats, *tokens)
    if final:
        return dq_c, dk, dv
    return grads[0] + dq_c, grads[1] + dk, grads[2] + dv


__all__ = ["bwd_chunk", "flash_chunk", "fwd_chunk"]
