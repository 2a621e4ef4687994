"""The training loop behind `lwm train`.

On the mesh its caller built, initialises (or loads, or resumes) parameters already sharded,
reads batches from the loader of `lwm.train_data` and runs the jitted, buffer-donating training
step (`lwm.train_step`). Checkpoints go through an orbax `CheckpointManager`
(asynchronous saves every ``train.save_every`` steps, ``max_to_keep``, and a save on
SIGTERM/SIGINT); each holds parameters, optimizer state and, as JSON, the step and the data
loader's position. Rerunning the same command resumes from the newest checkpoint that restores
(a damaged one is reported and skipped). A non-finite loss stops the run naming the step;
nothing after the last good checkpoint is saved.

Metrics every ``train.log_every`` steps go to ``OUTPUT/metrics.jsonl`` and TensorBoard
(``OUTPUT/tensorboard``): loss and accuracy per modality, gradient norm, learning rate,
tokens/s, step time and MFU; with cuDNN attention, the share of those steps whose rows had each
order (``rows_*``, `lwm.model.ROW_ORDERS`: each order runs a step compiled for it).
"""

from __future__ import annotations

import functools
import math
import queue
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh

from lwm.base.mesh import MeshError, check_batch_fits
from lwm.base.metrics import MetricsWriter
from lwm.base.signals import StopSignals
from lwm.config import Config, config_to_yaml
from lwm.info import flops_per_token, measure_peak_flops, mfu_of_spec
from lwm.model import round_reach, row_permutation, row_schedule, sequence_layout
from lwm.runs import (
    checkpoint_manager,
    restore_newest,
    save_checkpoint,
)
from lwm.train_data import TrainingError, TrainingInputError, build_loader, restore_loader
from lwm.train_step import (
    abstract_train_state,
    batch_sharding,
    jit_train_step,
    optimizer_from_config,
    pack_batch,
    packed_batch_sharding,
    row_orders,
)


@dataclass
class TrainResult:
    step: int  # steps completed
    stopped_by: str | None  # None, or the signal name that interrupted the run


# ----------------------------------------------------------------------------------------------
# held-out evaluation


class QAEvaluator:
    """`eval.manifest`'s questions answered by the model being trained (`lwm.qa_eval`): per
    category for the model and the swap ablation, next to the blind baseline. Videos are
    encoded once, with the VQGAN and frame sampling of the training dataset; every report is
    kept as ``OUTPUT/eval/qa-STEP.jsonl``."""

    def __init__(self, cfg: Config, graphdef, output: Path, log):
        from lwm.qa_eval import BlindBaseline, read_questions, swap_videos
        from lwm.vision_qa import TrainingInputs, video_qa_for

        ec = cfg.eval
        assert ec.manifest is not None
        inputs = TrainingInputs.of(cfg.data.source)
        if not (ec.vqgan or inputs.get("vqgan")):
            raise TrainingInputError("eval.manifest needs eval.vqgan: the dataset names no VQGAN")
        try:
            self.questions = read_questions(ec.manifest)
        except ValueError as e:  # no questions, or a line that is not a manifest's
            raise TrainingInputError(f"eval.manifest: {e}") from None
        try:  # before the first step: the ablation's own check
            if ec.swap:
                swap_videos([q.video for q in self.questions])
        except ValueError:
            raise TrainingInputError(
                f"eval.manifest '{ec.manifest}' asks about one video; the video-swap ablation "
                "needs two: ask about another video too, or set eval.swap=false"
            ) from None
        train_manifest = ec.train_manifest or inputs.get("manifest")
        self.blind = BlindBaseline.from_manifest(train_manifest) if train_manifest else None
        self.graphdef, self.swap, self.output = graphdef, ec.swap, output
        try:
            self.qa = video_qa_for(
                None,  # the model of the current parameters, set at each evaluation
                inputs,
                ec.vqgan,
                model_cfg=cfg.model,
                max_new_tokens=ec.max_new_tokens,
                batch_size=ec.batch_size,
            )
        except ValueError as e:  # a VQGAN that does not fit the model or its dataset
            raise TrainingInputError(f"eval.vqgan: {e}") from None
        for q in self.questions:  # encode every video now, not in the middle of training
            self.qa.codes(q.video)
        log(
            f"held-out QA every {ec.every} steps: {len(self.questions)} questions from "
            f"{ec.manifest}" + (f"; blind baseline from {train_manifest}" if self.blind else "")
        )

    @staticmethod
    def check_inputs(cfg: Config) -> None:
        """Before anything is written: the manifests the evaluation reads are there."""
        ec = cfg.eval
        for key, path in (
            ("eval.manifest", ec.manifest),
            ("eval.train_manifest", ec.train_manifest),
        ):
            if path and not Path(path).is_file():
                raise TrainingInputError(f"{key} '{path}' not found (expected a .jsonl manifest)")

    def __call__(self, params, step: int) -> dict[str, float]:
        from lwm.qa_eval import evaluate

        self.qa.model = nnx.merge(self.graphdef, params)
        t0 = time.perf_counter()
        report = evaluate(self.questions, self.qa.answer, blind=self.blind, swap=self.swap)
        if jax.process_index() == 0:
            (self.output / "eval").mkdir(parents=True, exist_ok=True)
            report.write_jsonl(self.output / "eval" / f"qa-{step}.jsonl")
        metrics = {"eval_seconds": time.perf_counter() - t0}
        for condition, cats in report.scores().items():
            for category, (correct, total) in cats.items():
                name = "accuracy" if category == "all" else f"accuracy_{category}"
                metrics[f"{condition}_{name}"] = correct / total
        metrics["model_cut"] = float(report.cut("model"))
        return metrics


