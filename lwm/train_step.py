"""The training step: modality-balanced loss, gradients, AdamW or Muon; explicit shardings throughout.

Parameters are an `nnx.State` (the model's graph definition is static); the optimizer is optax.
`abstract_train_state` describes parameters and optimizer state as sharded
`jax.ShapeDtypeStruct`s without allocating them, so a step can be compiled ahead of time for a
model that does not fit this host (`tools/aot_compile.py`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax import lax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from data.batches import BATCH_FIELDS, WINDOW_FIELD
from lwm.attention import cudnn
from lwm.attention.blockwise import resolve_kernel
from lwm.base.mesh import logical_to_spec
from lwm.base.schedule import warmup_schedule
from lwm.config import ModelConfig, TrainConfig, optimizer_problem
from lwm.info import is_block_matrix
from lwm.loss import Targets, loss_from_sums, loss_sums, target_counts
from lwm.model import LWMModel, abstract_params


def muon_dimension_numbers(params: nnx.State) -> nnx.State:
    """Which parameters Muon orthogonalises, and along which axes: the matrices of the
    transformer blocks (attention and MLP projections; with `scan_layers` stacked on a leading
    axis that is orthogonalised per layer). Embeddings, output heads and norms get None: they
    stay with AdamW, as in Muon's reference recipe."""
    from optax.contrib import MuonDimensionNumbers

    def numbers(path, x):
        # the `param_specs` name: the path's keys but the Variable's trailing `.value`
        name = ".".join(str(getattr(k, "key", getattr(k, "name", k))) for k in path[:-1])
        if not is_block_matrix(name, x.ndim):
            return None
        return MuonDimensionNumbers(reduction_axis=x.ndim - 2, output_axis=x.ndim - 1)

    return jax.tree_util.tree_map_with_path(numbers, params)


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
    optimizer: str = "adamw",
) -> tuple[optax.GradientTransformation, optax.Schedule]:
    """AdamW (or Muon) with linear warmup then cosine decay (or constant), the schedule of
    `lwm.base.schedule`; norms are not decayed.

    ``optimizer="muon"``: `optax.contrib.muon` on the blocks' matrices
    (`muon_dimension_numbers`), with its updates scaled to an RMS of 0.2 per matrix (Moonshot's
    "consistent RMS", so that one learning rate suits both), and AdamW (``b1``, ``b2``) on
    everything else; both follow the one schedule. No weight decay with Muon."""
    if problem := optimizer_problem(optimizer, weight_decay):
        raise ValueError(problem)
    lr = warmup_schedule(
        learning_rate,
        warmup_steps=warmup_steps,
        total_steps=total_steps,
        kind=schedule,
        end_ratio=end_learning_rate / learning_rate,
    )

    def decay_mask(params):
        return jax.tree.map(lambda x: x.ndim >= 2, params)

    parts = [] if clip_norm is None else [optax.clip_by_global_norm(clip_norm)]
    if optimizer == "muon":
        from optax.contrib import muon

        parts.append(
            muon(
                lr,
                adam_b1=b1,
                adam_b2=b2,
                consistent_rms=0.2,
                muon_weight_dimension_numbers=muon_dimension_numbers,
            )
        )
    else:
        parts.append(optax.adamw(lr, b1=b1, b2=b2, weight_decay=weight_decay, mask=decay_mask))
    return optax.chain(*parts), lr


def batch_sharding(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, logical_to_spec(("batch", "length")))


def pack_batch(local: dict) -> np.ndarray:
    """A host batch (the fields of `BATCH_FIELDS`, and `WINDOW_FIELD`'s ``[batch, seq, K]``
    when present) as one int32 array ``[fields (+ K), batch, seq]``: moved to the devices in
    one transfer instead of one per field (`benchmarks/bench_loader.py --device-prefetch`
    measures both). Booleans become 0/1, float32 keeps its bits; `unpack_batch` inverts it in
    the step."""
    rows = [
        np.asarray(local[k], np.float32).view(np.int32)
        if dt == np.float32
        else np.asarray(local[k]).astype(np.int32, copy=False)
        for k, dt in BATCH_FIELDS.items()
    ]
    if WINDOW_FIELD in local:
        rows.extend(np.moveaxis(np.asarray(local[WINDOW_FIELD], np.int32), -1, 0))
    return np.stack(rows)


