"""Analytic model facts: parameter shapes and logical axes, counts, FLOPs and per-device memory;
and the measured matmul FLOP/s of the devices (`measure_peak_flops`), which MFU divides by.

Nothing here allocates parameters, so a 7B (or larger) config is described instantly.
`param_specs` is the single table of parameter shapes and logical axis names; the model uses it.
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping, Sequence
from typing import NamedTuple

import jax

from data.tokens import window_offsets
from lwm.base.mesh import logical_to_spec, shard_bytes
from lwm.config import ModelConfig

__all__ = [
    "DTYPE_BYTES",
    "VISION_PARAMS",
    "FlopsPerToken",
    "MemoryPerDevice",
    "ParamCounts",
    "ParamSpec",
    "flops_per_token",
    "is_block_matrix",
    "layer_param_specs",
    "memory_per_device",
    "param_counts",
    "param_specs",
]

DTYPE_BYTES: dict[str, int] = {"float32": 4, "bfloat16": 2, "float16": 2}
ADAM_MOMENT_BYTES = 4  # AdamW keeps two float32 moments per parameter

# Parameters that belong to the vision side of the model (the rest is the text LLaMA).
VISION_PARAMS: frozenset[str] = frozenset(
    {"embed_vision", "vision_head", "embed_vision_row", "embed_vision_col", "embed_vision_window"}
)

# Matrices multiplied against every token (embedding lookups are not matmuls).
_MATMUL_LAYER_PARAMS = ("attn.q", "attn.k", "attn.v", "attn.o", "mlp.gate", "mlp.up", "mlp.down")


class ParamSpec(NamedTuple):
    """Shape of one parameter and the logical name of each of its dimensions."""

    shape: tuple[int, ...]
    axes: tuple[str | None, ...]


class ParamCounts(NamedTuple):
    text: int
    vision: int

    @property
    def total(self) -> int:
        return self.text + self.vision


class FlopsPerToken(NamedTuple):
    train: float  # forward + backward, attention counted in full (PaLM's convention)
    inference: float  # forward, excluding attention over the context
    seq_len: int
    matmul_params: int
    train_causal: float = 0.0  # the same with causal attention halved (MaxText's convention)


class MemoryPerDevice(NamedTuple):
    params: int  # bytes, in param_dtype
    optimizer: int  # bytes, optimizer moments in float32 (AdamW: two per parameter)


def layer_param_specs(cfg: ModelConfig) -> dict[str, ParamSpec]:
    """Parameters of one transformer block (attention, SwiGLU MLP, two RMSNorms)."""
    h, m = cfg.hidden_size, cfg.intermediate_size
    return {
        "attn_norm": ParamSpec((h,), ("norm",)),
        "attn.q": ParamSpec((h, cfg.q_size), ("embed", "heads")),
        "attn.k": ParamSpec((h, cfg.kv_size), ("embed", "kv_heads")),
        "attn.v": ParamSpec((h, cfg.kv_size), ("embed", "kv_heads")),
        "attn.o": ParamSpec((cfg.q_size, h), ("heads", "embed")),
        "mlp_norm": ParamSpec((h,), ("norm",)),
        "mlp.gate": ParamSpec((h, m), ("embed", "mlp")),
        "mlp.up": ParamSpec((h, m), ("embed", "mlp")),
        "mlp.down": ParamSpec((m, h), ("mlp", "embed")),
    }


def is_block_matrix(name: str, ndim: int) -> bool:
    """Whether the parameter ``name`` (a `param_specs` name: ``layers.attn.q`` stacked for
    scanning, ``layers.0.attn.q`` not) of ``ndim`` dimensions is a weight matrix of a
    transformer block (attention or MLP projection), not a norm's vector or an embedding or
    head: what Muon orthogonalises (`lwm.train_step.make_optimizer`)."""
    parts = name.split(".")
    if parts[0] != "layers":
        return False
    stacked = not parts[1].isdigit()
    return ndim - stacked == 2


def param_specs(cfg: ModelConfig) -> dict[str, ParamSpec]:
    """Every parameter of the model, by dotted name.

    With `scan_layers` the blocks are stacked under `layers.*` with a leading ("layers",) axis;
    otherwise each block is `layers.{i}.*`. Tied heads reuse the embedding and have no entry.
    """
    h = cfg.hidden_size
    specs: dict[str, ParamSpec] = {
        "embed_text": ParamSpec((cfg.text_vocab_size, h), ("vocab", "embed")),
        "embed_vision": ParamSpec((cfg.vision_vocab_size, h), ("vocab", "embed")),
    }
    if cfg.vision_grid is not None:
        rows, cols = cfg.vision_grid
        specs["embed_vision_row"] = ParamSpec((rows, h), ("grid", "embed"))
        specs["embed_vision_col"] = ParamSpec((cols, h), ("grid", "embed"))
        if cfg.vision_window:
            k = len(window_offsets(cfg.vision_window))
            codes = cfg.codes_read
            specs["embed_vision_window"] = ParamSpec((k, codes, h), ("grid", "vocab", "embed"))
    layer = layer_param_specs(cfg)
    if cfg.scan_layers:
        for name, (shape, axes) in layer.items():
            specs[f"layers.{name}"] = ParamSpec((cfg.num_layers, *shape), ("layers", *axes))
    else:
        for i in range(cfg.num_layers):
            for name, spec in layer.items():
                specs[f"layers.{i}.{name}"] = spec
    specs["final_norm"] = ParamSpec((h,), ("norm",))
    if not cfg.tie_word_embeddings:
        specs["lm_head"] = ParamSpec((h, cfg.text_vocab_size), ("embed", "vocab"))
    if not cfg.tie_vision_embeddings:
        specs["vision_head"] = ParamSpec((h, cfg.vision_vocab_size), ("embed", "vocab"))
    return specs


def shape_differences(found: ModelConfig, wanted: ModelConfig) -> list[str]:
    """Why the parameters of a model configured as ``found`` would not fit one configured as
    ``wanted`` (`param_specs` differ): each setting that alone changes them, as ``model.KEY:
    FOUND there, WANTED here`` (every differing setting where none does alone); [] where they
    fit (a longer context, another rope theta or attention kernel)."""
    from lwm.base.config import setting_differences

    specs = param_specs(found)
    if specs == param_specs(wanted):
        return []

    def alone(k: str) -> bool:
        return param_specs(found.model_copy(update={k: getattr(wanted, k)})) != specs

    return setting_differences(found, wanted, "model", alone) or setting_differences(
        found, wanted, "model"
    )


def param_counts(cfg: ModelConfig) -> ParamCounts:
    """Parameter counts of the text model and of the vision embedding + head."""
    text = vision = 0
    for name, spec in param_specs(cfg).items():
        n = math.prod(spec.shape)
        if name in VISION_PARAMS:
            vision += n
        else:
            text += n
    return ParamCounts(text=text, vision=vision)


def flops_per_token(cfg: ModelConfig, seq_len: int | None = None) -> FlopsPerToken:
    """Model FLOPs per token at sequence length S (default `max_seq_len`).

    N counts the parameters multiplied against every token: per layer q, k, v, o, gate, up and
    down, plus the text and the vision head (LWM computes both logits at every position; a tied
    head still costs its matmul). Embedding lookups are free. The vision head counts only the
    columns it scores (``vision_codes`` + 2 when set); the text head counts the share of
    positions it runs at (``loss_positions`` / S when set; a training-only saving that
    inference FLOPs do not take).

        train     = 6 * N + 12 * L * (num_heads * head_dim) * S
        inference = 2 * N

    The attention term is forward (QK^T and AV: 2 * 2 * L * d * S) times 3 for fwd + bwd, without
    the causal halving, as in PaLM's model-FLOPs accounting. Recomputation is not counted.
    """
    s = cfg.max_seq_len if seq_len is None else seq_len
    layer = layer_param_specs(cfg)
    n = cfg.num_layers * sum(math.prod(layer[k].shape) for k in _MATMUL_LAYER_PARAMS)
    vision = cfg.vision_codes + 2 if cfg.vision_codes else cfg.vision_vocab_size
    n += cfg.hidden_size * (cfg.text_vocab_size + vision)
    text_share = min(1.0, cfg.loss_positions / s) if cfg.loss_positions else 1.0
    n_train = n - (1.0 - text_share) * cfg.hidden_size * cfg.text_vocab_size
    train = 6.0 * n_train + 12.0 * cfg.num_layers * cfg.q_size * s
    causal = 6.0 * n_train + 6.0 * cfg.num_layers * cfg.q_size * s
    return FlopsPerToken(
        train=train, inference=2.0 * n, seq_len=s, matmul_params=n, train_causal=causal
    )


# Peak dense bfloat16 matmul FLOP/s per chip from the vendors' specifications, by JAX's
# ``device_kind``: the denominator of MFU in MaxText's convention (`spec_peak_flops`).
SPEC_PEAK_BF16 = {
    "TPU v4": 275e12,
    "TPU v5 lite": 197e12,  # v5e
    "TPU v5e": 197e12,
    "TPU v5": 459e12,  # v5p
    "TPU v5p": 459e12,
    "TPU v6 lite": 918e12,  # v6e (Trillium)
    "TPU v6e": 918e12,
    "NVIDIA H100 80GB HBM3": 989e12,
    "NVIDIA H200": 989e12,
}


def spec_peak_flops(device_kind: str) -> float | None:
    """The chip's specified peak bfloat16 FLOP/s (`SPEC_PEAK_BF16`), or None for a chip not
    listed (CPUs among them)."""
    return SPEC_PEAK_BF16.get(device_kind)


def mfu_of_spec(flops: float, seconds: float, devices: Sequence[jax.Device]) -> float | None:
    """MFU in MaxText's convention: ``flops`` (count attention causal: `FlopsPerToken`'s
    ``train_causal``) done in ``seconds`` over the devices' specified peak, or None for chips
    not listed in `SPEC_PEAK_BF16`."""
    spec = spec_peak_flops(devices[0].device_kind)
    return None if spec is None else flops / seconds / (spec * len(devices))


def memory_per_device(
    cfg: ModelConfig, axis_sizes: Mapping[str, int], optimizer: str = "adamw"
) -> MemoryPerDevice:
    """Bytes of parameters and of optimizer state one device holds, sharded by the logical
    rules. ``optimizer`` (`TrainConfig.optimizer`): AdamW keeps two float32 moments per
    parameter; Muon one (its momentum) for the transformer blocks' matrices, and AdamW's two for
    the rest (`lwm.train_step.make_optimizer`).

    `axis_sizes` maps mesh axes to sizes (`mesh.shape`, or `mesh_axis_sizes(shape)` for a planned
    mesh). Uneven dimensions round up.
    """
    itemsize = DTYPE_BYTES[cfg.param_dtype]
    params = moments = 0
    for name, spec in param_specs(cfg).items():
        pspec = logical_to_spec(spec.axes)
        params += shard_bytes(spec.shape, pspec, axis_sizes, itemsize)
        count = 1 if optimizer == "muon" and is_block_matrix(name, len(spec.shape)) else 2
        moments += count * shard_bytes(spec.shape, pspec, axis_sizes, ADAM_MOMENT_BYTES)
    return MemoryPerDevice(params=params, optimizer=moments)


def measure_peak_flops(
    devices: list[jax.Device],
    dtype: str = "float32",
    size: int | None = None,
    repeats: int = 3,
    calls: int | None = None,
) -> float:
    """Achieved matmul FLOP/s per device in ``dtype`` (the model's compute dtype: MFU is
    measured against the rate of the matmuls the model runs), with every device multiplying at
    once. ``size``: the square matmul's side, by default 1024 on CPUs and 8192 on accelerators
    (smaller ones leave a GPU's tensor cores partly idle). Random operands (constant ones let a
    GPU hold higher clocks: 894 against 788 TFLOP/s on an H200, device/KINDS.md), and ``calls``
    products dispatched back to back per timing (default 1 on CPUs, 10 on accelerators), so
    that the host's wait for each result is not counted as matmul time. (On the H200, ones and
    one product per timing read 647-694 TFLOP/s, against PyTorch's 788 on random data: MFU
    over that rate came out 14-22% above MFU over 788; the cause is presumed, not measured.)"""
    n = len(devices)
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    cpu = devices[0].platform == "cpu"
    if size is None:
        size = 1024 if cpu else 8 * 1024
    if calls is None:
        calls = 1 if cpu else 10
    mesh = Mesh(np.asarray(devices), ("d",))
    sharding = NamedSharding(mesh, PartitionSpec("d"))
    make = jax.jit(
        lambda key: jax.random.normal(key, (n, size, size), jnp.dtype(dtype)),
        out_shardings=sharding,
    )
    x = make(jax.random.key(0))
    mm = jax.jit(lambda a: jnp.einsum("nij,njk->nik", a, a), out_shardings=sharding)
    mm(x).block_until_ready()
    best = math.inf
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(calls):
            y = mm(x)
        y.block_until_ready()
        best = min(best, (time.perf_counter() - t0) / calls)
    return 2.0 * size**3 / best
