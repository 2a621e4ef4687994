"""LWM's VQGAN architecture as LWM's ``lwm/vqgan.py`` writes it (Flax linen), for side-by-side
benchmarks (`benchmarks/bench_vqgan.py --compare-lwm`) and parity tests against ours
(`tests/test_vqgan.py`). Re-expressed here from LWM's released code: the same modules, the same
auto-generated parameter names (``Conv_0``, ``ResnetBlock_1``, ...), so the parameter tree of
`vqgan.weights.export_lwm_params` applies to it unchanged. Nothing in the product imports this.

    model = LWMVQGAN(cfg)  # cfg: our `vqgan.config.VQGANModelConfig` (32 groups)
    codes = model.apply({"params": tree}, frames, method=LWMVQGAN.encode)[1]
    frames = model.apply({"params": tree}, codes, method=LWMVQGAN.decode)
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from vqgan.config import VQGANModelConfig


def check_config(cfg) -> None:
    """The reference takes one of our `VQGANModelConfig` for its sizes. LWM's GroupNorms are
    linen's default, 32 groups, so a config with other groups has no LWM counterpart."""
    if cfg.num_groups != 32:
        raise ValueError(f"LWM's VQGAN has 32 GroupNorm groups; the config has {cfg.num_groups}")


class ResnetBlock(nn.Module):
    out_channels: int | None = None

    @nn.compact
    def __call__(self, x):
        out = self.out_channels or x.shape[-1]
        h = nn.Conv(out, [3, 3])(nn.silu(nn.GroupNorm()(x)))
        h = nn.Conv(out, [3, 3])(nn.silu(nn.GroupNorm()(h)))
        if out != x.shape[-1]:
            x = nn.Conv(out, [1, 1])(x)
        return h + x


class Downsample(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = jnp.pad(x, [(0, 0), (0, 1), (0, 1), (0, 0)])
        return nn.Conv(x.shape[-1], [3, 3], strides=[2, 2], padding="VALID")(x)


class Upsample(nn.Module):
    @nn.compact
    def __call__(self, x):
        b, h, w, c = x.shape
        x = jax.image.resize(x, (b, h * 2, w * 2, c), method="nearest")
        return nn.Conv(c, [3, 3])(x)


class DownsamplingBlock(nn.Module):
    config: VQGANModelConfig
    block_idx: int

    @nn.compact
    def __call__(self, x):
        cfg = self.config
        for _ in range(cfg.num_res_blocks):
            x = ResnetBlock(cfg.hidden_channels * cfg.channel_mult[self.block_idx])(x)
        if self.block_idx != len(cfg.channel_mult) - 1:
            x = Downsample()(x)
        return x


class UpsamplingBlock(nn.Module):
    config: VQGANModelConfig
    block_idx: int

    @nn.compact
    def __call__(self, x):
        cfg = self.config
        for _ in range(cfg.num_res_blocks + 1):
            x = ResnetBlock(cfg.hidden_channels * cfg.channel_mult[self.block_idx])(x)
        if self.block_idx != 0:
            x = Upsample()(x)
        return x


class MidBlock(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = ResnetBlock()(x)  # (linen names modules in the order they are made)
        return ResnetBlock()(x)  # no attention between them (LWM: no_attn_mid_block)


class Encoder(nn.Module):
    config: VQGANModelConfig

    @nn.compact
    def __call__(self, x):
        cfg = self.config
        x = nn.Conv(cfg.hidden_channels, [3, 3])(x)
        for level in range(len(cfg.channel_mult)):
            x = DownsamplingBlock(cfg, level)(x)
        x = MidBlock()(x)
        return nn.Conv(cfg.z_channels, [3, 3])(nn.silu(nn.GroupNorm()(x)))


class Decoder(nn.Module):
    config: VQGANModelConfig

    @nn.compact
    def __call__(self, x):
        cfg = self.config
        x = nn.Conv(cfg.hidden_channels * cfg.channel_mult[-1], [3, 3])(x)
        x = MidBlock()(x)
        for level in reversed(range(len(cfg.channel_mult))):
            x = UpsamplingBlock(cfg, level)(x)
        return nn.Conv(cfg.num_channels, [3, 3])(nn.silu(nn.GroupNorm()(x)))


class VectorQuantizer(nn.Module):
    n_e: int
    e_dim: int

    @nn.compact
    def __call__(self, z, encoding_indices=None):
        embeddings = self.param(
            "embeddings",
            lambda rng, shape: jax.random.uniform(
                rng, shape, minval=-1 / self.n_e, maxval=1 / self.n_e
            ),
            (self.n_e, self.e_dim),
        )
        if encoding_indices is not None:
            return embeddings[(encoding_indices,)]
        flat = z.reshape(-1, z.shape[-1])
        d = (
            jnp.sum(flat**2, axis=1, keepdims=True)
            + jnp.sum(embeddings.T**2, axis=0, keepdims=True)
            - 2 * jnp.einsum("bd,nd->bn", flat, embeddings)
        )
        idx = jnp.argmin(d, axis=1)
        z_q = embeddings[(idx,)].reshape(z.shape)
        return z + jax.lax.stop_gradient(z_q - z), idx.reshape(z.shape[:-1])


class LWMVQGAN(nn.Module):
    config: VQGANModelConfig

    def setup(self):
        cfg = self.config
        check_config(cfg)
        self.encoder = Encoder(cfg)
        self.decoder = Decoder(cfg)
        self.quantize = VectorQuantizer(cfg.num_embeddings, cfg.embed_dim)
        self.quant_conv = nn.Conv(cfg.embed_dim, [1, 1])
        self.post_quant_conv = nn.Conv(cfg.z_channels, [1, 1])

    def encode(self, pixel_values):
        """``[N, H, W, 3]`` in [-1, 1] -> (quantized latents, codes ``[N, h, w]``)."""
        return self.quantize(self.quant_conv(self.encoder(pixel_values)))

    def decode(self, codes):
        """Codes ``[N, h, w]`` -> frames ``[N, H, W, 3]`` clipped to [-1, 1]."""
        x = self.post_quant_conv(self.quantize(None, codes))
        return jnp.clip(self.decoder(x), -1, 1)

    def __call__(self, pixel_values):
        return self.decode(self.encode(pixel_values)[1])