# ----------------------------------------------------------------------------------------------
# the loop


def out_of_memory(error: BaseException, batch: int, seq_len: int) -> str | None:
    """One line for an error of XLA's that says the step does not fit the devices' memory
    (its ``RESOURCE_EXHAUSTED``: the sizes it names, and what to change), or None for any
    other error."""
    text = str(error)
    if "RESOURCE_EXHAUSTED" not in text and "Ran out of memory" not in text:
        return None
    lines = [x.strip() for x in text.splitlines() if x.strip()]
    sizes = [x for x in lines if "Ran out of memory" in x or x.startswith("Used ")]
    what = sizes[0] if sizes else lines[0]
    what = what.split("RESOURCE_EXHAUSTED:")[-1].strip()
    return (
        f"the train step of {batch} x {seq_len} tokens does not fit the devices' memory ({what}); "
        "lower train.batch_size or train.seq_len, shard over more devices (mesh.shape), or "
        "keep less per layer (model.remat_policy, model.mlp_chunk_size, "
        "model.logits_chunk_size, model.offload_layer_inputs, model.rope_dtype, "
        "train.offload_optimizer)"
    )


def train(cfg: Config, *, mesh: Mesh, log=None) -> TrainResult:
    """Run (or resume) the training described by ``cfg`` on ``mesh``, which the caller builds
    once from ``cfg.mesh`` (after `init_distributed` on a multi-host job, as `lwm train` does)."""
    log = log or (lambda msg: print(f"lwm train: {msg}", file=sys.stderr, flush=True))
    tc = cfg.train
    primary = jax.process_index() == 0
    model_cfg = cfg.model
    seq_len = tc.seq_len or model_cfg.max_seq_len
    if seq_len > model_cfg.max_seq_len:
        model_cfg = model_cfg.model_copy(update={"max_seq_len": seq_len})
    check_batch_fits(mesh, tc.batch_size, seq_len)
    if tc.batch_size % tc.grad_accum:
        raise MeshError(
            f"batch size {tc.batch_size} is not divisible by grad_accum {tc.grad_accum}"
        )
    check_batch_fits(mesh, tc.batch_size // tc.grad_accum, seq_len)
    sp = mesh.shape["sp"]
    layout = row_permutation(model_cfg, seq_len, sp)  # the order the model's attention assumes

    output = Path(tc.output_dir)
    QAEvaluator.check_inputs(cfg)
    tx, schedule = optimizer_from_config(tc)
    graphdef, abs_params, abs_opt = abstract_train_state(
        model_cfg, mesh, tx, offload_optimizer=tc.offload_optimizer
    )
    shardings = jax.tree.map(lambda x: x.sharding, {"params": abs_params, "opt_state": abs_opt})
    found = _check_same_model(output, model_cfg, tc)
    loader = build_loader(cfg, seq_len, layout)
    manager = checkpoint_manager(output / "checkpoints", cfg)

    resumed = restore_newest(manager, {"params": abs_params, "opt_state": abs_opt}, log)
    if resumed is not None:
        start, state, meta = resumed
        params, opt_state = state["params"], state["opt_state"]
        restore_loader(loader, meta["loader"], str(output))
        log(f"resumed from checkpoint {start} in {output / 'checkpoints'}")
        if found is not None and start < tc.steps:
            _log_changes(found, cfg, start, output, schedule, log)
    else:
        start = 0
        if any(".damaged-" in p.name for p in (output / "checkpoints").iterdir()):
            log("no checkpoint restores: training starts again from step 0")
        params = _initial_params(cfg, model_cfg, mesh, log, getattr(loader, "metadata", None))
        opt_state = jax.jit(tx.init, out_shardings=shardings["opt_state"])(params)
    if start >= tc.steps:
        log(f"nothing to do: checkpoint {start} already reaches train.steps={tc.steps}")
        manager.close()
        return TrainResult(step=start, stopped_by=None)
    # the peak rate before any thread of the loader's competes with its timing
    host_schedule = on_host_cpu(schedule)
    tokens_per_step = tc.batch_size * seq_len
    per_token = flops_per_token(model_cfg, seq_len)
    model_flops = per_token.train * tokens_per_step
    peak = (
        measure_peak_flops(jax.devices(), model_cfg.dtype)
        if tc.peak_flops == "auto"
        else tc.peak_flops
    )
    peak_total = peak * jax.device_count()
    if hasattr(loader, "warm"):  # the epoch's records worked out while the step compiles
        loader.warm()

    # With cuDNN attention, what is known of the rows' order picks the schedule
    # (`lwm.model.ROW_ORDERS`): each batch is checked here (`row_schedule`: its order and, for
    # rows in order, how far back their queries look) and runs the step compiled for that, so
    # only what occurs is compiled. Many processes would have to agree on it: there the step
    # checks on the device (`train_step` with ``rows=None``), for rows in order within the
    # reach that the loader's plan gives alike on every host (`last_look_back`), which each
    # host checks against its own rows.
    orders = row_orders(model_cfg, mesh)
    # one process checks rows on the host and moves a batch as `pack_batch`'s one array (one
    # transfer); many processes each give their rows of every field (`next_batch`)
    one_process = not _many_processes()
    on_host = len(orders) > 1 and one_process
    planned = not on_host and "in_order" in orders and hasattr(loader, "last_look_back")
    order_layout = sequence_layout(model_cfg, sp)
    steps: dict[tuple[str | None, int], object] = {}

    def step_for(rows: str | None, reach: int):
        if (rows, reach) not in steps:
            if on_host:
                within = f" within {reach} tokens" if reach else ""
                log(f"rows {rows}{within}: compiling the train step for them")
            elif planned:
                log(
                    "rows checked on the device (one document each, else in order within "
                    f"{reach} tokens): compiling the train step for them"
                )
            steps[rows, reach] = jit_train_step(
                graphdef,
                tx,
                mesh,
                abs_params,
                abs_opt,
                weights=(tc.text_loss_weight, tc.vision_loss_weight),
                grad_accum=tc.grad_accum,
                rows=rows,
                reach=reach,
                packed_batch=one_process,
            )
        return steps[rows, reach]

    bsharding = batch_sharding(mesh)
    packed_sharding = packed_batch_sharding(mesh)
    global_shape = (tc.batch_size, seq_len)

    def next_batch(step: int):
        """Batch ``step`` on the devices, its rows' schedule and the loader's state after it
        (what a checkpoint of that step keeps): made in `BatchPrefetch`'s thread."""
        local = next(loader)
        if one_process:  # every field in one array, one transfer
            batch = jax.device_put(pack_batch(local), packed_sharding)
        else:
            batch = {
                k: jax.make_array_from_process_local_data(
                    bsharding, v, (*global_shape, *v.shape[2:])
                )
                for k, v in local.items()
            }
        rows, reach = None, 0
        if on_host or planned:
            positions, segments = local["positions"], local["segment_ids"]
            rows, reach = row_schedule(positions, segments, order_layout, sp, orders)
        if planned:  # the plan's reach, and this host's rows within it
            mine, rows, reach = reach, None, round_reach(loader.last_look_back())
            if mine > reach:
                raise TrainingError(
                    f"step {step}: this host's rows look back {mine} tokens, more than the "
                    f"{reach} of the loader's plan for the whole batch"
                )
        return batch, rows, reach, loader.state()

    # batch 1 is made while the rest is set up (the evaluator encodes its videos): the first
    # step waits less for it
    batches = BatchPrefetch(
        next_batch, range(start + 1, tc.steps + 1), depth=cfg.data.device_prefetch
    )
    try:
        writer = MetricsWriter(output, primary)
        evaluator = QAEvaluator(cfg, graphdef, output, log) if cfg.eval.manifest else None
        if primary:
            (output / "config.yaml").write_text(config_to_yaml(cfg))

        stop = StopSignals()
        bar = None
        if primary and tc.progress:
            from tqdm import tqdm

            bar = tqdm(total=tc.steps, initial=start, desc="train", unit="step", dynamic_ncols=True)
    except BaseException:
        batches.close()
        loader.close()
        raise

    # dispatched steps whose metrics are not yet checked, with the time each waited for its
    # batch, the time that batch took to make, and its rows' order
    pending: list[tuple[int, tuple[tuple[str, ...], jax.Array], float, float, str | None]] = []
    last_good_save = resumed[0] if resumed is not None else None
    # the steps fetched since the last logged line: their time, data waits, batches' making
    # times and rows' orders
    window = {"t": time.perf_counter(), "wait": 0.0, "made": 0.0, "checked": 0, "rows": []}

    def check(upto: int) -> None:
        """Fetch the metrics of dispatched steps <= upto in one transfer; stop on a non-finite
        loss; log. ``upto`` is never past a step to log that is still pending (the loop checks
        at each), so a line's time is that of the steps up to it."""
        nonlocal pending
        due = [p for p in pending if p[0] <= upto]
        pending = pending[len(due) :]
        fetched = jax.device_get([packed for _, (_, packed), *_ in due])
        for (step, (keys, _), waited, made, rows), values in zip(due, fetched, strict=True):
            window["wait"] += waited
            window["made"] += made
            window["checked"] += 1
            window["rows"].append(rows)
            host = dict(zip(keys, values.tolist(), strict=True))
            if not math.isfinite(host["loss"]):
                where = (
                    f"checkpoint {last_good_save}"
                    if last_good_save is not None
                    else "no checkpoint"
                )
                raise TrainingError(
                    f"loss is {host['loss']} at step {step}; stopping. The last good state is "
                    f"{where} in {output / 'checkpoints'}"
                )
            if host.get("targets_dropped", 0) > 0:
                raise TrainingError(
                    f"step {step}: {host['targets_dropped']:.0f} trained positions did not fit "
                    f"in model.loss_positions={model_cfg.loss_positions}; raise it (or set 0)"
                )
            if bar is not None:
                bar.set_postfix(loss=f"{host['loss']:.4f}", refresh=False)  # drawn by update
            if step % tc.log_every == 0 or step == tc.steps:
                now = time.perf_counter()
                # over the steps fetched since the line before (not those dispatched: one more
                # than that when the line before was logged while its next step ran)
                dt = (now - window["t"]) / max(window["checked"], 1)
                wait = window["wait"] / max(window["checked"], 1)  # of the steps logged
                made = window["made"] / max(window["checked"], 1)
                if on_host:  # the share of the steps logged whose rows had each order
                    seen = window["rows"]
                    host.update({f"rows_{o}": seen.count(o) / len(seen) for o in orders})
                window.update(t=now, wait=0.0, made=0.0, checked=0, rows=[])
                host.update(
                    learning_rate=host_schedule(step - 1),
                    step_time_s=dt,
                    # the time a step waited for its batch, per step
                    data_wait_s=wait,
                    data_wait_share=wait / dt,
                    # the loader thread's time to read, pack and move a batch (`BatchPrefetch`)
                    data_make_s=made,
                    tokens_per_s=tokens_per_step / dt,
                    mfu=model_flops / dt / peak_total,
                )
                # MaxText's convention beside ours: causal attention, the chips' spec peak
                spec_mfu = mfu_of_spec(per_token.train_causal * tokens_per_step, dt, jax.devices())
                if spec_mfu is not None:
                    host["mfu_causal_of_spec"] = spec_mfu
                writer.write(step, host)

    stopped_by = None
    step = start
    profile = range(tc.profile_start, tc.profile_start + tc.profile_steps)
    tracing = 0  # the first step traced, while tracing
    try:
        for step in range(start + 1, tc.steps + 1):
            if step in profile and not tracing and primary:
                jax.profiler.start_trace(str(output / "profile"), create_perfetto_trace=True)
                tracing = step
            t_data = time.perf_counter()
            batch, rows, reach, loader_state = batches.get()
            waited = time.perf_counter() - t_data
            try:
                params, opt_state, metrics = step_for(rows, reach)(params, opt_state, batch)
            except Exception as e:  # XLA's out-of-memory is a page of text: one line instead
                if (message := out_of_memory(e, tc.batch_size, seq_len)) is None:
                    raise
                raise TrainingError(message) from None
            batches.taken()
            pending.append((step, packed_metrics(metrics), waited, batches.made_s, rows))
            done = step - 1  # fetched while this step runs
            if done % tc.fetch_every == 0 or done % tc.log_every == 0:
                check(done)
            if bar is not None:
                bar.update(1)
            if tracing and step == profile[-1]:
                check(step)
                jax.profiler.stop_trace()
                log(f"profile of steps {tracing}-{step} in {output / 'profile'}")
                tracing = 0
            save_now = step % tc.save_every == 0 or step == tc.steps
            if stop.received is not None or save_now:
                check(step)
                save_checkpoint(
                    manager, step, params, opt_state, {"step": step, "loader": loader_state}
                )
                last_good_save = step
            if evaluator is not None and (step % cfg.eval.every == 0 or step == tc.steps):
                check(step)
                t_eval = time.perf_counter()
                scores = evaluator(params, step)
                writer.write(step, scores, split="eval")
                log(
                    f"step {step}: held-out QA accuracy {scores['model_accuracy']:.1%}"
                    + (
                        f", swapped {scores['swapped_accuracy']:.1%}"
                        if "swapped_accuracy" in scores
                        else ""
                    )
                    + (
                        f", blind {scores['blind_accuracy']:.1%}"
                        if "blind_accuracy" in scores
                        else ""
                    )
                    + f" ({scores['eval_seconds']:.0f} s)"
                )
                window["t"] += time.perf_counter() - t_eval  # the evaluation is no step's time
            if stop.received is not None:
                stopped_by = stop.received
                log(
                    f"{stopped_by} at step {step}: saved checkpoint {step}; rerun the same "
                    "command to resume"
                )
                break
        check(step)
    finally:
        if tracing:
            jax.profiler.stop_trace()
        batches.close()
        loader.close()
        manager.wait_until_finished()
        manager.close()
        writer.close()
        if bar is not None:
            bar.close()
        stop.restore()
    return TrainResult(step=step, stopped_by=stopped_by)


def on_host_cpu(schedule):
    """``step -> float``: the learning rate of ``schedule`` (an optax schedule, written with
    jax.numpy) computed on the host's CPU, not as a dozen small programs on the accelerator."""
    cpu = jax.local_devices(backend="cpu")[0]

    def rate(step: int) -> float:
        with jax.default_device(cpu):
            return float(schedule(step))

    return rate


@functools.cache
def _stacker(keys: tuple[str, ...]):
    return jax.jit(lambda m: jnp.stack([m[k].astype(jnp.float32) for k in keys]))


def packed_metrics(metrics: dict) -> tuple[tuple[str, ...], jax.Array]:
    """A step's scalar ``metrics`` as their names and one float32 vector on the devices, so
    that the host fetches them in one transfer instead of one per metric."""
    keys = tuple(sorted(metrics))
    return keys, _stacker(keys)(metrics)


class BatchPrefetch:
    """``make(step)`` for each of ``steps``, run in a thread up to ``depth`` steps ahead of the
    training loop (`DataConfig.device_prefetch`): reading, packing, the transfer to the devices
    and the rows' schedule overlap the steps before, as MaxText's and Flax's device prefetch
    do. The loop calls `taken` once it has dispatched the step of a batch it got: only then is
    the next batch made, so that the thread's Python does not hold the interpreter while the
    loop dispatches. An error in the thread is raised by the `get` that would have returned
    that step. `made_s` is the thread's time to make the batch last got: where it is longer
    than a step, the loader sets the pace."""

    def __init__(self, make, steps, depth: int = 2):
        self.made_s = 0.0
        self._queue: queue.Queue = queue.Queue()
        self._slots = threading.Semaphore(max(depth, 1))
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._run, args=(make, steps), name="lwm-batches", daemon=True
        )
        self._thread.start()

    def _run(self, make, steps) -> None:
        try:
            for step in steps:
                while not self._slots.acquire(timeout=0.1):
                    if self._stop.is_set():
                        return
                if self._stop.is_set():
                    return
                t = time.perf_counter()
                item = make(step)
                self._queue.put((item, time.perf_counter() - t, None))
        except BaseException as e:  # noqa: BLE001  (handed to the training loop)
            self._queue.put((None, 0.0, e))

    def get(self):
        item, self.made_s, error = self._queue.get()
        if error is not None:
            raise error
        return item

    def taken(self) -> None:
        """The step of the batch last got is dispatched: its slot may be refilled."""
        self._slots.release()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)


