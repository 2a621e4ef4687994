"""cuDNN's fused flash attention as the block kernel of blockwise and ring attention
(``model.attention_kernel: cudnn``; ``auto`` picks it on NVIDIA GPUs).

cuDNN masks by index (causal or nothing) or by an additive bias, while our masks come from
positions and segment ids. So the local shard is cut into pieces (its two zigzag halves under
ring attention, the whole shard on one device) and each (query piece, key piece) pair of a ring
step is classified at run time from its positions and segment ids (`pair_kind`):

- ``DEAD``: nothing visible, skipped;
- ``FULL``: everything visible: one cuDNN call without a mask;
- ``CAUSAL``: exactly cuDNN's causal mask (the zigzag layout's diagonal pairs of one
  document): one cuDNN call with it;
- ``GENERAL`` (a pair longer than `PIECE` tokens, classified from its ranges of positions and
  segment ids): cut into pieces of at most `PIECE` tokens on each side, each classified
  exactly, from its whole mask;
- ``MASKED_CAUSAL`` (a piece, or a short pair, whose mask lies within cuDNN's causal one:
  documents packed in order) and ``MASKED`` (anything else): one cuDNN call with the mask as a
  bias (0 or a large negative number), under its causal mask for the former so that it skips
  the blocks above the diagonal. A query that sees nothing in the piece gets nothing from it.

So the result equals `dense_attention` for any positions and segment ids, and every live pair
or piece is one cuDNN call: a row of one document makes one per pair (as large as cuDNN alone
would make on that shard); rows packed with documents, one per piece. The pairs' outputs are
combined with their float32 log-sum-exps, as the ring combines chunks.

Each of those choices is a conditional, and on a GPU the device idles while the host reads its
predicate (1-2 ms per fwd+bwd call at 8K on an H200, more than the kernels' own gap to cuDNN;
docs/benchmarks.md). So when the caller gives no positions and no segment ids (``Spec.order``:
one document in a contiguous or zigzag order), every call is scheduled when tracing
(`_ordered_forward`): nothing is decided at run time. On one device, when the caller says that
every key a query sees comes before it (``in_order``: documents packed one after another), one
thing is decided per call, whether that holds (`_if_in_order`), and then every call is
scheduled when tracing (`_in_order_forward`), at the price of computing every piece below the
diagonal, or, told how far back any query looks (``reach``), each piece's band of them.

Backward: JAX's own cuDNN rule is for one call; it drops the log-sum-exp's cotangent, so autodiff
through the combine would be wrong. This module has its own VJP (as ring-flash-attention does
with flash-attn): every live pair calls cuDNN's backward kernel with the **global** output and
log-sum-exp of its queries, which makes each pair's dQ, dK, dV exact parts of the total; dK and
dV travel around the ring with their chunk, as in `lwm.attention.blockwise`.

The forward and backward kernels are reached through ``jax._src.cudnn.fused_attention_stablehlo``
(private: `dot_product_attention(..., return_residual=True)` for the float32 statistics, which
the public `jax.nn.dot_product_attention` rounds to the input dtype, and the backward
primitive, which the public API only reaches through its own VJP). Off a GPU, or with
``emulate``, both kernels are replaced by a dense float32 computation with cuDNN's conventions
(output in the input dtype, log-sum-exp ``[batch, heads, q]`` in float32): how the tests check
everything around the kernels on a CPU.
"""

from __future__ import annotations

import logging
from functools import partial

import jax
import jax.numpy as jnp
from jax import lax

from lwm.attention._common import (
    DEAD,
    FULL,
    attention_mask,
    axis_size,
    block_kind,
    full,
    keys_precede_queries,
    look_back,
    make_varying,
    union_vma,
)
from lwm.attention.blocks import F32, Spec

log = logging.getLogger(__name__)

# pair kinds besides DEAD (0) and FULL (2); MASKED*: one cuDNN call with the mask as a bias
CAUSAL, GENERAL, MASKED_CAUSAL, MASKED = 3, 4, 5, 6
DTYPES = (jnp.bfloat16, jnp.float16)


