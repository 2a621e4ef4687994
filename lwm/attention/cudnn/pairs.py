"""Pairs of (query piece, key piece) and how each goes to cuDNN: its kind (`pair_kind`), read
at run time from positions and segment ids, the branch each kind runs (`_run_pair`), how a
general pair is cut into pieces (`PIECE`, `_split_count`), and the pieces' slicing and
log-sum-exp combining shared by every schedule."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from lwm.attention._common import (
    DEAD,
    FULL,
    attention_mask,
    block_kind,
)
from lwm.attention.blocks import Spec

# pair kinds besides DEAD (0) and FULL (2); MASKED*: one cuDNN call with the mask as a bias
CAUSAL, GENERAL, MASKED_CAUSAL, MASKED = 3, 4, 5, 6


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
    docs/benchmarks.md)."""
    return lax.optimization_barrier((positional, operands))


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


PIECE = 4096  # a general pair is cut into pieces of at most this many tokens (`_split_count`)


def _split_count(q_len: int, kv_len: int) -> int:
    """Into how many pieces a general pair is cut on each side: halved until a piece is at most
    `PIECE` tokens (1: the pair is classified exactly, whole)."""
    m = 1
    while q_len // m > PIECE and q_len % (2 * m) == 0 and kv_len % (2 * m) == 0:
        m *= 2
    return m


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


def _set_rows(acc, i, part):
    """``acc`` = (output ``[b, t, h, d]``, log-sum-exp ``[b, h, t]``) with query piece ``i``
    replaced by ``part`` (the same of the piece's queries; output cast to ``acc``'s dtype)."""
    return _put_piece(acc[0], i, part[0]), _put_piece(acc[1], i, part[1], axis=2)


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


__all__ = ["CAUSAL", "DEAD", "FULL", "GENERAL", "MASKED", "MASKED_CAUSAL", "PIECE", "pair_kind"]
