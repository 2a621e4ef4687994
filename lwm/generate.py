"""Generation: prefill with the model's attention, then one jitted decode loop on a KV cache.

The cache is ``[layers, batch, max_len, kv_heads, head_dim]``, sharded like the activations:
batch over ``(dp, fsdp)``, length over ``sp``, heads over ``tp``. Each decoded token is written
into its slot by the device that holds the slot (`ring_write_cache`: a window of the token's
own length, so no shard moves and a write does not touch the rest of the cache) and attends
the cache with
`ring_decode_attention`: every ``sp`` device attends its own slice and one reduction combines
the partial softmax statistics.

Prompts are right-padded ``[batch, prompt]`` arrays with per-row lengths. Two modes:

- ``text``: sample from the text head until a stop token or ``max_new_tokens``.
- ``vision``: sample codes from the vision head; every ``tokens_per_frame + 1``-th token is
  forced to ``<eof>`` (``<eov>`` after the last frame), and code positions never sample the
  markers. With ``cfg_scale`` the logits are ``uncond + scale * (cond - uncond)`` from a second
  batch of unconditional prompts, as in LWM's ``generate_vision``.

    tokens, lengths = generate(model, prompt, vision_mask, prompt_len, key=jax.random.key(0),
                               max_new_tokens=64, sampling=Sampling(temperature=0.7, top_p=0.9))
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial
from typing import Literal, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from data.tokens import (
    EOF_ID,
    EOV_ID,
    frame_cells,
    frame_window,
    window_neighbours,
    window_offsets,
)
from lwm.attention import default_positions
from lwm.attention.decode import decode_attention_local, ring_decode_attention, ring_write_cache
from lwm.base.mesh import batch_devices
from lwm.model import LWMModel


class Sampling(NamedTuple):
    """``temperature == 0`` is greedy; ``top_k == 0`` (or at least the vocabulary) and
    ``top_p == 1`` disable those filters."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0


GREEDY = Sampling()


class KVCache(NamedTuple):
    k: jax.Array  # [layers, batch, max_len, kv_heads, head_dim]
    v: jax.Array


def sample_logits(logits: jax.Array, key: jax.Array, sampling: Sampling) -> jax.Array:
    """One token per row of ``logits [batch, vocab]`` (float32)."""
    logits = logits.astype(jnp.float32)
    if sampling.temperature <= 0:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    logits = logits / sampling.temperature
    if 0 < sampling.top_k < logits.shape[-1]:  # k at least the vocabulary: every token
        kth = jax.lax.top_k(logits, sampling.top_k)[0][:, -1:]
        logits = jnp.where(logits < kth, -jnp.inf, logits)
    if sampling.top_p < 1.0:
        order = jnp.argsort(-logits, axis=-1)
        sorted_logits = jnp.take_along_axis(logits, order, axis=-1)
        probs = jax.nn.softmax(sorted_logits, axis=-1)
        # Keep the smallest prefix whose mass reaches top_p (always at least the top token).
        mass_before = jnp.cumsum(probs, axis=-1) - probs
        keep_sorted = mass_before < sampling.top_p
        keep = (
            jnp.zeros_like(keep_sorted)
            .at[jnp.arange(logits.shape[0])[:, None], order]
            .set(keep_sorted)
        )
        logits = jnp.where(keep, logits, -jnp.inf)
    return jax.random.categorical(key, logits, axis=-1).astype(jnp.int32)