# -- what cuDNN takes --------------------------------------------------------------------------


def unsupported(q: jax.Array, k: jax.Array) -> str | None:
    """Why cuDNN's flash attention cannot run these inputs on this GPU, or None if it can."""
    if q.dtype not in DTYPES:
        return f"dtype {q.dtype} (cuDNN's flash attention takes bfloat16 or float16)"
    d = q.shape[-1]
    if d % 8 or d > 256:
        return f"head_dim {d} (cuDNN needs a multiple of 8, at most 128 before Hopper, 256 on)"
    if k.dtype != q.dtype:
        return f"keys in {k.dtype} and queries in {q.dtype}"
    try:
        from jax._src.cudnn import fused_attention_stablehlo as fa

        version = fa.check_cudnn_version()
        if d > 128 and not fa.check_compute_capability("9.0"):
            return f"head_dim {d} before Hopper"
    except Exception as e:  # no cuDNN in this jaxlib, or not a CUDA backend
        return f"cuDNN is not available ({e})"
    if version < 8904:
        return f"cuDNN {version} (flash attention needs 8.9.4 or later)"
    return None


_logged: set[str] = set()


def log_fallback(reason: str) -> None:
    """One log line per reason: the XLA block kernel runs instead of cuDNN."""
    if reason not in _logged:
        _logged.add(reason)
        log.warning("attention_kernel cudnn: falling back to the XLA block kernel for %s", reason)


# -- the two kernels: cuDNN's, or a dense float32 stand-in with its conventions ----------------


def _negative(dtype) -> int:
    """What a masked-out score gets added: JAX's own choice for cuDNN
    (`fused_attention_stablehlo.get_large_negative_number`), finite because cuDNN mishandles
    the difference of two infinities; float16's is the largest it holds."""
    return -(2 << 14) if jnp.dtype(dtype) == jnp.float16 else -(2 << 40)


def _cudnn_fwd(q, k, v, causal: bool, scale: float, bias=None):
    from jax._src.cudnn import fused_attention_stablehlo as fa

    mask = fa.MaskType.CAUSAL if causal else fa.MaskType.NO_MASK
    out, lse = fa.dot_product_attention(
        q, k, v, bias, scale=scale, mask_type=mask, qkv_layout="BTNH", return_residual=True
    )
    return out, lse


def _cudnn_bwd(q, k, v, out, lse, dout, causal: bool, scale: float, bias=None):
    from jax._src.cudnn import fused_attention_stablehlo as fa

    mask = fa.MaskType.CAUSAL if causal else fa.MaskType.NO_MASK
    unused = jnp.zeros(0, q.dtype)
    dq, dk, dv = fa._dot_product_attention_bwd_p_wrapper.bind(
        q, k, v, unused if bias is None else bias, *([unused] * 6), lse, out, dout,
        scale=scale, seed=42, dropout_rate=0.0, variadic_args=(bias is not None, False),
        mask_type=mask, layout=fa.AttentionLayout.BTNH.value, sliding_window_length=None,
    )  # fmt: skip
    return dq, dk, dv


