"""The LWM transformer in Flax NNX: LLaMA-2 blocks with a text and a vision embedding and head.

Per position, ``vision_mask`` picks the embedding table (``embed_text`` or ``embed_vision``);
the model returns both text and vision logits, and the loss uses the head of the target's
modality (as LWM's ``FlaxVideoLLaMA``). Rotary embeddings are driven by the given positions,
so packed documents and permuted (zigzag) layouts need nothing special. Parameter names,
shapes and logical axes come from the one table in `lwm.info.param_specs`.

    model = create_model(cfg, mesh=mesh, seed=0)      # parameters born sharded
    text_logits, vision_logits = model(tokens, vision_mask, positions, segment_ids)
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import Mesh, NamedSharding, SingleDeviceSharding
from jax.sharding import PartitionSpec as P

from data.tokens import EOF_ID, EOV_ID, frame_cells, frame_window
from lwm.attention import (
    blockwise_attention,
    default_positions,
    dense_attention,
    keys_precede_queries,
    look_back,
    ring_attention,
)
from lwm.attention.layout import Layout, layout_permutation
from lwm.base.mesh import SEQUENCE_AXIS, check_batch_fits, logical_sharding, logical_to_spec
from lwm.base.precision import PRECISIONS, with_precision
from lwm.config import ModelConfig
from lwm.info import ParamSpec, layer_param_specs, param_specs


def sequence_layout(cfg: ModelConfig, sp: int) -> Layout:
    """The order of each row's tokens over ``sp`` sequence shards: zigzag under ring attention
    with ``cfg.zigzag`` (load-balanced causal work, `lwm.attention.layout`), else contiguous.
    `lwm train` lays its batches out in this order and the model's attention assumes it."""
    return "zigzag" if cfg.attention == "ring" and cfg.zigzag and sp > 1 else "contiguous"


def row_permutation(cfg: ModelConfig, seq_len: int, sp: int) -> np.ndarray | None:
    """The permutation `lwm train` applies to each row (`sequence_layout`'s order), or None
    where that order is the sequence's own (contiguous)."""
    order = sequence_layout(cfg, sp)
    return None if order == "contiguous" else layout_permutation(order, seq_len, sp)


# What is known of the order of each row's tokens, from least to most (`row_order`); with the
# cuDNN kernel each allows a faster attention schedule (`lwm.attention.cudnn`). ``any``:
# positions and segment ids decide at run time, pair by pair; ``in_order``: no query sees a key
# at a later index (documents packed one after another, `keys_precede_queries`), so attention
# decides one thing per call (that this holds) where the sequence is not split over devices;
# ``one_document``: every row is one document in the model's layout (`one_document_rows`), so
# attention needs no positions and decides nothing at run time.
ROW_ORDERS = ("any", "in_order", "one_document")


def one_document_rows(positions, segment_ids, layout: Layout, sp: int, xp=jnp):
    """Whether every row is one document (one segment id throughout) whose positions are
    ``layout``'s own order over ``sp`` shards: a scalar bool, traced (``xp=jnp``) or on the
    host (``xp=np``)."""
    order = xp.asarray(layout_permutation(layout, positions.shape[1], sp), positions.dtype)
    one_segment = xp.all(segment_ids == segment_ids[:, :1])
    return one_segment & xp.all(positions == order[None])


def row_order(
    positions: np.ndarray,
    segment_ids: np.ndarray,
    layout: Layout,
    sp: int,
    orders: tuple[str, ...] = ROW_ORDERS,
) -> str:
    """The most specific of ``orders`` (`ROW_ORDERS`) that holds for every row of a batch on
    the host (numpy ``[batch, seq]``, in ``layout``'s order over ``sp`` shards): what
    ``hidden_states(rows=...)`` may be told. ``any`` always holds."""
    if "one_document" in orders and one_document_rows(positions, segment_ids, layout, sp, np):
        return "one_document"
    if "in_order" in orders and keys_precede_queries(positions, segment_ids, np):
        return "in_order"
    return "any"


