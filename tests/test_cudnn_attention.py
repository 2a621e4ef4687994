"""The cuDNN block kernel (`lwm.attention.cudnn`): everything around cuDNN's two kernels is
checked on the CPU with their dense stand-in (same conventions); the kernels themselves only on
an NVIDIA GPU (``LWM_REQUIRE_GPU=1 JAX_PLATFORMS=cuda pytest tests/test_cudnn_attention.py -k
gpu``).

So a test here that says it equals dense attention (``..._cudnn_schedule_with_standin_...``)
checks the schedule of calls and the masks around the kernels, with the stand-in computing each
call: it says nothing of cuDNN. (On a GPU, in float32, the same tests run the XLA kernel: cuDNN
refuses float32 and `kernel_for_inputs` falls back.) What needs cuDNN itself is in the tests
named ``test_gpu_...``: they skip off a GPU, and ``LWM_REQUIRE_GPU=1`` (to be set on every run
on a GPU) makes this module fail to load instead, and makes them fail where cuDNN's kernels
would not run (a fallback to the XLA kernel)."""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.extend.core import ClosedJaxpr, Jaxpr
from test_attention import (
    assert_close,
    document_positions,
    mesh_of,
    packed_segments,
    qkv,
)

import lwm.attention.cudnn as cudnn
from data.batches import turn_segment_ids
from lwm.attention import (
    blockwise_attention,
    dense_attention,
    keys_precede_queries,
    look_back,
    ring_attention,
)
from lwm.attention._common import attention_mask
from lwm.attention.blockwise import resolve_kernel
from lwm.attention.layout import zigzag_permutation

ON_GPU = jax.default_backend() == "gpu"
if os.environ.get("LWM_REQUIRE_GPU") == "1" and not ON_GPU:  # a run on a GPU must not skip
    raise RuntimeError(
        f"LWM_REQUIRE_GPU=1, but JAX runs on {jax.default_backend()}: the GPU tests would skip"
    )


@pytest.fixture
def small_pieces(monkeypatch):
    """Pieces of at most 8 tokens, so that short test sequences have many pairs of each kind."""
    monkeypatch.setattr(cudnn.pairs, "PIECE", 8)


def long_documents(b: int, s: int, cut: int) -> jax.Array:
    """Two documents per row, the first ``cut`` tokens long: most pieces hold one document."""
    return jnp.asarray(np.broadcast_to((np.arange(s) >= cut).astype(np.int32), (b, s)))


# ---------------------------------------------------------------------------------------------
# One compiled program per attention call, shared by the cases that differ only in their masks.
# Compiling is most of these tests' time on the CPU. `test_attention.value_and_grads` closes
# over the positions and segment ids, so every case compiled its own programs (ours and dense
# attention's); here they are arguments, as is the fixed random projection of the output (the
# same numbers), and each program is compiled once per what it depends on besides them. The
# masks traced, every pair's kind is decided at run time, as in training, where positions and
# segment ids are data (`conditionals`).

_PROGRAMS: dict = {}


def _attend(kind: str, static: tuple):
    """The attention call ``kind`` with the options ``static`` (pairs of name and value: all
    the call depends on besides q, k, v and the masks): ``dense``, or the cuDNN path (its
    stand-in here) of ``blockwise`` or ``ring`` attention (``mesh_shape`` among the options)."""
    options = dict(static)
    if kind == "dense":
        return lambda q, k, v, **masks: dense_attention(q, k, v, **options, **masks)
    if kind == "blockwise":
        return lambda q, k, v, **masks: blockwise_attention(
            q, k, v, kernel="cudnn", **options, **masks
        )
    mesh = mesh_of(options.pop("mesh_shape"))
    return lambda q, k, v, **masks: ring_attention(
        q, k, v, mesh=mesh, kernel="cudnn", **options, **masks
    )


def shared_program(kind: str, q, k, v, masks=None, *, causal: bool = True, **static):
    """The compiled program of `value_and_grads` of `_attend` ``(kind, static)`` and the
    jaxpr it was compiled from: ``(q, k, v, w, masks) -> (output, (dq, dk, dv))`` for the
    projection ``w`` of the output and ``masks`` (positions and segment ids, by keyword,
    traced). Compiled once per call, options, `cudnn.pairs.PIECE` (read when tracing) and
    shapes of the arguments; `shared_value_and_grads` runs it."""
    static["causal"] = causal
    options = tuple(sorted(static.items()))
    w = jax.ShapeDtypeStruct(q.shape, jnp.float32)  # the projection, an argument
    args = (q, k, v, w, {} if masks is None else dict(masks))
    avals = tuple((x.shape, x.dtype) for x in jax.tree.leaves(args))
    key = (kind, options, cudnn.pairs.PIECE, jax.tree.structure(args), avals)
    if key not in _PROGRAMS:
        attend = _attend(kind, options)

        def value_and_grads_of(q, k, v, w, masks):
            def loss(q, k, v):
                out = attend(q, k, v, **masks)
                return jnp.sum(out.astype(jnp.float32) * w), out

            (_, out), grads = jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)(q, k, v)
            return out, grads

        traced = jax.jit(value_and_grads_of).trace(*args)
        _PROGRAMS[key] = traced.lower().compile(), traced.jaxpr.jaxpr
    return _PROGRAMS[key]