def unpack_batch(packed: jax.Array) -> dict:
    """The batch dict of a `pack_batch` array, inside the jitted step."""
    batch = {}
    for i, (k, dt) in enumerate(BATCH_FIELDS.items()):
        if dt == np.float32:
            batch[k] = lax.bitcast_convert_type(packed[i], jnp.float32)
        elif dt == np.bool_:
            batch[k] = packed[i] != 0
        else:
            batch[k] = packed[i]
    if packed.shape[0] > len(BATCH_FIELDS):
        batch[WINDOW_FIELD] = jnp.moveaxis(packed[len(BATCH_FIELDS) :], 0, -1)
    return batch


def packed_batch_sharding(mesh: Mesh) -> NamedSharding:
    """`batch_sharding` of a `pack_batch` array (its leading axis whole on every device)."""
    return NamedSharding(mesh, P(None, *batch_sharding(mesh).spec))


def loss_fn(
    params: nnx.State,
    graphdef: nnx.GraphDef,
    batch: dict,
    weights: tuple[float, float] = (0.5, 0.5),
    counts: tuple[jax.Array, jax.Array] | None = None,
    rows: str = "any",
    reach: int = 0,
):
    """The modality-balanced loss and its metrics; ``rows``, ``reach`` as for
    `LWMModel.hidden_states` (the caller has checked them: `row_order`, `row_reach`)."""
    model: LWMModel = nnx.merge(graphdef, params)
    targets = _targets(batch)
    # Vision targets as columns of the vision logits (restricted by model.vision_codes).
    targets = targets._replace(
        tokens=jnp.where(
            targets.is_vision, model.vision_target_index(targets.tokens), targets.tokens
        )
    )
    inputs = (
        batch["tokens"],
        batch["vision_mask"],
        batch["positions"],
        batch["segment_ids"],
        batch["frame_cells"],
        batch.get(WINDOW_FIELD),
    )
    heads = (weights[0] > 0, weights[1] > 0)  # a head whose loss weight is 0 is not computed
    hidden = model.hidden_states(*inputs, rows=rows, reach=reach)
    cap = model.cfg.loss_positions
    dropped = None
    if heads[0] and 0 < cap < hidden.shape[1]:
        # The text head only at the positions with a text target; the vision head everywhere.
        text_only = targets._replace(weight=targets.weight * ~targets.is_vision)
        h, t, dropped = trained_positions(hidden, text_only, cap)
        text_sums = _loss_sums(model, h, t, (True, False))
        vision_sums = _loss_sums(model, hidden, targets, (False, heads[1]))
        sums = {k: (text_sums if k.startswith("t_") else vision_sums)[k] for k in text_sums}
    else:
        sums = _loss_sums(model, hidden, targets, heads)
    loss, metrics = loss_from_sums(
        sums, text_weight=weights[0], vision_weight=weights[1], counts=counts
    )
    if dropped is not None:
        metrics["targets_dropped"] = dropped
    return loss, metrics


def _loss_sums(model: LWMModel, hidden: jax.Array, targets: Targets, heads) -> dict:
    if model.cfg.logits_chunk_size:
        return model.chunked_loss_sums(hidden, targets, heads)
    return loss_sums(*model.logits(hidden, heads), targets)


def trained_positions(hidden: jax.Array, targets: Targets, n: int):
    """The hidden states and targets of the first ``n`` trained positions of each row (then
    untrained ones, if fewer), and the number of trained positions that did not fit."""
    trained = targets.weight > 0
    order = jnp.argsort(~trained, axis=1, stable=True)[:, :n]
    kept = Targets(*(jnp.take_along_axis(x, order, axis=1) for x in targets))
    dropped = jnp.sum(trained, dtype=jnp.float32) - jnp.sum(kept.weight > 0, dtype=jnp.float32)
    return jnp.take_along_axis(hidden, order[..., None], axis=1), kept, dropped


def model_kernel(cfg: ModelConfig, platform: str) -> tuple[str, bool, str | None]:
    """The block kernel ``cfg``'s attention runs on ``platform`` and whether it is emulated
    (`resolve_kernel`), and why cuDNN's own kernels refuse its inputs (float32, some head
    sizes: each attention call then runs the XLA kernel, `kernel_for_inputs`), else None."""
    kernel, emulated = resolve_kernel(cfg.attention_kernel, platform)
    if kernel != "cudnn" or emulated:
        return kernel, emulated, None
    q = jax.ShapeDtypeStruct((1, 1, cfg.num_heads, cfg.head_dim), cfg.dtype)
    k = jax.ShapeDtypeStruct((1, 1, cfg.num_kv_heads, cfg.head_dim), cfg.dtype)
    return kernel, emulated, cudnn.unsupported(q, k)


