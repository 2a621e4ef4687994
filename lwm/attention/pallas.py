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
  JAX's splash attention fed by the same projections; `_dims`, `_grid_specs`). Heads narrower
  than 128 lanes (64) take it with the sequence minor (``[b, kvh, g, d, seq]``,
  `blocks.seq_minor_q`): a TPU lays out ``[.., seq, 64]`` arrays that way rather than pad 64
  to 128, so the kernel reads them where they are; the forward and dQ kernels turn the query
  (and dO) block once per row of tiles, the dK/dV kernel works on ``[block_k, block_q]`` tiles
  (the key block turned once, the statistics as rows), and the outputs are turned back once
  per block (splash's ``QKVLayout.SEQ_MINOR`` turns inputs alone).
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
_NN = (((1,), (0,)), ((), ()))  # a @ b


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


def _mask(qp_ref, kp_ref, qs_ref, ks_ref, causal: bool, n: int, keys_in_rows: bool = False):
    """``[block_q, block_k]`` visibility of one tile (``n = block_k``), from positions and
    segment ids; with ``keys_in_rows``, ``[block_k, block_q]`` (``n = block_q``) from query
    tokens broadcast over sublanes and key tokens over lanes."""

    def row(ref):  # tokens broadcast over sublanes: their first row, [1, n]
        return ref[:1, :]

    def column(ref):  # tokens broadcast over lanes: [rows, n]
        return _lanes(ref[...], n)

    q_at, k_at = (row, column) if keys_in_rows else (column, row)
    mask = None
    if causal:
        mask = k_at(kp_ref) <= q_at(qp_ref)
    if qs_ref is not None:
        same = segments_see(q_at(qs_ref), k_at(ks_ref))
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
    kinds_ref,
    fetch_ref,
    q_ref,
    k_ref,
    v_ref,
    qp_ref,
    kp_ref,
    *refs,
    scale,
    causal,
    has_seg,
    seq_minor,
):
    qs_ref, ks_ref, (o_ref, lse_ref), (m_sc, l_sc, acc_sc, *qt_sc) = _split_refs(refs, has_seg, 2)
    b, qi, ki, nk = pl.program_id(0), pl.program_id(3), pl.program_id(4), pl.num_programs(4)
    d, bk = k_ref.shape if seq_minor else k_ref.shape[::-1]

    @pl.when(ki == 0)
    def _():
        m_sc[...] = jnp.full(m_sc.shape, -jnp.inf, F32)
        l_sc[...] = jnp.zeros(l_sc.shape, F32)
        acc_sc[...] = jnp.zeros(acc_sc.shape, F32)
        # the query block scaled (and turned from [d, bq]) once, for all its key blocks
        qt_sc[0][...] = _query_block(q_ref, seq_minor, scale)

    def compute(masked: bool) -> None:
        # k, v [d, bk] (seq_minor) or [bk, d]
        dims = _NN if seq_minor else _NT
        s = lax.dot_general(qt_sc[0][...], k_ref[...], dims, preferred_element_type=F32)
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
        pv = lax.dot_general(
            p.astype(v.dtype), v, _NT if seq_minor else _NN, preferred_element_type=F32
        )
        acc_sc[...] = acc_sc[...] * _lanes(alpha, d) + pv

    _when_live(kinds_ref[b, qi, ki], compute)

    @pl.when(ki == nk - 1)
    def _():
        lsum = l_sc[...]
        empty = lsum == 0.0
        out = acc_sc[...] / _lanes(jnp.where(empty, 1.0, lsum), d)
        o_ref[...] = (out.T if seq_minor else out).astype(o_ref.dtype)
        lse = m_sc[...] + jnp.log(jnp.where(empty, 1.0, lsum))
        # [block_q, 128] lanes -> the [1, block_q] row the output keeps (an aligned transpose)
        lse_ref[...] = jnp.transpose(jnp.where(empty, -jnp.inf, lse))[:1, :]


def _query_block(q_ref, seq_minor: bool, scale: float) -> jax.Array:
    """The query block as ``[bq, d]`` (turned from ``[d, bq]`` with ``seq_minor``), times
    ``scale`` and rounded back to its dtype, as splash attention and MaxText scale q: once per
    block instead of on every ``[bq, bk]`` tile of scores (the forward is bound by the vector
    unit, so one pass fewer per tile is measurably faster)."""
    return _scaled(q_ref[...].T if seq_minor else q_ref[...], scale)