def _many_processes() -> bool:
    """Whether this run spans many processes (`jax.distributed`)."""
    return jax.process_count() > 1


def _check_same_model(output: Path, model_cfg, tc) -> Config | None:
    """Refuse to resume a run of another model, or of another form of optimizer state
    (``tc``: the train settings), in ``output`` (its config.yaml and checkpoints): its
    checkpoints would not restore, and training from scratch there would bury them."""
    from lwm.base.config import resumable_config
    from lwm.config import Config
    from lwm.info import shape_differences

    found = resumable_config(output, Config)
    if found is None:
        return None
    differences = shape_differences(found.model, model_cfg)
    if differences:
        raise TrainingInputError(
            f"train.output_dir '{output}' holds a run of another model ({'; '.join(differences)});"
            " resume it with its own model settings, or choose another train.output_dir"
        )
    differences = [
        f"train.{key}: {there} there, {here} here"
        for key, there, here in zip(
            ("optimizer", "clip_norm"),
            _optimizer_structure(found.train),
            _optimizer_structure(tc),
            strict=True,
        )
        if there != here
    ]
    if differences:  # its checkpoints would not restore, and were taken for damaged ones
        raise TrainingInputError(
            f"train.output_dir '{output}' holds a run whose optimizer state has another form "
            f"({'; '.join(differences)}); resume it with its own settings, or start a new run "
            f"from its weights (train.init_from=run:{output} and another train.output_dir)"
        )
    return found


