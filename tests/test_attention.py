"""Blockwise, ring and decode attention against the dense reference on 8 simulated devices."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType

from lwm.attention import blockwise_attention, dense_attention, ring_attention
from lwm.attention.decode import decode_attention_local, ring_decode_attention
from lwm.attention.layout import (
    balance,
    inverse_permutation,
    ring_schedule_work,
    ring_step_balance,
    striped_permutation,
    zigzag_permutation,
)

AXES = ("dp", "fsdp", "sp", "tp")


def mesh_of(shape):
    n = int(np.prod(shape))
    return jax.make_mesh(shape, AXES, axis_types=(AxisType.Auto,) * 4, devices=jax.devices()[:n])


def qkv(b=2, s=64, h=8, kvh=2, d=16, dtype=jnp.float32, seed=0):
    rng = np.random.default_rng(seed)
    q = rng.normal(size=(b, s, h, d))
    k = rng.normal(size=(b, s, kvh, d))
    v = rng.normal(size=(b, s, kvh, d))
    return tuple(jnp.asarray(x, dtype) for x in (q, k, v))


def packed_segments(b, s, seed=1):
    """Random document boundaries per row; ids increase along the sequence."""
    rng = np.random.default_rng(seed)
    seg = np.zeros((b, s), np.int32)
    for row in range(b):
        cuts = np.sort(rng.choice(np.arange(1, s), size=3, replace=False))
        for c in cuts:
            seg[row, c:] += 1
    return jnp.asarray(seg)


def value_and_grads(fn, q, k, v):
    """Output and (dq, dk, dv) of a fixed random projection of the output."""
    w = jnp.asarray(np.random.default_rng(7).normal(size=q.shape), jnp.float32)

    def loss(q, k, v):
        out = fn(q, k, v)
        return jnp.sum(out.astype(jnp.float32) * w), out

    (_, out), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(q, k, v)
    return out, grads


def assert_matches(fn, ref_fn, q, k, v, fwd_tol=1e-5, grad_tol=1e-4):
    out, grads = value_and_grads(fn, q, k, v)
    ref, ref_grads = value_and_grads(ref_fn, q, k, v)
    assert_close(out, grads, ref, ref_grads, fwd_tol, grad_tol)


def assert_close(out, grads, ref, ref_grads, fwd_tol=1e-5, grad_tol=1e-4):
    """``out`` within ``fwd_tol`` of ``ref`` and each of (dq, dk, dv) within ``grad_tol``
    relative (to the reference's largest magnitude), with the same shapes and dtypes."""
    assert out.shape == ref.shape and out.dtype == ref.dtype
    assert float(jnp.max(jnp.abs(out - ref))) <= fwd_tol
    for name, g, r in zip(("dq", "dk", "dv"), grads, ref_grads, strict=True):
        assert g.shape == r.shape and g.dtype == r.dtype, name
        rel = float(jnp.max(jnp.abs(g - r)) / jnp.max(jnp.abs(r)))
        assert rel <= grad_tol, f"{name} relative error {rel}"


# ---------------------------------------------------------------------------------------------
# the dense reference itself, against numpy


def numpy_attention(q, k, v, causal, q_pos, kv_pos, q_seg, kv_seg):
    """Softmax attention in float64, written out per row, head and query: a query sees a key
    where ``kv_pos <= q_pos`` (if causal) and the segment ids are equal (plain ids); a query
    that sees nothing gives zeros."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    b, sq, h, d = q.shape
    group = h // k.shape[2]
    out = np.zeros_like(q)
    for r in range(b):
        for i in range(sq):
            see = np.ones(k.shape[1], bool)
            if causal:
                see &= kv_pos[r] <= q_pos[r, i]
            if q_seg is not None:
                see &= kv_seg[r] == q_seg[r, i]
            if not see.any():
                continue
            for hd in range(h):
                scores = k[r, see, hd // group] @ q[r, i, hd] / np.sqrt(d)
                p = np.exp(scores - scores.max())
                out[r, i, hd] = (p / p.sum()) @ v[r, see, hd // group]
    return out


@pytest.mark.parametrize("causal", [True, False])
def test_dense_matches_a_numpy_reference(causal):
    """Every other kernel is tested against `dense_attention`, which shares its mask with
    blockwise, ring and decode (`_common.attention_mask`): here it is checked on its own,
    with GQA, packed documents, per-document positions and a query row that sees no key."""
    q, k, v = qkv(s=24)
    seg = np.asarray(packed_segments(2, 24))
    pos = np.zeros_like(seg)
    for r in range(2):
        for i in range(1, 24):
            pos[r, i] = 0 if seg[r, i] != seg[r, i - 1] else pos[r, i - 1] + 1
    kv_seg = seg.copy()
    kv_seg[0, seg[0] == seg[0, -1]] = 9  # row 0's last document: its queries see no key
    got = dense_attention(
        q,
        k,
        v,
        causal=causal,
        q_positions=jnp.asarray(pos),
        kv_positions=jnp.asarray(pos),
        q_segment_ids=jnp.asarray(seg),
        kv_segment_ids=jnp.asarray(kv_seg),
    )
    want = numpy_attention(q, k, v, causal, pos, pos, seg, kv_seg)
    np.testing.assert_allclose(np.asarray(got), want, atol=1e-5)
    # and with no positions or segment ids: causal by index
    idx = np.broadcast_to(np.arange(24), (2, 24))
    got = dense_attention(q, k, v, causal=causal)
    np.testing.assert_allclose(
        np.asarray(got), numpy_attention(q, k, v, causal, idx, idx, None, None), atol=1e-5
    )


# ---------------------------------------------------------------------------------------------
# blockwise, one device


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("seq,block_q,block_k", [(64, 16, 8), (50, 16, 16), (37, 64, 8)])
def test_blockwise_matches_dense(causal, seq, block_q, block_k):
    q, k, v = qkv(s=seq)
    kw = dict(causal=causal)
    assert_matches(
        lambda q, k, v: blockwise_attention(q, k, v, block_q=block_q, block_k=block_k, **kw),
        lambda q, k, v: dense_attention(q, k, v, **kw),
        q,
        k,
        v,
    )


def test_blockwise_packed_segments_and_positions():
    q, k, v = qkv(s=64)
    seg = packed_segments(2, 64)
    # Per-document positions restart at each boundary, as the loader produces them.
    pos = np.zeros((2, 64), np.int32)
    for r in range(2):
        s = np.asarray(seg[r])
        starts = np.r_[0, np.flatnonzero(np.diff(s)) + 1]
        for a, e in zip(starts, np.r_[starts[1:], 64], strict=True):
            pos[r, a:e] = np.arange(e - a)
    kw = dict(q_positions=pos, kv_positions=pos, q_segment_ids=seg, kv_segment_ids=seg)
    assert_matches(
        lambda q, k, v: blockwise_attention(q, k, v, block_q=16, block_k=16, **kw),
        lambda q, k, v: dense_attention(q, k, v, **kw),
        q,
        k,
        v,
    )


def test_fully_masked_rows_give_zero_and_finite_grads():
    q, k, v = qkv(s=32)
    # Queries of segment 1 have no key of segment 1.
    q_seg = jnp.concatenate([jnp.zeros((2, 16), jnp.int32), jnp.ones((2, 16), jnp.int32)], 1)
    kv_seg = jnp.zeros((2, 32), jnp.int32)
    kw = dict(causal=False, q_segment_ids=q_seg, kv_segment_ids=kv_seg)
    out, grads = value_and_grads(
        lambda q, k, v: blockwise_attention(q, k, v, block_q=8, block_k=8, **kw), q, k, v
    )
    assert float(jnp.abs(out[:, 16:]).max()) == 0.0
    assert all(bool(jnp.isfinite(g).all()) for g in grads)
    assert float(jnp.abs(grads[0][:, 16:]).max()) == 0.0


def test_blockwise_memory_is_linear_in_sequence():
    """Compiled temp memory of forward+backward stays far below one seq x seq score matrix."""
    s, block = 4096, 256
    q, k, v = qkv(b=1, s=s, h=1, kvh=1, d=16)

    def temp_bytes(fn):
        g = jax.jit(jax.grad(lambda q, k, v: fn(q, k, v).sum(), argnums=(0, 1, 2)))
        return g.lower(q, k, v).compile().memory_analysis().temp_size_in_bytes

    blockwise = temp_bytes(
        lambda q, k, v: blockwise_attention(q, k, v, block_q=block, block_k=block)
    )
    dense = temp_bytes(lambda q, k, v: dense_attention(q, k, v))
    scores = s * s * 4
    assert dense >= scores  # the reference materialises the scores
    assert blockwise < scores / 8, (blockwise, scores)


def test_bad_shapes_are_clear_errors():
    q, k, v = qkv(h=6, kvh=4)
    with pytest.raises(ValueError, match="multiple of key/value heads"):
        blockwise_attention(q, k, v)
    q, k, v = qkv()
    with pytest.raises(ValueError, match="both q_segment_ids and kv_segment_ids"):
        blockwise_attention(q, k, v, q_segment_ids=jnp.zeros((2, 64), jnp.int32))
    with pytest.raises(ValueError, match="block sizes must be positive"):
        blockwise_attention(q, k, v, block_q=0)


# ---------------------------------------------------------------------------------------------
# ring


@pytest.mark.parametrize("sp", [1, 2, 4, 8])
def test_ring_causal_gqa_over_sp(sp):
    q, k, v = qkv()
    mesh = mesh_of((1, 1, sp, 1))
    assert_matches(
        lambda q, k, v: ring_attention(q, k, v, mesh=mesh, block_q=4, block_k=8),
        lambda q, k, v: dense_attention(q, k, v),
        q,
        k,
        v,
    )


def test_ring_non_causal():
    q, k, v = qkv()
    mesh = mesh_of((1, 1, 4, 1))
    assert_matches(
        lambda q, k, v: ring_attention(q, k, v, mesh=mesh, causal=False, block_q=8, block_k=8),
        lambda q, k, v: dense_attention(q, k, v, causal=False),
        q,
        k,
        v,
    )


@pytest.mark.parametrize("causal", [True, False])
def test_ring_packed_segments_on_full_mesh(causal):
    """Mesh (1,2,2,2): batch over fsdp, sequence over sp, heads over tp."""
    q, k, v = qkv()
    seg = packed_segments(2, 64)
    mesh = mesh_of((1, 2, 2, 2))
    kw = dict(causal=causal, q_segment_ids=seg, kv_segment_ids=seg)
    assert_matches(
        lambda q, k, v: ring_attention(q, k, v, mesh=mesh, block_q=8, block_k=8, **kw),
        lambda q, k, v: dense_attention(q, k, v, **kw),
        q,
        k,
        v,
    )


@pytest.mark.parametrize("layout", ["zigzag", "striped"])
def test_ring_balanced_layouts_equal_dense_permuted(layout):
    sp, s = 8, 64
    perm = zigzag_permutation(s, sp) if layout == "zigzag" else striped_permutation(s, sp)
    q, k, v = qkv(s=s)
    mesh = mesh_of((1, 1, sp, 1))
    pos = jnp.broadcast_to(jnp.asarray(perm, jnp.int32), (2, s))

    def ring_fn(q, k, v):
        return ring_attention(
            q[:, perm],
            k[:, perm],
            v[:, perm],
            mesh=mesh,
            q_positions=pos,
            kv_positions=pos,
            block_q=4,
            block_k=4,
        )[:, inverse_permutation(perm)]

    assert_matches(ring_fn, lambda q, k, v: dense_attention(q, k, v), q, k, v)


@pytest.mark.parametrize("sp", [2, 8])
def test_ring_layout_without_positions_is_that_order(sp):
    """`ring_attention(layout="zigzag")` given no positions takes the sequence to be in zigzag
    order (each shard makes its own positions): the same as passing the permutation."""
    s = 64
    perm = zigzag_permutation(s, sp)
    q, k, v = qkv(s=s)
    mesh = mesh_of((1, 1, sp, 1))

    def ring_fn(q, k, v):
        out = ring_attention(
            q[:, perm], k[:, perm], v[:, perm], mesh=mesh, layout="zigzag", block_q=4, block_k=4
        )
        return out[:, inverse_permutation(perm)]

    assert_matches(ring_fn, lambda q, k, v: dense_attention(q, k, v), q, k, v)
    with pytest.raises(ValueError, match="contiguous or zigzag order, not 'striped'"):
        ring_attention(q, k, v, mesh=mesh, layout="striped")


def test_ring_shard_not_multiple_of_block():
    q, k, v = qkv(s=48)  # 24 tokens per device, blocks of 16
    mesh = mesh_of((1, 1, 2, 1))
    for causal in (True, False):
        assert_matches(
            lambda q, k, v, c=causal: ring_attention(
                q, k, v, mesh=mesh, causal=c, block_q=16, block_k=16
            ),
            lambda q, k, v, c=causal: dense_attention(q, k, v, causal=c),
            q,
            k,
            v,
        )


def test_ring_errors_name_the_problem():
    q, k, v = qkv(s=60)
    with pytest.raises(ValueError, match="sequence length 60 is not divisible by the 8 devices"):
        ring_attention(q, k, v, mesh=mesh_of((1, 1, 8, 1)))
    q, k, v = qkv(kvh=1)
    with pytest.raises(ValueError, match="key/value heads 1 is not divisible"):
        ring_attention(q, k, v, mesh=mesh_of((1, 1, 4, 2)))


def test_ring_bfloat16_error_within_twice_dense_bfloat16():
    q32, k32, v32 = qkv(s=128)
    q, k, v = (x.astype(jnp.bfloat16) for x in (q32, k32, v32))
    mesh = mesh_of((1, 1, 4, 1))
    ref = dense_attention(q32, k32, v32)
    dense_bf16 = dense_attention(q, k, v)
    ring_bf16 = jax.jit(lambda q, k, v: ring_attention(q, k, v, mesh=mesh, block_q=16, block_k=16))(
        q, k, v
    )
    assert ring_bf16.dtype == jnp.bfloat16
    err_dense = float(jnp.max(jnp.abs(dense_bf16.astype(jnp.float32) - ref)))
    err_ring = float(jnp.max(jnp.abs(ring_bf16.astype(jnp.float32) - ref)))
    assert err_ring <= 2 * err_dense + 1e-3, (err_ring, err_dense)
    # Gradients come back in the input dtype.
    _, grads = value_and_grads(
        lambda q, k, v: ring_attention(q, k, v, mesh=mesh, block_q=16, block_k=16), q, k, v
    )
    assert all(g.dtype == jnp.bfloat16 for g in grads)


def test_blockwise_bfloat16_gradients_of_packed_rows():
    """bf16 inputs, two rows of two documents: the backward runs on XLA's CPU runtime (which
    lacks some bf16 x bf16 -> f32 dots) and its gradients stay within twice the error of
    dense attention computed in bf16, against float32 dense."""
    q32, k32, v32 = qkv(s=64)
    seg = jnp.asarray(np.where(np.arange(64) < 40, 1, 2)[None].repeat(2, 0), jnp.int32)
    kw = dict(q_segment_ids=seg, kv_segment_ids=seg)
    bf = [x.astype(jnp.bfloat16) for x in (q32, k32, v32)]
    _, ref = value_and_grads(lambda q, k, v: dense_attention(q, k, v, **kw), q32, k32, v32)
    _, dense = value_and_grads(lambda q, k, v: dense_attention(q, k, v, **kw), *bf)
    _, ours = value_and_grads(
        lambda q, k, v: blockwise_attention(q, k, v, block_q=16, block_k=16, **kw), *bf
    )
    for o, d, r in zip(ours, dense, ref, strict=True):
        assert o.dtype == jnp.bfloat16
        err = float(jnp.max(jnp.abs(o.astype(jnp.float32) - r)))
        err_dense = float(jnp.max(jnp.abs(d.astype(jnp.float32) - r)))
        assert err <= 2 * err_dense + 1e-3 * float(jnp.max(jnp.abs(r))), (err, err_dense)


def test_ring_inside_an_outer_shard_map():
    """The local variant composes with a caller's own shard_map (as the model uses it)."""
    from jax.sharding import PartitionSpec as P

    from lwm.attention import ring_attention_local

    q, k, v = qkv()
    mesh = mesh_of((1, 2, 2, 2))
    spec = P(("dp", "fsdp"), "sp", "tp", None)
    fn = jax.shard_map(
        lambda q, k, v: ring_attention_local(q, k, v, axis_name="sp", block_q=8, block_k=8),
        mesh=mesh,
        in_specs=(spec, spec, spec),
        out_specs=spec,
        check_vma=True,
    )
    assert_matches(fn, lambda q, k, v: dense_attention(q, k, v), q, k, v)


