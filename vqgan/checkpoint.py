"""Orbax checkpoints of VQGAN training: item ``model`` (the VQGAN's parameters) and item
``train`` (discriminator, optimizer states, codebook usage), so the model alone can be restored
(`restore_model_params`) without knowing the training state's structure.

Checkpoints are labelled with the number of completed steps; resuming from label ``s`` runs
step ``s`` next.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp

from lwm.base.checkpoints import restore_first

__all__ = ["Checkpointer", "latest_checkpoint_step", "restore_model_params"]


def _abstract(tree: Any) -> Any:
    """Restore targets: the arrays' shardings, or the default device for abstract leaves."""
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])

    def leaf(a: Any) -> jax.ShapeDtypeStruct:
        sharding = getattr(a, "sharding", None) or device
        return jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding)

    return jax.tree.map(leaf, tree)


def _to_host(tree: Any) -> Any:
    def leaf(a: Any) -> Any:
        if isinstance(a, jax.Array) and a.is_fully_addressable and a.sharding.is_fully_replicated:
            return np.asarray(jax.device_get(a))
        return a

    return jax.tree.map(leaf, tree)


class Checkpointer:
    def __init__(self, directory: str | os.PathLike, max_to_keep: int = 2):
        self.directory = Path(directory).absolute()
        options = ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, create=True)
        self._manager = ocp.CheckpointManager(self.directory, options=options)

    def latest_step(self) -> int | None:
        return self._manager.latest_step()

    def save(self, step: int, model: Any, train: Any) -> None:
        # Replicated arrays are fetched to host numpy first: orbax otherwise slices every
        # replicated array per device (a compiled slice per shape; seconds for a small model).
        model, train = _to_host(model), _to_host(train)
        args = ocp.args.Composite(
            model=ocp.args.StandardSave(model), train=ocp.args.StandardSave(train)
        )
        self._manager.save(step, args=args)

    def restore(self, step: int, model_like: Any, train_like: Any) -> tuple[Any, Any]:
        """Restore into trees shaped (and sharded) like the given ones."""
        args = ocp.args.Composite(
            model=ocp.args.StandardRestore(_abstract(model_like)),
            train=ocp.args.StandardRestore(_abstract(train_like)),
        )
        restored = self._manager.restore(step, args=args)
        return restored["model"], restored["train"]

    def restore_newest(
        self, model_like: Any, train_like: Any, log: Callable[[str], None]
    ) -> tuple[int, Any, Any] | None:
        """``(step, model, train)`` of the newest checkpoint that restores (`restore`), or
        None; damaged ones are logged and set aside (`lwm.base.checkpoints.restore_first`)."""
        found = restore_first(
            self._manager,
            lambda step: self.restore(step, model_like, train_like),
            log,
            set_aside=True,
            is_primary=jax.process_index() == 0,
        )
        return None if found is None else (found[0], *found[1])

    def wait(self) -> None:
        self._manager.wait_until_finished()

    def close(self) -> None:
        self._manager.close()


def latest_checkpoint_step(directory: str | os.PathLike) -> int | None:
    path = Path(directory).absolute()
    if not path.is_dir():
        return None
    with ocp.CheckpointManager(path) as manager:
        return manager.latest_step()


def restore_model_params(
    directory: str | os.PathLike, model_like: Any, step: int | None = None
) -> Any:
    """The ``model`` item of a checkpoint (latest if ``step`` is None), shaped like ``model_like``."""
    path = Path(directory).absolute()
    with ocp.CheckpointManager(path) as manager:
        step = manager.latest_step() if step is None else step
        if step is None:
            raise FileNotFoundError(f"no checkpoint in '{path}'")
        args = ocp.args.Composite(model=ocp.args.StandardRestore(_abstract(model_like)))
        return manager.restore(step, args=args)["model"]