def _log_changes(found: Config, cfg: Config, start: int, output: Path, schedule, log) -> None:
    """Say which settings a resume changes from the run's ``config.yaml`` (which then holds
    the new ones: the old file is kept as ``config.until-START.yaml``, unless an earlier resume
    at the same step kept one), and where a new ``train.steps`` moves the learning rate of a
    decaying schedule (it is spread over the new number of steps, so extending a finished
    cosine run raises it again)."""
    from lwm.base.config import keep_config_before_changes

    sections = ("model", "train", "data", "eval")
    first = jax.process_index() == 0
    changes = keep_config_before_changes(output, found, cfg, sections, start, write=first)
    if changes is None:
        return
    log(changes)
    if found.train.steps != cfg.train.steps and cfg.train.schedule != "constant":
        before, after = optimizer_from_config(found.train)[1], schedule
        log(
            f"train.steps {found.train.steps} -> {cfg.train.steps} spreads the "
            f"{cfg.train.schedule} schedule over the new steps: the learning rate of step "
            f"{start + 1} is {float(after(start)):.3g} (step {start} had "
            f"{float(before(start - 1)):.3g})"
        )


def _optimizer_structure(tc) -> tuple[str, str]:
    """What of ``train`` decides the form of the optimizer state (`make_optimizer`): the
    optimizer, and whether gradients are clipped (its value may change on a resume)."""
    return tc.optimizer, "none" if tc.clip_norm is None else "a number"


