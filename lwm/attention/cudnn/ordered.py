"""Schedules fixed when tracing, with no run-time choice per pair: one document in a known
order (``Spec.order``: `_ordered_forward`), and documents packed in index order on one device
(``Spec.in_order``: `_in_order_forward`, chosen once per call by `_if_in_order`); each with
its backward."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from lwm.attention._common import (
    axis_size,
    full,
    keys_precede_queries,
    look_back,
    make_varying,
    union_vma,
)
from lwm.attention.blocks import F32, Spec
from lwm.attention.cudnn.kernels import (
    _call_bwd,
    _call_fwd,
    _kernels,
)
from lwm.attention.cudnn.pairs import (
    _add_piece,
    _merge,
    _piece,
    _put_piece,
    _send,
    _set_rows,
    _split_count,
    _tied,
    _visible,
)


def _known_order(spec: Spec, axis_name: str | None) -> bool:
    """Whether the pairs' kinds follow from ``spec.order`` alone (`_ordered_forward`): one
    device, or the zigzag layout over the ring with causal (or no) masking."""
    if spec.order is None:
        return False
    n = axis_size(axis_name)
    return n == 1 or (spec.order == "zigzag" and spec.kv_len % 2 == 0)


def _ring_position(axis_name: str, step):
    """Whether the chunk visiting at ring step ``step`` >= 1 comes from an earlier device (its
    owner ``(i - step) mod n`` below this device ``i``), as an int32 0/1."""
    i = lax.axis_index(axis_name)
    return (step <= i).astype(jnp.int32)


def _half(x, which, c: int, axis: int = 1):
    return lax.dynamic_slice_in_dim(x, which * c, c, axis=axis)


def _ordered_forward(q, k, v, spec: Spec, axis_name):
    """`_forward` for one document in ``spec.order`` (no positions or segment ids given): every
    cuDNN call's mask is known when tracing, so nothing is decided at run time.

    One device: one call over the shard. The zigzag ring (device ``i`` holds chunks ``i`` and
    ``2n-1-i``, its halves): at step 0 one causal call over the shard (its two chunks are in
    order, so the index mask is the position mask); at step ``s`` the chunk of device ``j``
    visits, and (second half x first half) is always visible, plus (first x first) when
    ``j < i`` or (second x second) when ``j > i``; the other two pairs are masked whole. That
    second pair is cut out by a data-dependent offset, so every step is the same two unmasked
    calls of half a shard each, as ring-flash-attention schedules zigzag rings."""
    fwd, _ = _kernels(spec)
    out, lse = fwd(q, k, v, spec.causal, spec.scale)
    n = axis_size(axis_name)
    if n == 1:
        return out, lse.astype(F32)
    vma = union_vma((q, k, v))
    c = q.shape[1] // 2
    acc = (out.astype(F32), lse.astype(F32))

    def part(a, b, k, v, acc):
        """Fold (query half a, key half b), unmasked, into the queries' half a: a, b traced."""
        o, lse_o = fwd(_half(q, a, c), _half(k, b, c), _half(v, b, c), False, spec.scale)
        out, lse = acc
        return _set_rows(
            acc, a, _merge(_half(out, a, c), _half(lse, a, c, 2), o.astype(F32), lse_o)
        )

    def fold(kv, acc, step):
        k, v = kv
        if not spec.causal:  # everything is visible: one call
            o, lse_o = fwd(q, k, v, False, spec.scale)
            return _merge(*acc, o.astype(F32), lse_o.astype(F32))
        acc = part(1, 0, k, v, acc)
        a = 1 - _ring_position(axis_name, step)  # 0: first x first, 1: second x second
        return part(a, a, k, v, acc)

    def step(carry, s):
        kv, acc = carry
        incoming = _send(kv, axis_name, n)
        return (incoming, fold(kv, acc, s)), None

    kv = jax.tree.map(lambda x: make_varying(x, vma), _send((k, v), axis_name, n))
    acc = jax.tree.map(lambda x: make_varying(x, vma), acc)
    steps = jnp.arange(1, n, dtype=jnp.int32)
    if n > 2:
        (kv, acc), _ = lax.scan(step, (kv, acc), steps[:-1])
    out, lse = fold(kv, acc, steps[-1])
    return out.astype(q.dtype), lse


