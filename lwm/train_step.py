"""The training step: modality-balanced loss, gradients, AdamW; explicit shardings throughout.

Parameters are an `nnx.State` (the model's graph definition is static); the optimizer is optax.
`abstract_train_state` describes parameters and optimizer state as sharded
`jax.ShapeDtypeStruct`s without allocating them, so a step can be compiled ahead of time for a
model that does not fit this host (`scripts/aot_compile.py`).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from lwm.config import ModelConfig
from lwm.loss import Targets, lwm_loss
from lwm.mesh import logical_to_spec
from lwm.model import LWMModel, state_shardings

# Every field is [batch, seq] and sharded batch over (dp, fsdp), sequence over sp.
BATCH_FIELDS: dict[str, Any] = {
    "tokens": jnp.int32,
    "vision_mask": jnp.bool_,
    "positions": jnp.int32,
    "segment_ids": jnp.int32,
    "target_tokens": jnp.int32,
    "target_is_vision": jnp.bool_,
    "target_weight": jnp.float32,
}


def make_optimizer(
    learning_rate: float = 3e-4,
    *,
    warmup_steps: int = 0,
    total_steps: int = 1000,
    schedule: str = "cosine",
    end_learning_rate: float = 0.0,
    weight_decay: float = 0.0,
    b1: float = 0.9,
    b2: float = 0.95,
    clip_norm: float | None = 1.0,
) -> tuple[optax.GradientTransformation, optax.Schedule]:
    """AdamW with linear warmup then cosine decay (or constant); norms are not decayed."""
    if schedule == "cosine":
        lr = optax.warmup_cosine_decay_schedule(
            0.0,
            learning_rate,
            max(warmup_steps, 1),
            max(total_steps, warmup_steps + 1),
            end_learning_rate,
        )
    elif schedule == "constant":
        lr = optax.join_schedules(
            [
                optax.linear_schedule(0.0, learning_rate, max(warmup_steps, 1)),
                optax.constant_schedule(learning_rate),
            ],
            [max(warmup_steps, 1)],
        )
    else:
        raise ValueError(f"unknown learning-rate schedule '{schedule}'; choose cosine or constant")

    def decay_mask(params):
        return jax.tree.map(lambda x: x.ndim >= 2, params)

    parts = [] if clip_norm is None else [optax.clip_by_global_norm(clip_norm)]
    parts.append(optax.adamw(lr, b1=b1, b2=b2, weight_decay=weight_decay, mask=decay_mask))
    return optax.chain(*parts), lr


def batch_sharding(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, logical_to_spec(("batch", "length")))


def loss_fn(params: nnx.State, graphdef: nnx.GraphDef, batch: dict, weights=(0.5, 0.5)):
    model: LWMModel = nnx.merge(graphdef, params)
    text, vision = model(
        batch["tokens"], batch["vision_mask"], batch["positions"], batch["segment_ids"]
    )
    targets = Targets(batch["target_tokens"], batch["target_is_vision"], batch["target_weight"])
    return lwm_loss(text, vision, targets, text_weight=weights[0], vision_weight=weights[1])


def train_step(
    params: nnx.State,
    opt_state: optax.OptState,
    batch: dict,
    *,
    graphdef: nnx.GraphDef,
    tx: optax.GradientTransformation,
    weights: tuple[float, float] = (0.5, 0.5),
):
    """One optimizer step; returns new parameters, optimizer state and metrics (incl. grad norm)."""
    (_, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(
        params, graphdef, batch, weights
    )
    updates, opt_state = tx.update(grads, opt_state, params)
    params = optax.apply_updates(params, updates)
    metrics = dict(metrics, grad_norm=optax.global_norm(grads))
    return params, opt_state, metrics


def abstract_train_state(cfg: ModelConfig, mesh: Mesh, tx: optax.GradientTransformation):
    """(graphdef, params, opt_state) with `jax.ShapeDtypeStruct` leaves carrying shardings."""
    abstract_model = nnx.eval_shape(lambda: LWMModel(cfg, rngs=nnx.Rngs(0), mesh=mesh))
    graphdef, params = nnx.split(abstract_model, nnx.Param)
    shardings = state_shardings(params, mesh)
    params = jax.tree.map(
        lambda v, s: v.replace(jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=s)),
        params,
        shardings,
        is_leaf=lambda x: isinstance(x, nnx.Variable),
    )
    # Optimizer moments take their parameter's sharding; counts and other scalars replicate.
    replicated = NamedSharding(mesh, P())
    opt_state = optax.tree_utils.tree_map_params(
        tx,
        lambda x, p: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=p.sharding),
        jax.eval_shape(tx.init, params),
        params,
        transform_non_params=lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=replicated),
    )
    return graphdef, params, opt_state


def abstract_batch(mesh: Mesh, batch_size: int, seq_len: int) -> dict:
    sharding = batch_sharding(mesh)
    return {
        k: jax.ShapeDtypeStruct((batch_size, seq_len), dt, sharding=sharding)
        for k, dt in BATCH_FIELDS.items()
    }