def _initial_params(cfg, model_cfg, mesh, log, metadata=None):
    """Fresh sharded parameters, or those of ``train.init_from``: ``run:DIR`` (the newest
    checkpoint of an earlier `lwm train` run, e.g. the previous context stage), or any source
    `lwm.weights.load_model` takes (``hf:``, ``lwm:``/``params::``, ``orbax:``). A fresh model's
    vision embeddings start from the dataset's VQGAN codebook with
    ``train.vision_embed_init=codebook`` (``metadata``: the dataset's)."""
    from lwm.model import create_model

    source = cfg.train.init_from
    codebook_init = cfg.train.vision_embed_init == "codebook"
    if source and codebook_init:
        log(
            f"train.vision_embed_init=codebook does not apply: train.init_from '{source}' brings "
            "its own vision embeddings"
        )
    if not source:
        params = nnx.state(create_model(model_cfg, mesh=mesh, seed=cfg.seed), nnx.Param)
        if codebook_init:
            path = ((metadata or {}).get("vqgan") or {}).get("path")
            if not path:
                raise TrainingInputError(
                    f"train.vision_embed_init=codebook needs a dataset tokenized with a VQGAN; "
                    f"data.source '{cfg.data.source}' names none"
                )
            weights = metadata["vqgan"].get("weights")
            params = _codebook_init(params, path, weights, model_cfg, cfg.seed, log)
        return params
    log(f"initialising from {source}")
    from lwm.weights import load_model

    return nnx.state(load_model(source, model_cfg, mesh=mesh, log=log), nnx.Param)