def prompt_batch(
    prompts: Sequence[tuple[np.ndarray, np.ndarray]], rows: int, width: int, mesh=None
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(tokens, vision_mask)`` prompts as one right-padded batch for `generate`: at least
    ``rows`` rows (a multiple of the mesh's batch devices, which the batch is sharded over) of
    ``width`` tokens, and each row's prompt length (1 for the padding rows)."""
    if mesh is not None:
        data = batch_devices(mesh)
        rows = -(-rows // data) * data
    tokens = np.zeros((rows, width), np.int32)
    vision = np.zeros((rows, width), bool)
    lengths = np.ones((rows,), np.int32)
    for i, (t, v) in enumerate(prompts):
        tokens[i, : len(t)], vision[i, : len(v)], lengths[i] = t, v, len(t)
    return tokens, vision, lengths


def _cache_sharding(model: LWMModel, x: jax.Array) -> jax.Array:
    return model._constrain(x, None, "batch", "length", "act_kv_heads", None)


def empty_cache(model: LWMModel, batch: int, max_len: int) -> KVCache:
    """A zero key/value cache of ``max_len`` slots in the compute dtype, sharded as the cache is."""
    cfg = model.cfg
    shape = (cfg.num_layers, batch, max_len, cfg.num_kv_heads, cfg.head_dim)
    k, v = (_cache_sharding(model, jnp.zeros(shape, jnp.dtype(cfg.dtype))) for _ in range(2))
    return KVCache(k, v)  # two buffers: callers may donate the cache


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def prompt_width(width: int, sp: int, chunk: int | None) -> tuple[int, int | None]:
    """The padded width of prompts ``width`` tokens wide and the prefill chunk to use: whole
    shards of the ring (``sp``), and with a chunk, whole chunks of at most the prompts' width
    (a longer chunk would only prefill padding: the chunk bounds memory, it never adds to it)."""
    padded = _round_up(width, sp)
    if not chunk:
        return padded, None
    chunk = min(chunk, padded)
    return _round_up(width, chunk), chunk


def prefill(
    model: LWMModel,
    tokens: jax.Array,
    vision_mask: jax.Array,
    prompt_len: jax.Array,
    max_len: int,
) -> tuple[KVCache, jax.Array]:
    """Run the prompt through the model with its own attention (blockwise or ring) and keep
    each layer's keys and values. Returns the cache and the hidden state of each row's last
    prompt token. The prompts' width must be a multiple of the mesh's ``sp`` (`generate`
    pads them: `prompt_width`)."""
    model._check_inputs(tokens, vision_mask=vision_mask)
    b, p = tokens.shape
    positions = default_positions(b, p)
    # Where the model's layout is the prompt's own order, attention is told nothing: each row
    # is one document in that order, so its kernels are scheduled when tracing (on cuDNN one
    # call instead of a conditional per pair, `lwm.attention.cudnn`). Right padding needs no
    # mask: causal attention never looks ahead at it.
    attention_positions = None if model.layout == "contiguous" else positions

    def attend(q, k, v, _):
        return model._attention(q, k, v, attention_positions, None), (k, v)

    hidden, (ks, vs) = model.run_layers(model.embed(tokens, vision_mask), positions, attend)
    pad = [(0, 0), (0, 0), (0, max_len - p), (0, 0), (0, 0)]
    cache = KVCache(*(_cache_sharding(model, jnp.pad(x, pad)) for x in (ks, vs)))
    last = jnp.take_along_axis(hidden, (prompt_len - 1)[:, None, None], axis=1)[:, 0]
    return cache, last


def prefill_chunked(
    model: LWMModel,
    tokens: jax.Array,
    vision_mask: jax.Array,
    prompt_len: jax.Array,
    max_len: int,
    chunk: int,
) -> tuple[KVCache, jax.Array]:
    """`prefill` in chunks of ``chunk`` tokens (``tokens.shape[1]`` a multiple of it): each
    chunk is written into the cache and attends the cache so far (`extend`), so the
    activations of one prefill step are bounded by the chunk, not by the prompt. Same results
    as `prefill` (to float rounding)."""
    b, p = tokens.shape
    cfg = model.cfg
    cache = empty_cache(model, b, max_len)
    cells = frame_cells(tokens, vision_mask, xp=jnp)  # of the whole prompt: chunks cut frames
    window = None
    if cfg.vision_window:
        window = frame_window(tokens, vision_mask, cfg.vision_grid, cfg.vision_window, jnp, cells)

    def body(i, carry):
        cache, last = carry
        start = i * chunk
        piece = jax.lax.dynamic_slice_in_dim(tokens, start, chunk, axis=1)
        vision = jax.lax.dynamic_slice_in_dim(vision_mask, start, chunk, axis=1)
        piece_cells = jax.lax.dynamic_slice_in_dim(cells, start, chunk, axis=1)
        piece_window = None
        if window is not None:
            piece_window = jax.lax.dynamic_slice_in_dim(window, start, chunk, axis=1)
        cache, hidden = extend(model, cache, piece, vision, start, piece_cells, piece_window)
        at = prompt_len - 1 - start  # each row's last prompt token, if it is in this chunk
        inside = (at >= 0) & (at < chunk)
        h = jnp.take_along_axis(hidden, jnp.clip(at, 0, chunk - 1)[:, None, None], axis=1)
        return cache, jnp.where(inside[:, None], h[:, 0], last)

    last = jnp.zeros((b, cfg.hidden_size), cache.k.dtype)
    return jax.lax.fori_loop(0, p // chunk, body, (cache, last))


def extend(
    model: LWMModel,
    cache: KVCache,
    tokens: jax.Array,
    vision_mask: jax.Array,
    start: jax.Array | int,
    cells: jax.Array | None = None,
    window: jax.Array | None = None,
) -> tuple[KVCache, jax.Array]:
    """Feed ``tokens [batch, n]`` at positions ``start .. start + n - 1`` (the same for every
    row): their keys and values go into those cache slots (`ring_write_cache`: each device
    updates its own slice, O(n)) and they attend the cache up to themselves. ``cells``: their
    `data.tokens.frame_cells` (computed from ``tokens`` when not given, right when they start
    at a frame boundary); ``window`` likewise (`data.tokens.frame_window`, for a model with
    `ModelConfig.vision_window`). Returns the cache and their hidden states ``[batch, n,
    hidden]``."""
    b, n = tokens.shape
    max_len = cache.k.shape[2]
    slot = jnp.arange(max_len, dtype=jnp.int32)
    start = jnp.asarray(start, jnp.int32)
    positions = jnp.broadcast_to(start + jnp.arange(n, dtype=jnp.int32), (b, n))

    def attend(q, k, v, layer_cache):
        k_cache = ring_write_cache(layer_cache[0], k, start, mesh=model.mesh)
        v_cache = ring_write_cache(layer_cache[1], v, start, mesh=model.mesh)
        if model.mesh is not None:
            o = ring_decode_attention(
                q, k_cache, v_cache, mesh=model.mesh, cache_len=start + n, q_positions=positions
            )
        else:
            o = decode_attention_local(
                q,
                k_cache,
                v_cache,
                cache_len=jnp.broadcast_to(start + n, (b,)),
                q_positions=positions,
                kv_positions=jnp.broadcast_to(slot, (b, max_len)),
                axis_name=None,
            )
        return o, (k_cache, v_cache)

    x = model.embed(tokens, vision_mask, cells, window)
    hidden, (ks, vs) = model.run_layers(x, positions, attend, layers_in=tuple(cache))
    return KVCache(_cache_sharding(model, ks), _cache_sharding(model, vs)), hidden


def decode_step(
    model: LWMModel,
    cache: KVCache,
    token: jax.Array,
    is_vision: jax.Array,
    position: jax.Array,
    cell: jax.Array | None = None,
    window: jax.Array | None = None,
) -> tuple[KVCache, jax.Array]:
    """Feed one token per row at ``position [batch]`` (``cell [batch]``: a vision code's cell in
    its frame, -1 for anything else; None: -1; ``window [batch, K]``: the codes of its causal
    neighbours for a model with `ModelConfig.vision_window`, None: none); returns the cache
    and its hidden state."""
    max_len = cache.k.shape[2]
    slot = jnp.arange(max_len, dtype=jnp.int32)
    positions = position[:, None]

    def attend(q, k, v, layer_cache):
        k_cache = ring_write_cache(layer_cache[0], k, position, mesh=model.mesh)
        v_cache = ring_write_cache(layer_cache[1], v, position, mesh=model.mesh)
        if model.mesh is not None:
            o = ring_decode_attention(
                q, k_cache, v_cache, mesh=model.mesh, cache_len=position + 1, q_positions=positions
            )
        else:
            kv_pos = jnp.broadcast_to(slot, (q.shape[0], max_len))
            o = decode_attention_local(
                q,
                k_cache,
                v_cache,
                cache_len=position + 1,
                q_positions=positions,
                kv_positions=kv_pos,
                axis_name=None,
            )
        return o, (k_cache, v_cache)

    if cell is None:
        cell = jnp.full(token.shape, -1, jnp.int32)
    if window is None and model.cfg.vision_window:
        k = len(window_offsets(model.cfg.vision_window))
        window = jnp.full((*token.shape, k), -1, jnp.int32)
    x = model.embed(
        token[:, None],
        is_vision[:, None],
        cell[:, None],
        None if window is None else window[:, None],
    )
    hidden, (ks, vs) = model.run_layers(x, positions, attend, layers_in=tuple(cache))
    return KVCache(_cache_sharding(model, ks), _cache_sharding(model, vs)), hidden[:, 0]


class _Loop(NamedTuple):
    step: jax.Array
    cache: KVCache
    hidden: jax.Array
    out: jax.Array
    done: jax.Array
    key: jax.Array


def _next_logits(model: LWMModel, hidden: jax.Array, mode: str) -> jax.Array:
    """Logits of the next token from the head of ``mode``; in vision mode column ``i < n`` is
    code ``i`` (n = ``model.cfg.vision_codes`` or all 8192 codes), then the markers."""
    vision = mode == "vision"
    text, image = model.logits(hidden[:, None], heads=(not vision, vision))
    return (image if vision else text)[:, 0]


def _generated_window(model: LWMModel, out: jax.Array, step: jax.Array, cell: jax.Array):
    """The codes of the causal neighbours (`data.tokens.window_offsets`) of the code generated
    at ``step`` in its cell ``cell [batch]`` (-1: not a code), read from the tokens generated so
    far ``out [batch, max_new_tokens]``: vision mode starts at a frame boundary, so every
    neighbour in the frame was generated."""
    found = []
    for back, inside in window_neighbours(cell, model.cfg.vision_grid[1], model.cfg.vision_window):
        code = jax.lax.dynamic_index_in_dim(out, jnp.maximum(step - back, 0), 1, keepdims=False)
        found.append(jnp.where(inside, code, -1))
    return jnp.stack(found, axis=-1).astype(jnp.int32)


def decode_loop(
    model,
    cache,
    hidden,
    prompt_len,
    key,
    *,
    b,
    max_new_tokens,
    mode,
    sampling,
    stop_tokens,
    tokens_per_frame,
    cfg_scale,
    pad_id,
):
    """Sample up to ``max_new_tokens`` after ``hidden`` (the state of the token at
    ``prompt_len - 1``), feeding each into the cache; returns the tokens, each row's length and
    the cache (which then holds every fed token)."""
    stops = jnp.asarray(stop_tokens or (-1,), jnp.int32)
    frame = tokens_per_frame + 1

    def cond(s: _Loop):
        return (s.step < max_new_tokens) & ~jnp.all(s.done)

    def body(s: _Loop):
        key, sub = jax.random.split(s.key)
        logits = _next_logits(model, s.hidden, mode)
        if cfg_scale is not None:
            cond_l, uncond_l = logits[:b], logits[b:]
            logits = uncond_l + cfg_scale * (cond_l - uncond_l)
        if mode == "vision":
            is_marker = (s.step + 1) % frame == 0
            is_last = s.step + 1 == max_new_tokens
            marker = jnp.where(is_last, EOV_ID, EOF_ID)
            code_logits = logits.at[:, model.cfg.codes_read :].set(-jnp.inf)
            token = jnp.where(is_marker, marker, sample_logits(code_logits, sub, sampling))
        else:
            token = sample_logits(logits, sub, sampling)
        token = jnp.where(s.done, pad_id, token)
        out = s.out.at[:, s.step].set(token)
        done = s.done | jnp.isin(token, stops)
        feed = jnp.concatenate([token, token]) if cfg_scale is not None else token
        is_vision = jnp.full(feed.shape, mode == "vision")
        # Vision mode starts at a frame boundary: token `step` is cell `step % frame` of its
        # frame, or the frame's marker.
        cell = jnp.where(is_vision & (feed < EOF_ID), s.step % frame, -1)
        window = None
        if model.cfg.vision_window:
            window = _generated_window(model, out, s.step, cell[:b])
            if cfg_scale is not None:
                window = jnp.concatenate([window, window])
        cache, hidden = decode_step(
            model, s.cache, feed, is_vision, prompt_len + s.step, cell, window
        )
        return _Loop(s.step + 1, cache, hidden, out, done, key)

    init = _Loop(
        step=jnp.int32(0),
        cache=cache,
        hidden=hidden,
        out=jnp.full((b, max_new_tokens), pad_id, jnp.int32),
        done=jnp.zeros((b,), bool),
        key=key,
    )
    final = jax.lax.while_loop(cond, body, init)
    stop_at = jnp.where(
        jnp.isin(final.out, stops), jnp.arange(max_new_tokens)[None], max_new_tokens
    ).min(axis=1)
    lengths = jnp.minimum(stop_at + 1, final.step)
    return final.out, lengths, final.cache


@partial(
    jax.jit,
    static_argnames=(
        "graphdef",
        "max_new_tokens",
        "mode",
        "sampling",
        "stop_tokens",
        "tokens_per_frame",
        "cfg_scale",
        "pad_id",
        "prefill_chunk",
    ),
)
def _generate(
    graphdef,
    state,
    tokens,
    vision_mask,
    prompt_len,
    key,
    *,
    max_new_tokens,
    mode,
    sampling,
    stop_tokens,
    tokens_per_frame,
    cfg_scale,
    pad_id,
    prefill_chunk=None,
):
    model = nnx.merge(graphdef, state)
    rows = tokens.shape[0]
    b = rows // 2 if cfg_scale is not None else rows
    sp = 1 if model.mesh is None else model.mesh.shape["sp"]
    max_len = _round_up(tokens.shape[1] + max_new_tokens, sp)
    if prefill_chunk:
        cache, hidden = prefill_chunked(
            model, tokens, vision_mask, prompt_len, max_len, prefill_chunk
        )
    else:
        cache, hidden = prefill(model, tokens, vision_mask, prompt_len, max_len)
    out, lengths, _ = decode_loop(
        model,
        cache,
        hidden,
        prompt_len,
        key,
        b=b,
        max_new_tokens=max_new_tokens,
        mode=mode,
        sampling=sampling,
        stop_tokens=stop_tokens,
        tokens_per_frame=tokens_per_frame,
        cfg_scale=cfg_scale,
        pad_id=pad_id,
    )
    return out, lengths


def _check_prompts(
    tokens: jax.Array, vision_mask: jax.Array, lengths, names: tuple[str, str, str]
) -> jax.Array:
    """Each row's prompt length as ``int32 [batch]``, after checking what `generate` is given
    (``names``: of those three arguments): ``[batch, width]`` prompts, a vision mask of their
    shape, and lengths from 1 to the width (past it, the cache's empty slots were attended; at
    0, the last position read was index -1; a narrower mask was padded as text)."""
    name, mask, length = names
    if tokens.ndim != 2:
        raise ValueError(f"{name} must be [batch, width], got shape {tokens.shape}")
    if vision_mask.shape != tokens.shape:
        raise ValueError(f"{mask} has shape {vision_mask.shape}; its prompts {tokens.shape}")
    given = jnp.asarray(lengths, jnp.int32)
    if given.ndim > 1 or (given.ndim == 1 and given.shape[0] != tokens.shape[0]):
        raise ValueError(
            f"{length} must be one length or one per row ({tokens.shape[0]}), got "
            f"shape {given.shape}"
        )
    lengths = jnp.broadcast_to(given, (tokens.shape[0],))
    if not isinstance(lengths, jax.core.Tracer):
        low, high = int(lengths.min()), int(lengths.max())
        if low < 1 or high > tokens.shape[1]:
            raise ValueError(
                f"{length} must lie in [1, {tokens.shape[1]}] (the prompts' width), got "
                f"{low if low < 1 else high}"
            )
    return lengths


def generate(
    model: LWMModel,
    tokens: jax.Array,
    vision_mask: jax.Array,
    prompt_len: jax.Array,
    *,
    key: jax.Array,
    max_new_tokens: int | None = None,
    mode: Literal["text", "vision"] = "text",
    sampling: Sampling = GREEDY,
    stop_tokens: tuple[int, ...] = (),
    tokens_per_frame: int = 256,
    num_frames: int | None = None,
    cfg_scale: float | None = None,
    uncond_tokens: jax.Array | None = None,
    uncond_vision_mask: jax.Array | None = None,
    uncond_len: jax.Array | None = None,
    pad_id: int = 0,
    prefill_chunk: int | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Generate ``[batch, max_new_tokens]`` tokens after right-padded prompts.

    Returns the tokens (``pad_id`` after a row stops) and each row's length (including its
    stop token). In vision mode ``num_frames`` sets ``max_new_tokens`` to
    ``num_frames * (tokens_per_frame + 1)``. ``cfg_scale`` needs the unconditional prompts.
    ``prefill_chunk``: prefill the prompts in chunks of this many tokens (`prefill_chunked`),
    so the longest prompt is bounded by the cache, not by one prefill's activations.
    """
    if not isinstance(sampling, Sampling):
        raise TypeError(f"sampling must be a Sampling, got {type(sampling).__name__}")
    tokens = jnp.asarray(tokens, jnp.int32)
    vision_mask = jnp.asarray(vision_mask, bool)
    prompt_len = _check_prompts(
        tokens, vision_mask, prompt_len, ("tokens", "vision_mask", "prompt_len")
    )
    if mode not in ("text", "vision"):
        raise ValueError(f"unknown generation mode '{mode}'; choose text or vision")
    if mode == "vision" and num_frames is not None:
        max_new_tokens = num_frames * (tokens_per_frame + 1)
    if max_new_tokens is None or max_new_tokens <= 0:
        raise ValueError(
            f"max_new_tokens must be a positive integer (or give num_frames in vision mode), "
            f"got {max_new_tokens}"
        )
    if cfg_scale is not None:
        if uncond_tokens is None or uncond_vision_mask is None or uncond_len is None:
            raise ValueError("cfg_scale needs uncond_tokens, uncond_vision_mask and uncond_len")
        uncond_tokens = jnp.asarray(uncond_tokens, jnp.int32)
        uncond_vision_mask = jnp.asarray(uncond_vision_mask, bool)
        uncond_len = _check_prompts(
            uncond_tokens,
            uncond_vision_mask,
            uncond_len,
            ("uncond_tokens", "uncond_vision_mask", "uncond_len"),
        )
        if uncond_tokens.shape[0] != tokens.shape[0]:
            raise ValueError(
                f"uncond_tokens has {uncond_tokens.shape[0]} rows, the prompts {tokens.shape[0]}"
            )
        width = max(tokens.shape[1], uncond_tokens.shape[1])
        pad = lambda x: jnp.pad(jnp.asarray(x), [(0, 0), (0, width - x.shape[1])])  # noqa: E731
        tokens = jnp.concatenate([pad(tokens), pad(uncond_tokens)])
        vision_mask = jnp.concatenate([pad(vision_mask), pad(uncond_vision_mask)])
        prompt_len = jnp.concatenate([prompt_len, uncond_len])
    sp = 1 if model.mesh is None else model.mesh.shape["sp"]
    width, prefill_chunk = prompt_width(tokens.shape[1], sp, prefill_chunk)
    tokens = jnp.pad(tokens, [(0, 0), (0, width - tokens.shape[1])], constant_values=pad_id)
    vision_mask = jnp.pad(vision_mask, [(0, 0), (0, width - vision_mask.shape[1])])
    graphdef, state = nnx.split(model)
    return _generate(
        graphdef,
        state,
        tokens,
        vision_mask,
        prompt_len,
        key,
        max_new_tokens=max_new_tokens,
        mode=mode,
        sampling=Sampling(*sampling),
        stop_tokens=tuple(int(t) for t in stop_tokens),
        tokens_per_frame=tokens_per_frame,
        cfg_scale=None if cfg_scale is None else float(cfg_scale),
        pad_id=pad_id,
        prefill_chunk=int(prefill_chunk) if prefill_chunk else None,
    )
