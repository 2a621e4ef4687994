"""Ring attention: blockwise attention with the sequence sharded over a mesh axis.

Each device keeps its queries; key/value chunks (with their positions and segment ids) travel
around the ring with `ppermute`, one hop per step, and each device folds the visiting chunk
into float32 softmax statistics. The backward pass sends the chunks around again, and their
key/value gradients travel with them, arriving home after the last step. Only the K/V heads
travel (grouped-query attention). Block pairs whose mask is empty are skipped, so with the
zigzag layout (`lwm.attention.layout`) every device does the same causal work at every step.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from lwm.attention._common import check_qkv, default_positions, one_document_order
from lwm.attention.blockwise import core_for, prepare_inputs, resolve_kernel
from lwm.attention.layout import Layout, layout_permutation, ring_block_size
from lwm.base.mesh import BATCH_AXES, SEQUENCE_AXIS


def ring_attention_local(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    axis_name: str | None = SEQUENCE_AXIS,
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
    platform: str | None = None,
    layout: Layout = "contiguous",
    in_order: bool = False,
    reach: int | None = None,
) -> jax.Array:
    """Ring attention on local shards; call inside `jax.shard_map` with ``axis_name`` bound
    (``axis_name=None``: the whole sequence is local, i.e. blockwise attention).

    Arguments are this device's shards (``[batch, seq/sp, heads, head_dim]``, positions
    ``[batch, seq/sp]``). Positions default to ``layout``'s order (`lwm.attention.layout`):
    contiguous (shard i holds tokens ``i*len .. (i+1)*len-1``) or zigzag; pass the positions
    for any other order. With no positions and no segment ids (one document in ``layout``'s
    order) the cuDNN kernel knows every block pair's mask when tracing and decides nothing at
    run time. ``kernel``: the block kernel (`lwm.attention.blockwise.KERNELS`) on ``platform``
    (default: JAX's backend). ``in_order``, ``reach``: as for `lwm.attention.blockwise_attention` (used by
    the cuDNN kernel where the whole sequence is on this device).
    """
    b, s_local = q.shape[0], q.shape[1]
    ring = axis_name is not None and lax.axis_size(axis_name) > 1
    given = (q_positions, kv_positions, q_segment_ids, kv_segment_ids)
    order = one_document_order(layout, q, k, *given)
    if q_positions is None or kv_positions is None:
        default = _shard_positions(layout, axis_name, b, s_local)
        q_positions = default if q_positions is None else q_positions
        kv_positions = default if kv_positions is None else kv_positions
    if ring:
        block_q, block_k = ring_block_size(s_local, block_q), ring_block_size(k.shape[1], block_k)
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
        platform=platform,
        order=order,
        in_order=in_order,
        reach=reach,
    )
    return core_for(spec)(*args, spec, axis_name)


def _layout_positions(layout: Layout, batch: int, length: int, shards: int) -> jax.Array:
    """Positions of ``length`` tokens in ``layout``'s order over ``shards``, ``[batch, length]``."""
    perm = layout_permutation(layout, length, shards)
    return jnp.broadcast_to(jnp.asarray(perm, jnp.int32), (batch, length))


def _shard_positions(layout: Layout, axis_name: str | None, batch: int, length: int):
    """This shard's positions under ``layout`` (`lwm.attention.layout`), ``[batch, length]``."""
    if axis_name is None:
        return default_positions(batch, length)
    i, n = lax.axis_index(axis_name), lax.axis_size(axis_name)
    if layout == "contiguous":
        return i * length + default_positions(batch, length)
    if layout == "zigzag":
        if length % 2:
            raise ValueError(f"zigzag layout needs an even shard length, got {length}")
        c = length // 2
        half = default_positions(batch, c)
        return jnp.concatenate([i * c + half, (2 * n - 1 - i) * c + half], axis=1)
    raise ValueError(f"positions default to a contiguous or zigzag order, not '{layout}'")


def _present(mesh: Mesh, axes: str | Sequence[str] | None):
    if axes is None:
        return None
    names = (axes,) if isinstance(axes, str) else tuple(axes)
    kept = tuple(a for a in names if a in mesh.axis_names)
    if not kept:
        return None
    return kept[0] if len(kept) == 1 else kept


def _axes_size(mesh: Mesh, axes) -> int:
    if axes is None:
        return 1
    names = (axes,) if isinstance(axes, str) else axes
    size = 1
    for a in names:
        size *= mesh.shape[a]
    return size