def row_orders(cfg: ModelConfig, mesh: Mesh | None = None) -> tuple[str, ...]:
    """The row orders (`lwm.model.ROW_ORDERS`) whose attention schedules differ for this
    model on ``mesh``: only where attention runs on cuDNN (`lwm.attention.cudnn`; its stand-in
    off a GPU) are there more than ``any``; ``in_order`` only where each device attends over
    the whole sequence (blockwise attention, or a ring of one device)."""
    platform = jax.default_backend() if mesh is None else mesh.devices.flat[0].platform
    kernel, _, refused = model_kernel(cfg, platform)
    if refused:  # what cuDNN refuses runs on the XLA kernel whatever the order
        cudnn.log_fallback(refused)
    if cfg.attention == "dense" or kernel != "cudnn" or refused:
        return ("any",)
    sp = 1 if mesh is None else mesh.shape.get("sp", 1)
    whole = cfg.attention == "blockwise" or sp == 1
    return ("any", "in_order", "one_document") if whole else ("any", "one_document")


def _grads_fn(params: nnx.State, graphdef: nnx.GraphDef, weights, rows: str | None, reach: int = 0):
    """``batch, counts -> ((loss, metrics), grads)`` for rows of order ``rows``
    (`lwm.model.ROW_ORDERS`, checked by the caller on the host: one program per order). With
    ``rows=None`` the step checks on the device whether the batch's rows are each one document
    in the model's layout (`one_document_rows`) and takes the ``one_document`` schedule if so,
    else the one for rows in order where the model has it (``in_order`` with ``reach``, or
    every piece below the diagonal without one: a hint that each attention call checks on the
    device, falling back to the general schedule where it does not hold), else ``any``: one
    conditional per step (per micro-batch), both branches compiled (and planned: the larger
    one's memory), for callers that cannot check on the host (processes that would have to
    agree). The metric ``one_document`` then says which ran."""
    grad_fn = jax.value_and_grad(loss_fn, has_aux=True)

    def run(batch, counts, order):
        within = reach if order == "in_order" else 0
        return grad_fn(params, graphdef, batch, weights, counts, order, within)

    model: LWMModel = nnx.merge(graphdef, params)
    orders = row_orders(model.cfg, model.mesh)
    if rows is None and "one_document" not in orders:
        rows = "any"  # nothing to choose: the same program either way
    if rows is not None:
        return lambda batch, counts=None: run(batch, counts, rows)
    other = "in_order" if "in_order" in orders else "any"

    def grads(batch, counts=None):
        known = model.rows_are_one_document(batch["positions"], batch["segment_ids"])
        (loss, metrics), g = jax.lax.cond(
            known, lambda: run(batch, counts, "one_document"), lambda: run(batch, counts, other)
        )
        return (loss, dict(metrics, one_document=known.astype(jnp.float32))), g

    return grads


def _targets(batch: dict) -> Targets:
    return Targets(batch["target_tokens"], batch["target_is_vision"], batch["target_weight"])


def _micro_batches(batch: dict, accum: int, mesh: Mesh | None) -> dict:
    """[batch, seq] -> [accum, batch/accum, seq], each micro-batch sharded like a batch."""

    def split(x):
        x = x.reshape(accum, x.shape[0] // accum, *x.shape[1:])
        if mesh is None:
            return x
        spec = P(None, *logical_to_spec(("batch", "length")))
        return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))

    return jax.tree.map(split, batch)