def _ordered_backward(res, dout, spec: Spec, axis_name):
    """`_backward` for `_ordered_forward`'s schedule: the same calls, each with the global
    output and log-sum-exp of its queries."""
    q, k, v, _, _, _, _, out, lse = res
    _, bwd = _kernels(spec)
    dq, dk, dv = bwd(q, k, v, out, lse, dout, spec.causal, spec.scale)
    n = axis_size(axis_name)
    if n == 1:
        return dq, dk, dv
    vma = union_vma((q, k, v, out, lse, dout))
    c = q.shape[1] // 2
    dq = dq.astype(F32)

    def part(a, b, k, v):
        """dQ, dK, dV of (query half a, key half b): a, b traced 0/1."""
        qa, oa, da = (_half(x, a, c) for x in (q, out, dout))
        return bwd(qa, _half(k, b, c), _half(v, b, c), oa, _half(lse, a, c, 2), da, False,
                   spec.scale)  # fmt: skip

    def add(x, which, g):
        return _add_piece(x, which, g.astype(F32))

    def fold(kv, dq, dk, dv, step):
        k, v = kv
        if not spec.causal:
            gq, gk, gv = bwd(q, k, v, out, lse, dout, False, spec.scale)
            return dq + gq.astype(F32), dk + gk.astype(F32), dv + gv.astype(F32)
        gq, gk, gv = part(1, 0, k, v)
        dq, dk, dv = add(dq, 1, gq), add(dk, 0, gk), add(dv, 0, gv)
        a = 1 - _ring_position(axis_name, step)
        gq, gk, gv = part(a, a, k, v)
        return add(dq, a, gq), add(dk, a, gk), add(dv, a, gv)

    def step(carry, s):
        kv, dq, dk, dv = carry
        incoming = _send(kv, axis_name, n)
        dq, dk, dv = fold(kv, dq, dk, dv, s)
        return (incoming, dq, *_send((dk, dv), axis_name, n)), None

    kv = _send((k, v), axis_name, n)
    zeros = full(k.shape, 0.0, F32, vma)
    carry = jax.tree.map(lambda x: make_varying(x, vma), (kv, dq, zeros, zeros))
    steps = jnp.arange(1, n, dtype=jnp.int32)
    if n > 2:
        carry, _ = lax.scan(step, carry, steps[:-1])
    kv, dq, dk_r, dv_r = carry
    dq, dk_r, dv_r = fold(kv, dq, dk_r, dv_r, steps[-1])
    dk_r, dv_r = _send((dk_r, dv_r), axis_name, n)  # home after n - 1 hops and this one
    return (
        dq.astype(q.dtype),
        (dk.astype(F32) + dk_r).astype(k.dtype),
        (dv.astype(F32) + dv_r).astype(v.dtype),
    )


def _in_order(spec: Spec, axis_name: str | None, q_len: int, kv_len: int) -> bool:
    """Whether `_if_in_order` chooses the schedule: the caller says that no query sees a later
    key (``spec.in_order``), attention is causal, and the whole sequence is on this device."""
    return spec.in_order and spec.causal and axis_size(axis_name) == 1 and q_len == kv_len


def _if_in_order(in_order, general, reach: int, *operands):
    """``in_order(*operands)`` where the rows are in order (`keys_precede_queries`, checked
    on the device: queries and keys the same tokens, every visible key at or before its
    query, and with ``reach`` none looking back further: `look_back`), else
    ``general(*operands)``; ``operands`` end with (qp, qsg, kp, ksg). One conditional per
    call: so ``in_order`` and ``reach`` are hints, never wrong, and the schedule plans the
    memory of the general one (unconditioned, XLA's CPU scheduler planned it 17% more for the
    1.14B model at 128K: docs/benchmarks.md)."""
    qp, qsg, kp, ksg = operands[-4:]
    same = jnp.all(qp == kp) & (True if qsg is None else jnp.all(qsg == ksg))
    ok = same & keys_precede_queries(qp, qsg)
    if reach:  # and no query looks back further
        ok = ok & (look_back(qsg, qp.shape[1]) <= reach)
    ok, operands = _tied(ok, operands)
    return lax.cond(ok, in_order, general, *operands)


