"""VQGAN training: reconstruction + codebook/commitment losses, a PatchGAN hinge loss from
``loss.disc_start`` on, dead-code restarts, data parallel over the mesh's batch axes.

    lwm vqgan train --config configs/vqgan/small.yaml train.steps=2000

Writes into ``train.output_dir``: ``config.yaml``; ``checkpoints/`` (orbax; a rerun resumes from
the latest exactly: batches and random keys are functions of the step); ``metrics.jsonl`` and
``tb/`` (TensorBoard scalars); ``samples/step_NNNNNN.png`` (originals above reconstructions of
held-out frames) at each evaluation; and at the end ``model.safetensors`` + ``eval.json``, so
the folder is what `vqgan.load_tokenizer` loads.
"""

from __future__ import annotations

import functools
import json
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from lwm.base.config import keep_config_before_changes
from lwm.base.media import write_png
from lwm.base.mesh import BATCH_AXES, MeshError, batch_devices
from lwm.base.metrics import MetricsWriter
from lwm.base.schedule import warmup_schedule
from lwm.base.signals import StopSignals
from vqgan.checkpoint import Checkpointer, latest_checkpoint_step
from vqgan.config import (
    LossConfig,
    QuantizerConfig,
    TrainConfig,
    VQGANConfig,
)
from vqgan.data import FrameSource
from vqgan.discriminator import PatchDiscriminator
from vqgan.losses import get_perceptual, hinge_d_loss, hinge_g_loss, psnr, recon_loss
from vqgan.model import VQGAN, host_init, init_model
from vqgan.preprocess import postprocess
from vqgan.quantizer import code_counts, restart_dead_codes, update_usage, usage_stats
from vqgan.weights import WeightsError, save_weights, write_config

__all__ = [
    "TrainingStopped",
    "TrainState",
    "create_state",
    "evaluate",
    "make_train_step",
    "step_phase",
    "train",
]


class TrainingStopped(Exception):  # noqa: N818 (not an error: what the user asked)
    """`train` was stopped by ``signal`` (SIGINT, SIGTERM) after saving a checkpoint at
    ``step``: a rerun resumes there."""

    def __init__(self, signal: str, step: int):
        super().__init__(f"{signal} at step {step}")
        self.signal, self.step = signal, step


BATCH = P(BATCH_AXES)


@dataclass
class TrainState:
    model: VQGAN
    disc: PatchDiscriminator
    opt: nnx.Optimizer
    disc_opt: nnx.Optimizer
    usage: jax.Array  # EMA of per-step code counts [num_embeddings]

    def checkpoint_trees(self) -> tuple[dict, dict]:
        """(model params, everything else) as pure dicts of arrays, for orbax."""
        model = nnx.to_pure_dict(nnx.state(self.model, nnx.Param))
        train = {
            "disc": nnx.to_pure_dict(nnx.state(self.disc, nnx.Param)),
            "opt": nnx.to_pure_dict(nnx.state(self.opt)),
            "disc_opt": nnx.to_pure_dict(nnx.state(self.disc_opt)),
            "usage": self.usage,
        }
        return model, train

    def load_trees(self, model: dict, train: dict) -> None:
        for obj, tree, filt in (
            (self.model, model, nnx.Param),
            (self.disc, train["disc"], nnx.Param),
            (self.opt, train["opt"], ...),
            (self.disc_opt, train["disc_opt"], ...),
        ):
            state = nnx.state(obj, filt)
            nnx.replace_by_pure_dict(state, tree)
            nnx.update(obj, state)
        self.usage = train["usage"]


def _schedule(t: TrainConfig, peak: float) -> optax.Schedule:
    return warmup_schedule(
        peak,
        warmup_steps=t.warmup_steps,
        total_steps=t.steps,
        kind=t.schedule,
        end_ratio=t.end_learning_rate_ratio,
    )


@functools.cache
def _optimizer(train_json: str, peak: float) -> optax.GradientTransformation:
    # Cached on the settings, so runs with equal settings share one transformation object and
    # with it the compiled train step (the optimizer is static structure under nnx.jit).
    t = TrainConfig.model_validate_json(train_json)
    adam = optax.adamw(_schedule(t, peak), b1=t.b1, b2=t.b2, weight_decay=t.weight_decay)
    return optax.chain(optax.clip_by_global_norm(t.clip_norm), adam) if t.clip_norm else adam