def train_step(
    params: nnx.State,
    opt_state: optax.OptState,
    batch: dict,
    *,
    graphdef: nnx.GraphDef,
    tx: optax.GradientTransformation,
    weights: tuple[float, float] = (0.5, 0.5),
    grad_accum: int = 1,
    mesh: Mesh | None = None,
    rows: str | None = None,
    reach: int = 0,
    opt_device=None,
):
    """One optimizer step; returns new parameters, optimizer state and metrics (incl. grad norm).

    ``rows``: what the caller knows of the order of every row of the batch (`row_order`: one
    program per order), or None for the device to check (`_grads_fn`); ``reach``: for rows in
    order, how far back any query looks (`row_reach`; 0: unknown). With ``grad_accum > 1``
    the batch is split into micro-batches whose gradients are summed; each micro-batch loss is
    averaged over the whole batch's target counts, so the result equals one step on the whole
    batch (up to float summation order). ``opt_device``: the device shardings to move an
    optimizer state kept in host memory to for the update (`TrainConfig.offload_optimizer`).
    """
    if not isinstance(batch, dict):  # `pack_batch`'s one array
        batch = unpack_batch(batch)
    grads_of = _grads_fn(params, graphdef, weights, rows, reach)
    if grad_accum == 1:
        (_, metrics), grads = grads_of(batch)
    else:
        counts = target_counts(_targets(batch))
        micro = _micro_batches(batch, grad_accum, mesh)

        def accumulate(carry, mb):
            grads, metrics = carry
            (_, m), g = grads_of(mb, counts)
            return (jax.tree.map(jnp.add, grads, g), jax.tree.map(jnp.add, metrics, m)), None

        zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params)
        zero_metrics = jax.tree.map(jnp.zeros_like, jax.eval_shape(lambda: grads_of(batch)[0][1]))
        (grads, metrics), _ = jax.lax.scan(accumulate, (zeros, zero_metrics), micro)
        if "one_document" in metrics:  # summed over micro-batches: the share that took it
            metrics["one_document"] = metrics["one_document"] / grad_accum
        grads = jax.tree.map(lambda g, p: g.astype(p.dtype), grads, params)
    if opt_device is not None:
        opt_state = jax.device_put(opt_state, opt_device)
    updates, opt_state = tx.update(grads, opt_state, params)
    params = optax.apply_updates(params, updates)
    metrics = dict(metrics, grad_norm=optax.tree.norm(grads))
    return params, opt_state, metrics


def layers_sharding(sharding: NamedSharding, num_layers: int) -> NamedSharding:
    """The sharding of Muon's momentum for a stacked block matrix ``[layers, rows, cols]`` of
    ``sharding``: split by layer over the mesh axes of size > 1 (in mesh order, as many as
    divide ``num_layers``), which then leave the matrix axes; an axis that does not divide stays
    where ``sharding`` has it. Muon orthogonalises every layer's matrix whole (Newton-Schulz), so
    with the momentum split by layer each device runs it on its own layers, with no collectives
    inside where every axis fits (`docs/aot.md`). AdamW's moments keep their parameter's
    sharding: its update is elementwise."""
    mesh = sharding.mesh
    chosen, size = [], 1
    for axis, n in mesh.shape.items():
        if n > 1 and num_layers % (size * n) == 0:
            chosen.append(axis)
            size *= n
    if not chosen:
        return sharding

    def rest(entry):
        axes = (entry,) if isinstance(entry, str) else tuple(entry or ())
        kept = tuple(a for a in axes if a not in chosen)
        return kept[0] if len(kept) == 1 else (kept or None)

    spec = tuple(sharding.spec) + (None,) * (3 - len(sharding.spec))
    lead = chosen[0] if len(chosen) == 1 else tuple(chosen)
    return NamedSharding(mesh, P(lead, *(rest(e) for e in spec[1:])))


HOST_MEMORY = "pinned_host"


