"""`attention_core` and its VJP: the schedule for any positions and segment ids (every pair
classified at run time, a general one cut into pieces, folded over the ring's steps), or one of
`lwm.attention.cudnn.ordered`'s where the caller's `Spec` allows."""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
from jax import lax

from lwm.attention._common import (
    axis_size,
    full,
    union_vma,
)
from lwm.attention.blocks import F32, Spec
from lwm.attention.cudnn.kernels import (
    _call_bwd,
    _call_fwd,
    _kernels,
)
from lwm.attention.cudnn.ordered import (
    _if_in_order,
    _in_order,
    _in_order_backward,
    _in_order_forward,
    _known_order,
    _ordered_backward,
    _ordered_forward,
)
from lwm.attention.cudnn.pairs import (
    _add_piece,
    _merge,
    _num_pieces,
    _piece,
    _put_piece,
    _run_pair,
    _send,
    _set_rows,
    _split_count,
)


def _pair_fwd(q, k, v, qp, qsg, kp, ksg, spec: Spec, vma, split: bool = True, dtype=F32):
    """Output (``[b, t, h, d]`` in ``dtype``: float32 where pairs are combined, the input's
    where this pair is the whole attention) and log-sum-exp (float32 ``[b, h, t]``, -inf where
    nothing is visible) of one pair. A general pair longer than `PIECE` is cut into pieces
    (``split``); a shorter one, or a piece, is classified exactly and runs as one cuDNN call,
    with its mask as a bias where the index mask cannot express it."""
    fwd, _ = _kernels(spec)
    b, t, h, d = q.shape
    pieces = split and _split_count(t, k.shape[1]) > 1

    def dead(*_):
        return full((b, t, h, d), 0.0, dtype, vma), full((b, h, t), -jnp.inf, F32, vma)

    def on_cudnn(causal, masked=False):
        def run(q, k, v, qp, qsg, kp, ksg, seen):
            return _call_fwd(fwd, q, k, v, causal, spec, dtype, seen if masked else None)

        return run

    def general(*operands):
        return _split_fwd(*operands[:-1], spec, vma, dtype)  # the last: no mask when cut

    operands = (q, k, v, qp, qsg, kp, ksg)
    return _run_pair(pieces, dead, on_cudnn, general, spec, (qp, qsg, kp, ksg), operands)


def _fold_fwd(q, k, v, qp, qsg, kp, ksg, acc, m: int, spec: Spec, vma):
    """Fold the driver's (query piece, key piece) pairs, ``m`` pieces a side, into its float32
    ``acc`` = (output, log-sum-exp) of the queries, carried over ring steps (a general pair is
    cut further: `_split_fwd`)."""
    t, s = q.shape[1] // m, k.shape[1] // m

    def q_step(i, acc):
        qi = (_piece(q, i, t), _piece(qp, i, t), _piece(qsg, i, t))

        def k_step(j, carry):
            kj = [_piece(x, j, s) for x in (k, v, kp, ksg)]
            pair = _pair_fwd(qi[0], kj[0], kj[1], qi[1], qi[2], kj[2], kj[3], spec, vma)
            return _merge(*carry, *pair)

        carry = (_piece(acc[0], i, t), _piece(acc[1], i, t, axis=2))
        return _set_rows(acc, i, lax.fori_loop(0, m, k_step, carry))

    return lax.fori_loop(0, m, q_step, acc)


def _fold_by_queries(q, m: int, pair, dtype, vma):
    """Output (in ``dtype``) and float32 log-sum-exp of pieces, ``m`` a side, folded with
    query pieces outside: each query piece starts from nothing in float32, folds ``pair(i,
    j)`` (float32 output, log-sum-exp) of every key piece and is stored in ``dtype``: no
    float32 output the size of the whole. (The loops' trip counts are static: XLA's GPU while
    loop with a run-time trip count reads its condition on the host every iteration.)"""
    b, sq, h, d = q.shape
    t = sq // m

    def q_step(i, acc):
        carry = (full((b, t, h, d), 0.0, F32, vma), full((b, h, t), -jnp.inf, F32, vma))
        return _set_rows(acc, i, lax.fori_loop(0, m, lambda j, c: _merge(*c, *pair(i, j)), carry))

    acc = (full((b, sq, h, d), 0.0, dtype, vma), full((b, h, sq), -jnp.inf, F32, vma))
    return lax.fori_loop(0, m, q_step, acc)


def _split_fwd(q, k, v, qp, qsg, kp, ksg, spec: Spec, vma, dtype):
    """`_pair_fwd` of a general pair, piece by piece, its output in ``dtype``."""
    m = _split_count(q.shape[1], k.shape[1])
    t, s = q.shape[1] // m, k.shape[1] // m

    def pair(i, j):
        qi, qpi, qsgi = (_piece(x, i, t) for x in (q, qp, qsg))
        kj, vj, kpj, ksgj = (_piece(x, j, s) for x in (k, v, kp, ksg))
        return _pair_fwd(qi, kj, vj, qpi, qsgi, kpj, ksgj, spec, vma, split=False)

    return _fold_by_queries(q, m, pair, dtype, vma)