def row_reach(segment_ids: np.ndarray) -> int:
    """How far back any query of rows in order looks, in tokens (`look_back` on the host),
    rounded up (`round_reach`): what ``hidden_states(rows="in_order", reach=...)`` may be
    told."""
    return round_reach(int(look_back(segment_ids, segment_ids.shape[1], np)))


def round_reach(tokens: int) -> int:
    """``tokens`` rounded up to a power of two, so that a run compiles few programs."""
    return 1 << (tokens - 1).bit_length()


def row_schedule(
    positions: np.ndarray,
    segment_ids: np.ndarray,
    layout: Layout,
    sp: int,
    orders: tuple[str, ...] = ROW_ORDERS,
) -> tuple[str, int]:
    """A batch's `row_order` and, for rows in order, its `row_reach` (else 0): the ``rows``
    and ``reach`` its train step is compiled for (`lwm train`, `benchmarks/bench_train.py`)."""
    order = row_order(positions, segment_ids, layout, sp, orders)
    return order, row_reach(segment_ids) if order == "in_order" else 0


# What a layer's remat keeps for the backward pass (the rest is recomputed from the layer's
# input). ``attention_saveable``: the attention kernel's output and log-sum-exp (named in
# `lwm.attention.blockwise`), so that the recomputation skips attention, which at long
# sequences is most of a layer's forward, for a few bytes per token and head;
# ``attention_dots_saveable``: those and the projections' outputs.
_ATTENTION = jax.checkpoint_policies.save_only_these_names("attention_out", "attention_lse")
REMAT_POLICIES = {
    "nothing_saveable": jax.checkpoint_policies.nothing_saveable,
    "dots_saveable": jax.checkpoint_policies.dots_saveable,
    "dots_with_no_batch_dims_saveable": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
    "attention_saveable": _ATTENTION,
    "attention_dots_saveable": jax.checkpoint_policies.save_from_both_policies(
        _ATTENTION, jax.checkpoint_policies.dots_with_no_batch_dims_saveable
    ),
    "everything_saveable": jax.checkpoint_policies.everything_saveable,
}


LAYER_INPUT = "layer_input"  # the name of each layer's input in `LWMModel.run_layers`


def with_offloaded_inputs(policy):
    """``policy`` with each layer's input (named `LAYER_INPUT`) kept in pinned host memory for
    the backward pass instead of on the device (`ModelConfig.offload_layer_inputs`)."""
    offload = jax.checkpoint_policies.save_and_offload_only_these_names(
        names_which_can_be_saved=(),
        names_which_can_be_offloaded=(LAYER_INPUT,),
        offload_src="device",
        offload_dst="pinned_host",
    )

    def offloading(prim, *args, **params):
        if prim.name == "name" and params.get("name") == LAYER_INPUT:
            return offload(prim, *args, **params)
        return policy(prim, *args, **params)

    return offloading


def _dtype(name: str) -> jnp.dtype:
    return jnp.dtype(name)


def _param(rngs: nnx.Rngs, spec: ParamSpec, cfg: ModelConfig, stack: int | None) -> nnx.Param:
    """A parameter of ``spec`` (with a leading ``layers`` axis when stacked for scanning)."""
    shape, axes = spec.shape, spec.axes
    if stack is not None:
        shape, axes = (stack, *shape), ("layers", *axes)
    dtype = _dtype(cfg.param_dtype)
    if axes[-1] == "norm":
        value = jnp.ones(shape, dtype)
    else:
        value = (cfg.initializer_range * jax.random.normal(rngs.params(), shape)).astype(dtype)
    return nnx.Param(value, axes=axes)


class Attention(nnx.Module):
    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs, stack: int | None = None):
        specs = layer_param_specs(cfg)
        self.q = _param(rngs, specs["attn.q"], cfg, stack)
        self.k = _param(rngs, specs["attn.k"], cfg, stack)
        self.v = _param(rngs, specs["attn.v"], cfg, stack)
        self.o = _param(rngs, specs["attn.o"], cfg, stack)