def _band(reach: int, t: int, m: int) -> int | None:
    """How many pieces (``t`` tokens each, ``m`` a side) below the diagonal a piece's queries
    can see when no query looks back more than ``reach`` tokens (itself included; 0: unknown):
    key piece ``j`` can hold a key of a query in piece ``i > j`` only if ``(i-j-1)*t + 1 <
    reach``. None where the band saves nothing: a loop over each row's ``band`` pieces computes
    ``m * band`` of them (the first rows' missing ones too, discarded), the paired schedule all
    ``m*(m-1)/2``."""
    if reach <= 0:
        return None
    band = 0 if reach < 2 else 1 + (reach - 2) // t
    return band if 2 * band < m - 1 else None


def _paired(r, n, m: int):
    """Pieces below the diagonal, ``m`` a side (even), two lines at a time: line ``r`` has
    ``r`` of them and line ``m-1-r`` has ``m-1-r``, so every pair of lines has ``m - 1``, and
    the ``n``-th of them (``n < m - 1``) is on line ``r`` when ``n < r`` (its ``n``-th piece),
    else on line ``m-1-r`` (its ``(n-r)``-th). Returns (on line ``r``, the line, the piece
    along it), traced, no conditional: loops of fixed trip counts go over every piece below
    the diagonal with no work wasted, as causal flash attention balances its rows."""
    first = n < r
    return first, jnp.where(first, r, m - 1 - r), jnp.where(first, n, n - r)