def _scaled(q: jax.Array, scale: float) -> jax.Array:
    """``q * scale`` rounded back to ``q``'s dtype: the query every kernel's scores take."""
    return (q.astype(F32) * scale).astype(q.dtype)


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


def _dims(qs, kv, head_major: bool, seq_minor: bool = False) -> tuple[int, ...]:
    """``(nq, b, kvh, g, bq, d, nk, bk)`` of blocked queries and keys in any layout
    (``head_major``: ``q [b, kvh, g, nq, bq, d]``, ``k [b, kvh, nk, bk, d]``; with
    ``seq_minor`` too, ``q [b, kvh, g, d, nq * bq]``, ``k [b, kvh, d, nk * bk]``; else ``q [nq,
    b, kvh, g, bq, d]``, ``k [nk, b, kvh, bk, d]``)."""
    nq, b, bq = qs.pos.shape
    nk, _, bk = kv.pos.shape
    kvh, g = qs.q.shape[1:3] if head_major else qs.q.shape[2:4]
    d = qs.q.shape[3] if seq_minor else qs.q.shape[-1]
    return nq, b, kvh, g, bq, d, nk, bk


def _grid_specs(qs, kv, inner_q: bool, head_major: bool = False, seq_minor: bool = False):
    """Block specs of the blocked inputs for a grid of ``(b, kvh, g, nq, nk)`` (``inner_q``:
    ``(b, kvh, nk, g, nq)``), in any layout (`_dims`), and the per-row statistics' spec
    (``[.., 1, bq]`` rows of ``[.., nq, 1, bq]`` arrays in the queries' order of heads).
    Index maps receive the prefetched kind and fetch tables and take the block of the inner
    axis from the fetch table (`fetch_table`). With ``seq_minor`` and ``inner_q`` (the dK/dV
    kernel, which works on ``[block_k, block_q]`` tiles) the query tokens come broadcast over
    sublanes and the key tokens over lanes."""
    _, _, _, _, bq, d, _, bk = _dims(qs, kv, head_major, seq_minor)

    def ids(fn):
        if inner_q:
            return lambda b, h, ki, g, qi, kinds, fetch: fn(b, h, g, fetch[b, ki, qi], ki)
        return lambda b, h, g, qi, ki, kinds, fetch: fn(b, h, g, qi, fetch[b, qi, ki])

    if seq_minor:
        q_spec = pl.BlockSpec(
            (None, None, None, d, bq), ids(lambda b, h, g, qi, ki: (b, h, g, 0, qi))
        )
        kv_spec = pl.BlockSpec((None, None, d, bk), ids(lambda b, h, g, qi, ki: (b, h, 0, ki)))
        row_at = ids(lambda b, h, g, qi, ki: (b, h, g, qi, 0, 0))
    else:
        if head_major:
            q_at = ids(lambda b, h, g, qi, ki: (b, h, g, qi, 0, 0))
            kv_at = ids(lambda b, h, g, qi, ki: (b, h, ki, 0, 0))
        else:
            q_at = ids(lambda b, h, g, qi, ki: (qi, b, h, g, 0, 0))
            kv_at = ids(lambda b, h, g, qi, ki: (ki, b, h, 0, 0))
        q_spec = pl.BlockSpec((None, None, None, None, bq, d), q_at)
        kv_spec = pl.BlockSpec((None, None, None, bk, d), kv_at)
        row_at = q_at
    q_row = pl.BlockSpec((None, None, None, None, 1, bq), row_at)
    q_lanes = pl.BlockSpec((None, None, bq, LANES), ids(lambda b, h, g, qi, ki: (qi, b, 0, 0)))
    k_sub = pl.BlockSpec((None, None, SUBLANES, bk), ids(lambda b, h, g, qi, ki: (ki, b, 0, 0)))
    if seq_minor and inner_q:
        q_sub = pl.BlockSpec((None, None, SUBLANES, bq), q_lanes.index_map)
        k_lanes = pl.BlockSpec((None, None, bk, LANES), k_sub.index_map)
        ids_q, ids_k, spec_q, spec_k = _kv_sublanes, _q_lanes, q_sub, k_lanes
    else:
        ids_q, ids_k, spec_q, spec_k = _q_lanes, _kv_sublanes, q_lanes, k_sub
    tokens = [ids_q(qs.pos), ids_k(kv.pos)]
    token_specs = [spec_q, spec_k]
    if qs.seg is not None:
        tokens += [ids_q(qs.seg), ids_k(kv.seg)]
        token_specs += [spec_q, spec_k]
    return q_spec, q_row, kv_spec, tokens, token_specs