def shared_value_and_grads(kind: str, q, k, v, masks=None, **static):
    """`value_and_grads` of `_attend` ``(kind, static)`` with ``masks`` (positions and segment
    ids, by keyword), by `shared_program`: the output and (dq, dk, dv) of the same projection
    of the output, and the program's jaxpr."""
    compiled, jaxpr = shared_program(kind, q, k, v, masks, **static)
    w = jnp.asarray(np.random.default_rng(7).normal(size=q.shape), jnp.float32)
    out, grads = compiled(q, k, v, w, {} if masks is None else dict(masks))
    return out, grads, jaxpr


def assert_matches_dense(
    kind: str, q, k, v, masks=None, *, dense_masks=None, causal: bool = True, **static
):
    """`test_attention.assert_matches` of `_attend` ``(kind, static)`` against dense attention
    (with ``dense_masks``, by default the same ``masks``), through `shared_value_and_grads`:
    output to 1e-5, gradients to 1e-4 relative, the same shapes and dtypes. Returns the jaxpr
    of the program of ``kind``."""
    out, grads, program = shared_value_and_grads(kind, q, k, v, masks, causal=causal, **static)
    dense_masks = masks if dense_masks is None else dense_masks
    ref, ref_grads, _ = shared_value_and_grads("dense", q, k, v, dense_masks, causal=causal)
    assert_close(out, grads, ref, ref_grads, fwd_tol=1e-5, grad_tol=1e-4)
    return program


@pytest.mark.parametrize("mesh_shape", [(1, 1, 8, 1), (1, 2, 2, 2), (1, 1, 1, 1)])
@pytest.mark.parametrize("docs", ["one", "long", "packed"])
def test_ring_cudnn_schedule_with_standin_equals_dense(small_pieces, mesh_shape, docs):
    """Causal, GQA (8 query heads on 2 key/value heads), zigzag layout; one document per row,
    two long ones (pairs across the boundary cut into pieces, some of them masked by a bias)
    or four short ones (positions restarting per document): output to 1e-5, gradients to 1e-4
    (fp32)."""
    sp, s = mesh_shape[2], 64
    perm = zigzag_permutation(s, sp)
    q, k, v = qkv(s=s)
    if docs == "one":
        pos = jnp.broadcast_to(jnp.asarray(perm, jnp.int32), (2, s))
        kw = dict(q_positions=pos, kv_positions=pos)
    else:
        seg = long_documents(2, s, 42) if docs == "long" else packed_segments(2, s)
        pos = document_positions(seg)[:, perm]
        seg = seg[:, perm]
        kw = dict(q_positions=pos, kv_positions=pos, q_segment_ids=seg, kv_segment_ids=seg)
    # `long` and `packed` share one compiled ring per mesh (`shared_value_and_grads`)
    assert_matches_dense(
        "ring", q[:, perm], k[:, perm], v[:, perm], kw, mesh_shape=mesh_shape, block_q=4, block_k=4
    )


@pytest.mark.parametrize("causal", [True, False])
def test_blockwise_cudnn_schedule_with_standin_equals_dense(small_pieces, causal):
    """One device, contiguous positions; rows that see no key (segments that match nothing)."""
    q, k, v = qkv(s=48, h=4, kvh=2)
    seg = jnp.concatenate([jnp.zeros((2, 32), jnp.int32), jnp.ones((2, 16), jnp.int32)], 1)
    kw = dict(q_segment_ids=seg, kv_segment_ids=seg.at[:, 32:].set(5))
    assert_matches_dense("blockwise", q, k, v, kw, causal=causal, block_q=8, block_k=8)
    assert_matches_dense("blockwise", q, k, v, causal=causal)


@pytest.mark.parametrize("mesh_shape", [(1, 1, 8, 1), (1, 2, 2, 2), (1, 1, 1, 1)])
@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
@pytest.mark.parametrize("causal", [True, False])
def test_one_document_in_a_known_order_cudnn_schedule_with_standin_equals_dense(
    mesh_shape, layout, causal
):
    """No positions and no segment ids: one document in ``layout``'s order, which the cuDNN path
    schedules without looking at positions (zigzag, or one device) or with the general pairs
    (contiguous over a ring). Equals dense attention on the same order, GQA, fp32."""
    sp, s = mesh_shape[2], 64
    perm = zigzag_permutation(s, sp) if layout == "zigzag" else np.arange(s)
    pos = jnp.broadcast_to(jnp.asarray(perm, jnp.int32), (2, s))
    q, k, v = qkv(s=s)
    assert_matches_dense(
        "ring",
        q[:, perm],
        k[:, perm],
        v[:, perm],
        dense_masks=dict(q_positions=pos, kv_positions=pos),  # ours: no positions
        causal=causal,
        mesh_shape=mesh_shape,
        layout=layout,
        block_q=4,
        block_k=4,
    )


def conditionals(kind: str, q, k, v, masks=None, **static) -> int:
    """How many conditionals the compiled gradient of `_attend` ``(kind, static)`` holds (each
    one makes a GPU wait for its predicate before it launches the branch: 1-2 ms per fwd+bwd
    at 8K on an H200); the masks are traced, not folded as constants (`shared_program`)."""
    compiled, _ = shared_program(kind, q, k, v, masks, **static)
    return compiled.as_text().count(" conditional(")