class MLP(nnx.Module):
    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs, stack: int | None = None):
        specs = layer_param_specs(cfg)
        self.gate = _param(rngs, specs["mlp.gate"], cfg, stack)
        self.up = _param(rngs, specs["mlp.up"], cfg, stack)
        self.down = _param(rngs, specs["mlp.down"], cfg, stack)


class Block(nnx.Module):
    """One pre-norm transformer block. With ``stack=L`` it holds all L blocks' parameters
    stacked along a leading axis, for `jax.lax.scan`."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs, stack: int | None = None):
        specs = layer_param_specs(cfg)
        self.attn_norm = _param(rngs, specs["attn_norm"], cfg, stack)
        self.attn = Attention(cfg, rngs, stack)
        self.mlp_norm = _param(rngs, specs["mlp_norm"], cfg, stack)
        self.mlp = MLP(cfg, rngs, stack)


# ---------------------------------------------------------------------------------------------
# Functional pieces (operate on arrays, so the scanned and unscanned paths share them)


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """LWM's RMSNorm, with the weight applied in float32 before the cast back to ``x``'s dtype
    (LWM casts the normalised ``x`` to the compute dtype first, then multiplies: the same in
    float32, one rounding apart in bfloat16)."""
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return (xf * weight.astype(jnp.float32)).astype(x.dtype)


def rope_tables(
    positions: jax.Array, head_dim: int, theta: float, rope_dims: int | None = None
) -> tuple[jax.Array, jax.Array]:
    """cos/sin ``[batch, seq, 1, rope_dims]`` (float32) for the rotate-half convention, over
    the first ``rope_dims`` dimensions of a head (None: all ``head_dim``)."""
    rot = head_dim if rope_dims is None else rope_dims
    inv_freq = 1.0 / (theta ** (jnp.arange(0, rot, 2, dtype=jnp.float32) / rot))
    freqs = positions.astype(jnp.float32)[..., None] * inv_freq
    emb = jnp.concatenate([freqs, freqs], axis=-1)[:, :, None, :]
    return jnp.cos(emb), jnp.sin(emb)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotary embedding of ``x [..., head_dim]``; when the tables are narrower than a head
    (`ModelConfig.rope_dims`), only its first dimensions rotate and the rest pass through
    (partial rotary, as GPT-NeoX's ``rotary_pct``). Computed in the tables' dtype (float32 from
    `rope_tables`, as LWM does), returned in ``x``'s."""
    rot = cos.shape[-1]
    xf = x.astype(cos.dtype)
    xr, rest = xf[..., :rot], xf[..., rot:]
    half = rot // 2
    rotated = jnp.concatenate([-xr[..., half:], xr[..., :half]], axis=-1)
    return jnp.concatenate([xr * cos + rotated * sin, rest], axis=-1).astype(x.dtype)