def codebook_embeddings(codebook, hidden_size: int, scale: float, seed: int):
    """Embeddings ``[codes, hidden_size]`` from a VQGAN codebook ``[codes, dim]``: each
    dimension standardised over the codes, then a fixed random projection (normal / sqrt(dim))
    times ``scale``, so every entry has about the standard deviation ``scale`` of a random
    initialisation while codes whose vectors are close (which decode to alike patches) get
    close embeddings."""
    import numpy as np

    vectors = np.asarray(codebook, np.float64)
    vectors = (vectors - vectors.mean(0)) / (vectors.std(0) + 1e-12)
    dim = vectors.shape[1]
    projection = np.random.default_rng(seed).standard_normal((dim, hidden_size)) / math.sqrt(dim)
    return (scale * vectors @ projection).astype(np.float32)


def _codebook_init(params, vqgan_path: str, weights: str | None, model_cfg, seed: int, log):
    """``params`` with the rows of ``embed_vision`` for the VQGAN's codes replaced by
    `codebook_embeddings` (the frame markers and any codes past the codebook stay random).
    ``weights``: the fingerprint of the VQGAN the dataset was tokenized with (None: an older
    dataset, not checked)."""
    import jax.numpy as jnp

    import vqgan
    from vqgan.tokenizer import VideoTokenizer

    try:
        model = vqgan.load_model(vqgan_path)
    except (FileNotFoundError, OSError) as e:
        raise TrainingInputError(f"train.vision_embed_init=codebook: {e}") from None
    if weights and VideoTokenizer(model).fingerprint != weights:
        raise TrainingInputError(
            f"train.vision_embed_init=codebook: the VQGAN '{vqgan_path}' has other weights "
            "than the dataset was tokenized with (trained on since?): its codebook is not the "
            "one of the dataset's codes"
        )
    codebook = model.quantizer.embeddings[...]
    table = params["embed_vision"]
    current = table[...]
    if codebook.shape[0] > current.shape[0]:
        raise TrainingInputError(
            f"train.vision_embed_init=codebook: the VQGAN '{vqgan_path}' has "
            f"{codebook.shape[0]} codes, more than the model's {current.shape[0]} vision rows"
        )
    rows = codebook_embeddings(codebook, model_cfg.hidden_size, model_cfg.initializer_range, seed)
    set_rows = jax.jit(
        lambda t, r: t.at[: r.shape[0]].set(r.astype(t.dtype)),
        out_shardings=current.sharding,
    )
    table.set_value(set_rows(current, jnp.asarray(rows)))
    log(
        f"vision embeddings of the {len(rows)} codes from the codebook of {vqgan_path} "
        f"(train.vision_embed_init=codebook)"
    )
    return params