def _train_json(cfg: VQGANConfig) -> str:
    # The fields the optimizer depends on (not output_dir, logging, ...).
    fields = {"steps", "learning_rate", "warmup_steps", "schedule", "end_learning_rate_ratio"}
    fields |= {"b1", "b2", "weight_decay", "clip_norm"}
    return cfg.train.model_dump_json(include=fields)


def _key(seed: int) -> jax.Array:
    """The training's random key (dead-code restarts draw from it). Threefry: the same random
    bits on a CPU, a GPU and a TPU, as JAX documents them; "rbg" keys (XLA's RngBitGenerator),
    used here before, draw other bits on each backend, so the same command restarted other
    codes on a TPU than on a CPU."""
    return jax.random.key(seed, impl="threefry2x32")


@functools.partial(nnx.jit, static_argnums=(2, 3))
def _optimizers(
    model: VQGAN,
    disc: PatchDiscriminator,
    tx: optax.GradientTransformation,
    disc_tx: optax.GradientTransformation,
) -> tuple[nnx.Optimizer, nnx.Optimizer]:
    return nnx.Optimizer(model, tx, wrt=nnx.Param), nnx.Optimizer(disc, disc_tx, wrt=nnx.Param)


def create_state(cfg: VQGANConfig, mesh: Mesh | None = None) -> TrainState:
    """Fresh model, discriminator and optimizers (replicated over ``mesh`` if given); the model
    computes at ``train.matmul_precision``."""
    train_json = _train_json(cfg)
    tx = _optimizer(train_json, cfg.train.learning_rate)
    disc_tx = _optimizer(train_json, cfg.discriminator.learning_rate)
    # trained at train.matmul_precision; the weights are the same for any precision
    model = init_model(
        cfg.model.model_copy(update={"matmul_precision": cfg.train.matmul_precision}), cfg.seed
    )
    disc = host_init(
        nnx.eval_shape(
            lambda: PatchDiscriminator(cfg.discriminator, cfg.model.num_channels, rngs=nnx.Rngs(0))
        ),
        cfg.seed + 1,
    )
    opt, disc_opt = _optimizers(model, disc, tx, disc_tx)
    modules = (model, disc, opt, disc_opt)
    usage = jnp.zeros((cfg.model.num_embeddings,), jnp.float32)
    if mesh is not None:
        replicated = NamedSharding(mesh, P())
        for obj in modules:
            nnx.update(obj, jax.device_put(nnx.state(obj), replicated))
        usage = jax.device_put(usage, replicated)
    return TrainState(*modules, usage)


def step_phase(cfg: VQGANConfig, step: int) -> tuple[bool, bool]:
    """(adversarial loss on, restart dead codes after) for 0-based ``step``."""
    q = cfg.quantizer
    use_adv = cfg.loss.adversarial_weight > 0 and step >= cfg.loss.disc_start
    do_restart = (
        q.restart_dead_codes
        and step > 0
        and step % q.restart_every == 0
        and (q.restart_until is None or step <= q.restart_until)
    )
    return use_adv, do_restart


def make_train_step(cfg: VQGANConfig) -> Callable[..., tuple[jax.Array, dict[str, jax.Array]]]:
    """The train step for ``cfg``'s losses and quantizer (cached: equal settings, one program).

    ``step(model, disc, opt, disc_opt, usage, frames_uint8, key, use_adv, do_restart)
    -> (usage, metrics)``, updating the modules in place. ``use_adv`` is static (one compiled
    program before ``loss.disc_start``, one after); ``do_restart`` is a traced bool."""
    return _make_train_step(cfg.loss.model_dump_json(), cfg.quantizer.model_dump_json())


