"""Training runs on disk: ``OUTPUT/config.yaml`` (the resolved config) and
``OUTPUT/checkpoints/STEP`` (orbax: parameters, optimizer state, and JSON metadata with the step
and the data loader's position). The optimizer is training's (`lwm.train_step`); this module
only knows that the state holds ``params`` and ``opt_state``.

`load_run` gives back the model of a run's newest restorable checkpoint, for the next context
stage (``train.init_from=run:DIR``), for inference, or for `lwm.weights.load_model`.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

import jax
from flax import nnx
from jax.sharding import Mesh

from lwm.base.checkpoints import CheckpointMismatchError, restore_first
from lwm.config import Config, load_config
from lwm.model import LWMModel, abstract_params

Log = Callable[[str], None]

__all__ = [
    "CheckpointMismatchError",
    "checkpoint_manager",
    "load_run",
    "restore_newest",
    "run_config",
    "save_checkpoint",
]


def _stderr(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def checkpoint_manager(directory: Path, cfg: Config):
    import orbax.checkpoint as ocp

    options = ocp.CheckpointManagerOptions(
        max_to_keep=cfg.train.max_to_keep,
        enable_async_checkpointing=cfg.train.async_save,
        create=True,
    )
    return ocp.CheckpointManager(Path(directory).absolute(), options=options)


def save_checkpoint(manager, step: int, params, opt_state, meta: dict) -> None:
    import orbax.checkpoint as ocp

    manager.save(
        step,
        args=ocp.args.Composite(
            state=ocp.args.StandardSave({"params": params, "opt_state": opt_state}),
            meta=ocp.args.JsonSave(meta),
        ),
        force=True,
    )


def restore_newest(
    manager,
    abstract_state: dict,
    log: Log = _stderr,
    *,
    partial: bool = False,
    set_aside: bool = True,
):
    """``(step, state, meta)`` of the newest checkpoint that restores, or None. Damaged ones
    are reported and, with ``set_aside`` (training, which redoes their steps), renamed
    ``STEP.damaged-TIME`` (kept for inspection, out of the way of the steps about to be
    redone); a reader leaves the run as it is. ``partial``: restore only the entries of
    ``abstract_state`` (e.g. the parameters without the optimizer state). Parameters of other
    shapes, or a state of another form, than ``abstract_state``'s raise
    `CheckpointMismatchError` (`lwm.base.checkpoints.restore_first`)."""
    import orbax.checkpoint as ocp

    if partial:
        restore_args = jax.tree.map(
            lambda x: ocp.ArrayRestoreArgs(sharding=x.sharding), abstract_state
        )
        state_args = ocp.args.PyTreeRestore(
            item=abstract_state, restore_args=restore_args, partial_restore=True
        )
    else:
        state_args = ocp.args.StandardRestore(abstract_state)

    def restore(step: int):
        return manager.restore(
            step, args=ocp.args.Composite(state=state_args, meta=ocp.args.JsonRestore())
        )

    found = restore_first(
        manager, restore, log, set_aside=set_aside, is_primary=jax.process_index() == 0
    )
    if found is None:
        return None
    step, restored = found
    return step, restored["state"], restored["meta"]


def run_config(run_dir: str | Path) -> Config:
    """The config of an `lwm train` run (its ``config.yaml``), read without its weights."""
    run_dir = Path(run_dir)
    config_file, checkpoints = run_dir / "config.yaml", run_dir / "checkpoints"
    if not config_file.is_file() or not checkpoints.is_dir():
        raise FileNotFoundError(
            f"'{run_dir}' is not an lwm train run (expected config.yaml and checkpoints/)"
        )
    return load_config(config_file)


def load_run(
    run_dir: str | Path, *, mesh: Mesh | None = None, log: Log = _stderr
) -> tuple[Config, LWMModel]:
    """The config and model of the newest restorable checkpoint of an `lwm train` run.

    Only the parameters are read (not the optimizer state). With ``mesh`` they land in its
    shardings; without, on one device.
    """
    cfg = run_config(run_dir)
    checkpoints = Path(run_dir) / "checkpoints"
    graphdef, abs_params = abstract_params(cfg.model, mesh)
    manager = checkpoint_manager(checkpoints, cfg)
    try:
        found = restore_newest(manager, {"params": abs_params}, log, partial=True, set_aside=False)
    finally:
        manager.close()
    if found is None:
        raise FileNotFoundError(f"no checkpoint in '{checkpoints}' can be restored")
    step, state, _ = found
    log(f"loaded {run_dir} at step {step}")
    return cfg, nnx.merge(graphdef, state["params"])
