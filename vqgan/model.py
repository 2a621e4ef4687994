"""LWM's VQGAN in Flax NNX: convolutional encoder, vector quantizer, convolutional decoder.

Architecture (as LWM's `lwm/vqgan.py`, whose weights `vqgan.lwm_import` loads): a 3x3 input
conv; per level ``i`` of ``channel_mult`` residual blocks of width ``hidden_channels *
channel_mult[i]`` (GroupNorm, SiLU, 3x3 conv, twice; a 1x1 conv on the shortcut when the width
changes), then a stride-2 3x3 conv (after padding one row and column at the bottom/right) on all
but the last level; two residual blocks in the middle; GroupNorm, SiLU, a 3x3 conv to
``z_channels``; a 1x1 ``quant_conv`` to ``embed_dim``. The decoder mirrors it with
``num_res_blocks + 1`` blocks per level and nearest-neighbour 2x upsampling followed by a 3x3
conv. No attention (LWM's `attn_resolutions=()` and `no_attn_mid_block=True`).

    model = VQGAN(cfg, rngs=nnx.Rngs(0))
    out = model.encode(x)              # x [N, H, W, 3] in [-1, 1] -> out.codes [N, h, w]
    x_hat = model.decode_codes(codes)  # [N, H, W, 3], clipped to [-1, 1]
    x_hat, out = model(x)              # training: reconstruction (unclipped) and quantizer output
"""

from __future__ import annotations

import itertools
from typing import TypeVar

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from lwm.base.precision import with_precision
from vqgan.config import VQGANModelConfig
from vqgan.quantizer import QuantizerOutput, VectorQuantizer

__all__ = [
    "VQGAN",
    "Decoder",
    "Encoder",
    "GroupNorm",
    "ResnetBlock",
    "host_init",
    "init_model",
]

M = TypeVar("M", bound=nnx.Module)


def _conv(cfg: VQGANModelConfig, cin: int, cout: int, k: int, rngs: nnx.Rngs, **kw) -> nnx.Conv:
    return nnx.Conv(
        cin, cout, (k, k), dtype=cfg.dtype, param_dtype=cfg.param_dtype, rngs=rngs, **kw
    )