@functools.cache
def _make_train_step(loss_json: str, quantizer_json: str):
    loss_cfg = LossConfig.model_validate_json(loss_json)
    q_cfg = QuantizerConfig.model_validate_json(quantizer_json)
    perceptual = get_perceptual(loss_cfg.perceptual) if loss_cfg.perceptual_weight > 0 else None

    def gen_loss(model: VQGAN, disc: PatchDiscriminator, x: jax.Array, use_adv: bool):
        x_hat, q = model(x)
        rec = recon_loss(x, x_hat, loss_cfg.recon)
        vq = q_cfg.codebook_weight * q.codebook_loss + q_cfg.commitment_cost * q.commitment_loss
        loss = loss_cfg.recon_weight * rec + vq
        aux = {"recon": rec, "codebook": q.codebook_loss, "commitment": q.commitment_loss}
        if perceptual is not None:
            aux["perceptual"] = perceptual(x, x_hat)
            loss = loss + loss_cfg.perceptual_weight * aux["perceptual"]
        if use_adv:
            aux["g_adv"] = hinge_g_loss(disc(x_hat))
            loss = loss + loss_cfg.adversarial_weight * aux["g_adv"]
        return loss, (aux, x_hat, q.codes, q.latents)

    def disc_loss(disc: PatchDiscriminator, x: jax.Array, x_hat: jax.Array):
        real, fake = disc(x), disc(x_hat)
        return hinge_d_loss(real, fake), (jnp.mean(real), jnp.mean(fake))

    @nnx.jit(static_argnames=("use_adv",))
    def step(model, disc, opt, disc_opt, usage, frames, key, use_adv, do_restart):
        x = frames.astype(jnp.float32) / 127.5 - 1.0
        grad_fn = nnx.value_and_grad(gen_loss, has_aux=True)
        (loss, (aux, x_hat, codes, latents)), grads = grad_fn(model, disc, x, use_adv)
        opt.update(model, grads)
        metrics = {"loss": loss, **aux, **usage_stats(code_counts(codes, usage.shape[0]))}
        if use_adv:
            d_fn = nnx.value_and_grad(disc_loss, has_aux=True)
            (d_loss, (real, fake)), d_grads = d_fn(disc, x, jax.lax.stop_gradient(x_hat))
            disc_opt.update(disc, d_grads)
            metrics.update(d_loss=d_loss, d_real=real, d_fake=fake)
        usage = update_usage(usage, codes, q_cfg.usage_decay)
        # A traced flag (not static): restarting is cheap, and one program serves every step.
        emb = model.quantizer.embeddings
        new, new_usage, restarted = restart_dead_codes(
            emb[...], usage, latents, key, q_cfg.dead_threshold
        )
        emb[...] = jnp.where(do_restart, new, emb[...])
        usage = jnp.where(do_restart, new_usage, usage)
        metrics["restarted"] = jnp.where(do_restart, restarted, 0)
        return usage, metrics

    return step


@nnx.jit
def _reconstruct(model: VQGAN, frames: jax.Array) -> tuple[jax.Array, jax.Array]:
    x = frames.astype(jnp.float32) / 127.5 - 1.0
    codes = model.encode(x).codes
    return codes, postprocess(model.decode_codes(codes))


def evaluate(
    model: VQGAN, frames: np.ndarray, batch_size: int, mesh: Mesh | None = None
) -> tuple[dict[str, float], np.ndarray]:
    """PSNR (dB, mean over frames) and codebook usage on ``frames``; also the reconstructions."""
    sharding = NamedSharding(mesh, BATCH) if mesh is not None else None
    codes_all, recon_all = [], []
    for start in range(0, len(frames), batch_size):
        chunk = frames[start : start + batch_size]
        n = len(chunk)
        if n < batch_size:
            chunk = np.concatenate([chunk, np.zeros((batch_size - n, *chunk.shape[1:]), np.uint8)])
        chunk = jax.device_put(chunk, sharding) if sharding is not None else jnp.asarray(chunk)
        codes, recon = _reconstruct(model, chunk)
        codes_all.append(np.asarray(codes)[:n])
        recon_all.append(np.asarray(recon)[:n])
    codes, recon = np.concatenate(codes_all), np.concatenate(recon_all)
    counts = np.bincount(codes.reshape(-1), minlength=model.cfg.num_embeddings).astype(np.float32)
    stats = {k: float(v) for k, v in usage_stats(jnp.asarray(counts)).items()}
    return {"psnr": float(np.mean(psnr(frames, recon))), **stats}, recon