def _emulated_scores(q, k, causal: bool, scale: float, bias=None):
    b, t, h, d = q.shape
    kvh = k.shape[2]
    qf = q.astype(F32).reshape(b, t, kvh, h // kvh, d)
    s = jnp.einsum("btkgd,bskd->bkgts", qf, k.astype(F32)) * scale
    if bias is not None:  # [b, 1, t, s]: added to the scaled scores, as cuDNN adds it
        s = s + bias.astype(F32)[:, :, None]
    if causal:
        s = jnp.where(jnp.tril(jnp.ones((t, k.shape[1]), bool)), s, -jnp.inf)
    return s


def _emulated_fwd(q, k, v, causal: bool, scale: float, bias=None):
    b, t, h, d = q.shape
    s = _emulated_scores(q, k, causal, scale, bias)
    lse = jax.nn.logsumexp(s, axis=-1)  # [b, kvh, g, t]
    p = jnp.exp(s - lse[..., None])
    out = jnp.einsum("bkgts,bskd->btkgd", p, v.astype(F32)).reshape(b, t, h, d)
    return out.astype(q.dtype), lse.reshape(b, h, t)


def _emulated_bwd(q, k, v, out, lse, dout, causal: bool, scale: float, bias=None):
    b, t, h, d = q.shape
    kvh = k.shape[2]
    g = h // kvh
    s = _emulated_scores(q, k, causal, scale, bias)
    p = jnp.exp(s - lse.reshape(b, kvh, g, t)[..., None])
    do = dout.astype(F32).reshape(b, t, kvh, g, d)
    delta = jnp.sum(do * out.astype(F32).reshape(b, t, kvh, g, d), axis=-1)  # [b, t, kvh, g]
    dp = jnp.einsum("btkgd,bskd->bkgts", do, v.astype(F32))
    ds = p * (dp - delta.transpose(0, 2, 3, 1)[..., None]) * scale
    dq = jnp.einsum("bkgts,bskd->btkgd", ds, k.astype(F32)).reshape(b, t, h, d)
    qf = q.astype(F32).reshape(b, t, kvh, g, d)
    dk = jnp.einsum("bkgts,btkgd->bskd", ds, qf)
    dv = jnp.einsum("bkgts,btkgd->bskd", p, do)
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)


def _kernels(spec: Spec):
    return (_emulated_fwd, _emulated_bwd) if spec.interpret else (_cudnn_fwd, _cudnn_bwd)


# -- which pairs go to cuDNN, and how ------------------------------------------------------------


def _contiguous(pos: jax.Array) -> jax.Array:
    return jnp.all(pos == pos[:, :1] + jnp.arange(pos.shape[1], dtype=pos.dtype))


def _one_segment(seg: jax.Array | None) -> jax.Array | bool:
    return True if seg is None else jnp.all(seg == seg[:, :1])


def _visible(qp, qsg, kp, ksg, causal: bool) -> jax.Array:
    """Which keys each query sees, ``[batch, q, kv]`` (all True where nothing masks)."""
    seen = attention_mask(qp, kp, qsg, ksg, causal)
    return jnp.ones((qp.shape[0], qp.shape[1], kp.shape[1]), bool) if seen is None else seen


def _exact_kind(qp, qsg, kp, ksg, causal: bool):
    """`pair_kind` from the pair's whole mask, and that mask ``[batch, q, kv]`` (None with a
    Python `FULL`, where nothing can be masked)."""
    if block_kind(qp, kp, qsg, ksg, causal) is FULL:
        return FULL, None
    seen = _visible(qp, qsg, kp, ksg, causal)
    t, s = seen.shape[1:]
    lower = jnp.tri(t, s, dtype=bool)  # cuDNN's causal mask (by index)
    is_lower = jnp.all(seen == lower) if t == s else False
    under = ~jnp.any(seen & ~lower) if t == s else False
    conditions = [~jnp.any(seen), jnp.all(seen), is_lower, under]
    kind = jnp.select(conditions, [DEAD, FULL, CAUSAL, MASKED_CAUSAL], MASKED)
    return kind.astype(jnp.int32), seen