def test_one_document_in_a_known_order_decides_nothing_at_run_time():
    """The zigzag ring and one device, given no positions: no conditional anywhere (the kinds of
    all pairs are known when tracing). Given the same positions as arrays, every pair's kind is
    decided at run time. (The programs without positions are those of
    `test_one_document_in_a_known_order_cudnn_schedule_with_standin_equals_dense`.)"""
    s = 64
    for mesh_shape in ((1, 1, 1, 1), (1, 1, 8, 1)):  # the ring on 8 devices, as that test's
        pos = jnp.broadcast_to(jnp.asarray(zigzag_permutation(s, mesh_shape[2]), jnp.int32), (2, s))
        ring = dict(mesh_shape=mesh_shape, layout="zigzag", block_q=4, block_k=4)
        assert conditionals("ring", *qkv(s=s), **ring) == 0, mesh_shape
        masks = dict(q_positions=pos, kv_positions=pos)
        assert conditionals("ring", *qkv(s=s), masks, **ring) > 0, mesh_shape


def test_every_loop_has_a_known_trip_count(small_pieces):
    """Every loop of the cuDNN path's compiled gradient has a trip count known when compiling
    (the blockwise path with packed documents, its pieces folded in loops; the zigzag ring with
    and without positions; packed rows told ``in_order``). On a GPU, XLA's while loop without one reads its condition back to
    the host after every iteration (`WhileThunk`): a wait per iteration, as a conditional's.
    (The ring with positions and the rows told ``in_order`` are programs of
    `test_ring_cudnn_schedule_with_standin_equals_dense` and
    `test_in_order_rows_cudnn_schedule_with_standin_equal_dense`.)"""
    import re

    seg = packed_segments(2, 64)
    pos = document_positions(seg)
    perm = zigzag_permutation(64, 8)  # the ring on 8 devices, as those tests'
    zpos, zseg = pos[:, perm], seg[:, perm]
    kw = dict(q_positions=pos, kv_positions=pos, q_segment_ids=seg, kv_segment_ids=seg)
    zkw = dict(q_positions=zpos, kv_positions=zpos, q_segment_ids=zseg, kv_segment_ids=zseg)
    ring = dict(mesh_shape=(1, 1, 8, 1), block_q=4, block_k=4)
    cases = {
        "packed": ("blockwise", kw, {}),
        "ring": ("ring", zkw, ring),
        "ring_one_document": ("ring", None, dict(ring, layout="zigzag")),
        "in_order": ("blockwise", kw, dict(in_order=True)),
    }
    for name, (kind, masks, static) in cases.items():
        text = shared_program(kind, *qkv(s=64), masks, **static)[0].as_text()
        loops = [line for line in text.splitlines() if re.search(r" = .* while\(", line)]
        assert loops or name == "ring_one_document", name
        unknown = [line[:120] for line in loops if "known_trip_count" not in line]
        assert not unknown, (name, unknown)


def kinds_of_ring(s: int, sp: int, seg: np.ndarray | None) -> set[int]:
    """Every kind of the pairs of zigzag halves that the ring computes for one row."""
    perm = zigzag_permutation(s, sp)
    seg_row = None if seg is None else np.asarray(seg)[perm]
    pos_row = perm if seg is None else np.asarray(document_positions(seg[None]))[0][perm]
    t = s // sp // 2
    kinds = set()
    for qi in range(sp * 2):
        for ki in range(sp * 2):
            qs, ks = slice(qi * t, (qi + 1) * t), slice(ki * t, (ki + 1) * t)

            def part(x, sl):
                return None if x is None else jnp.asarray(x[sl])[None]

            kind = cudnn.pair_kind(
                part(pos_row, qs), part(seg_row, qs), part(pos_row, ks), part(seg_row, ks), True
            )
            kinds.add(int(kind))
    return kinds


def test_one_document_per_row_runs_every_pair_on_cudnn():
    """In the zigzag layout every pair of halves of one document is dead, fully visible or the
    causal diagonal: each is one cuDNN call, nothing falls back. With two long documents only
    the pairs that hold the boundary are general (then cut into pieces); with the boundary
    between two halves, no pair is."""
    assert kinds_of_ring(64, 4, None) == {cudnn.DEAD, cudnn.CAUSAL, cudnn.FULL}
    assert kinds_of_ring(128, 2, None) == {cudnn.DEAD, cudnn.CAUSAL, cudnn.FULL}
    inside = np.asarray(long_documents(1, 64, 42))[0]  # halves of 8 tokens: 40..47 holds it
    assert kinds_of_ring(64, 4, inside) == {cudnn.DEAD, cudnn.CAUSAL, cudnn.FULL, cudnn.GENERAL}
    between = np.asarray(long_documents(1, 64, 40))[0]
    assert kinds_of_ring(64, 4, between) == {cudnn.DEAD, cudnn.CAUSAL, cudnn.FULL}
    # Positions that are not one contiguous run (a striped layout's) are never sent to cuDNN's
    # index mask.
    pos = jnp.asarray([[0, 2, 4, 6]])
    assert int(cudnn.pair_kind(pos, None, pos, None, True)) == cudnn.GENERAL


def whole_float32_carries(jaxpr, s: int) -> list[int]:
    """For every loop in ``jaxpr`` (nested ones included), how many float32 arrays
    ``[batch, s, heads, head_dim]`` (the whole sequence) it carries."""
    counts = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name in ("while", "scan"):
            whole = [
                a for a in (v.aval for v in eqn.outvars)
                if a.dtype == jnp.float32 and a.ndim == 4 and a.shape[1] == s
            ]  # fmt: skip
            counts.append(len(whole))
        for param in eqn.params.values():
            for sub in param if isinstance(param, list | tuple) else (param,):
                if isinstance(sub, ClosedJaxpr):
                    counts += whole_float32_carries(sub.jaxpr, s)
                elif isinstance(sub, Jaxpr):
                    counts += whole_float32_carries(sub, s)
    return counts