def _out(shape: tuple[int, ...], like: jax.Array, dtype=F32) -> jax.ShapeDtypeStruct:
    """A kernel output (float32 unless ``dtype``) that varies over the same mesh axes as
    ``like`` (shard_map)."""
    mat = getattr(jax.typeof(like), "manual_axis_type", None)
    return jax.ShapeDtypeStruct(shape, dtype, manual_axis_type=mat)


def _params(
    interpret: bool, semantics: tuple[str, ...], dims: tuple[int, ...], matmuls: int, arrays
):
    """pallas_call's keywords: interpret mode, or the TPU compiler's grid semantics and a cost
    estimate for XLA's scheduler (an upper bound: every tile counted, though dead ones are
    skipped at run time; ``matmuls`` of ``[block_q, block_k, head_dim]`` per tile; ``dims``:
    `_dims`)."""
    if interpret:
        return dict(interpret=True)
    nq, b, kvh, g, bq, d, nk, bk = dims
    tiles = nq * b * kvh * g * nk
    cost = pl.CostEstimate(
        flops=2 * matmuls * tiles * bq * bk * d,
        transcendentals=tiles * bq * bk,
        bytes_accessed=sum(x.size * x.dtype.itemsize for x in arrays),
    )
    return dict(
        compiler_params=pltpu.CompilerParams(dimension_semantics=semantics), cost_estimate=cost
    )


def _row_shape(dims: tuple[int, ...], head_major: bool) -> tuple[int, ...]:
    """The shape of a per-row statistic kept as ``[1, bq]`` rows (log-sum-exp, delta)."""
    nq, b, kvh, g, bq = dims[:5]
    return (b, kvh, g, nq, 1, bq) if head_major else (nq, b, kvh, g, 1, bq)