def _in_order_forward(q, k, v, qp, qsg, kp, ksg, spec: Spec, vma):
    """`_forward` for rows in which every key a query sees comes before it in the sequence
    (``spec.in_order``: documents packed one after another, each in order). Nothing above the
    diagonal is visible then, so the schedule is fixed when tracing, with no conditional (the
    general path has one per piece and layer; `_if_in_order` has the one that chose this):
    each diagonal piece (`PIECE` tokens a side) is
    one cuDNN call under its causal mask and the pieces' mask as a bias, and every piece below
    the diagonal one call with the bias. Query pieces go two at a time (`_paired`: rows ``r``
    and ``m-1-r``, ``m - 1`` pieces below the diagonal between them), each summed in float32
    and stored in the input dtype: no float32 output the size of the row. Pieces that see
    nothing are computed anyway: the calls do the work of one causal call over the row;
    unless ``spec.reach`` (no query looks back further) bounds the key pieces a query piece
    can see to a band of the last few (`_band`): then each row's band only."""
    fwd, _ = _kernels(spec)
    (qp, qsg, kp, ksg), (q, k, v) = _tied((qp, qsg, kp, ksg), (q, k, v))
    m = _split_count(q.shape[1], k.shape[1])
    t = q.shape[1] // m

    def call(i, j, causal, dtype=F32):
        qi, qpi, qsgi = (_piece(x, i, t) for x in (q, qp, qsg))
        kj, vj, kpj, ksgj = (_piece(x, j, t) for x in (k, v, kp, ksg))
        seen = _visible(qpi, qsgi, kpj, ksgj, True)
        return _call_fwd(fwd, qi, kj, vj, causal, spec, dtype, seen)

    if m == 1:
        return call(0, 0, True, q.dtype)
    b, sq, h, d = q.shape
    acc = (full((b, sq, h, d), 0.0, q.dtype, vma), full((b, h, sq), -jnp.inf, F32, vma))
    band = _band(spec.reach, t, m)
    if band is not None:  # each query piece and the `band` key pieces before it

        def row(i, acc):
            def below(n, part):
                j = i - 1 - n
                merged = _merge(*part, *call(i, jnp.maximum(j, 0), False))
                return jax.tree.map(lambda x, y: jnp.where(j >= 0, x, y), merged, part)

            return _set_rows(acc, i, lax.fori_loop(0, band, below, call(i, i, True)))

        return lax.fori_loop(0, m, row, acc)

    def rows(r, acc):
        a, b = r, m - 1 - r

        def below(n, parts):
            first, i, j = _paired(r, n, m)
            part = call(i, j, False)
            merged = [_merge(*p, *part) for p in parts]
            pick = lambda x, y: jnp.where(first, x, y)  # noqa: E731
            return (
                jax.tree.map(pick, merged[0], parts[0]),
                jax.tree.map(pick, parts[1], merged[1]),
            )

        parts = lax.fori_loop(0, m - 1, below, (call(a, a, True), call(b, b, True)))
        return _set_rows(_set_rows(acc, a, parts[0]), b, parts[1])

    return lax.fori_loop(0, m // 2, rows, acc)


def _in_order_backward(q, k, v, out, lse, dout, qp, qsg, kp, ksg, spec: Spec, vma):
    """`_backward` for `_in_order_forward`'s schedule: the same calls, each with the global
    output and log-sum-exp of its queries. Key pieces go two at a time (`_paired`: columns
    ``m-1-r`` and ``r``, read from the right, ``m - 1`` pieces below the diagonal between
    them), their dK, dV summed in float32 and stored in the input dtype; only dQ is carried
    whole in float32 (as the general path's `_fold_by_keys`)."""
    _, bwd = _kernels(spec)
    (qp, qsg, kp, ksg), (q, k, v, out, dout) = _tied((qp, qsg, kp, ksg), (q, k, v, out, dout))
    m = _split_count(q.shape[1], k.shape[1])
    t = q.shape[1] // m

    def call(i, j, causal, dtype=F32):
        qi, oi, doi, qpi, qsgi = (_piece(x, i, t) for x in (q, out, dout, qp, qsg))
        kj, vj, kpj, ksgj = (_piece(x, j, t) for x in (k, v, kp, ksg))
        seen = _visible(qpi, qsgi, kpj, ksgj, True)
        lse_i = _piece(lse, i, t, axis=2)
        return _call_bwd(bwd, qi, kj, vj, oi, lse_i, doi, causal, spec, dtype, seen)

    if m == 1:
        return call(0, 0, True, q.dtype)

    zeros_kv = full(k.shape, 0.0, k.dtype, vma)
    grads = (full(q.shape, 0.0, F32, vma), zeros_kv, zeros_kv)
    band = _band(spec.reach, t, m)
    if band is not None:  # each key piece and the `band` query pieces after it

        def column(j, grads):
            dq, dk, dv = grads
            gq, gk, gv = call(j, j, True)

            def below(n, carry):
                dq, kv = carry
                i = j + 1 + n
                live = i < m
                gq, gk, gv = call(jnp.minimum(i, m - 1), j, False)
                keep = lambda g: jnp.where(live, g, 0.0)  # noqa: E731
                dq = _add_piece(dq, jnp.minimum(i, m - 1), keep(gq))
                return dq, (kv[0] + keep(gk), kv[1] + keep(gv))

            dq, kv = lax.fori_loop(0, band, below, (_add_piece(dq, j, gq), (gk, gv)))
            return dq, _put_piece(dk, j, kv[0]), _put_piece(dv, j, kv[1])

        dq, dk, dv = lax.fori_loop(0, m, column, grads)
        return dq.astype(q.dtype), dk, dv

    def columns(r, grads):
        # Column c, read from the right (c' = m-1-c), has c' pieces below the diagonal: the
        # columns m-1-r and r are `_paired`'s lines r and m-1-r.
        a, b = m - 1 - r, r
        dq, dk, dv = grads

        def diagonal(dq, j):
            gq, gk, gv = call(j, j, True)
            return _add_piece(dq, j, gq), (gk, gv)

        dq, kv_a = diagonal(dq, a)
        dq, kv_b = diagonal(dq, b)

        def below(n, carry):
            dq, kv_a, kv_b = carry
            first, line, along = _paired(r, n, m)
            j = m - 1 - line  # the column
            i = j + 1 + along  # the query piece: the column's pieces below the diagonal, in order
            gq, gk, gv = call(i, j, False)
            pick = lambda x, y: jnp.where(first, x, y)  # noqa: E731
            kv_a = jax.tree.map(lambda x, g: pick(x + g, x), kv_a, (gk, gv))
            kv_b = jax.tree.map(lambda x, g: pick(x, x + g), kv_b, (gk, gv))
            return _add_piece(dq, i, gq), kv_a, kv_b

        dq, kv_a, kv_b = lax.fori_loop(0, m - 1, below, (dq, kv_a, kv_b))
        dk = _put_piece(_put_piece(dk, a, kv_a[0]), b, kv_b[0])
        dv = _put_piece(_put_piece(dv, a, kv_a[1]), b, kv_b[1])
        return dq, dk, dv

    dq, dk, dv = lax.fori_loop(0, m // 2, columns, grads)
    return dq.astype(q.dtype), dk, dv


__all__ = []