@pytest.mark.parametrize("in_order", [False, True])
def test_a_general_pair_in_bfloat16_carries_one_float32_gradient(small_pieces, in_order):
    """On one device in bf16 a general pair (packed documents) is folded piece by piece with
    float32 only where pieces are summed: the forward stores each query piece's output in bf16,
    and the backward runs key pieces outside, so that only dQ is carried whole in float32 (dK
    and dV of the pair all in float32 cost 20 GiB more for the 1.14B model at 512K; CPU plans
    in docs/benchmarks.md). So does the in-order schedule, two lines of pieces at a time. The
    ring's own accumulators, carried over ring steps, are float32 as before."""
    s = 64
    q, k, v = (x.astype(jnp.bfloat16) for x in qkv(s=s, h=4, kvh=4))
    seg = packed_segments(2, s)
    pos = document_positions(seg)
    kw = dict(q_positions=pos, kv_positions=pos, q_segment_ids=seg, kv_segment_ids=seg)

    def loss(q, k, v):
        out = blockwise_attention(q, k, v, kernel="cudnn", in_order=in_order, **kw)
        return jnp.sum(out.astype(jnp.float32))

    jaxpr = jax.make_jaxpr(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v).jaxpr
    carries = whole_float32_carries(jaxpr, s)
    assert carries and max(carries) == 1, carries


# ---------------------------------------------------------------------------------------------
# documents packed in index order (``in_order``): every call scheduled when tracing


def isolated_turns(b: int, s: int) -> tuple[jax.Array, jax.Array]:
    """Segment ids and positions of rows as `lwm train` lays out isolated QA turns: a record
    whose two questions each see its video (turn 0) and themselves, at the positions right
    after the video; a record without turns; then padding counting its own positions."""
    parts = [(1, 0, 12, 0), (1, 1, 6, 12), (1, 2, 8, 12), (2, 0, 20, 0)]  # doc, turn, n, first
    seg, pos = [], []
    for doc, turn, n, first in parts:
        seg += [int(turn_segment_ids(doc, turn))] * n
        pos += list(range(first, first + n))
    pad = s - len(seg)
    seg, pos = seg + [0] * pad, pos + list(range(pad))
    return tuple(jnp.asarray(np.broadcast_to(np.asarray(x, np.int32), (b, s))) for x in (seg, pos))


def in_order_rows(rows: str, b: int, s: int) -> tuple[jax.Array, jax.Array]:
    """Segment ids and positions: ``packed`` (four documents), ``long`` (two), ``padded``
    (three, then padding counting its own positions) or ``turns`` (`isolated_turns`)."""
    if rows == "turns":
        return isolated_turns(b, s)
    seg = long_documents(b, s, 42) if rows == "long" else packed_segments(b, s)
    if rows == "padded":
        seg = (seg + 1).at[:, s - 12 :].set(0)
    return seg, document_positions(seg)


def brute_look_back(pos, seg) -> int:
    """`look_back` by its definition: the most, over queries, of its index less its first
    visible key's, plus one."""
    seen = np.asarray(
        attention_mask(
            jnp.asarray(pos)[None],
            jnp.asarray(pos)[None],
            jnp.asarray(seg)[None],
            jnp.asarray(seg)[None],
            True,
        )
    )[0]
    return max(q - int(np.argmax(row)) + 1 for q, row in enumerate(seen) if row.any())  # fmt: skip


def brute_keys_precede_queries(pos, seg) -> bool:
    """`keys_precede_queries` by its definition: nothing visible above the diagonal."""
    seen = np.asarray(_attention_mask(jnp.asarray(pos), jnp.asarray(pos), seg, seg, True))
    return not np.triu(seen, 1).any()


# Jitted, one program per shape (called eagerly, each of their operations compiled its own).
_attention_mask = jax.jit(attention_mask, static_argnums=4)
_keys_precede_queries = jax.jit(keys_precede_queries)
_look_back = jax.jit(look_back, static_argnums=1)


@pytest.mark.parametrize(
    "rows, s",
    [("packed", 64), ("long", 64), ("padded", 64), ("turns", 64), ("packed", 16), ("padded", 32)],
)
def test_in_order_rows_cudnn_schedule_with_standin_equal_dense(small_pieces, rows, s):
    """Rows whose every visible key precedes its query, told so (``in_order``): the schedule
    of masked pieces on and below the diagonal equals dense attention, output to 1e-5 and
    gradients to 1e-4 (fp32, GQA; 8, 2 and 4 pieces a side)."""
    seg, pos = in_order_rows(rows, 2, s)
    assert bool(_keys_precede_queries(pos, seg)) and brute_keys_precede_queries(pos, seg)
    kw = dict(q_positions=pos, kv_positions=pos, q_segment_ids=seg, kv_segment_ids=seg)
    # the rows of one length share one compiled program (`shared_value_and_grads`)
    assert_matches_dense("blockwise", *qkv(s=s), kw, in_order=True)


def top_level_conds(jaxpr) -> list[tuple[int, ...]]:
    """For every conditional not inside another one (nested jaxprs searched), how many
    conditionals each of its branches holds (at any depth)."""

    def subjaxprs(eqn):
        for param in eqn.params.values():
            for sub in param if isinstance(param, list | tuple) else (param,):
                if isinstance(sub, ClosedJaxpr):
                    yield sub.jaxpr
                elif isinstance(sub, Jaxpr):
                    yield sub

    def count(jaxpr) -> int:
        return sum(
            (eqn.primitive.name == "cond") + sum(count(j) for j in subjaxprs(eqn))
            for eqn in jaxpr.eqns
        )

    found = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "cond":
            found.append(tuple(count(b.jaxpr) for b in eqn.params["branches"]))
        else:
            for sub in subjaxprs(eqn):
                found += top_level_conds(sub)
    return found