class LWMModel(nnx.Module):
    """LLaMA-2 transformer over interleaved text and vision tokens (LWM's FlaxVideoLLaMA)."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, mesh: Mesh | None = None):
        self.cfg = cfg
        self.mesh = mesh
        specs = param_specs(cfg)
        self.embed_text = _param(rngs, specs["embed_text"], cfg, None)
        self.embed_vision = _param(rngs, specs["embed_vision"], cfg, None)
        if cfg.vision_grid is not None:
            self.embed_vision_row = _param(rngs, specs["embed_vision_row"], cfg, None)
            self.embed_vision_col = _param(rngs, specs["embed_vision_col"], cfg, None)
        if cfg.vision_window:
            self.embed_vision_window = _param(rngs, specs["embed_vision_window"], cfg, None)
        if cfg.scan_layers:
            self.layers = Block(cfg, rngs, stack=cfg.num_layers)
        else:
            self.layers = nnx.List([Block(cfg, rngs) for _ in range(cfg.num_layers)])
        self.final_norm = _param(rngs, specs["final_norm"], cfg, None)
        if not cfg.tie_word_embeddings:
            self.lm_head = _param(rngs, specs["lm_head"], cfg, None)
        if not cfg.tie_vision_embeddings:
            self.vision_head = _param(rngs, specs["vision_head"], cfg, None)

    # -- sharding helpers -------------------------------------------------------------------

    def _constrain(self, x: jax.Array, *logical: str | None) -> jax.Array:
        if self.mesh is None:
            return x
        return jax.lax.with_sharding_constraint(x, logical_sharding(self.mesh, logical))

    def _weight(self, param: nnx.Param, dtype) -> jax.Array:
        """A weight gathered over its ``embed`` (FSDP) dimension, still split over ``tp``."""
        w = param[...].astype(dtype)
        if self.mesh is None:
            return w
        axes = param.get_metadata()["axes"][-w.ndim :]
        return self._constrain(w, *(None if a == "embed" else a for a in axes))

    @property
    def sequence_shards(self) -> int:
        """Devices of the mesh's sequence axis (1 without a mesh)."""
        return 1 if self.mesh is None else self.mesh.shape.get(SEQUENCE_AXIS, 1)

    @property
    def layout(self) -> Layout:
        """The order of each row's tokens over the mesh (`sequence_layout`)."""
        return sequence_layout(self.cfg, self.sequence_shards)

    def rows_are_one_document(self, positions: jax.Array, segment_ids: jax.Array) -> jax.Array:
        """`one_document_rows` in this model's layout, traced: whether ``hidden_states`` may
        be told ``rows="one_document"``."""
        return one_document_rows(positions, segment_ids, self.layout, self.sequence_shards)

    def _attention(self, q, k, v, positions, segment_ids, in_order: bool = False, reach: int = 0):
        """Attention of one layer; ``positions`` and ``segment_ids`` None: every row is one
        document in `layout`'s order (``hidden_states(rows="one_document")``); ``in_order``:
        no query sees a later key, nor one more than ``reach`` tokens back (``rows="in_order"``)."""
        cfg = self.cfg
        kw = dict(
            q_positions=positions,
            kv_positions=positions,
            q_segment_ids=segment_ids,
            kv_segment_ids=segment_ids,
        )
        if cfg.attention == "dense":
            return dense_attention(q, k, v, **kw)
        blocks = dict(
            block_q=cfg.block_q,
            block_k=cfg.block_k,
            precision=PRECISIONS[cfg.matmul_precision],  # its backward is traced later
            kernel=cfg.attention_kernel,
            in_order=in_order,
            reach=reach,
        )
        if cfg.attention == "ring" and self.mesh is not None:
            return ring_attention(q, k, v, mesh=self.mesh, layout=self.layout, **kw, **blocks)
        if self.mesh is None:
            return blockwise_attention(q, k, v, **kw, **blocks)
        # Blockwise on a mesh: each device attends its batch/head slice over the whole sequence.
        return ring_attention(q, k, v, mesh=self.mesh, axis_name=None, **kw, **blocks)

    # -- the block --------------------------------------------------------------------------

    def _block(self, p: Block, x, cos, sin, attend, layer_in):
        """One block. ``attend(q, k, v, layer_in) -> (o, layer_out)`` is the attention step:
        plain attention for training, attention that also returns K/V for a prefill, or an
        update of this layer's KV cache and attention against it for decoding."""
        cfg = self.cfg
        dt = x.dtype
        b, s, _ = x.shape
        h = rms_norm(x, p.attn_norm[...], cfg.rms_norm_eps)
        q = (h @ self._weight(p.attn.q, dt)).reshape(b, s, cfg.num_heads, cfg.head_dim)
        k = (h @ self._weight(p.attn.k, dt)).reshape(b, s, cfg.num_kv_heads, cfg.head_dim)
        v = (h @ self._weight(p.attn.v, dt)).reshape(b, s, cfg.num_kv_heads, cfg.head_dim)
        q = self._constrain(apply_rope(q, cos, sin), "batch", "length", "act_heads", None)
        k = self._constrain(apply_rope(k, cos, sin), "batch", "length", "act_kv_heads", None)
        v = self._constrain(v, "batch", "length", "act_kv_heads", None)
        o, layer_out = attend(q, k, v, layer_in)
        o = o.reshape(b, s, cfg.q_size)
        x = x + self._constrain(o @ self._weight(p.attn.o, dt), "batch", "length", "act_embed")
        h = rms_norm(x, p.mlp_norm[...], cfg.rms_norm_eps)
        return x + self._mlp(p.mlp, h), layer_out

    def _mlp(self, p: MLP, h: jax.Array) -> jax.Array:
        dt = h.dtype
        gate, up, down = (self._weight(w, dt) for w in (p.gate, p.up, p.down))

        def swiglu(h):
            a = self._constrain(h @ gate, "batch", "length", "act_mlp")
            u = self._constrain(h @ up, "batch", "length", "act_mlp")
            return self._constrain((jax.nn.silu(a) * u) @ down, "batch", "length", "act_embed")

        chunks = self.cfg.mlp_chunk_size and h.shape[1] // self.cfg.mlp_chunk_size
        if not chunks or chunks <= 1:
            return swiglu(h)
        # Blockwise MLP: only one chunk's [batch, seq/chunks, intermediate] is live at a time.
        # Over a sharded sequence token j goes to chunk j % chunks, so that every chunk keeps
        # the sharding; otherwise chunks are contiguous, which for one row needs no transposed
        # copies of the activations (1 GiB less in the 570M model's 256K plan on one chip).
        b, s, d = h.shape
        if s % chunks:
            raise ValueError(f"sequence length {s} is not divisible into {chunks} MLP chunks")
        contiguous = self.sequence_shards == 1
        axis = 1 if contiguous else 2  # the chunks' axis of the split sequence
        split = (b, chunks, s // chunks, d) if contiguous else (b, s // chunks, chunks, d)
        out = jax.lax.map(jax.checkpoint(swiglu), jnp.moveaxis(h.reshape(split), axis, 0))
        return jnp.moveaxis(out, 0, axis).reshape(b, s, d)

    # -- forward ----------------------------------------------------------------------------

    def embed(
        self,
        tokens: jax.Array,
        vision_mask: jax.Array,
        cells: jax.Array | None = None,
        window: jax.Array | None = None,
    ) -> jax.Array:
        """Per position, the vision or the text embedding of the token (compute dtype); with
        `ModelConfig.vision_grid`, plus the embeddings of each code's row and column in its
        frame. ``cells``: `data.tokens.frame_cells` of the streams; when not given they are
        computed from ``tokens``, which must then be in document order (not a ring layout).
        With `ModelConfig.vision_window`, plus the embedding of each causal neighbour's code;
        ``window``: `data.tokens.frame_window` of the streams (computed as ``cells`` are)."""
        cfg = self.cfg
        dt = _dtype(cfg.dtype)
        if cfg.vision_window and window is None and cells is not None:
            # the streams may be in a ring layout: no neighbours can be read there
            raise ValueError("model.vision_window: pass each code's window with its cells")
        if cfg.vision_grid is not None and cells is None:
            cells = frame_cells(tokens, vision_mask, xp=jnp)
        if cfg.vision_window and window is None:
            window = frame_window(
                tokens, vision_mask, cfg.vision_grid, cfg.vision_window, jnp, cells
            )
        tokens = self._constrain(tokens, "batch", "length")
        vision_mask = self._constrain(vision_mask.astype(bool), "batch", "length")
        x = jnp.where(
            vision_mask[..., None],
            jnp.take(
                self._weight(self.embed_vision, dt),
                jnp.clip(tokens, 0, cfg.vision_vocab_size - 1),
                axis=0,
            ),
            jnp.take(
                self._weight(self.embed_text, dt),
                jnp.clip(tokens, 0, cfg.text_vocab_size - 1),
                axis=0,
            ),
        )
        if cfg.vision_grid is not None:
            rows, cols = cfg.vision_grid
            cells = self._constrain(jnp.asarray(cells, jnp.int32), "batch", "length")
            row = jnp.clip(cells // cols, 0, rows - 1)
            grid = jnp.take(self._weight(self.embed_vision_row, dt), row, axis=0) + jnp.take(
                self._weight(self.embed_vision_col, dt), cells % cols, axis=0
            )
            x = x + jnp.where((cells >= 0)[..., None], grid, 0).astype(dt)
        if cfg.vision_window:
            window = self._constrain(jnp.asarray(window, jnp.int32), "batch", "length", None)
            table = self._weight(self.embed_vision_window, dt)
            for k in range(table.shape[0]):
                code = window[..., k]
                near = jnp.take(table[k], jnp.clip(code, 0, table.shape[1] - 1), axis=0)
                x = x + jnp.where((code >= 0)[..., None], near, 0).astype(dt)
        return self._constrain(x, "batch", "length", "act_embed")

    @with_precision
    def run_layers(self, x: jax.Array, positions: jax.Array, attend, layers_in=None):
        """All blocks over ``x`` (scanned when ``scan_layers``), then the final norm.

        ``layers_in`` holds one input per layer for ``attend`` (stacked along a leading layer
        axis); the per-layer outputs of ``attend`` come back stacked the same way.
        """
        cfg = self.cfg
        cos, sin = rope_tables(positions, cfg.head_dim, cfg.rope_theta, cfg.rope_dims)
        if cfg.rope_dtype == "compute":  # the arithmetic in x's dtype: no float32 copies of q, k
            cos, sin = cos.astype(x.dtype), sin.astype(x.dtype)

        def layer(x, block, layer_in):
            x = checkpoint_name(x, LAYER_INPUT)  # what `offload_layer_inputs` moves to the host
            return self._block(block, x, cos, sin, attend, layer_in)

        if cfg.remat_policy != "none":
            policy = REMAT_POLICIES[cfg.remat_policy]
            if cfg.offload_layer_inputs:
                policy = with_offloaded_inputs(policy)
            layer = jax.checkpoint(layer, policy=policy)

        if cfg.scan_layers:
            graphdef, stacked = nnx.split(self.layers)

            def body(x, xs):
                layer_state, layer_in = xs
                return layer(x, nnx.merge(graphdef, layer_state), layer_in)

            x, layers_out = jax.lax.scan(body, x, (stacked, layers_in))
        else:
            outs = []
            for i, block in enumerate(self.layers):
                layer_in = (
                    None if layers_in is None else jax.tree.map(lambda a, i=i: a[i], layers_in)
                )
                x, out = layer(x, block, layer_in)
                outs.append(out)
            layers_out = None if outs[0] is None else jax.tree.map(lambda *a: jnp.stack(a), *outs)
        return rms_norm(x, self.final_norm[...], cfg.rms_norm_eps), layers_out

    def _check_inputs(self, tokens: jax.Array, **others: jax.Array | None) -> None:
        """The shapes the model reads (static, so checked when traced too): ``[batch, seq]``
        tokens, the others of their shape, and a batch and length that the mesh's data and
        sequence axes divide. (Token ids are not checked: out of range, they are clamped.)"""
        if tokens.ndim != 2:
            raise ValueError(f"tokens must be [batch, seq], got shape {tokens.shape}")
        for name, x in others.items():
            if x is not None and x.shape != tokens.shape:
                raise ValueError(f"{name} has shape {x.shape}; the tokens {tokens.shape}")
        if self.mesh is not None:
            check_batch_fits(self.mesh, *tokens.shape)

    def hidden_states(
        self,
        tokens: jax.Array,
        vision_mask: jax.Array,
        positions: jax.Array | None = None,
        segment_ids: jax.Array | None = None,
        cells: jax.Array | None = None,
        window: jax.Array | None = None,
        *,
        rows: str = "any",
        reach: int = 0,
    ) -> jax.Array:
        """Final normalised hidden states ``[batch, seq, hidden]`` in the compute dtype.
        ``cells``, ``window`` as for `embed` (needed when the streams are in a ring layout).
        ``rows``: what the caller knows of every row's order (`ROW_ORDERS`, checked by
        `row_order`). With ``one_document`` attention is told the layout's order instead of
        reading positions and segment ids; with ``in_order`` it is told that no query sees a
        later key, and with ``reach`` (`row_reach`) none more than that many tokens back. The
        same result each time; with the cuDNN kernel, faster schedules.
        Positions still drive the rotary embeddings."""
        if rows not in ROW_ORDERS:
            raise ValueError(f"unknown row order '{rows}'; choose one of {', '.join(ROW_ORDERS)}")
        self._check_inputs(tokens, vision_mask=vision_mask, positions=positions,
                           segment_ids=segment_ids)  # fmt: skip
        b, s = tokens.shape
        if positions is None:
            positions = default_positions(b, s)
        masks = (None, None) if rows == "one_document" else (positions, segment_ids)
        in_order = rows == "in_order"

        def attend(q, k, v, _):
            return self._attention(q, k, v, *masks, in_order=in_order, reach=reach), None

        x, _ = self.run_layers(self.embed(tokens, vision_mask, cells, window), positions, attend)
        return x

    def head_weights(self, dtype) -> tuple[jax.Array, jax.Array]:
        """The text and vision heads ``[hidden, vocab]`` (transposed embeddings when tied)."""
        cfg = self.cfg
        text = self.embed_text if cfg.tie_word_embeddings else self.lm_head
        vision = self.embed_vision if cfg.tie_vision_embeddings else self.vision_head
        text_w, vision_w = self._weight(text, dtype), self._weight(vision, dtype)
        return (
            text_w.T if cfg.tie_word_embeddings else text_w,
            vision_w.T if cfg.tie_vision_embeddings else vision_w,
        )

    def vision_head_ids(self) -> jax.Array | None:
        """The vision ids the vision head scores when ``vision_codes`` restricts it (codes
        ``0 .. vision_codes-1``, then <eof>, <eov>); None when it scores the whole vocabulary.
        Column ``i`` of restricted vision logits is id ``ids[i]``."""
        n = self.cfg.vision_codes
        if not n:
            return None
        return jnp.concatenate([jnp.arange(n), jnp.asarray([EOF_ID, EOV_ID])]).astype(jnp.int32)

    def vision_target_index(self, tokens: jax.Array) -> jax.Array:
        """Vision ids -> columns of the vision logits (the identity unless restricted)."""
        n = self.cfg.vision_codes
        if not n:
            return tokens
        return jnp.where(tokens >= EOF_ID, tokens - EOF_ID + n, jnp.minimum(tokens, n - 1))

    @with_precision
    def logits(
        self, hidden: jax.Array, heads: tuple[bool, bool] = (True, True)
    ) -> tuple[jax.Array | None, jax.Array | None]:
        """(text_logits, vision_logits) in float32 from hidden states; a head switched off in
        ``heads`` (text, vision) is not computed and gives None. The vision logits have one
        column per `vision_head_ids` when ``vision_codes`` restricts them."""
        out = []
        ids = self.vision_head_ids()
        for i, (w, on) in enumerate(zip(self.head_weights(hidden.dtype), heads, strict=True)):
            if not on:
                out.append(None)
                continue
            if i == 1 and ids is not None:
                w = jnp.take(w, ids, axis=1)
            y = jnp.einsum("bsd,dv->bsv", hidden, w, preferred_element_type=jnp.float32)
            out.append(self._constrain(y, "batch", "length", "act_vocab"))
        return out[0], out[1]

    def chunked_loss_sums(
        self, hidden: jax.Array, targets, heads: tuple[bool, bool] = (True, True)
    ) -> dict:
        """`lwm.loss.loss_sums` computed chunk by chunk, so only one chunk's text and vision
        logits (``[batch, logits_chunk_size, vocab]``, float32) exist at a time, in the
        forward and, recomputed, in the backward pass. Token j goes to chunk j % chunks, so
        every chunk keeps the sequence sharding."""
        from lwm.loss import Targets, loss_sums

        b, s, d = hidden.shape
        chunks = max(s // self.cfg.logits_chunk_size, 1)
        if s % chunks:
            raise ValueError(f"sequence length {s} is not divisible into {chunks} logits chunks")

        def split(x):
            return jnp.moveaxis(x.reshape(b, s // chunks, chunks, *x.shape[2:]), 2, 0)

        @jax.checkpoint
        def one(carry, xs):
            h, t = xs
            text, vision = self.logits(h, heads)
            return jax.tree.map(jnp.add, carry, loss_sums(text, vision, Targets(*t))), None

        zero = {
            k: jnp.zeros((), jnp.float32)
            for k in ("t_nll", "t_correct", "t_n", "v_nll", "v_correct", "v_n")
        }
        sums, _ = jax.lax.scan(one, zero, (split(hidden), tuple(split(x) for x in targets)))
        return sums

    def __call__(
        self,
        tokens: jax.Array,
        vision_mask: jax.Array,
        positions: jax.Array | None = None,
        segment_ids: jax.Array | None = None,
        cells: jax.Array | None = None,
        window: jax.Array | None = None,
    ) -> tuple[jax.Array, jax.Array]:
        """``tokens, vision_mask [batch, seq]`` -> (text_logits, vision_logits), float32."""
        return self.logits(
            self.hidden_states(tokens, vision_mask, positions, segment_ids, cells, window)
        )


# ---------------------------------------------------------------------------------------------
# Creation with shardings


def _is_variable(x) -> bool:
    return isinstance(x, nnx.Variable)


def state_shardings(state: nnx.State, mesh: Mesh) -> nnx.State:
    """A NamedSharding for every parameter, from its logical ``axes`` metadata."""

    def sharding(v):
        axes = v.get_metadata().get("axes")
        return NamedSharding(mesh, logical_to_spec(axes) if axes else P())

    return jax.tree.map(sharding, state, is_leaf=_is_variable)


def abstract_params(cfg: ModelConfig, mesh: Mesh | None) -> tuple[nnx.GraphDef, nnx.State]:
    """(graphdef, parameters) of the model with `jax.ShapeDtypeStruct` leaves that carry their
    shardings on ``mesh`` (without one: the default device): what checkpoints restore into."""
    abstract_model = nnx.eval_shape(lambda: LWMModel(cfg, rngs=nnx.Rngs(0), mesh=mesh))
    graphdef, params = nnx.split(abstract_model, nnx.Param)
    if mesh is None:
        one = SingleDeviceSharding(jax.devices()[0])
        shardings = jax.tree.map(lambda _: one, params, is_leaf=_is_variable)
    else:
        shardings = state_shardings(params, mesh)
    params = jax.tree.map(
        lambda v, s: v.replace(jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=s)),
        params,
        shardings,
        is_leaf=_is_variable,
    )
    return graphdef, params


def create_model(cfg: ModelConfig, *, mesh: Mesh | None = None, seed: int = 0) -> LWMModel:
    """Initialise the model. With a mesh, every parameter is created directly in its shards
    (a jitted initialiser with ``out_shardings``): no host ever holds a whole weight."""

    def make() -> LWMModel:
        return LWMModel(cfg, rngs=nnx.Rngs(seed), mesh=mesh)

    if mesh is None:
        return make()
    graphdef, abstract = nnx.split(nnx.eval_shape(make))
    init = jax.jit(lambda: nnx.state(make()), out_shardings=state_shardings(abstract, mesh))
    return nnx.merge(graphdef, init())
