"""PatchGAN discriminator (as in taming-transformers' NLayerDiscriminator, with GroupNorm in
place of BatchNorm so it needs no running statistics under data parallelism).

``num_layers`` 4x4 stride-2 convs (widths ``channels * min(2**n, 8)``), a 4x4 stride-1 conv,
and a 4x4 stride-1 conv to one logit per patch; leaky ReLU 0.2 after each hidden conv.
"""

from __future__ import annotations

import jax
from flax import nnx

from vqgan.config import DiscriminatorConfig

__all__ = ["PatchDiscriminator"]


class PatchDiscriminator(nnx.Module):
    def __init__(self, cfg: DiscriminatorConfig, num_channels: int = 3, *, rngs: nnx.Rngs):
        pad = ((1, 1), (1, 1))
        widths = [cfg.channels * min(2**n, 8) for n in range(cfg.num_layers + 1)]
        convs, norms = [], []
        cin = num_channels
        for n, cout in enumerate(widths):
            stride = 2 if n < cfg.num_layers else 1
            convs.append(nnx.Conv(cin, cout, (4, 4), strides=stride, padding=pad, rngs=rngs))
            # No norm after the first conv (as the original).
            norms.append(
                None if n == 0 else nnx.GroupNorm(cout, num_groups=cfg.num_groups, rngs=rngs)
            )
            cin = cout
        self.convs = nnx.List(convs)
        self.norms = nnx.List(norms)
        self.head = nnx.Conv(cin, 1, (4, 4), strides=1, padding=pad, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        """Frames ``[N, H, W, C]`` in [-1, 1] -> patch logits ``[N, h, w, 1]``."""
        for conv, norm in zip(self.convs, self.norms, strict=True):
            x = conv(x)
            if norm is not None:
                x = norm(x)
            x = nnx.leaky_relu(x, 0.2)
        return self.head(x)