def test_in_order_rows_decide_once_per_call(small_pieces):
    """Told ``in_order``, packed rows decide one thing at run time per call, forward and
    backward: whether they are in order. Its branch for rows in order holds no conditional
    (64 tokens in pieces of 8: 36 cuDNN calls each way, in loops of fixed trip counts); the
    other is the general schedule, which decides every pair's and piece's kind at run time."""
    seg, pos = in_order_rows("packed", 2, 64)

    def grads(in_order):
        def loss(q, k, v):
            kw = dict(q_positions=pos, kv_positions=pos, q_segment_ids=seg, kv_segment_ids=seg)
            out = blockwise_attention(q, k, v, kernel="cudnn", in_order=in_order, **kw)
            return jnp.sum(out)

        return jax.make_jaxpr(jax.grad(loss, argnums=(0, 1, 2)))(*qkv(s=64)).jaxpr

    told = top_level_conds(grads(True))
    assert len(told) == 2 and all(general > 0 and ordered == 0 for general, ordered in told)
    general = top_level_conds(grads(False))  # the pair's kind, forward and backward
    assert len(general) == 2 and all(min(branches) == 0 < max(branches) for branches in general)


def test_in_order_is_a_hint_checked_on_the_device(small_pieces):
    """Rows told ``in_order`` that are not (padding all at position 0, whose queries see later
    padding keys; a zigzag order) take the general schedule: still equal to dense attention."""
    padded, pos = in_order_rows("padded", 2, 64)
    flat = jnp.where(padded == 0, 0, pos)
    zigzag = jnp.broadcast_to(jnp.asarray(zigzag_permutation(64, 2), jnp.int32), (2, 64))
    for pos, seg in ((flat, padded), (zigzag, jnp.ones_like(padded))):
        assert not bool(_keys_precede_queries(pos, seg))
        kw = dict(q_positions=pos, kv_positions=pos, q_segment_ids=seg, kv_segment_ids=seg)
        # the program of `test_in_order_rows_cudnn_schedule_with_standin_equal_dense` at 64
        assert_matches_dense("blockwise", *qkv(s=64), kw, in_order=True)


