"""Typed VQGAN configs: the architecture, the quantizer, the losses, training and data.

Loaded from YAML (`configs/vqgan/*.yaml`) with `key=value` overrides by `load_vqgan_config`,
which reuses `lwm.config`'s loader (``base:`` inheritance, one-line errors naming the key).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from lwm.base.config import MeshConfig, PositiveFloat, PositiveInt, Precision, load_config

__all__ = [
    "DataConfig",
    "DiscriminatorConfig",
    "LossConfig",
    "QuantizerConfig",
    "TrainConfig",
    "VQGANConfig",
    "VQGANModelConfig",
    "load_vqgan_config",
]

NonNegFloat = Annotated[float, Field(ge=0)]
NonNegInt = Annotated[int, Field(ge=0)]
DType = Literal["float32", "bfloat16", "float16"]


class VQGANModelConfig(BaseModel):
    """Encoder / quantizer / decoder architecture (LWM's VQGAN with its defaults).

    Each of ``len(channel_mult)`` levels has ``num_res_blocks`` residual blocks in the encoder
    and ``num_res_blocks + 1`` in the decoder; every level but the last halves (encoder) or
    doubles (decoder) the resolution, so a frame becomes ``(resolution / 2**(levels-1))**2``
    codes. Frozen (hashable): modules keep it as static structure under `jax.jit`."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    resolution: PositiveInt = 256
    num_channels: PositiveInt = 3
    hidden_channels: PositiveInt = 128
    channel_mult: tuple[PositiveInt, ...] = (1, 2, 2, 4, 6)
    num_res_blocks: PositiveInt = 2
    z_channels: PositiveInt = 64
    num_embeddings: PositiveInt = 8192
    embed_dim: PositiveInt = 64
    num_groups: PositiveInt = 32  # GroupNorm groups (LWM: flax's default, 32)
    dtype: DType = "float32"  # activations / compute
    param_dtype: DType = "float32"
    # Float32 convolutions of the encoder and decoder (jax.default_matmul_precision) wherever
    # the trained VQGAN encodes or decodes (tokenize, vqgan encode/decode, ask, chat, the world
    # model's evaluation; training has train.matmul_precision): on TPUs "default" is one
    # bfloat16 pass, "high" three, "highest" float32-exact as on CPUs (there all three are the
    # same). Codes of similar colours lie close, and a chip's default rounding gives some
    # frames other codes than a CPU does. The code search is exact always.
    matmul_precision: Precision = "default"

    @model_validator(mode="after")
    def _check(self) -> VQGANModelConfig:
        if not self.channel_mult:
            raise ValueError("channel_mult must have at least one level")
        if self.resolution % self.downsample_factor:
            raise ValueError(
                f"resolution ({self.resolution}) must be divisible by the downsampling factor "
                f"2**(len(channel_mult)-1) = {self.downsample_factor}"
            )
        for width in {self.hidden_channels * m for m in self.channel_mult}:
            if width % self.num_groups:
                raise ValueError(
                    f"channel width {width} (hidden_channels x channel_mult) is not divisible by "
                    f"num_groups ({self.num_groups})"
                )
        return self

    @property
    def downsample_factor(self) -> int:
        return 2 ** (len(self.channel_mult) - 1)

    @property
    def codes_per_side(self) -> int:
        return self.resolution // self.downsample_factor

    @property
    def tokens_per_frame(self) -> int:
        return self.codes_per_side**2


class QuantizerConfig(BaseModel):
    """Vector quantizer training: losses and dead-code restarts."""

    model_config = ConfigDict(extra="forbid")

    codebook_weight: NonNegFloat = 1.0  # ||sg(z) - e||^2
    commitment_cost: NonNegFloat = 0.25  # ||z - sg(e)||^2 (LWM's value)
    restart_dead_codes: bool = True
    restart_every: PositiveInt = 50  # steps between restarts (the first is at this step)
    restart_until: NonNegInt | None = None  # no restarts after this step (None: never stop)
    usage_decay: Annotated[float, Field(ge=0, lt=1)] = 0.9  # EMA of per-step code counts
    dead_threshold: NonNegFloat = 0.01  # a code whose EMA count is below this is dead


class LossConfig(BaseModel):
    """Reconstruction + PatchGAN hinge adversarial loss (+ optional perceptual loss)."""

    model_config = ConfigDict(extra="forbid")

    recon: Literal["l1", "l2", "l1+l2"] = "l1"
    recon_weight: NonNegFloat = 1.0
    adversarial_weight: NonNegFloat = 0.1
    disc_start: NonNegInt = 10_000  # step at which the discriminator and its loss switch on
    perceptual: str = "none"  # a name registered in vqgan.losses.PERCEPTUAL_LOSSES
    perceptual_weight: NonNegFloat = 0.0


class DiscriminatorConfig(BaseModel):
    """PatchGAN discriminator (conv 4x4 stride 2 stack, GroupNorm, leaky ReLU)."""

    model_config = ConfigDict(extra="forbid")

    channels: PositiveInt = 64
    num_layers: PositiveInt = 3
    num_groups: PositiveInt = 8
    learning_rate: PositiveFloat = 1e-4


class TrainConfig(BaseModel):
    """`lwm vqgan train`: optimisation, evaluation, checkpoints and logs."""

    model_config = ConfigDict(extra="forbid")

    output_dir: str = "runs/vqgan"
    steps: PositiveInt = 1000
    batch_size: PositiveInt = 32  # frames, global
    learning_rate: PositiveFloat = 1e-4
    warmup_steps: NonNegInt = 0
    schedule: Literal["cosine", "constant"] = "constant"
    end_learning_rate_ratio: NonNegFloat = 0.1  # cosine decays to this fraction of the peak
    # the same setting as model.matmul_precision for the steps and the held-out evaluation of
    # training; on TPUs the training step compiles far slower at "high" or "highest"
    matmul_precision: Precision = "default"
    b1: float = 0.5
    b2: float = 0.9
    weight_decay: NonNegFloat = 0.0
    clip_norm: PositiveFloat | None = 1.0
    log_every: PositiveInt = 10
    eval_every: PositiveInt = 200
    eval_frames: PositiveInt = 256  # held-out frames for PSNR and codebook usage
    save_every: PositiveInt = 200
    max_to_keep: PositiveInt = 2
    grid_frames: PositiveInt = 8  # columns of the original/reconstruction PNG grid
    progress: bool = True


class DataConfig(BaseModel):
    """Training frames: synthetic videos rendered in memory, or the MP4s of a manifest."""

    model_config = ConfigDict(extra="forbid")

    source: Literal["synthetic", "manifest"] = "synthetic"
    manifest: str | None = None  # for source=manifest: a manifest.jsonl (data/synthetic.py)
    eval_fraction: Annotated[float, Field(gt=0, lt=1)] = 0.1  # manifest: held-out videos
    videos: PositiveInt = 200  # synthetic: training videos
    eval_videos: PositiveInt = 32  # synthetic: held-out videos (same seed, after the training ones)
    frame_size: PositiveInt | None = None  # synthetic: rendered size (None: model.resolution)
    num_frames: PositiveInt = 16
    needle_prob: Annotated[float, Field(ge=0, le=1)] = 0.5
    seed: int = 0

    @model_validator(mode="after")
    def _check(self) -> DataConfig:
        if self.source == "manifest" and not self.manifest:
            raise ValueError("data.source is 'manifest' but data.manifest is not set")
        return self


class VQGANConfig(BaseModel):
    """Root of a `configs/vqgan/*.yaml` file."""

    model_config = ConfigDict(extra="forbid")

    model: VQGANModelConfig = Field(default_factory=VQGANModelConfig)
    quantizer: QuantizerConfig = Field(default_factory=QuantizerConfig)
    loss: LossConfig = Field(default_factory=LossConfig)
    discriminator: DiscriminatorConfig = Field(default_factory=DiscriminatorConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    mesh: MeshConfig = Field(default_factory=MeshConfig)
    seed: int = 0

    @model_validator(mode="after")
    def _check(self) -> VQGANConfig:
        # The discriminator halves the frame num_layers times; keep at least a 2x2 patch map.
        smallest = self.model.resolution / 2**self.discriminator.num_layers
        if smallest < 2:
            raise ValueError(
                f"discriminator.num_layers ({self.discriminator.num_layers}) is too deep for "
                f"{self.model.resolution}x{self.model.resolution} frames"
            )
        if math.gcd(self.discriminator.channels, self.discriminator.num_groups) != (
            self.discriminator.num_groups
        ):
            raise ValueError(
                f"discriminator.channels ({self.discriminator.channels}) must be divisible by "
                f"discriminator.num_groups ({self.discriminator.num_groups})"
            )
        return self


def load_vqgan_config(path: str | Path, overrides: tuple[str, ...] | list[str] = ()) -> VQGANConfig:
    """Load a VQGAN YAML config (``base:`` links followed), apply overrides, validate."""
    return load_config(path, overrides, VQGANConfig)