def _pair_bwd(
    q, k, v, out, lse, dout, qp, qsg, kp, ksg, spec: Spec, vma, split: bool = True, dtype=F32
):
    """This pair's parts of dQ, dK, dV (in ``dtype``, as `_pair_fwd`'s output), from the global
    output and log-sum-exp."""
    _, bwd = _kernels(spec)
    pieces = split and _split_count(q.shape[1], k.shape[1]) > 1

    def dead(q, k, *_):
        return (
            full(q.shape, 0.0, dtype, vma),
            full(k.shape, 0.0, dtype, vma),
            full(k.shape, 0.0, dtype, vma),
        )

    def on_cudnn(causal, masked=False):
        def run(q, k, v, out, lse, dout, qp, qsg, kp, ksg, seen):
            operands = (q, k, v, out, lse, dout, causal, spec, dtype)
            return _call_bwd(bwd, *operands, seen if masked else None)

        return run

    def general(*operands):
        grads = _split_bwd(*operands[:-1], spec, vma, dtype)  # the last: no mask when cut
        return tuple(g.astype(dtype) for g in grads)

    operands = (q, k, v, out, lse, dout, qp, qsg, kp, ksg)
    return _run_pair(pieces, dead, on_cudnn, general, spec, (qp, qsg, kp, ksg), operands)


def _fold_bwd(q, k, v, out, lse, dout, qp, qsg, kp, ksg, grads, m: int, spec, vma):
    """Add the driver's (query piece, key piece) pairs' dQ, dK, dV, ``m`` pieces a side, into
    its float32 ``grads`` (a general pair is cut further: `_split_bwd`)."""
    t, s = q.shape[1] // m, k.shape[1] // m

    def q_step(i, grads):
        dq, dk, dv = grads
        qi = [_piece(x, i, t) for x in (q, out, dout, qp, qsg)]
        lse_i = _piece(lse, i, t, axis=2)

        def k_step(j, carry):
            dq_i, dk, dv = carry
            kj, vj, kpj, ksgj = (_piece(x, j, s) for x in (k, v, kp, ksg))
            gq, gk, gv = _pair_bwd(
                qi[0], kj, vj, qi[1], lse_i, qi[2], qi[3], qi[4], kpj, ksgj, spec, vma
            )
            return dq_i + gq, _add_piece(dk, j, gk), _add_piece(dv, j, gv)

        dq_i, dk, dv = lax.fori_loop(0, m, k_step, (_piece(dq, i, t), dk, dv))
        return _put_piece(dq, i, dq_i), dk, dv

    return lax.fori_loop(0, m, q_step, grads)


def _fold_by_keys(q, k, m: int, pair, dtype, vma):
    """dQ, dK, dV of pieces, ``m`` a side, folded with key pieces outside: only dQ is carried
    whole in float32; each key piece's dK, dV are summed over the query pieces in float32 and
    stored in ``dtype``. ``pair(i, j)``: float32 dQ, dK, dV of a piece. (dQ, dK, dV all whole
    in float32 would take three times the memory where there are as many key heads as query
    heads.)"""
    s = k.shape[1] // m

    def k_step(j, grads):
        dq, dk, dv = grads
        zeros = full((k.shape[0], s, *k.shape[2:]), 0.0, F32, vma)

        def q_step(i, carry):
            dq, dk_j, dv_j = carry
            gq, gk, gv = pair(i, j)
            return _add_piece(dq, i, gq), dk_j + gk, dv_j + gv

        dq, dk_j, dv_j = lax.fori_loop(0, m, q_step, (dq, zeros, zeros))
        return dq, _put_piece(dk, j, dk_j), _put_piece(dv, j, dv_j)

    zeros_kv = full(k.shape, 0.0, dtype, vma)
    return lax.fori_loop(0, m, k_step, (full(q.shape, 0.0, F32, vma), zeros_kv, zeros_kv))


def _split_bwd(q, k, v, out, lse, dout, qp, qsg, kp, ksg, spec: Spec, vma, dtype):
    """`_pair_bwd` of a general pair, piece by piece (dK, dV in ``dtype``, dQ in float32)."""
    m = _split_count(q.shape[1], k.shape[1])
    t, s = q.shape[1] // m, k.shape[1] // m

    def pair(i, j):
        qi, oi, doi, qpi, qsgi = (_piece(x, i, t) for x in (q, out, dout, qp, qsg))
        kj, vj, kpj, ksgj = (_piece(x, j, s) for x in (k, v, kp, ksg))
        lse_i = _piece(lse, i, t, axis=2)
        return _pair_bwd(qi, kj, vj, oi, lse_i, doi, qpi, qsgi, kpj, ksgj, spec, vma, split=False)

    return _fold_by_keys(q, k, m, pair, dtype, vma)