def short_documents(b: int, s: int) -> tuple[jax.Array, jax.Array]:
    """Segment ids and positions: documents of 1 to 12 tokens packed in order, then padding
    counting its own positions: no query looks back more than 12 tokens."""
    seg, pos = [], []
    for doc, n in enumerate([5, 9, 3, 12, 7, 1, 11, 6] * (s // 48 + 1), 1):
        if len(seg) + n > s - 6:
            break
        seg, pos = seg + [doc] * n, pos + list(range(n))
    pad = s - len(seg)
    seg, pos = seg + [0] * pad, pos + list(range(pad))
    return tuple(jnp.asarray(np.broadcast_to(np.asarray(x, np.int32), (b, s))) for x in (seg, pos))


def scan_lengths(jaxpr) -> set[int]:
    """The trip counts of every loop in ``jaxpr`` (nested ones included)."""
    found = set()
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "scan":
            found.add(eqn.params["length"])
        for param in eqn.params.values():
            for sub in param if isinstance(param, list | tuple) else (param,):
                if isinstance(sub, ClosedJaxpr | Jaxpr):
                    found |= scan_lengths(getattr(sub, "jaxpr", sub))
    return found


def test_in_order_rows_within_reach_skip_the_pieces_out_of_it(small_pieces):
    """Short documents at 128 tokens (16 pieces of 8 a side): told that no query looks back
    more than 12 tokens (`look_back`), the in-order schedule runs each query piece against its
    own and the 2 key pieces before it (loops of 16 and 2, not the paired schedule's 8 and 15)
    and equals dense attention; told a reach the rows exceed (4), the check sends them to the
    general schedule, still equal (its band, 1, is in the program); told none, the paired
    schedule runs."""
    s = 128
    seg, pos = short_documents(2, s)
    assert int(_look_back(seg, s)) == 12 == look_back(np.asarray(seg), s, np)
    kw = dict(q_positions=pos, kv_positions=pos, q_segment_ids=seg, kv_segment_ids=seg)
    for reach, lengths in ((12, {16, 2}), (4, {16, 1}), (None, {8, 15})):
        # the loops of the program that computed the gradient (forward and backward)
        found = scan_lengths(
            assert_matches_dense("blockwise", *qkv(s=s), kw, in_order=True, reach=reach)
        )
        assert lengths <= found and not ({8, 15, 2, 1} - lengths) & found, (reach, found)


def test_keys_precede_queries_says_yes_only_where_it_holds():
    """Yes to packed documents, isolated turns and padding that counts its own positions; no
    to a zigzag layout, padding all at position 0 (as the training loader writes it), a
    question before its video; and over random rows (documents, turns, padding, then tokens
    swapped or positions repeated), never yes where a query sees a key after it; on the host
    (numpy, as `lwm train` checks its batches) the same answers."""
    for rows in ("packed", "long", "padded", "turns"):
        assert bool(keys_precede_queries(*in_order_rows(rows, 1, 64)[::-1]))
    one = jnp.asarray(zigzag_permutation(64, 2), jnp.int32)[None]
    assert not bool(keys_precede_queries(one, jnp.ones_like(one)))
    seg, pos = in_order_rows("padded", 1, 64)
    assert not bool(keys_precede_queries(jnp.where(seg == 0, 0, pos), seg))
    seg, pos = isolated_turns(1, 64)
    swapped = (jnp.concatenate([seg[:, 12:18], seg[:, :12], seg[:, 18:]], 1),
               jnp.concatenate([pos[:, 12:18], pos[:, :12], pos[:, 18:]], 1))  # fmt: skip
    assert not brute_keys_precede_queries(swapped[1], swapped[0])
    assert not bool(keys_precede_queries(swapped[1], swapped[0]))

    rng = np.random.default_rng(0)
    said_yes = 0
    precede, back_of = jax.jit(keys_precede_queries), jax.jit(look_back, static_argnums=1)
    for _ in range(150):
        seg, pos = [], []
        for doc in range(1, rng.integers(3, 6)):  # two to four documents
            turns = rng.integers(1, 4) if rng.random() < 0.5 else 0
            video = int(rng.integers(1, 5))
            for turn in range(max(turns, 1)):
                n = video if turn == 0 else int(rng.integers(1, 4))
                ids = turn_segment_ids(doc, turn) if turns else doc
                seg += [int(ids)] * n
                pos += list(range(0 if turn == 0 else video, (0 if turn == 0 else video) + n))
        pad = 64 - len(seg)  # one length: each jitted check compiles once
        seg, pos = np.asarray(seg + [0] * pad), np.asarray(pos + list(range(pad)))
        if rng.random() < 0.5:
            i, j = rng.choice(len(seg), 2, replace=False)
            seg[[i, j]], pos[[i, j]] = seg[[j, i]], pos[[j, i]]
        if rng.random() < 0.3:
            i = rng.integers(1, len(seg))
            pos[i] = pos[i - 1]
        yes = bool(precede(jnp.asarray(pos)[None], jnp.asarray(seg)[None]))
        assert keys_precede_queries(pos[None], seg[None], np) == yes  # on the host, the same
        if yes:
            assert brute_keys_precede_queries(pos[None], seg[None]), (seg, pos)
            # no query's visible keys are further back than `look_back` says (host, device)
            back = look_back(seg[None], len(seg), np)
            assert back == int(back_of(jnp.asarray(seg)[None], len(seg)))
            assert brute_look_back(pos, seg) <= back, (seg, pos, back)
        said_yes += yes
    assert 20 <= said_yes < 150, said_yes


def test_pieces_are_classified_exactly():
    """A piece (or a pair no longer than `PIECE`) is classified from its whole mask, so every
    one runs as one cuDNN call: none visible (even where the ranges of segment ids overlap),
    all visible, exactly cuDNN's causal mask, within it (packed documents, positions
    restarting: causal mask plus the segments as a bias) or anything else (bias alone)."""

    def kind(qp, qs, kp, ks, causal=True):
        rows = (jnp.asarray([x], jnp.int32) for x in (qp, qs, kp, ks))
        return int(cudnn.pair_kind(*rows, causal, exact=True))

    idx, one = list(range(8)), [1] * 8
    assert kind(idx, one, idx, one) == cudnn.CAUSAL
    assert kind(idx, one, idx, one, causal=False) == cudnn.FULL
    seg, pos = [1, 1, 1, 2, 2, 2, 2, 2], [0, 1, 2, 0, 1, 2, 3, 4]
    assert kind(pos, seg, pos, seg) == cudnn.MASKED_CAUSAL
    # later queries of document 2 against its earlier keys, and queries of document 3
    later_seg, later_pos = [2, 2, 2, 2, 3, 3, 3, 3], [5, 6, 7, 8, 0, 1, 2, 3]
    assert kind(later_pos, later_seg, pos, seg) == cudnn.MASKED
    assert kind(later_pos, [1, 1, 3, 3, 3, 3, 3, 3], pos, [2] * 8) == cudnn.DEAD
    assert kind(list(range(5, 13)), [2] * 8, pos, [2] * 8) == cudnn.FULL
    # the range-based kind of the same pairs: general (then cut into pieces)
    rows = (
        jnp.asarray([x], jnp.int32) for x in (later_pos, [1, 1, 3, 3, 3, 3, 3, 3], pos, [2] * 8)
    )
    assert int(cudnn.pair_kind(*rows, True)) == cudnn.GENERAL


def test_kernel_choice_per_platform():
    assert resolve_kernel("auto", "gpu") == ("cudnn", False)
    assert resolve_kernel("auto", "tpu") == ("pallas", False)
    assert resolve_kernel("auto", "cpu") == ("xla", False)
    assert resolve_kernel("cudnn", "cpu") == ("cudnn", True)  # emulated off a GPU
    assert resolve_kernel("cudnn", "gpu") == ("cudnn", False)
    with pytest.raises(ValueError, match="choose one of xla, pallas, cudnn, auto"):
        resolve_kernel("flash", "gpu")


def test_what_cudnn_refuses_is_named():
    q, k, _ = qkv(d=16)
    assert "dtype float32" in cudnn.unsupported(q, k)
    q, k, _ = qkv(d=12, dtype=jnp.bfloat16)
    assert "head_dim 12" in cudnn.unsupported(q, k)


def test_real_kernels_lower_for_cuda_from_this_host(monkeypatch):
    """The path with cuDNN's own kernels (not the stand-in) traces inside the ring's
    shard_map, forward and backward, and lowers to StableHLO for CUDA on this CPU host: the
    private JAX API it uses is there with the arguments it passes, and the program holds
    cuDNN's forward and backward calls. (cuDNN's own checks of the GPU are skipped: there is
    none here.)"""
    from jax._src.cudnn import fused_attention_stablehlo as fa

    import lwm.attention.blockwise as blockwise

    monkeypatch.setattr(fa, "check_cudnn_version", lambda: 91000)
    monkeypatch.setattr(fa, "check_is_flash_attention", lambda *a, **k: None)
    monkeypatch.setattr(cudnn.pairs, "PIECE", 16)
    real = blockwise.resolve_kernel

    def on_gpu(kernel, platform=None):
        return ("cudnn", False) if kernel == "cudnn" else real(kernel, platform)

    monkeypatch.setattr(blockwise, "resolve_kernel", on_gpu)
    monkeypatch.setattr("lwm.attention.ring.resolve_kernel", on_gpu)
    monkeypatch.setattr(cudnn, "unsupported", lambda q, k: None)
    s, sp = 128, 2
    perm = zigzag_permutation(s, sp)
    q, k, v = (x.astype(jnp.bfloat16) for x in qkv(s=s))
    seg = packed_segments(2, s)[:, perm]
    pos = document_positions(packed_segments(2, s))[:, perm]
    mesh = mesh_of((1, 2, 2, 2))
    kw = dict(q_positions=pos, kv_positions=pos, q_segment_ids=seg, kv_segment_ids=seg)

    def loss(q, k, v):
        out = ring_attention(q, k, v, mesh=mesh, block_q=8, block_k=8, kernel="cudnn", **kw)
        return out.astype(jnp.float32).sum()

    def one_document(q, k, v):  # no positions: the schedule that decides nothing at run time
        out = ring_attention(q, k, v, mesh=mesh, layout="zigzag", kernel="cudnn")
        return out.astype(jnp.float32).sum()

    plain = packed_segments(2, s)
    in_kw = dict(q_segment_ids=plain, kv_segment_ids=plain)
    in_kw |= dict(q_positions=document_positions(plain), kv_positions=document_positions(plain))

    def in_order(q, k, v):  # packed rows in order, one device: the masked pieces' schedule
        out = blockwise_attention(q, k, v, kernel="cudnn", in_order=True, **in_kw)
        return out.astype(jnp.float32).sum()

    for fn in (loss, one_document, in_order):
        step = jax.jit(jax.value_and_grad(fn, argnums=(0, 1, 2)))
        text = step.trace(q, k, v).lower(lowering_platforms=("cuda",)).as_text()
        kind = "ScaleBias" if fn is in_order else ""  # every call of it has a mask as a bias
        assert f"__cudnn$fmha{kind}Softmax" in text, fn.__name__
        assert f"__cudnn$fmha{kind}SoftmaxBackward" in text, fn.__name__


def test_layers_in_a_scan_do_not_hoist_quadratic_masks():
    """The gradient of attention layers in a `lax.scan` (as `scan_layers` runs the model) plans
    no more temporary memory on the cuDNN path than with the XLA kernel, and no more when a
    general pair is cut into 16 pieces a side than when it is not. Without the barrier in
    `_switch` JAX hoisted out of the scan what depends on positions alone: first the
    fallback's masks of every block pair (12x the XLA kernel's temporaries at 4K, 210 GiB for
    the 1.14B model at 32K on an H200), then every piece's constants (2.6x the unsplit
    temporaries here, 162 GiB planned for that model at 128K)."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    from conftest import subprocess_xla_flags

    root = Path(__file__).resolve().parents[1]
    # The script picks its one CPU device; it compiles as this process does (`conftest`: the
    # same planned temporaries as XLA's default flags, 6 s of CPU instead of 17).
    env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}
    env["XLA_FLAGS"] = subprocess_xla_flags()
    run = subprocess.run(
        [sys.executable, str(root / "benchmarks" / "cudnn_memory.py"), "--seq", "4096"]
        + ["--heads", "4", "--head-dim", "32", "--piece", "256"]
        + ["--cases", "scan,scan-nosplit,scan-xla"],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        cwd=root,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    temp = {r["case"]: r["temp_gib"] for r in map(json.loads, run.stdout.splitlines())}
    assert temp["scan"] <= 1.5 * temp["scan-xla"], temp
    assert temp["scan"] <= 1.2 * temp["scan-nosplit"], temp


# ---------------------------------------------------------------------------------------------
# cuDNN itself: only on an NVIDIA GPU

gpu = pytest.mark.skipif(not ON_GPU, reason="needs an NVIDIA GPU (cuDNN's kernels run only there)")


@gpu
def test_gpu_cudnn_kernels_follow_their_stand_in():
    """cuDNN's forward (output, float32 log-sum-exp) and backward against the dense stand-in
    the CPU tests use, on bf16 inputs: causal and not, GQA, without and with a mask as a bias
    (packed documents)."""
    q, k, v = qkv(b=2, s=256, h=8, kvh=2, d=64, dtype=jnp.bfloat16)
    assert cudnn.unsupported(q, k) is None, cudnn.unsupported(q, k)  # cuDNN is there
    dout = qkv(b=2, s=256, h=8, kvh=2, d=64, dtype=jnp.bfloat16, seed=3)[0]
    seg = packed_segments(2, 256)  # every query sees its own document's start
    pos = document_positions(seg)
    bias = cudnn.kernels._mask_bias(cudnn.pairs._visible(pos, seg, pos, seg, True), jnp.bfloat16)
    for causal, b in ((True, None), (False, None), (True, bias), (False, bias)):
        fwd = jax.jit(cudnn.kernels._cudnn_fwd, static_argnums=(3, 4))
        out, lse = fwd(q, k, v, causal, 0.125, b)
        ref_out, ref_lse = cudnn.kernels._emulated_fwd(q, k, v, causal, 0.125, b)
        assert lse.dtype == jnp.float32 and lse.shape == (2, 8, 256)
        assert float(jnp.max(jnp.abs(lse - ref_lse))) < 2e-2
        assert float(jnp.max(jnp.abs(out.astype(jnp.float32) - ref_out.astype(jnp.float32)))) < 3e-2
        bwd = jax.jit(cudnn.kernels._cudnn_bwd, static_argnums=(6, 7))
        grads = bwd(q, k, v, ref_out, ref_lse, dout, causal, 0.125, b)
        refs = cudnn.kernels._emulated_bwd(q, k, v, ref_out, ref_lse, dout, causal, 0.125, b)
        for g, r in zip(grads, refs, strict=True):
            r = r.astype(jnp.float32)
            rel = float(jnp.max(jnp.abs(g.astype(jnp.float32) - r)) / jnp.max(jnp.abs(r)))
            assert rel < 3e-2, rel


@pytest.mark.parametrize(
    "docs", ["one", "one-positions", "long", "packed", "packed-in-order", "short-in-order"]
)
def test_blockwise_cudnn_bfloat16_with_the_stand_in_within_twice_dense(monkeypatch, docs):
    """`within_twice_dense_bfloat16` on the CPU, with cuDNN's dense stand-in: what the path
    adds around the kernels in bf16 (outputs and dK, dV of a general pair stored in bf16 piece
    by piece, float32 only while they are summed) keeps to dense bf16's error."""
    within_twice_dense_bfloat16(monkeypatch, docs)


@gpu
@pytest.mark.parametrize(
    "docs", ["one", "one-positions", "long", "packed", "packed-in-order", "short-in-order"]
)
def test_gpu_blockwise_cudnn_within_twice_dense_bfloat16(monkeypatch, docs):
    """`within_twice_dense_bfloat16` with cuDNN's own kernels."""
    within_twice_dense_bfloat16(monkeypatch, docs)


_DENSE_BFLOAT16_REFERENCES: dict = {}  # `within_twice_dense_bfloat16`'s, by length and masks


def within_twice_dense_bfloat16(monkeypatch, docs: str) -> None:
    """On one device, pieces of 256 tokens (every pair kind): the error of the cuDNN path
    against float32 dense attention is at most twice that of dense attention computed in bf16,
    forward and gradients. ``one``: no positions (the schedule known when tracing);
    ``one-positions``: the same positions given (each pair's kind decided at run time);
    ``packed-in-order``: packed documents told ``in_order`` (the masked pieces' schedule);
    ``short-in-order``: short documents told that too and their reach (each piece's band).
    On a GPU 1024 tokens in pieces of 256; on the CPU, where the stand-in computes each piece
    at -O0, half of each (the same four pieces a side, a quarter of the work)."""
    piece = 256 if ON_GPU else 128
    monkeypatch.setattr(cudnn.pairs, "PIECE", piece)
    s = 4 * piece
    q32, k32, v32 = qkv(b=2, s=s, h=8, kvh=2, d=64)
    kw = {}
    if docs == "one-positions":
        pos = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (2, s))
        kw = dict(q_positions=pos, kv_positions=pos)
    elif docs == "short-in-order":
        seg, pos = short_documents(2, s)
        kw = dict(q_positions=pos, kv_positions=pos, q_segment_ids=seg, kv_segment_ids=seg)
        kw |= dict(reach=int(_look_back(seg, s)))
    elif docs != "one":
        seg = long_documents(2, s, s * 700 // 1024) if docs == "long" else packed_segments(2, s)
        pos = document_positions(seg)
        kw = dict(q_positions=pos, kv_positions=pos, q_segment_ids=seg, kv_segment_ids=seg)
    bf = [x.astype(jnp.bfloat16) for x in (q32, k32, v32)]
    if ON_GPU:  # cuDNN's kernels, not the XLA kernel it falls back to for what cuDNN refuses
        assert cudnn.unsupported(bf[0], bf[1]) is None, cudnn.unsupported(bf[0], bf[1])
    masks = {key: x for key, x in kw.items() if key != "reach"}
    # Dense attention's programs are shared by the cases (`shared_value_and_grads`), and its
    # results by those of the same masks: ``one`` takes the positions dense attention defaults
    # to, those of ``one-positions``.
    default = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (2, s))
    dense_masks = masks or dict(q_positions=default, kv_positions=default)
    key = (s, tuple((name, np.asarray(x).tobytes()) for name, x in sorted(dense_masks.items())))
    if key not in _DENSE_BFLOAT16_REFERENCES:
        _DENSE_BFLOAT16_REFERENCES[key] = tuple(
            shared_value_and_grads("dense", *inputs, dense_masks)[:2]
            for inputs in ((q32, k32, v32), bf)
        )
    (ref, ref_g), (dense, dense_g) = _DENSE_BFLOAT16_REFERENCES[key]
    in_order = docs.endswith("in-order")
    ours, ours_g, _ = shared_value_and_grads(
        "blockwise", *bf, masks, in_order=in_order, reach=kw.get("reach")
    )

    def err(x, r):
        return float(jnp.max(jnp.abs(x.astype(jnp.float32) - r)))

    assert err(ours, ref) <= 2 * err(dense, ref) + 1e-3
    for o, d, r in zip(ours_g, dense_g, ref_g, strict=True):
        assert err(o, r) <= 2 * err(d, r) + 1e-3 * float(jnp.max(jnp.abs(r)))