def _grid(originals: np.ndarray, recon: np.ndarray, min_size: int = 128) -> np.ndarray:
    """Originals in the top row, reconstructions below, upscaled (nearest) to >= min_size px."""
    scale = max(1, -(-min_size // originals.shape[1]))
    rows = [np.concatenate(list(frames), axis=1) for frames in (originals, recon)]
    grid = np.concatenate(rows, axis=0)
    return np.repeat(np.repeat(grid, scale, axis=0), scale, axis=1)


# How the commands that use a VQGAN's weights compute with them (not the weights themselves).
USE_SETTINGS = ("dtype", "matmul_precision")

# What a resume may change, named when it does: all but the model's shape (refused) and the mesh.
RESUME_SECTIONS = ("model", "quantizer", "loss", "discriminator", "train", "data", "seed")


def _check_same_model(out: Path, cfg: VQGANConfig) -> VQGANConfig | None:
    """Refuse to resume a run of another VQGAN in ``out`` (its config.yaml and checkpoints):
    its checkpoints would not restore, or would compute another function, and its config.yaml
    would be overwritten. The compute dtype and precision (``model.dtype``,
    ``model.matmul_precision``) alone may change: the same weights, computed in another
    precision. Returns the run's config (None: no run there)."""
    from lwm.base.config import resumable_config, setting_differences

    found = resumable_config(out, VQGANConfig)
    if found is None:
        return None
    changed = setting_differences(found.model, cfg.model, "model", lambda k: k not in USE_SETTINGS)
    # the discriminator's shape too: its weights are in the checkpoints (its rate may change)
    changed += setting_differences(
        found.discriminator, cfg.discriminator, "discriminator", lambda k: k != "learning_rate"
    )
    if changed:
        raise WeightsError(
            f"train.output_dir '{out}' holds a run of another VQGAN ({'; '.join(changed)}); "
            "resume it with its own model and discriminator settings, or choose another "
            "train.output_dir"
        )
    return found


def _record_use_settings(
    out: Path, saved: VQGANConfig, cfg: VQGANConfig, log: Callable[[str], None]
) -> None:
    """A finished run rerun with other `USE_SETTINGS`: written into its config.yaml (the rest
    of which stays the run's), where every command that uses the weights reads them."""
    from lwm.base.config import setting_differences

    update = {k: getattr(cfg.model, k) for k in USE_SETTINGS}
    changed = setting_differences(saved.model, cfg.model, "model", lambda k: k in update)
    if changed:
        write_config(out, saved.model_copy(update={"model": saved.model.model_copy(update=update)}))
        log(f"{'; '.join(changed)}: written to config.yaml for the commands that use the weights")


def train(
    cfg: VQGANConfig,
    *,
    mesh: Mesh,
    source: FrameSource | Callable[[], FrameSource],
    stop_at: int | None = None,
    log: Callable[[str], None] | None = None,
) -> dict[str, float]:
    """Train (or resume) per ``cfg`` on ``mesh`` (built by the caller from ``cfg.mesh``) with
    the frames of ``source`` (`data.vqgan_frames.load_frames`, or a function that returns
    them, called only when there are steps to run); returns the final held-out metrics.

    ``stop_at``: stop after this many completed steps (checkpointing there), as an interrupted
    run would; a later call resumes. The weights and eval.json are written only at the end.
    A damaged newest checkpoint is logged and set aside, and the one before it resumed; a
    checkpoint at or past ``train.steps`` whose weights are written is nothing to do. SIGINT
    or SIGTERM: the step running is finished, checkpointed, and `TrainingStopped` raised.
    ``log``: where those lines go (stderr)."""
    from tqdm import tqdm

    log = log or (lambda msg: print(f"lwm vqgan: {msg}", file=sys.stderr, flush=True))
    t = cfg.train
    out = Path(t.output_dir)
    saved = _check_same_model(out, cfg)
    data = batch_devices(mesh)
    if t.batch_size % data:
        raise MeshError(
            f"train.batch_size {t.batch_size} is not divisible by dp x fsdp = {data} devices"
        )
    # A finished run (its newest checkpoint at or past train.steps, its weights written) is
    # said before its frames are decoded or its state restored: seconds, not a minute.
    newest = latest_checkpoint_step(out / "checkpoints")
    if newest is not None and newest >= t.steps:
        finished = _finished(out, newest)
        if finished is not None:
            return _nothing_to_do(out, newest, saved, cfg, log, finished)
    if callable(source):
        source = source()
    eval_idx = np.unique(np.linspace(0, len(source.eval) - 1, t.eval_frames).astype(int))
    eval_frames = source.eval[eval_idx]
    grid_idx = np.linspace(0, len(eval_frames) - 1, t.grid_frames).astype(int)

    state = create_state(cfg, mesh)
    out.mkdir(parents=True, exist_ok=True)
    ckpt = Checkpointer(out / "checkpoints", t.max_to_keep)
    found = ckpt.restore_newest(*state.checkpoint_trees(), log=log)
    start = 0 if found is None else found[0]
    if found is not None:
        state.load_trees(*found[1:])
        log(f"resumed from checkpoint {start}")
    finished = _finished(out, start)
    if start >= t.steps and finished is not None:  # the newest was damaged, this one reaches
        ckpt.close()
        return _nothing_to_do(out, start, saved, cfg, log, finished)
    if start < t.steps:  # the settings the steps to come run with
        if saved is not None and start > 0:
            changes = keep_config_before_changes(out, saved, cfg, RESUME_SECTIONS, start)
            if changes is not None:
                log(changes)
        write_config(out, cfg)
    step_fn = make_train_step(cfg)
    batch_sharding = NamedSharding(mesh, BATCH)
    base_key = _key(cfg.seed)
    logger = MetricsWriter(out, tensorboard="tb", always_split=True)
    metrics: dict[str, float] = {}
    bar = tqdm(
        range(start, t.steps), initial=start, total=t.steps, disable=not t.progress, unit="step"
    )
    tick, tick_step = time.perf_counter(), start
    stop = StopSignals()  # Ctrl-C or SIGTERM: save, then stop
    done = start
    try:
        for step in bar:
            frames = jax.device_put(source.batch(step, t.batch_size), batch_sharding)
            use_adv, do_restart = step_phase(cfg, step)
            key = jax.random.fold_in(base_key, step)
            state.usage, step_metrics = step_fn(
                state.model,
                state.disc,
                state.opt,
                state.disc_opt,
                state.usage,
                frames,
                key,
                use_adv=use_adv,
                do_restart=jnp.asarray(do_restart),
            )
            done = step + 1
            if done % t.log_every == 0 or done == t.steps or do_restart:
                now = time.perf_counter()
                row = {k: float(v) for k, v in jax.device_get(step_metrics).items()}
                row["frames_per_s"] = (done - tick_step) * t.batch_size / max(now - tick, 1e-9)
                tick, tick_step = now, done
                logger.write(done, row, "train")
                bar.set_postfix(loss=f"{row['loss']:.4f}", used=f"{row['codebook_used']:.2f}")
            if done % t.eval_every == 0 or done == t.steps:
                t_eval = time.perf_counter()
                metrics, recon = evaluate(state.model, eval_frames, t.batch_size, mesh)
                logger.write(done, metrics, "eval")
                write_png(
                    out / "samples" / f"step_{done:06d}.png",
                    _grid(eval_frames[grid_idx], recon[grid_idx]),
                )
                bar.write(
                    f"step {done}: held-out PSNR {metrics['psnr']:.2f} dB, codebook used "
                    f"{metrics['codebook_used']:.1%}, perplexity {metrics['perplexity']:.1f}"
                )
                tick += time.perf_counter() - t_eval  # frames/s counts the training steps only
            stopping = done == stop_at or (stop.received is not None and done < t.steps)
            if done % t.save_every == 0 or done == t.steps or stopping:
                ckpt.save(done, *state.checkpoint_trees())
            if stopping:
                break
    finally:
        bar.close()
        ckpt.wait()
        ckpt.close()
        logger.close()
        stop.restore()
    if stop.received is not None and done < t.steps and done != stop_at:
        log(f"{stop.received} at step {done}: saved checkpoint {done}; rerun to resume")
        raise TrainingStopped(stop.received, done)
    if stop_at is not None and stop_at < t.steps:
        return metrics
    if not metrics:  # nothing left to run: evaluate what the checkpoint holds
        metrics, _ = evaluate(state.model, eval_frames, t.batch_size, mesh)
    save_weights(out, state.model, cfg)
    at = max(start, t.steps)  # the step of the weights written
    (out / "eval.json").write_text(json.dumps({"step": at, **metrics}, indent=1) + "\n")
    return metrics


def _nothing_to_do(
    out: Path,
    step: int,
    saved: VQGANConfig | None,
    cfg: VQGANConfig,
    log: Callable[[str], None],
    finished: dict[str, float],
) -> dict[str, float]:
    log(f"nothing to do: checkpoint {step} already reaches train.steps={cfg.train.steps}")
    if saved is not None:
        _record_use_settings(out, saved, cfg, log)
    return finished


def _finished(out: Path, step: int) -> dict[str, float] | None:
    """The held-out metrics of ``out``'s weights where a run wrote them at ``step``
    (``eval.json`` and ``model.safetensors``), else None."""
    try:
        written = json.loads((out / "eval.json").read_text())
    except (OSError, ValueError):
        return None
    if written.pop("step", None) != step or not (out / "model.safetensors").is_file():
        return None
    return written