def _forward(q, k, v, qp, kp, qsg, ksg, spec: Spec, axis_name):
    if _known_order(spec, axis_name):
        return _ordered_forward(q, k, v, spec, axis_name)
    vma = union_vma((q, k, v, qp, kp, qsg, ksg))
    if _in_order(spec, axis_name, q.shape[1], k.shape[1]):

        def general(q, k, v, qp, qsg, kp, ksg):
            return _pair_fwd(q, k, v, qp, qsg, kp, ksg, spec, vma, dtype=q.dtype)

        def in_order(q, k, v, qp, qsg, kp, ksg):
            return _in_order_forward(q, k, v, qp, qsg, kp, ksg, spec, vma)

        return _if_in_order(in_order, general, spec.reach, q, k, v, qp, qsg, kp, ksg)
    n = axis_size(axis_name)
    m = _num_pieces(axis_name, q.shape[1], k.shape[1])
    if n == 1 and m == 1:  # one pair is the whole attention: no float32 accumulator
        return _pair_fwd(q, k, v, qp, qsg, kp, ksg, spec, vma, dtype=q.dtype)
    b, sq, h, d = q.shape
    acc = (full((b, sq, h, d), 0.0, F32, vma), full((b, h, sq), -jnp.inf, F32, vma))

    def fold(kv, acc):
        return _fold_fwd(q, kv[0], kv[1], qp, qsg, kv[2], kv[3], acc, m, spec, vma)

    kv = (k, v, kp, ksg)
    if n > 1:

        def step(carry, _):
            kv, acc = carry
            incoming = _send(kv, axis_name, n)
            return (incoming, fold(kv, acc)), None

        (kv, acc), _ = lax.scan(step, (kv, acc), None, length=n - 1)
    out, lse = fold(kv, acc)
    return out.astype(q.dtype), lse


def _backward(res, dout, spec: Spec, axis_name):
    if _known_order(spec, axis_name):
        return _ordered_backward(res, dout, spec, axis_name)
    q, k, v, qp, kp, qsg, ksg, out, lse = res
    vma = union_vma(jax.tree.leaves(res))
    operands = (q, k, v, out, lse, dout, qp, qsg, kp, ksg)

    def general(*operands):  # one pair: its gradients are the whole ones, in the input dtype
        dq, dk, dv = _pair_bwd(*operands, spec, vma, dtype=q.dtype)
        return dq, dk.astype(k.dtype), dv.astype(v.dtype)

    if _in_order(spec, axis_name, q.shape[1], k.shape[1]):

        def in_order(*operands):
            return _in_order_backward(*operands, spec, vma)

        return _if_in_order(in_order, general, spec.reach, *operands)
    n = axis_size(axis_name)
    m = _num_pieces(axis_name, q.shape[1], k.shape[1])
    if n == 1 and m == 1:
        return general(*operands)

    def fold(kv, dq, dk, dv):
        k, v, kp, ksg = kv
        grads = (dq, dk, dv)
        return _fold_bwd(q, k, v, out, lse, dout, qp, qsg, kp, ksg, grads, m, spec, vma)

    dq = full(q.shape, 0.0, F32, vma)
    zeros_kv = full(k.shape, 0.0, F32, vma)
    kv = (k, v, kp, ksg)
    if n > 1:

        def step(carry, _):
            kv, dq, dk, dv = carry
            incoming = _send(kv, axis_name, n)
            dq, dk, dv = fold(kv, dq, dk, dv)
            return (incoming, dq, *_send((dk, dv), axis_name, n)), None

        (kv, dq, dk, dv), _ = lax.scan(step, (kv, dq, zeros_kv, zeros_kv), None, length=n - 1)
        dq, dk, dv = fold(kv, dq, dk, dv)
        dk, dv = _send((dk, dv), axis_name, n)
    else:
        dq, dk, dv = fold(kv, dq, zeros_kv, zeros_kv)
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)


@partial(jax.custom_vjp, nondiff_argnums=(7, 8))
def attention_core(q, k, v, q_pos, kv_pos, q_seg, kv_seg, spec: Spec, axis_name: str | None):
    """`lwm.attention.blockwise.attention_core` with cuDNN's kernels (same arguments)."""
    return _forward(q, k, v, q_pos, kv_pos, q_seg, kv_seg, spec, axis_name)[0]


def _core_fwd(q, k, v, q_pos, kv_pos, q_seg, kv_seg, spec, axis_name):
    out, lse = _forward(q, k, v, q_pos, kv_pos, q_seg, kv_seg, spec, axis_name)
    return out, (q, k, v, q_pos, kv_pos, q_seg, kv_seg, out, lse)


def _core_bwd(spec, axis_name, res, dout):
    dq, dk, dv = _backward(res, dout, spec, axis_name)
    return dq, dk, dv, None, None, None, None


attention_core.defvjp(_core_fwd, _core_bwd)

__all__ = ["attention_core"]