def flash_chunk(
    qs, kv, spec, dtype=F32, head_major: bool = False, seq_minor: bool = False
) -> tuple[jax.Array, jax.Array]:
    """This chunk's normalised attention output ``[nq, b, kvh, g, bq, d]`` (float32, or
    ``dtype``: with one chunk, the final output in the inputs' dtype) and log-sum-exp
    ``[nq, b, kvh, g, bq]`` (``-inf`` for rows that see no key of the chunk); with
    ``head_major`` (`_dims`), ``[b, kvh, g, nq, bq, d]`` and ``[b, kvh, g, nq, bq]``, and with
    ``seq_minor`` too, an output ``[b, kvh, g, d, nq * bq]``."""
    dims = nq, b, kvh, g, bq, d, nk, _ = _dims(qs, kv, head_major, seq_minor)
    kinds = kind_table(qs.pos, qs.seg, kv.pos, kv.seg, spec.causal)
    q_spec, q_row, kv_spec, tokens, token_specs = _grid_specs(qs, kv, False, head_major, seq_minor)
    kernel = partial(
        _fwd_kernel,
        scale=spec.scale,
        causal=spec.causal,
        has_seg=qs.seg is not None,
        seq_minor=seq_minor,
    )
    stats = pltpu.VMEM((bq, LANES), F32)  # the running max and sum
    scratch = [stats, stats, pltpu.VMEM((bq, d), F32), pltpu.VMEM((bq, d), qs.q.dtype)]  # acc, q
    out, lse = pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=2,
            grid=(b, kvh, g, nq, nk),
            in_specs=[q_spec, kv_spec, kv_spec, *token_specs],
            out_specs=[q_spec, q_row],
            scratch_shapes=scratch,
        ),
        out_shape=[_out(qs.q.shape, qs.q, dtype), _out(_row_shape(dims, head_major), qs.q)],
        **_params(
            spec.interpret, ("parallel",) * 4 + ("arbitrary",), dims, 2, (qs.q, kv.k, kv.v, qs.q)
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


def _scores_and_probs(q, k, dims, refs, lse, masked, causal, n, keys_in_rows=False):
    """``exp(q·k - lse)`` of one tile (``q`` already scaled), masked when ``masked`` by the
    token ``refs`` (query and key positions, then segment ids or Nones): ``n`` is the tile's
    minor size and ``keys_in_rows`` its orientation (`_mask`); ``lse`` broadcasts over the
    keys."""
    qp_ref, kp_ref, qs_ref, ks_ref = refs
    s = lax.dot_general(q, k, dims, preferred_element_type=F32)
    if masked:
        s = jnp.where(_mask(qp_ref, kp_ref, qs_ref, ks_ref, causal, n, keys_in_rows), s, -jnp.inf)
    return jnp.exp(s - lse)


def _column(ref) -> jax.Array:
    """A ``[1, block_q]`` per-row statistic as a ``[block_q, 1]`` column (as splash attention
    reads its log-sum-exp)."""
    return jnp.expand_dims(ref[0], -1)


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
    seq_minor,
):
    qs_ref, ks_ref, (dq_ref,), (dq_sc, *t_sc) = _split_refs(refs, has_seg, 1)
    b, qi, ki, nk = pl.program_id(0), pl.program_id(3), pl.program_id(4), pl.num_programs(4)

    @pl.when(ki == 0)
    def _():
        dq_sc[...] = jnp.zeros(dq_sc.shape, F32)
        # the query block scaled (and turned), and dO turned, once for all key blocks
        t_sc[0][...] = _query_block(q_ref, seq_minor, scale)
        if seq_minor:
            t_sc[1][...] = do_ref[...].T

    def compute(masked: bool) -> None:
        k, v = k_ref[...], v_ref[...]
        # [bq, d] x [d, bk] (seq_minor) or [bq, d] x [bk, d]^T
        dims = _NN if seq_minor else _NT
        q = t_sc[0][...]
        do = t_sc[1][...] if seq_minor else do_ref[...]
        bk = k.shape[1] if seq_minor else k.shape[0]
        refs = (qp_ref, kp_ref, qs_ref, ks_ref)
        p = _scores_and_probs(q, k, dims, refs, _column(lse_ref), masked, causal, bk)
        dp = lax.dot_general(do, v, dims, preferred_element_type=F32)
        ds = p * (dp - _column(delta_ref))  # dQ is scaled once, at the end
        # [bq, bk] x [d, bk]^T (seq_minor) or [bq, bk] x [bk, d]
        dq_sc[...] += lax.dot_general(
            ds.astype(k.dtype), k, _NT if seq_minor else _NN, preferred_element_type=F32
        )

    _when_live(kinds_ref[b, qi, ki], compute)

    @pl.when(ki == nk - 1)
    def _():
        dq = dq_sc[...] * scale
        dq_ref[...] = (dq.T if seq_minor else dq).astype(dq_ref.dtype)


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
    seq_minor,
):
    qs_ref, ks_ref, (dk_ref, dv_ref), (dk_sc, dv_sc, *t_sc) = _split_refs(refs, has_seg, 2)
    b, ki, g, qi = pl.program_id(0), pl.program_id(2), pl.program_id(3), pl.program_id(4)
    first = (g == 0) & (qi == 0)
    last = (g == pl.num_programs(3) - 1) & (qi == pl.num_programs(4) - 1)

    @pl.when(first)
    def _():
        dk_sc[...] = jnp.zeros(dk_sc.shape, F32)
        dv_sc[...] = jnp.zeros(dv_sc.shape, F32)
        if seq_minor:  # the key/value block [d, bk] turned once, for all query blocks
            t_sc[0][...] = k_ref[...].T
            t_sc[1][...] = v_ref[...].T

    def compute(masked: bool) -> None:
        q, do = q_ref[...], do_ref[...]
        q = _scaled(q, scale)  # as the forward's: dK = dS^T (q * scale) needs no scale
        refs = (qp_ref, kp_ref, qs_ref, ks_ref)
        if seq_minor:
            # [bk, bq] tiles: [bk, d] x [d, bq]; the statistics broadcast as [1, bq] rows
            bq = q.shape[1]
            pt = _scores_and_probs(
                t_sc[0][...], q, _NN, refs, lse_ref[...], masked, causal, bq, True
            )
            dv_sc[...] += lax.dot_general(pt.astype(do.dtype), do, _NT, preferred_element_type=F32)
            dpt = lax.dot(t_sc[1][...], do, preferred_element_type=F32)
            dst = pt * (dpt - delta_ref[...])
            dk_sc[...] += lax.dot_general(dst.astype(q.dtype), q, _NT, preferred_element_type=F32)
            return
        bk = k_ref.shape[0]
        p = _scores_and_probs(q, k_ref[...], _NT, refs, _column(lse_ref), masked, causal, bk)
        dv_sc[...] += lax.dot(p.T.astype(do.dtype), do, preferred_element_type=F32)
        dp = lax.dot_general(do, v_ref[...], _NT, preferred_element_type=F32)
        ds = p * (dp - _column(delta_ref))
        dk_sc[...] += lax.dot(ds.T.astype(q.dtype), q, preferred_element_type=F32)

    _when_live(kinds_ref[b, qi, ki], compute)

    @pl.when(last)
    def _():
        dk, dv = dk_sc[...], dv_sc[...]
        if seq_minor:
            dk, dv = dk.T, dv.T
        dk_ref[...] = dk.astype(dk_ref.dtype)
        dv_ref[...] = dv.astype(dv_ref.dtype)