class GroupNorm(nnx.GroupNorm):
    """`nnx.GroupNorm` (the same parameters, ``scale`` and ``bias`` per channel, and the same
    result up to float rounding: mean and ``E[x^2] - mean^2`` over each group, epsilon inside
    the square root), computed as XLA runs it fastest on ``[N, H, W, C]`` frames: per-channel
    sums over ``H, W`` (a reduction along the major axes, vectorised over channels), summed
    into groups on the small ``[N, C]`` result, then one fused multiply-add per element. Flax's
    version reduces a ``[N, H, W, groups, C / groups]`` view, whose minor axis of a few
    channels XLA's CPU backend reduces about twice as slowly (`docs/benchmarks.md`, "VQGAN")."""

    def __call__(self, x: jax.Array, *, mask: jax.Array | None = None) -> jax.Array:
        if mask is not None or self.reduction_axes is not None or not self.use_fast_variance:
            return super().__call__(x, mask=mask)
        c, g = x.shape[-1], self.num_groups
        axes = tuple(range(1, x.ndim - 1))
        xf = x.astype(jnp.promote_types(self.dtype or x.dtype, jnp.float32))
        count = int(np.prod(x.shape[1:-1])) * (c // g)
        sums = jnp.sum(xf, axis=axes).reshape(-1, g, c // g).sum(-1)
        squares = jnp.sum(xf * xf, axis=axes).reshape(-1, g, c // g).sum(-1)
        mean = sums / count
        var = jnp.maximum(squares / count - mean * mean, 0.0)
        inv = jnp.repeat(jax.lax.rsqrt(var + self.epsilon), c // g, axis=1)  # [N, C]
        mean = jnp.repeat(mean, c // g, axis=1)
        scale = inv if self.scale is None else inv * self.scale[...].astype(xf.dtype)
        shift = -mean * scale
        if self.bias is not None:
            shift = shift + self.bias[...].astype(xf.dtype)
        bcast = (x.shape[0],) + (1,) * (x.ndim - 2) + (c,)
        y = xf * scale.reshape(bcast) + shift.reshape(bcast)
        return y.astype(self.dtype or x.dtype)


def _norm(cfg: VQGANModelConfig, channels: int, rngs: nnx.Rngs) -> GroupNorm:
    return GroupNorm(
        channels,
        num_groups=cfg.num_groups,
        epsilon=1e-6,
        dtype=cfg.dtype,
        param_dtype=cfg.param_dtype,
        rngs=rngs,
    )


class ResnetBlock(nnx.Module):
    def __init__(self, cfg: VQGANModelConfig, cin: int, cout: int, *, rngs: nnx.Rngs):
        self.norm1 = _norm(cfg, cin, rngs)
        self.conv1 = _conv(cfg, cin, cout, 3, rngs)
        self.norm2 = _norm(cfg, cout, rngs)
        self.conv2 = _conv(cfg, cout, cout, 3, rngs)
        self.shortcut = _conv(cfg, cin, cout, 1, rngs) if cin != cout else None

    def __call__(self, x: jax.Array) -> jax.Array:
        h = self.conv1(nnx.silu(self.norm1(x)))
        h = self.conv2(nnx.silu(self.norm2(h)))
        if self.shortcut is not None:
            x = self.shortcut(x)
        return x + h


class DownLevel(nnx.Module):
    def __init__(self, cfg: VQGANModelConfig, level: int, cin: int, *, rngs: nnx.Rngs):
        cout = cfg.hidden_channels * cfg.channel_mult[level]
        widths = [cin] + [cout] * cfg.num_res_blocks
        self.res = nnx.List(
            [ResnetBlock(cfg, a, b, rngs=rngs) for a, b in itertools.pairwise(widths)]
        )
        last = level == len(cfg.channel_mult) - 1
        self.downsample = (
            None if last else _conv(cfg, cout, cout, 3, rngs, strides=2, padding="VALID")
        )

    def __call__(self, x: jax.Array) -> jax.Array:
        for block in self.res:
            x = block(x)
        if self.downsample is not None:
            x = self.downsample(jnp.pad(x, ((0, 0), (0, 1), (0, 1), (0, 0))))
        return x


class UpLevel(nnx.Module):
    def __init__(self, cfg: VQGANModelConfig, level: int, cin: int, *, rngs: nnx.Rngs):
        cout = cfg.hidden_channels * cfg.channel_mult[level]
        widths = [cin] + [cout] * (cfg.num_res_blocks + 1)
        self.res = nnx.List(
            [ResnetBlock(cfg, a, b, rngs=rngs) for a, b in itertools.pairwise(widths)]
        )
        self.upsample = None if level == 0 else _conv(cfg, cout, cout, 3, rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        for block in self.res:
            x = block(x)
        if self.upsample is not None:
            x = jnp.repeat(jnp.repeat(x, 2, axis=1), 2, axis=2)  # nearest-neighbour 2x
            x = self.upsample(x)
        return x


class Encoder(nnx.Module):
    def __init__(self, cfg: VQGANModelConfig, *, rngs: nnx.Rngs):
        self.conv_in = _conv(cfg, cfg.num_channels, cfg.hidden_channels, 3, rngs)
        levels, width = [], cfg.hidden_channels
        for level in range(len(cfg.channel_mult)):
            levels.append(DownLevel(cfg, level, width, rngs=rngs))
            width = cfg.hidden_channels * cfg.channel_mult[level]
        self.down = nnx.List(levels)
        self.mid = nnx.List([ResnetBlock(cfg, width, width, rngs=rngs) for _ in range(2)])
        self.norm_out = _norm(cfg, width, rngs)
        self.conv_out = _conv(cfg, width, cfg.z_channels, 3, rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        x = self.conv_in(x)
        for level in self.down:
            x = level(x)
        for block in self.mid:
            x = block(x)
        return self.conv_out(nnx.silu(self.norm_out(x)))


class Decoder(nnx.Module):
    """``up[i]`` is level ``i``; levels run from the last (coarsest) to level 0."""

    def __init__(self, cfg: VQGANModelConfig, *, rngs: nnx.Rngs):
        width = cfg.hidden_channels * cfg.channel_mult[-1]
        self.conv_in = _conv(cfg, cfg.z_channels, width, 3, rngs)
        self.mid = nnx.List([ResnetBlock(cfg, width, width, rngs=rngs) for _ in range(2)])
        levels: dict[int, UpLevel] = {}
        for level in reversed(range(len(cfg.channel_mult))):
            levels[level] = UpLevel(cfg, level, width, rngs=rngs)
            width = cfg.hidden_channels * cfg.channel_mult[level]
        self.up = nnx.List([levels[i] for i in range(len(cfg.channel_mult))])
        self.norm_out = _norm(cfg, width, rngs)
        self.conv_out = _conv(cfg, width, cfg.num_channels, 3, rngs)

    def __call__(self, z: jax.Array) -> jax.Array:
        x = self.conv_in(z)
        for block in self.mid:
            x = block(x)
        for level in reversed(self.up):
            x = level(x)
        return self.conv_out(nnx.silu(self.norm_out(x)))


class VQGAN(nnx.Module):
    def __init__(self, cfg: VQGANModelConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        self.encoder = Encoder(cfg, rngs=rngs)
        self.quant_conv = _conv(cfg, cfg.z_channels, cfg.embed_dim, 1, rngs)
        self.quantizer = VectorQuantizer(
            cfg.num_embeddings, cfg.embed_dim, param_dtype=cfg.param_dtype, rngs=rngs
        )
        self.post_quant_conv = _conv(cfg, cfg.embed_dim, cfg.z_channels, 1, rngs)
        self.decoder = Decoder(cfg, rngs=rngs)

    def num_parameters(self) -> int:
        """How many numbers the model's parameters hold."""
        return sum(int(x.size) for x in jax.tree.leaves(nnx.state(self, nnx.Param)))

    def _check_frames(self, x: jax.Array) -> None:
        res = self.cfg.resolution
        if x.ndim != 4 or x.shape[1:] != (res, res, self.cfg.num_channels):
            raise ValueError(
                f"expected frames [N, {res}, {res}, {self.cfg.num_channels}], got {x.shape}"
            )

    @with_precision  # `VQGANModelConfig.matmul_precision`
    def latents(self, x: jax.Array) -> jax.Array:
        """Encoder output before quantization, ``[N, h, w, embed_dim]`` float32."""
        self._check_frames(x)
        z = self.quant_conv(self.encoder(x.astype(self.cfg.dtype)))
        return z.astype(jnp.float32)

    def encode(self, x: jax.Array) -> QuantizerOutput:
        """Quantize frames ``[N, H, W, 3]`` in [-1, 1]."""
        return self.quantizer(self.latents(x))

    @with_precision
    def decode_latents(self, quantized: jax.Array) -> jax.Array:
        """Decoder output for quantized vectors ``[N, h, w, embed_dim]`` (float32, unclipped)."""
        h = self.post_quant_conv(quantized.astype(self.cfg.dtype))
        return self.decoder(h).astype(jnp.float32)

    def decode_codes(self, codes: jax.Array) -> jax.Array:
        """Frames ``[N, H, W, 3]`` in [-1, 1] for codes ``[N, h, w]``."""
        return jnp.clip(self.decode_latents(self.quantizer.lookup(codes)), -1.0, 1.0)

    def __call__(self, x: jax.Array) -> tuple[jax.Array, QuantizerOutput]:
        out = self.encode(x)
        return self.decode_latents(out.quantized), out


def init_model(cfg: VQGANModelConfig, seed: int = 0) -> VQGAN:
    """A freshly initialised `VQGAN` (parameters drawn on the host by `host_init`)."""
    return host_init(nnx.eval_shape(lambda: VQGAN(cfg, rngs=nnx.Rngs(0))), seed)


def host_init(abstract: M, seed: int) -> M:
    """Concrete parameters for an abstract (``nnx.eval_shape``) conv network, drawn with numpy:
    conv kernels LeCun-normal (variance 1/fan_in, untruncated), biases 0, GroupNorm scales 1,
    codebooks uniform in [-1/n, 1/n] (as LWM). Seconds faster on CPU than compiling the
    initialisers, and deterministic for ``seed`` on any backend."""
    rng = np.random.default_rng(seed)
    graphdef, state = nnx.split(abstract)
    flat = []
    for path, var in nnx.to_flat_state(state):
        name, shape, dtype = path[-1], var.shape, var.dtype
        if name == "kernel":
            fan_in = int(np.prod(shape[:-1]))
            value = rng.standard_normal(shape, np.float32) / np.sqrt(fan_in)
        elif name == "bias":
            value = np.zeros(shape, np.float32)
        elif name == "scale":
            value = np.ones(shape, np.float32)
        elif name == "embeddings":
            value = rng.uniform(-1.0 / shape[0], 1.0 / shape[0], shape).astype(np.float32)
        else:
            raise ValueError(f"host_init: no rule for parameter {'.'.join(map(str, path))}")
        flat.append((path, var.replace(jnp.asarray(value, dtype))))
    return nnx.merge(graphdef, nnx.from_flat_state(flat))
