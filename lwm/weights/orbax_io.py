"""Our own parameter checkpoints, through orbax.

    save_params(model, "ckpt/params")
    model = load_params("ckpt/params", cfg, mesh=mesh)   # restored straight into its shards

The checkpoint is the pure-dict parameter tree (`nnx.to_pure_dict`) written by orbax's
`StandardCheckpointer`, with the model config as custom metadata. Restoring builds the model
abstractly and hands orbax target arrays that carry the shardings of ``mesh``, so every host
reads only its own shards. The training loop keeps full train states with a CheckpointManager;
this is for parameters alone.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import jax
import orbax.checkpoint as ocp
from flax import nnx
from jax.sharding import Mesh

from lwm.config import ModelConfig
from lwm.model import LWMModel, state_shardings
from lwm.weights.common import WeightsError

__all__ = ["is_orbax_checkpoint", "load_params", "save_params"]

_METADATA_FILES = ("_CHECKPOINT_METADATA", "_METADATA")
_CONFIG_KEY = "lwm_model_config"


def is_orbax_checkpoint(directory: str | os.PathLike) -> bool:
    """Whether ``directory`` looks like an orbax checkpoint (its metadata files are there)."""
    path = Path(directory)
    return path.is_dir() and any((path / name).is_file() for name in _METADATA_FILES)


def save_params(model: LWMModel, directory: str | os.PathLike, *, overwrite: bool = False) -> None:
    """Write the model's parameters to ``directory`` (orbax writes a temporary folder and
    renames it when complete). An existing checkpoint is replaced only with ``overwrite``."""
    path = Path(directory).absolute()
    if path.exists() and not overwrite:
        raise WeightsError(f"'{path}' already exists; pass overwrite=True to replace it")
    pure = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    metadata = {_CONFIG_KEY: model.cfg.model_dump(mode="json")}
    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save(path, pure, force=overwrite, custom_metadata=metadata)
        ckptr.wait_until_finished()


def _flat(tree: Any) -> dict[str, Any]:
    leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    return {".".join(str(getattr(k, "key", k)) for k in path): v for path, v in leaves}


def _not_params(path: Path, composite: bool) -> str:
    """Why ``path`` is not what `save_params` writes: a step of an `lwm train` run's
    checkpoints (or its ``state``, with the optimizer state), named as the run to give."""
    for run in (path.parent.parent, path.parent.parent.parent):
        if (run / "config.yaml").is_file() and (run / "checkpoints") in path.parents:
            return (
                f"'{path}' is a checkpoint of the lwm train run '{run}', not parameters saved "
                f"alone: give the run, run:{run} (its newest checkpoint that restores)"
            )
    what = "several items (a CheckpointManager step?)" if composite else "an optimizer state"
    return f"'{path}' holds {what}, not parameters saved alone (lwm.weights.save_params)"


def load_params(
    directory: str | os.PathLike, cfg: ModelConfig, mesh: Mesh | None = None
) -> LWMModel:
    """An `LWMModel` with the parameters saved by `save_params`, each restored directly into
    its sharding on ``mesh`` (or onto the default device). Tensors missing from the checkpoint,
    extra ones, or ones of other shapes than ``cfg`` gives them are a `WeightsError`."""
    path = Path(directory).absolute()
    if not path.is_dir():
        raise WeightsError(f"orbax checkpoint '{path}' does not exist")
    if not is_orbax_checkpoint(path):
        raise WeightsError(f"'{path}' is not an orbax checkpoint (no {_METADATA_FILES[0]})")

    def make() -> LWMModel:
        return LWMModel(cfg, rngs=nnx.Rngs(0), mesh=mesh)

    graphdef, abstract = nnx.split(nnx.eval_shape(make))
    if mesh is None:
        device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        shardings = jax.tree.map(lambda _: device, abstract)
    else:
        shardings = state_shardings(abstract, mesh)
    target = jax.tree.map(
        lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
        nnx.to_pure_dict(abstract),
        nnx.to_pure_dict(shardings),
    )
    with ocp.StandardCheckpointer() as ckptr:
        item = ckptr.metadata(path).item_metadata
        if item is None or any(name.startswith("opt_state.") for name in _flat(item.tree)):
            raise WeightsError(_not_params(path, item is None))
        saved = _flat(item.tree)
        wanted = _flat(target)
        for name in saved:
            if name not in wanted:
                raise WeightsError(f"{path}: tensor '{name}' has no place in the model")
        for name, want in wanted.items():
            have = saved.get(name)
            if have is None:
                raise WeightsError(f"{path}: tensor '{name}' is missing")
            if tuple(have.shape) != want.shape:
                raise WeightsError(
                    f"{path}: tensor '{name}' has shape {tuple(have.shape)}, "
                    f"the model needs {want.shape}"
                )
        restored = ckptr.restore(path, target)
    nnx.replace_by_pure_dict(abstract, restored)
    return nnx.merge(graphdef, abstract)