def bwd_chunk(
    qs, do, lse, delta, kv, grads, spec, head_major: bool = False, seq_minor: bool = False
):
    """`lwm.attention.blocks.bwd_chunk` with the Pallas kernels: this chunk's gradient
    contributions added to ``grads`` = (dQ, dK, dV), float32, blocked. ``grads=None`` (one
    chunk: nothing to add to) returns the kernels' gradients in the inputs' dtypes, so that no
    float32 copy of the queries, keys and values is ever made. ``head_major`` (and
    ``seq_minor``): every blocked array in that layout (`_dims`), the gradients too."""
    final = grads is None
    dq_dtype, kv_dtype = (qs.q.dtype, kv.k.dtype) if final else (F32, F32)
    dims = nq, b, kvh, g, bq, d, nk, bk = _dims(qs, kv, head_major, seq_minor)
    kinds = kind_table(qs.pos, qs.seg, kv.pos, kv.seg, spec.causal)
    stats = [lse[..., None, :], delta[..., None, :]]  # [nq, b, kvh, g, 1, bq], or head-major
    has_seg = qs.seg is not None
    common = dict(scale=spec.scale, causal=spec.causal, has_seg=has_seg, seq_minor=seq_minor)

    q_spec, q_row, kv_spec, tokens, token_specs = _grid_specs(qs, kv, False, head_major, seq_minor)
    scratch = [pltpu.VMEM((bq, d), F32), pltpu.VMEM((bq, d), qs.q.dtype)]  # dQ, scaled q
    if seq_minor:
        scratch.append(pltpu.VMEM((bq, d), do.dtype))
    dq_c = pl.pallas_call(
        partial(_dq_kernel, **common),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=2,
            grid=(b, kvh, g, nq, nk),
            in_specs=[q_spec, kv_spec, kv_spec, q_spec, q_row, q_row, *token_specs],
            out_specs=q_spec,
            scratch_shapes=scratch,
        ),
        out_shape=_out(qs.q.shape, qs.q, dq_dtype),
        **_params(
            spec.interpret,
            ("parallel",) * 4 + ("arbitrary",),
            dims,
            3,
            (qs.q, kv.k, kv.v, do, qs.q),
        ),
    )(kinds, fetch_table(kinds, across_rows=True), qs.q, kv.k, kv.v, do, *stats, *tokens)

    q_spec, q_row, kv_spec, tokens, token_specs = _grid_specs(qs, kv, True, head_major, seq_minor)
    # The query heads of a key/value head come round between key blocks unless there is one.
    fetch_q = fetch_table(kinds.transpose(0, 2, 1), across_rows=g == 1)
    scratch = [pltpu.VMEM((bk, d), F32), pltpu.VMEM((bk, d), F32)]
    if seq_minor:
        scratch += [pltpu.VMEM((bk, d), kv.k.dtype), pltpu.VMEM((bk, d), kv.v.dtype)]
    dk, dv = pl.pallas_call(
        partial(_dkv_kernel, **common),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=2,
            grid=(b, kvh, nk, g, nq),
            in_specs=[q_spec, kv_spec, kv_spec, q_spec, q_row, q_row, *token_specs],
            out_specs=[kv_spec, kv_spec],
            scratch_shapes=scratch,
        ),
        out_shape=[_out(kv.k.shape, kv.k, kv_dtype)] * 2,
        **_params(
            spec.interpret,
            ("parallel",) * 3 + ("arbitrary",) * 2,
            dims,
            4,
            (qs.q, kv.k, kv.v, do, kv.k, kv.v),
        ),
    )(kinds, fetch_q, qs.q, kv.k, kv.v, do, *stats, *tokens)
    if final:
        return dq_c, dk, dv
    return grads[0] + dq_c, grads[1] + dk, grads[2] + dv


__all__ = ["bwd_chunk", "flash_chunk", "fwd_chunk"]
