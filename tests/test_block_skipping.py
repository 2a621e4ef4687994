"""Dead attention blocks are skipped, not computed and masked afterwards (issue 55).

Every parity test against dense attention would pass a kernel that computed every (query
block, key block) pair and masked the scores afterwards; the packed-row speed depends on the
pairs the mask makes dead not being computed at all. So here the keys and values of one key
block at a time are NaN: a pair that is computed spreads the NaN into its query rows
(``0 * NaN`` once the values are summed, whatever the mask says), a pair that is skipped
leaves them as they were. Rows of four documents packed one after another, positions
restarting in each, in blocks of 8 tokens that the documents' boundaries fall between: a
block pair is dead above the diagonal of a document, and between documents. For each block
kernel (XLA; Pallas, interpreted; the cuDNN schedule with its dense stand-in, in pieces of 8;
the zigzag ring with each of them), the rows of the query blocks for which the poisoned block
is dead must come out exactly as without the poison, and so must their dQ; every row of a live
pair must come out NaN (the poison reaches what is computed). Dense attention computes every
pair: it fails this check, which the last test asserts.

Which pairs are dead is worked out here from the documents (a query sees the keys of its own
document at or before its position), not by the package's `block_is_live`."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_attention import mesh_of, qkv

import lwm.attention.cudnn as cudnn
from lwm.attention import blockwise_attention, dense_attention, ring_attention
from lwm.attention.layout import inverse_permutation, zigzag_permutation

BLOCK = 8
DOCUMENTS = (16, 8, 24, 16)  # tokens per document, each a whole number of blocks
S = sum(DOCUMENTS)


def rows():
    """Segment ids and positions ``[1, S]`` of one row of the packed documents."""
    seg = np.concatenate([np.full(n, d + 1, np.int32) for d, n in enumerate(DOCUMENTS)])
    pos = np.concatenate([np.arange(n, dtype=np.int32) for n in DOCUMENTS])
    return seg[None], pos[None]


def dead_pairs() -> np.ndarray:
    """bool ``[query block, key block]``: no query of the one sees a key of the other."""
    seg, pos = (x[0] for x in rows())
    seen = (seg[:, None] == seg[None, :]) & (pos[None, :] <= pos[:, None])
    n = S // BLOCK
    return ~seen.reshape(n, BLOCK, n, BLOCK).any(axis=(1, 3))


def out_and_dq(fn, q, k, v):
    """Output and dQ of a fixed random projection of the output."""
    w = jnp.asarray(np.random.default_rng(7).normal(size=q.shape), jnp.float32)

    def loss(q):
        out = fn(q, k, v)
        return jnp.sum(out * w), out

    (_, out), dq = jax.value_and_grad(loss, has_aux=True)(q)
    return out, dq


def check_dead_blocks_are_skipped(fn) -> None:
    """``fn(q, k, v)`` (attention on the rows of `rows`, tokens in their order) with each key
    block poisoned in turn: see the module docstring."""
    q, k, v = qkv(b=1, s=S, h=4, kvh=2, d=8)
    step = jax.jit(lambda q, k, v: out_and_dq(fn, q, k, v))

    def run(q, k, v):
        return tuple(np.asarray(x) for x in step(q, k, v))

    ref_out, ref_dq = run(q, k, v)
    assert np.isfinite(ref_out).all() and np.isfinite(ref_dq).all()
    dead = dead_pairs()
    for j in range(S // BLOCK):
        assert dead[:, j].any() and not dead[:, j].all()  # the layout has both kinds
        cut = slice(j * BLOCK, (j + 1) * BLOCK)
        out, dq = run(q, k.at[:, cut].set(jnp.nan), v.at[:, cut].set(jnp.nan))
        quiet = np.repeat(dead[:, j], BLOCK)  # the rows of query blocks that skip block j
        assert np.array_equal(out[:, quiet], ref_out[:, quiet]), f"key block {j}: outputs"
        assert np.array_equal(dq[:, quiet], ref_dq[:, quiet]), f"key block {j}: dQ"
        assert np.isnan(out[:, ~quiet]).all(), f"key block {j}: the poison did not reach"


def kwargs(perm=None) -> dict:
    seg, pos = (jnp.asarray(x if perm is None else x[:, perm]) for x in rows())
    return dict(q_positions=pos, kv_positions=pos, q_segment_ids=seg, kv_segment_ids=seg)


@pytest.fixture
def pieces_of_a_block(monkeypatch):
    """cuDNN's pairs cut into pieces of one block: its unit of skipping (`pairs.PIECE`)."""
    monkeypatch.setattr(cudnn.pairs, "PIECE", BLOCK)


@pytest.mark.parametrize("kernel", ["xla", "pallas_interpreted", "cudnn_schedule_with_standin"])
def test_blockwise_skips_dead_blocks(kernel, pieces_of_a_block):
    kernel = kernel.split("_")[0]

    def fn(q, k, v):
        kw = dict(block_q=BLOCK, block_k=BLOCK, kernel=kernel)
        return blockwise_attention(q, k, v, **kw, **kwargs())

    check_dead_blocks_are_skipped(fn)


@pytest.mark.parametrize("kernel", ["xla", "pallas_interpreted", "cudnn_schedule_with_standin"])
def test_zigzag_ring_skips_dead_blocks(kernel, pieces_of_a_block):
    """Four devices, the zigzag layout: each device's shard is two runs of 8 tokens, so a
    block of the ring is a block of the global order."""
    kernel = kernel.split("_")[0]
    mesh = mesh_of((1, 1, 4, 1))
    perm = zigzag_permutation(S, 4)
    inv = inverse_permutation(perm)

    def fn(q, k, v):
        q, k, v = (x[:, perm] for x in (q, k, v))
        kw = dict(block_q=BLOCK, block_k=BLOCK, kernel=kernel, layout="zigzag")
        return ring_attention(q, k, v, mesh=mesh, **kw, **kwargs(perm))[:, inv]

    check_dead_blocks_are_skipped(fn)


def test_dense_attention_computes_every_block_and_fails_the_check():
    """The check can fail: dense attention (the reference) computes every pair, so the
    poison of any key block reaches every row."""
    with pytest.raises(AssertionError, match="key block 0: outputs"):
        check_dead_blocks_are_skipped(lambda q, k, v: dense_attention(q, k, v, **kwargs()))
