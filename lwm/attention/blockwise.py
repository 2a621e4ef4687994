"""Blockwise (flash-style) attention: online softmax over key blocks, custom VJP.

The block kernel (`fwd_chunk`, `bwd_chunk`: `lwm.attention.blocks` in XLA, or
`lwm.attention.pallas`, chosen by ``kernel``) is written for a local shard of queries against
one chunk of keys and values; this module drives it. Single-device
blockwise attention runs it against the whole key sequence; ring attention
(`lwm.attention.ring`) runs it once per ring step against the chunk that is visiting. Softmax
statistics and accumulators are float32 whatever the input dtype; only the outputs and the
log-sum-exp are saved for the backward pass, so memory is O(seq x block), not O(seq^2).
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
from jax import lax
from jax.ad_checkpoint import checkpoint_name

from lwm.attention import blocks, cudnn, pallas
from lwm.attention._common import (
    axis_size,
    check_qkv,
    check_segments,
    default_positions,
    full,
    make_varying,
    one_document_order,
    union_vma,
)
from lwm.attention.blocks import (
    F32,
    Spec,
    blocks_q,
    effective_blocks,
    finalize_stats,
    head_major_q,
    init_stats,
    merge_head_major_kv,
    merge_head_major_q,
    merge_kv,
    merge_q,
    merge_seq_minor_kv,
    merge_seq_minor_q,
    needs_segments,
    seq_minor_q,
    split_kv,
    split_q,
)

# ----------------------------------------------------------------------------------------------
# The shared driver: one chunk per ring step. ``axis_name=None`` is plain blockwise attention.


def _ring_perm(n: int) -> list[tuple[int, int]]:
    return [(i, (i + 1) % n) for i in range(n)]


def _send(tree, axis_name: str, n: int):
    perm = _ring_perm(n)
    return jax.tree.map(lambda x: lax.ppermute(x, axis_name, perm), tree)


def _kernel(spec: Spec):
    """The block kernel the spec names: the module with ``fwd_chunk`` and ``bwd_chunk``."""
    return pallas if spec.kernel == "pallas" else blocks


def _head_major(spec: Spec, n: int) -> bool:
    """Whether the kernel takes the blocked arrays head-major (`blocks.head_major_q`): the
    Pallas kernel on one chunk (single-device blockwise attention), whose inputs and outputs
    are then transposes XLA folds into the projections around attention instead of copies
    (the ring's steps keep the layout its running statistics are kept in)."""
    return n == 1 and spec.kernel == "pallas"


# Heads narrower than this many lanes go to the Pallas kernel with the sequence minor
# (`Spec.seq_minor`); 0 turns that off (benchmarks compare both).
SEQ_MINOR_BELOW = 128


def seq_minor_layout(kernel: str, head_dim: int, block_q: int, block_k: int) -> bool:
    """Whether the Pallas kernel's single-chunk path takes its arrays with the sequence minor
    (`blocks.seq_minor_q`): for heads narrower than a TPU's 128 lanes, whose ``[.., seq, d]``
    arrays the TPU lays out that way (else it pads ``d`` to 128), when the blocks fill whole
    lanes (multiples of 128) and the head's width whole bf16 sublane tiles (16)."""
    return (
        kernel == "pallas"
        and head_dim < SEQ_MINOR_BELOW
        and head_dim % 16 == 0
        and block_q % 128 == 0
        and block_k % 128 == 0
    )


def _prepare(
    q,
    k,
    v,
    q_pos,
    kv_pos,
    q_seg,
    kv_seg,
    spec: Spec,
    head_major: bool = False,
    seq_minor: bool = False,
):
    vma = union_vma((q, k, v, q_pos, kv_pos, q_seg, kv_seg))
    # Tie the positions and segment ids to the activations. Otherwise, when attention runs in
    # a scan over layers that is differentiated, JAX hoists everything that depends only on
    # them (the per-block masks) out of the layer loop and stores it for every block pair:
    # O(seq^2) memory (33 GiB per device for LWM-7B at 32K tokens on 8 devices).
    q, k, v, q_pos, kv_pos, q_seg, kv_seg = jax.lax.optimization_barrier(
        (q, k, v, q_pos, kv_pos, q_seg, kv_seg)
    )
    # Everything carried through scans must vary over the same mesh axes (check_vma).
    qs = split_q(q, q_pos, q_seg, k.shape[2], spec.block_q, head_major, seq_minor)
    kv = split_kv(k, v, kv_pos, kv_seg, spec.block_k, head_major, seq_minor)
    qs, kv = jax.tree.map(lambda x: make_varying(x, vma), (qs, kv))
    return qs, kv, vma


def _named(out, lse):
    """The kernel's output and log-sum-exp under the names a remat policy can keep
    (`lwm.model.REMAT_POLICIES`): with both saved, recomputing a layer for its backward pass
    does not run attention again."""
    return checkpoint_name(out, "attention_out"), checkpoint_name(lse, "attention_lse")


def _forward(q, k, v, q_pos, kv_pos, q_seg, kv_seg, spec: Spec, axis_name: str | None):
    """Output (input dtype), log-sum-exp, the blocked queries and own key/value chunk, and the
    output blocked like the queries: all the backward pass needs."""
    n = axis_size(axis_name)
    head_major = _head_major(spec, n)
    seq_minor = head_major and spec.seq_minor
    qs, kv, vma = _prepare(q, k, v, q_pos, kv_pos, q_seg, kv_seg, spec, head_major, seq_minor)
    own_kv = kv
    if head_major:
        # One chunk: the kernel's normalised output is the answer, written in the inputs'
        # dtype (no float32 statistics to fold, as a ring needs between its steps).
        out, lse = pallas.flash_chunk(qs, kv, spec, q.dtype, head_major=True, seq_minor=seq_minor)
        lse = jnp.where(jnp.isneginf(lse), jnp.inf, lse)  # rows with no key: finalize_stats'
        out, lse = _named(out, lse)
        merge = merge_seq_minor_q if seq_minor else merge_head_major_q
        return merge(out, q.shape[1]), lse, qs, own_kv, out
    fwd_chunk = _kernel(spec).fwd_chunk
    stats = init_stats(qs, vma)
    if n > 1:

        def step(carry, _):
            kv, stats = carry
            incoming = _send(kv, axis_name, n)  # issued before compute, so they can overlap
            return (incoming, fwd_chunk(qs, kv, stats, spec)), None

        (kv, stats), _ = lax.scan(step, (kv, stats), None, length=n - 1)
    stats = fwd_chunk(qs, kv, stats, spec)  # the last chunk: nothing left to send
    out, lse = finalize_stats(stats)
    out, lse = _named(out.astype(q.dtype), lse)
    return merge_q(out, q.shape[1]), lse, qs, own_kv, out


def _backward(res, dout, spec: Spec, axis_name: str | None):
    qs, kv, out, lse = res  # out: blocked like the queries, in their dtype
    length = dout.shape[1]
    n = axis_size(axis_name)
    head_major = _head_major(spec, n)
    seq_minor = head_major and spec.seq_minor
    if seq_minor:
        do = seq_minor_q(dout, kv.k.shape[1], spec.block_q)
    elif head_major:
        do = head_major_q(dout, kv.k.shape[1], spec.block_q)
    else:
        do = blocks_q(dout, kv.k.shape[2], spec.block_q)
    # delta_i = sum_d dout_id * out_id, per query row, from both blocked alike: from the merged
    # output XLA made float32 copies of it in the merged layout (1 GiB at 32K tokens of 32 heads
    # on a TPU); padded rows give 0 (their dout is zero).
    delta = jnp.sum(do.astype(F32) * out.astype(F32), axis=-2 if seq_minor else -1)
    if seq_minor:  # [b, kvh, g, s'] -> blocked like the log-sum-exp
        delta = delta.reshape(lse.shape)
    if head_major:  # one chunk: gradients straight in the inputs' dtypes
        dq, dk, dv = pallas.bwd_chunk(
            qs, do, lse, delta, kv, None, spec, head_major=True, seq_minor=seq_minor
        )
        merge_q_, merge_kv_ = (
            (merge_seq_minor_q, merge_seq_minor_kv)
            if seq_minor
            else (merge_head_major_q, merge_head_major_kv)
        )
        return merge_q_(dq, length), merge_kv_(dk, spec.kv_len), merge_kv_(dv, spec.kv_len)
    bwd_chunk = _kernel(spec).bwd_chunk
    vma = union_vma(jax.tree.leaves(res))
    grads = (
        full(qs.q.shape, 0.0, F32, vma),
        full(kv.k.shape, 0.0, F32, vma),
        full(kv.k.shape, 0.0, F32, vma),
    )
    if n > 1:

        def step(carry, _):
            kv, grads = carry
            incoming = _send(kv, axis_name, n)
            dq, dk, dv = bwd_chunk(qs, do, lse, delta, kv, grads, spec)
            # The gradients of a chunk travel with it and arrive home after the last step.
            return (incoming, (dq, *_send((dk, dv), axis_name, n))), None

        (kv, grads), _ = lax.scan(step, (kv, grads), None, length=n - 1)
        dq, dk, dv = bwd_chunk(qs, do, lse, delta, kv, grads, spec)
        dk, dv = _send((dk, dv), axis_name, n)
    else:
        dq, dk, dv = bwd_chunk(qs, do, lse, delta, kv, grads, spec)
    return (
        merge_q(dq, length).astype(qs.q.dtype),
        merge_kv(dk, spec.kv_len).astype(kv.k.dtype),
        merge_kv(dv, spec.kv_len).astype(kv.v.dtype),
    )


@partial(jax.custom_vjp, nondiff_argnums=(7, 8))
def attention_core(q, k, v, q_pos, kv_pos, q_seg, kv_seg, spec: Spec, axis_name: str | None):
    """Blockwise attention of local queries against keys that are local (``axis_name=None``)
    or sharded over ``axis_name`` and passed around the ring. Inputs must be prepared by the
    public wrappers (positions given, segment ids made where padding needs them)."""
    return _forward(q, k, v, q_pos, kv_pos, q_seg, kv_seg, spec, axis_name)[0]


def _core_fwd(q, k, v, q_pos, kv_pos, q_seg, kv_seg, spec, axis_name):
    out, lse, qs, own_kv, blocked = _forward(q, k, v, q_pos, kv_pos, q_seg, kv_seg, spec, axis_name)
    return out, (qs, own_kv, blocked, lse)


def _core_bwd(spec, axis_name, res, dout):
    dq, dk, dv = _backward(res, dout, spec, axis_name)
    return dq, dk, dv, None, None, None, None


attention_core.defvjp(_core_fwd, _core_bwd)


KERNELS = ("xla", "pallas", "cudnn", "auto")
_HOME = {"pallas": "tpu", "cudnn": "gpu"}  # where a kernel runs natively


def resolve_kernel(kernel: str, platform: str | None = None) -> tuple[str, bool]:
    """The block kernel to run (``"xla"``, ``"pallas"`` or ``"cudnn"``) and whether it must be
    emulated (Pallas in interpret mode off a TPU, cuDNN's kernels by a dense float32 stand-in
    off a GPU), for ``kernel`` in `KERNELS` on ``platform`` (default: JAX's backend). ``auto``
    is Pallas on TPUs, cuDNN on GPUs and XLA elsewhere."""
    if kernel not in KERNELS:
        raise ValueError(f"unknown attention kernel '{kernel}'; choose one of {', '.join(KERNELS)}")
    platform = platform or jax.default_backend()
    if kernel == "auto":
        kernel = {"tpu": "pallas", "gpu": "cudnn"}.get(platform, "xla")
    home = _HOME.get(kernel)
    return kernel, home is not None and platform != home


def kernel_for_inputs(kernel: str, emulated: bool, q, k) -> str:
    """The kernel that runs for ``q``, ``k`` (arrays or shape structs), given `resolve_kernel`'s
    answer: the XLA kernel for inputs cuDNN's own kernels refuse (named in one log line)."""
    if kernel == "cudnn" and not emulated:
        reason = cudnn.unsupported(q, k)
        if reason:
            cudnn.log_fallback(reason)
            return "xla"
    return kernel


def core_for(spec: Spec):
    """The custom-VJP attention core of the spec's kernel (same arguments for each)."""
    return cudnn.attention_core if spec.kernel == "cudnn" else attention_core


def prepare_inputs(
    q,
    k,
    v,
    *,
    causal,
    q_positions,
    kv_positions,
    q_segment_ids,
    kv_segment_ids,
    block_q,
    block_k,
    scale,
    precision,
    kernel="xla",
    platform=None,
    order=None,
    in_order=False,
    reach=0,
):
    """Validate, fill defaults, and make the static `Spec` (for local shards under ring
    attention: lengths are what one kernel call sees). ``order``: `Spec.order`, the layout of
    one document when the caller gave no positions and no segment ids; ``in_order``,
    ``reach``: `Spec.in_order`, `Spec.reach`."""
    kernel, interpret = resolve_kernel(kernel, platform)
    check_qkv(q, k, v)
    kernel = kernel_for_inputs(kernel, interpret, q, k)
    check_segments(q_segment_ids, kv_segment_ids)
    b, sq, _, d = q.shape
    sk = k.shape[1]
    if q_positions is None:
        q_positions = default_positions(b, sq)
    if kv_positions is None:
        kv_positions = default_positions(b, sk)
    bq, bk = effective_blocks(sq, sk, block_q, block_k)
    if needs_segments(sk, bk, causal, q_segment_ids):
        q_segment_ids = jnp.zeros((b, sq), jnp.int32)
        kv_segment_ids = jnp.zeros((b, sk), jnp.int32)
    spec = Spec(
        causal=bool(causal),
        scale=float(d**-0.5 if scale is None else scale),
        block_q=bq,
        block_k=bk,
        precision=precision,
        kv_len=sk,
        kernel=kernel,
        interpret=interpret,
        order=order,
        in_order=bool(in_order),
        reach=int(reach or 0),
        seq_minor=seq_minor_layout(kernel, d, bq, bk),
    )
    args = (
        q,
        k,
        v,
        jnp.asarray(q_positions, jnp.int32),
        jnp.asarray(kv_positions, jnp.int32),
        None if q_segment_ids is None else jnp.asarray(q_segment_ids, jnp.int32),
        None if kv_segment_ids is None else jnp.asarray(kv_segment_ids, jnp.int32),
    )
    return args, spec


def blockwise_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    causal: bool = True,
    q_positions: jax.Array | None = None,
    kv_positions: jax.Array | None = None,
    q_segment_ids: jax.Array | None = None,
    kv_segment_ids: jax.Array | None = None,
    block_q: int = 512,
    block_k: int = 512,
    scale: float | None = None,
    precision: lax.Precision | None = None,
    kernel: str = "xla",
    in_order: bool = False,
    reach: int | None = None,
) -> jax.Array:
    """Memory-efficient attention on one device; same semantics as `dense_attention`.

    Sequence lengths need not be multiples of the blocks (inputs are padded internally).
    ``kernel``: the block kernel, ``xla``, ``pallas`` (interpreted off a TPU), ``cudnn``
    (emulated off a GPU) or ``auto``. ``in_order``: the caller expects that no query sees a
    key at a later index (`keys_precede_queries`: documents packed one after another, each in
    order); the cuDNN kernel then checks it once per call and, where it holds, decides nothing
    else at run time (the result is the same either way); ``reach``: with it, that no query
    looks back more than this many tokens, itself included (`look_back`), so that key pieces
    out of reach are skipped (also checked). Arrays held as ``[batch, heads, seq, head_dim]``
    can be passed swapped (``jnp.swapaxes(x, 1, 2)``, the output swapped back): with the Pallas
    kernel on one device XLA folds the swaps into the kernel's head-major blocks, no copies.
    """
    given = (q_positions, kv_positions, q_segment_ids, kv_segment_ids)
    args, spec = prepare_inputs(
        q,
        k,
        v,
        causal=causal,
        q_positions=q_positions,
        kv_positions=kv_positions,
        q_segment_ids=q_segment_ids,
        kv_segment_ids=kv_segment_ids,
        block_q=block_q,
        block_k=block_k,
        scale=scale,
        precision=precision,
        kernel=kernel,
        order=one_document_order("contiguous", q, k, *given),
        in_order=in_order,
        reach=reach,
    )
    return core_for(spec)(*args, spec, None)


def attention_flops(
    batch: int, q_len: int, kv_len: int, heads: int, head_dim: int, causal: bool
) -> float:
    """Matmul FLOPs of the attention forward pass (QK^T and PV), halved when causal."""
    flops = 4.0 * batch * heads * q_len * kv_len * head_dim
    return flops / 2 if causal else flops