def ring_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    mesh: Mesh,
    causal: bool = True,
    q_positions: jax.Array | None = None,
    kv_positions: jax.Array | None = None,
    q_segment_ids: jax.Array | None = None,
    kv_segment_ids: jax.Array | None = None,
    block_q: int = 512,
    block_k: int = 512,
    axis_name: str | None = SEQUENCE_AXIS,
    batch_axes: str | Sequence[str] | None = BATCH_AXES,
    head_axis: str | None = "tp",
    scale: float | None = None,
    precision: lax.Precision | None = None,
    kernel: str = "xla",
    layout: Layout = "contiguous",
    in_order: bool = False,
    reach: int | None = None,
) -> jax.Array:
    """Ring attention on global arrays: sequence over ``axis_name`` (None: not sharded, so
    plain blockwise attention on each batch/head shard), batch over ``batch_axes``,
    heads over ``head_axis`` (axes missing from the mesh are ignored). Same semantics as
    `dense_attention` on the same (possibly permuted) token order. ``kernel``: the block
    kernel, ``xla``, ``pallas`` (interpreted unless the mesh is of TPUs), ``cudnn`` (emulated
    unless it is of NVIDIA GPUs) or ``auto``. ``layout``: the token order when positions are
    not given, ``contiguous`` or ``zigzag`` over ``axis_name`` (`lwm.attention.layout`); one
    document in a known order is the cuDNN kernel's fastest case (`ring_attention_local`).
    ``in_order``: the caller knows that no query sees a key at a later index
    (`lwm.attention.keys_precede_queries`), and ``reach`` how far back at most; the cuDNN
    kernel then checks that once per call and decides nothing else at run time where the
    sequence is not split (``axis_name`` None or of one device)."""
    check_qkv(q, k, v)
    platform = mesh.devices.flat[0].platform
    # An unknown kernel fails here, before tracing. Pallas's interpreter cannot yet evaluate
    # kernels on values that vary over manual mesh axes: it runs unchecked.
    resolved, interpret = resolve_kernel(kernel, platform)
    if axis_name is not None and axis_name not in mesh.axis_names:
        raise ValueError(
            f"ring attention axis '{axis_name}' is not in the mesh axes {mesh.axis_names}"
        )
    batch_axes = _present(mesh, batch_axes)
    head_axis = _present(mesh, head_axis)
    sp = 1 if axis_name is None else mesh.shape[axis_name]
    b, s, h, _ = q.shape
    for what, size, parts, axes in (
        ("sequence length", s, sp, axis_name),
        ("key/value length", k.shape[1], sp, axis_name),
        ("batch", b, _axes_size(mesh, batch_axes), batch_axes),
        ("key/value heads", k.shape[2], _axes_size(mesh, head_axis), head_axis),
    ):
        if size % parts:
            raise ValueError(
                f"ring attention: {what} {size} is not divisible by the {parts} devices of "
                f"mesh axes {axes}"
            )
    has_seg = q_segment_ids is not None or kv_segment_ids is not None
    # No positions and no segment ids: each shard makes its own (`ring_attention_local`).
    has_pos = has_seg or q_positions is not None or kv_positions is not None
    if has_pos:
        if q_positions is None:
            q_positions = _layout_positions(layout, b, s, sp)
        if kv_positions is None:
            kv_positions = _layout_positions(layout, b, k.shape[1], sp)

    x_spec = P(batch_axes, axis_name, head_axis, None)
    t_spec = P(batch_axes, axis_name)
    kw = dict(
        axis_name=axis_name,
        causal=causal,
        block_q=block_q,
        block_k=block_k,
        scale=scale,
        precision=precision,
        kernel=kernel,
        platform=platform,
        layout=layout,
        in_order=in_order,
        reach=reach,
    )

    def local(q, k, v, *rest):
        qp, kp, qs, ks = (*rest, None, None, None, None)[:4]
        return ring_attention_local(
            q, k, v, q_positions=qp, kv_positions=kp, q_segment_ids=qs, kv_segment_ids=ks, **kw
        )

    args = [q, k, v]
    specs = [x_spec, x_spec, x_spec]
    if has_pos:
        args += [q_positions, kv_positions]
        specs += [t_spec, t_spec]
    if has_seg:
        if q_segment_ids is None or kv_segment_ids is None:
            raise ValueError("pass both q_segment_ids and kv_segment_ids, or neither")
        args += [q_segment_ids, kv_segment_ids]
        specs += [t_spec, t_spec]
    fn = jax.shard_map(
        local,
        mesh=mesh,
        in_specs=tuple(specs),
        out_specs=x_spec,
        check_vma=not (interpret and resolved == "pallas"),
    )
    return fn(*args)