def pair_kind(qp, qsg, kp, ksg, causal: bool, exact: bool = False):
    """How a (query piece, key piece) pair is computed (see the module docstring), as an int32
    scalar (or a Python `FULL` when nothing can be masked). Positions ``[batch, len]``,
    segment ids the same or None. ``exact``: from the pair's whole mask (`DEAD`, `FULL`,
    `CAUSAL`, `MASKED_CAUSAL` or `MASKED`; for pieces, whose mask is small), else from its
    ranges of positions and segment ids (`DEAD`, `FULL`, `CAUSAL` or `GENERAL`)."""
    if exact:
        return _exact_kind(qp, qsg, kp, ksg, causal)[0]
    kind = block_kind(qp, kp, qsg, ksg, causal)
    if kind is FULL:
        return FULL
    if causal and qp.shape[1] == kp.shape[1]:
        same_doc = _one_segment(qsg) & _one_segment(ksg)
        if qsg is not None:
            same_doc = same_doc & jnp.all(qsg[:, :1] == ksg[:, :1])
        diagonal = same_doc & _contiguous(qp) & jnp.all(qp[:, :1] == kp[:, :1]) & _contiguous(kp)
    else:
        diagonal = False
    return jnp.where(
        kind == DEAD,
        DEAD,
        jnp.where(kind == FULL, FULL, jnp.where(diagonal, CAUSAL, GENERAL)),
    ).astype(jnp.int32)


def _switch(kind, branches: dict, *operands):
    """Run ``branches[kind]`` (a dict from kind to function of ``operands``)."""
    if kind is FULL:
        return branches[FULL](*operands)
    kinds = list(branches)
    index = jnp.select([kind == c for c in kinds[:-1]], list(range(len(kinds) - 1)), len(kinds) - 1)
    index, operands = _tied(index.astype(jnp.int32), operands)
    return lax.switch(index, [branches[c] for c in kinds], *operands)


def _tied(positional, operands):
    """``positional`` (what depends on positions and segment ids alone) and ``operands`` (this
    layer's q, k, v, ...) through one optimization barrier. Otherwise JAX, differentiating a
    `lax.scan` over layers, hoists out of the scan whatever of a pair depends on positions
    alone (a pair's kind, so its switch, and in each branch its constants and masks), and the
    pieces of a pair stack theirs: temporaries quadratic in the sequence (34 GiB for 4 layers
    at 8K from the masks; later 100 GiB for the 1.14B model at 128K from every piece's zeros;
    `scripts/probe_cudnn_memory.py`, docs/benchmarks.md)."""
    return lax.optimization_barrier((positional, operands))


def _mask_bias(seen: jax.Array, dtype):
    """cuDNN's additive mask ``[batch, 1, q, kv]`` for the mask ``seen`` (0 where visible)."""
    bias = jnp.where(seen, jnp.asarray(0, dtype), jnp.asarray(_negative(dtype), dtype))
    return bias[:, None]


def _run_pair(pieces: bool, dead, on_cudnn, general, spec: Spec, positions, operands):
    """Classify a pair from ``positions`` = (qp, qsg, kp, ksg) (exactly, unless it is cut into
    ``pieces``) and run its branch on ``operands`` and then the pair's mask (None unless it
    was classified exactly): ``dead``, ``on_cudnn(causal, masked=False)`` or ``general`` (the
    pieces)."""
    branches = {DEAD: dead, CAUSAL: on_cudnn(True), FULL: on_cudnn(False)}
    if pieces:
        branches[GENERAL] = general
        kind, seen = pair_kind(*positions, spec.causal), None
    else:
        branches |= {MASKED_CAUSAL: on_cudnn(True, True), MASKED: on_cudnn(False, True)}
        kind, seen = _exact_kind(*positions, spec.causal)
    return _switch(kind, branches, *operands, seen)


def _call_fwd(fwd, q, k, v, causal: bool, spec: Spec, dtype, seen=None):
    """One cuDNN forward call: output in ``dtype`` and float32 log-sum-exp; with ``seen`` (the
    mask ``[batch, q, kv]``) as a bias, and a query that sees nothing gets nothing (cuDNN
    averages such a row): output 0, log-sum-exp -inf, as everywhere else."""
    bias = None if seen is None else _mask_bias(seen, q.dtype)
    out, lse = fwd(q, k, v, causal, spec.scale, bias)
    out, lse = out.astype(dtype), lse.astype(F32)
    if seen is not None:
        rows = jnp.any(seen, axis=-1)
        out = jnp.where(rows[:, :, None, None], out, 0.0).astype(dtype)
        lse = jnp.where(rows[:, None, :], lse, -jnp.inf)
    return out, lse