def abstract_train_state(
    cfg: ModelConfig,
    mesh: Mesh,
    tx: optax.GradientTransformation,
    *,
    offload_optimizer: bool = False,
):
    """(graphdef, params, opt_state) with `jax.ShapeDtypeStruct` leaves carrying shardings;
    ``offload_optimizer``: the optimizer state's in pinned host memory
    (`TrainConfig.offload_optimizer`; `jit_train_step` then moves it for the update)."""
    graphdef, params = abstract_params(cfg, mesh)
    # Optimizer moments take their parameter's sharding, but for Muon's momentum of stacked
    # block matrices split by layer as well (`layers_sharding`); counts and other scalars
    # replicate. (Muon's state holds its own and AdamW's moments, each masked to its share of
    # the tree: a block matrix has only Muon's.)
    from optax.contrib import MuonState

    replicated = NamedSharding(mesh, P())
    masked = lambda x: isinstance(x, optax.MaskedNode)  # noqa: E731
    shapes = jax.eval_shape(tx.init, params)
    is_muon = lambda x: isinstance(x, MuonState)  # noqa: E731
    muon = any(map(is_muon, jax.tree.leaves(shapes, is_leaf=is_muon)))
    numbers = muon_dimension_numbers(params)

    def state_sharding(p, n):
        stacked = muon and n is not None and p.ndim == 3  # only scan_layers stacks them
        return layers_sharding(p.sharding, p.shape[0]) if stacked else p.sharding

    moments = jax.tree.map(
        lambda p, n: jax.ShapeDtypeStruct(p.shape, p.dtype, sharding=state_sharding(p, n)),
        params,
        numbers,
        is_leaf=lambda x: x is None or isinstance(x, jax.ShapeDtypeStruct),
    )
    opt_state = optax.tree_utils.tree_map_params(
        tx,
        lambda x, p: (
            x if masked(x) else jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=p.sharding)
        ),
        shapes,
        moments,
        transform_non_params=lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=replicated),
        is_leaf=masked,
    )
    if offload_optimizer:
        opt_state = jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(
                x.shape, x.dtype, sharding=x.sharding.with_memory_kind(HOST_MEMORY)
            ),
            opt_state,
        )
    return graphdef, params, opt_state


def abstract_batch(mesh: Mesh, batch_size: int, seq_len: int, window: int = 0) -> dict:
    """The batch `jit_train_step` takes, as shapes; ``window``: the neighbours per code of a
    model with `ModelConfig.vision_window` (`data.tokens.window_offsets`), 0 for none."""
    sharding = batch_sharding(mesh)
    batch = {
        k: jax.ShapeDtypeStruct((batch_size, seq_len), dt, sharding=sharding)
        for k, dt in BATCH_FIELDS.items()
    }
    if window:
        shape = (batch_size, seq_len, window)
        batch[WINDOW_FIELD] = jax.ShapeDtypeStruct(shape, jnp.int32, sharding=sharding)
    return batch


def optimizer_from_config(tc: TrainConfig) -> tuple[optax.GradientTransformation, optax.Schedule]:
    return make_optimizer(
        tc.learning_rate,
        warmup_steps=tc.warmup_steps,
        total_steps=tc.steps,
        schedule=tc.schedule,
        end_learning_rate=tc.end_learning_rate,
        weight_decay=tc.weight_decay,
        b1=tc.b1,
        b2=tc.b2,
        clip_norm=tc.clip_norm,
        optimizer=tc.optimizer,
    )


def jit_train_step(
    graphdef: nnx.GraphDef,
    tx: optax.GradientTransformation,
    mesh: Mesh,
    params: nnx.State,
    opt_state,
    *,
    weights: tuple[float, float] = (0.5, 0.5),
    grad_accum: int = 1,
    rows: str | None = None,
    reach: int = 0,
    packed_batch: bool = False,
):
    """The jitted training step `lwm train` runs, and the one `tools/aot_compile.py` and
    `benchmarks/bench_train.py` compile: parameters and optimizer state keep the shardings their
    leaves carry in ``params`` / ``opt_state`` (abstract ones from `abstract_train_state`),
    the batch is sharded by `batch_sharding`, and both state buffers are donated. ``rows``,
    ``reach``: what is known of the batches' rows it is for (`train_step`); ``packed_batch``:
    the batch comes as `pack_batch`'s one array (sharded by `packed_batch_sharding`)."""
    param_shardings = jax.tree.map(lambda x: x.sharding, params)
    opt_shardings = jax.tree.map(lambda x: x.sharding, opt_state)
    on_host = any(s.memory_kind == HOST_MEMORY for s in jax.tree.leaves(opt_shardings))
    opt_device = (
        jax.tree.map(lambda s: s.with_memory_kind("device"), opt_shardings) if on_host else None
    )
    return jax.jit(
        functools.partial(  # named train_step in profiles and compiler dumps
            train_step,
            graphdef=graphdef,
            tx=tx,
            weights=weights,
            grad_accum=grad_accum,
            mesh=mesh,
            rows=rows,
            reach=reach,
            opt_device=opt_device,
        ),
        in_shardings=(
            param_shardings,
            opt_shardings,
            packed_batch_sharding(mesh) if packed_batch else batch_sharding(mesh),
        ),
        out_shardings=(param_shardings, opt_shardings, NamedSharding(mesh, P())),
        donate_argnums=(0, 1),
    )