# ---------------------------------------------------------------------------------------------
# decode


@pytest.mark.parametrize(
    "mesh_shape,block", [((1, 1, 8, 1), 512), ((1, 1, 8, 1), 4), ((1, 2, 2, 2), 8), (None, 16)]
)
def test_decode_matches_dense_on_partly_filled_cache(mesh_shape, block):
    b, max_len, h, kvh, d, new = 2, 64, 8, 2, 16, 3
    q, _, _ = qkv(b=b, s=new, h=h, kvh=kvh, d=d, seed=3)
    _, k_cache, v_cache = qkv(b=b, s=max_len, h=h, kvh=kvh, d=d, seed=4)
    cache_len = jnp.asarray([21, 40], jnp.int32)  # neither fills the cache; not shard-aligned
    if block < 64:  # the blocks past the longest row are never read: NaN there changes nothing
        unread = -(-40 // block) * block
        k_cache, v_cache = (x.at[:, unread:].set(jnp.nan) for x in (k_cache, v_cache))
    if mesh_shape is None:
        slots = jnp.broadcast_to(jnp.arange(max_len), (b, max_len))
        out = jax.jit(
            lambda q, k, v, n: decode_attention_local(
                q, k, v, cache_len=n, q_positions=n[:, None] - new + jnp.arange(new),
                kv_positions=slots, axis_name=None, block=block,
            )
        )(q, k_cache, v_cache, cache_len)  # fmt: skip
    else:
        out = jax.jit(
            lambda q, k, v, n: ring_decode_attention(
                q, k, v, mesh=mesh_of(mesh_shape), cache_len=n, block=block
            )
        )(q, k_cache, v_cache, cache_len)
    for row in range(b):
        n = int(cache_len[row])
        ref = dense_attention(
            q[row : row + 1],
            k_cache[row : row + 1, :n],
            v_cache[row : row + 1, :n],
            q_positions=jnp.arange(n - new, n)[None],
            kv_positions=jnp.arange(n)[None],
        )
        assert float(jnp.max(jnp.abs(out[row : row + 1] - ref))) <= 1e-5


def test_decode_cache_is_never_communicated():
    """The only collectives in the compiled decode are reductions of the small partials."""
    q, _, _ = qkv(b=1, s=1, seed=3)
    _, k_cache, v_cache = qkv(b=1, s=64, seed=4)
    mesh = mesh_of((1, 1, 8, 1))
    hlo = (
        jax.jit(lambda q, k, v: ring_decode_attention(q, k, v, mesh=mesh, cache_len=40))
        .lower(q, k_cache, v_cache)
        .compile()
        .as_text()
    )
    assert "collective-permute" not in hlo and "all-gather" not in hlo
    assert "all-reduce" in hlo


# ---------------------------------------------------------------------------------------------
# load balance


def test_zigzag_balances_causal_work():
    for n in (4, 8):
        zig = ring_schedule_work(8192 * n // 4, n, block_q=256, block_k=256, layout="zigzag")
        contiguous = ring_schedule_work(
            8192 * n // 4, n, block_q=256, block_k=256, layout="contiguous"
        )
        assert zig.sum() == contiguous.sum()  # the same blocks in total, spread evenly
        assert balance(zig) <= 1.1 and ring_step_balance(zig) <= 1.1
        assert 1.5 <= balance(contiguous) <= 2.0
        assert ring_step_balance(contiguous) >= 1.5


def test_schedule_counts_only_causally_live_blocks():
    # One device, 4 blocks: the causal triangle has 10 live block pairs.
    assert ring_schedule_work(64, 1, block_q=16, block_k=16, layout="contiguous").tolist() == [[10]]
    assert ring_schedule_work(64, 1, block_q=16, block_k=16, causal=False).tolist() == [[16]]


def test_layout_permutations():
    perm = zigzag_permutation(16, 2)
    assert perm.tolist() == [0, 1, 2, 3, 12, 13, 14, 15, 4, 5, 6, 7, 8, 9, 10, 11]
    assert striped_permutation(8, 2).tolist() == [0, 2, 4, 6, 1, 3, 5, 7]
    assert (perm[inverse_permutation(perm)] == np.arange(16)).all()
    with pytest.raises(ValueError, match="divisible by 2 x num_shards"):
        zigzag_permutation(12, 4)


def test_ring_in_a_differentiated_layer_scan_keeps_linear_memory():
    """Regression: inside a scan whose xs are differentiated (the model's layer loop), JAX used
    to hoist the position-only mask computation out of the loop and keep every block pair's
    mask: O(seq^2) memory. The attention ties positions to activations to prevent it."""
    mesh = mesh_of((1, 1, 8, 1))
    s = 8192
    x = jax.ShapeDtypeStruct((1, s, 4, 32), jnp.float32)

    def attn(q, k, v):
        return ring_attention(q, k, v, mesh=mesh, block_q=128, block_k=128)

    def plain(q, k, v):
        return attn(q, k, v).sum()

    def layers(q, k, v):
        step = lambda c, w: (attn(c * w, k, v), None)  # noqa: E731
        return jax.lax.scan(step, q, jnp.ones((2,)))[0].sum()

    def temp(fn):
        g = jax.jit(jax.grad(fn, argnums=(0, 1, 2)))
        return g.lower(x, x, x).compile().memory_analysis().temp_size_in_bytes

    masks_of_all_block_pairs = (s // 8 // 128) ** 2 * 4 * 128 * 128  # bool, one device
    assert temp(layers) < 2 * temp(plain) + masks_of_all_block_pairs // 4


# ---------------------------------------------------------------------------------------------
# the Pallas block kernel (interpret mode off a TPU)


def document_positions(seg):
    """Positions restarting at 0 in every document, as the training loader writes them."""
    seg = np.asarray(seg)
    pos = np.zeros_like(seg)
    for row in range(seg.shape[0]):
        for i in range(1, seg.shape[1]):
            pos[row, i] = 0 if seg[row, i] != seg[row, i - 1] else pos[row, i - 1] + 1
    return jnp.asarray(pos)


@pytest.mark.parametrize("mesh_shape", [(1, 1, 8, 1), (1, 2, 2, 2)])
def test_ring_with_pallas_kernel_equals_dense(mesh_shape):
    """Causal, packed documents (positions restarting per document), GQA (8 query heads on 2
    key/value heads), zigzag layout: the ring with the Pallas block kernel equals dense
    attention on the same token order, output to 1e-5 and gradients to 1e-4 (fp32)."""
    sp, s = mesh_shape[2], 64
    perm = zigzag_permutation(s, sp)
    q, k, v = qkv(s=s)
    seg = packed_segments(2, s)[:, perm]
    pos = document_positions(packed_segments(2, s))[:, perm]
    kw = dict(q_positions=pos, kv_positions=pos, q_segment_ids=seg, kv_segment_ids=seg)
    mesh = mesh_of(mesh_shape)
    assert_matches(
        lambda q, k, v: ring_attention(
            q, k, v, mesh=mesh, block_q=4, block_k=4, kernel="pallas", **kw
        ),
        lambda q, k, v: dense_attention(q, k, v, **kw),
        q[:, perm],
        k[:, perm],
        v[:, perm],
    )


@pytest.mark.parametrize("causal", [True, False])
def test_blockwise_pallas_kernel_equals_dense(causal):
    """One device, uneven lengths (padding inside the last block), rows that see no key."""
    q, k, v = qkv(s=40, h=4, kvh=2)
    seg = jnp.concatenate([jnp.zeros((2, 30), jnp.int32), jnp.ones((2, 10), jnp.int32)], 1)
    kw = dict(causal=causal, q_segment_ids=seg, kv_segment_ids=seg.at[:, 30:].set(5))

    def fn(q, k, v):
        return blockwise_attention(q, k, v, block_q=16, block_k=8, kernel="pallas", **kw)

    assert "pallas_call" in str(jax.make_jaxpr(jax.grad(lambda *a: fn(*a).sum()))(q, k, v))
    assert_matches(
        fn,
        lambda q, k, v: dense_attention(q, k, v, **kw),
        q,
        k,
        v,
    )


@pytest.mark.parametrize("seq_minor", [True, False])
def test_blockwise_pallas_kernel_for_narrow_heads_equals_dense(seq_minor, monkeypatch):
    """Heads of 32 (narrower than a TPU's 128 lanes) with blocks of 128: the Pallas kernel
    takes q, k, v, dO and its outputs with the sequence minor (`seq_minor_q`; its backward's
    dK/dV kernel works on [block_k, block_q] tiles with the statistics as rows) and equals
    dense attention, as the head-dim-minor path does (``SEQ_MINOR_BELOW=0``). Rows packed as
    training packs QA records (a video turn every question sees, question turns, positions
    restarting per document), GQA, the last block padded."""
    import lwm.attention.blockwise as blockwise_module
    from data.batches import turn_segment_ids

    if not seq_minor:
        monkeypatch.setattr(blockwise_module, "SEQ_MINOR_BELOW", 0)
    s = 300
    q, k, v = qkv(s=s, h=4, kvh=2, d=32)
    seg = np.ones((2, s), np.int32)
    pos = np.tile(np.arange(s, dtype=np.int32), (2, 1))
    cuts, ids = [0, 140, 200, 250, s], [turn_segment_ids(2, t) for t in range(4)]
    for (lo, hi), sid in zip(zip(cuts[:-1], cuts[1:], strict=True), ids, strict=True):
        seg[1, lo:hi] = sid
    pos[1] = np.arange(s)  # one document of turns
    seg[0, 170:] = 3
    pos[0, 170:] = np.arange(s - 170)
    kw = dict(
        q_segment_ids=jnp.asarray(seg),
        kv_segment_ids=jnp.asarray(seg),
        q_positions=jnp.asarray(pos),
        kv_positions=jnp.asarray(pos),
    )

    def fn(q, k, v):
        return blockwise_attention(q, k, v, block_q=128, block_k=128, kernel="pallas", **kw)

    jaxpr = str(jax.make_jaxpr(jax.grad(lambda *a: fn(*a).sum()))(q, k, v))
    assert "pallas_call" in jaxpr
    # the queries [b, kv heads, group, d, padded seq] (seq minor) or [b, kvh, g, nq, bq, d]
    assert ("f32[2,2,2,32,384]" in jaxpr) == seq_minor
    assert ("f32[2,2,2,3,128,32]" in jaxpr) != seq_minor
    assert_matches(fn, lambda q, k, v: dense_attention(q, k, v, **kw), q, k, v)


def test_unknown_kernel_is_a_clear_error():
    q, k, v = qkv()
    with pytest.raises(ValueError, match="unknown attention kernel 'cuda'; choose one of xla"):
        ring_attention(q, k, v, mesh=mesh_of((1, 1, 8, 1)), kernel="cuda")


def test_pallas_fetch_table_points_dead_tiles_at_the_next_live_block():
    from lwm.attention.pallas import fetch_table

    kinds = jnp.asarray([[[2, 0, 0, 1, 0], [0, 0, 0, 0, 0], [0, 1, 0, 0, 0]]], jnp.int32)
    across = [[0, 3, 3, 3, 1], [1, 1, 1, 1, 1], [1, 1, 0, 0, 0]]
    within = [[0, 3, 3, 3, 0], [0, 0, 0, 0, 0], [1, 1, 1, 1, 1]]
    np.testing.assert_array_equal(np.asarray(fetch_table(kinds, across_rows=True))[0], across)
    np.testing.assert_array_equal(np.asarray(fetch_table(kinds, across_rows=False))[0], within)