def _call_bwd(bwd, q, k, v, out, lse, dout, causal: bool, spec: Spec, dtype, seen=None):
    """One cuDNN backward call (dQ, dK, dV in ``dtype``) from the global output and
    log-sum-exp; ``seen`` as in `_call_fwd`."""
    bias = None
    if seen is not None:
        bias = _mask_bias(seen, q.dtype)
        # A query that sees nothing at all (padding) has -inf: make its weights 0, not NaN
        # (its output and cotangent are 0, so it adds nothing).
        lse = jnp.where(jnp.isneginf(lse), jnp.finfo(F32).max, lse)
    grads = bwd(q, k, v, out, lse, dout, causal, spec.scale, bias)
    return tuple(g.astype(dtype) for g in grads)


# -- one pair: forward and backward ------------------------------------------------------------


PIECE = 4096  # a general pair is cut into pieces of at most this many tokens (`_split_count`)


def _split_count(q_len: int, kv_len: int) -> int:
    """Into how many pieces a general pair is cut on each side: halved until a piece is at most
    `PIECE` tokens (1: the pair is classified exactly, whole)."""
    m = 1
    while q_len // m > PIECE and q_len % (2 * m) == 0 and kv_len % (2 * m) == 0:
        m *= 2
    return m


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


def _set_rows(acc, i, part):
    """``acc`` = (output ``[b, t, h, d]``, log-sum-exp ``[b, h, t]``) with query piece ``i``
    replaced by ``part`` (the same of the piece's queries; output cast to ``acc``'s dtype)."""
    return _put_piece(acc[0], i, part[0]), _put_piece(acc[1], i, part[1], axis=2)


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


# -- the driver: pieces, ring steps, custom VJP ------------------------------------------------


def _piece(x: jax.Array | None, i, size: int, axis: int = 1) -> jax.Array | None:
    """Piece ``i`` (traced) of ``size`` tokens along ``axis``; None stays None."""
    return None if x is None else lax.dynamic_slice_in_dim(x, i * size, size, axis=axis)


def _put_piece(acc: jax.Array, i, part: jax.Array, axis: int = 1) -> jax.Array:
    """``acc`` with piece ``i`` (of ``part``'s size along ``axis``) replaced by ``part``, cast
    to ``acc``'s dtype."""
    size = part.shape[axis]
    return lax.dynamic_update_slice_in_dim(acc, part.astype(acc.dtype), i * size, axis)


def _add_piece(acc: jax.Array, i, part: jax.Array, axis: int = 1) -> jax.Array:
    return _put_piece(acc, i, _piece(acc, i, part.shape[axis], axis) + part, axis)


def _num_pieces(axis_name: str | None, q_len: int, kv_len: int) -> int:
    """Pieces per shard at the first level: its two zigzag halves under ring attention (each
    half is one contiguous run of the sequence), the whole shard on one device."""
    ring = axis_name is not None and lax.axis_size(axis_name) > 1
    return 2 if ring and q_len % 2 == 0 and kv_len % 2 == 0 else 1


def _merge(out, lse, out2, lse2):
    new = jnp.logaddexp(lse, lse2)
    safe = jnp.where(jnp.isneginf(new), 0.0, new)

    def weight(x):
        return jnp.exp(x - safe).transpose(0, 2, 1)[..., None]  # [b, t, h, 1]

    return out * weight(lse) + out2 * weight(lse2), new


def _send(tree, axis_name: str, n: int):
    perm = [(i, (i + 1) % n) for i in range(n)]
    return jax.tree.map(lambda x: lax.ppermute(x, axis_name, perm), tree)


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


# -- one document in a known order: no run-time choices ----------------------------------------


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


# -- documents packed in index order: no run-time choices -------------------------------------


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

__all__ = ["CAUSAL", "DEAD", "FULL", "GENERAL", "attention_core", "pair_kind"]
