"""VQGAN weights: our own format (a folder with `config.yaml` and `model.safetensors`) and the
import of LWM's released VQGAN (a pickled Flax linen parameter tree).

    save_weights("runs/vqgan/export", model, config)      # config: VQGANConfig or VQGANModelConfig
    model, model_cfg = load_weights("runs/vqgan/export")
    model = import_lwm_params(tree, lwm_cfg)               # tree: LWM's nested dict of arrays
    tree = export_lwm_params(model)                        # the same layout back

LWM's names come from linen's automatic naming inside `@nn.compact` modules: the n-th module
of a class within its parent is ``ClassName_n``. In the decoder, the upsampling levels are
created from the coarsest level down, so ``UpsamplingBlock_0`` is the *last* level.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import yaml
from flax import nnx

from lwm.base.config import ConfigError, validate_config
from lwm.base.files import atomic_path, write_text
from vqgan.config import VQGANConfig, VQGANModelConfig
from vqgan.model import VQGAN

__all__ = [
    "CONFIG_FILE",
    "WEIGHTS_FILE",
    "WeightsError",
    "export_lwm_params",
    "import_lwm_params",
    "load_weights",
    "lwm_path",
    "read_config",
    "save_weights",
    "write_config",
]

CONFIG_FILE = "config.yaml"
WEIGHTS_FILE = "model.safetensors"

_RES = {"norm1": "GroupNorm_0", "conv1": "Conv_0", "norm2": "GroupNorm_1", "conv2": "Conv_1"}
_RES["shortcut"] = "Conv_2"


class WeightsError(ValueError):
    """A weights file or folder is missing, malformed, or does not fit the config."""


# ---------------------------------------------------------------------------------------------
# Our format


def _flat_params(model: VQGAN) -> dict[str, jax.Array]:
    return {
        ".".join(str(k) for k in path): var[...]
        for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param))
    }


def save_weights(
    directory: str | os.PathLike, model: VQGAN, config: VQGANConfig | VQGANModelConfig
) -> Path:
    """Write ``config.yaml`` and ``model.safetensors`` into ``directory`` (each written to a
    temporary name, then renamed). Returns the folder."""
    from safetensors.numpy import save_file

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    if isinstance(config, VQGANModelConfig):
        config = VQGANConfig(model=config)
    # safetensors copies each array's buffer as it lies in memory, so each is made row-major
    # first: a TPU hands some parameters to the host in another layout (strides), and written
    # as they came they were scrambled (a 30 dB VQGAN read back at 7 dB).
    tensors = {k: np.ascontiguousarray(jax.device_get(v)) for k, v in _flat_params(model).items()}
    with atomic_path(directory / WEIGHTS_FILE) as tmp:
        save_file(tensors, str(tmp))
        _check_reads_back(tmp, tensors, directory / WEIGHTS_FILE)
    write_config(directory, config)
    return directory


def _check_reads_back(written: Path, tensors: Mapping[str, np.ndarray], path: Path) -> None:
    """A `WeightsError` unless every tensor of the file ``written`` is bitwise the one given
    (the file is then not kept): what a run measured is what its weights file holds."""
    from safetensors.numpy import load_file

    back = load_file(str(written))
    for name, value in tensors.items():
        if name not in back or back[name].tobytes() != value.tobytes():
            raise WeightsError(
                f"'{path}': tensor '{name}' does not read back as it was written; not kept"
            )


def write_config(directory: str | os.PathLike, config: VQGANConfig) -> None:
    """Write ``config.yaml`` (via a temporary name)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    text = yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False)
    write_text(directory / CONFIG_FILE, text)


def read_config(directory: str | os.PathLike) -> VQGANConfig:
    """The `VQGANConfig` saved in a weights folder or a training output folder."""
    path = Path(directory) / CONFIG_FILE
    if not path.is_file():
        raise FileNotFoundError(f"'{path}' not found (expected a VQGAN folder with {CONFIG_FILE})")
    try:
        return validate_config(yaml.safe_load(path.read_text()) or {}, VQGANConfig)
    except ConfigError as e:
        raise ConfigError(f"'{path}': {e}") from None


def assign_params(model: VQGAN, flat: Mapping[str, Any], source: str) -> VQGAN:
    """Copy ``flat`` ({'encoder.conv_in.kernel': array, ...}) into ``model``'s parameters,
    checking that the names and shapes match exactly."""
    ours = nnx.to_flat_state(nnx.state(model, nnx.Param))
    names = {".".join(str(k) for k in path) for path, _ in ours}
    missing, extra = sorted(names - set(flat)), sorted(set(flat) - names)
    if missing or extra:
        raise WeightsError(
            f"'{source}' does not fit the config: missing {missing[:5]}"
            f"{'...' if len(missing) > 5 else ''}, unexpected {extra[:5]}"
            f"{'...' if len(extra) > 5 else ''}"
        )
    for path, var in ours:
        name = ".".join(str(k) for k in path)
        value = np.asarray(flat[name])
        if value.shape != var.shape:
            raise WeightsError(
                f"'{source}': tensor '{name}' has shape {value.shape}, the config gives {var.shape}"
            )
        var[...] = jnp.asarray(value, dtype=var.dtype)
    return model


def load_weights(
    directory: str | os.PathLike, *, dtype: str | None = None
) -> tuple[VQGAN, VQGANModelConfig]:
    """The model saved by `save_weights` (with compute ``dtype`` overridden if given)."""
    from safetensors.numpy import load_file

    directory = Path(directory)
    cfg = read_config(directory).model
    if dtype is not None:
        cfg = cfg.model_copy(update={"dtype": dtype})
    weights = directory / WEIGHTS_FILE
    if not weights.is_file():
        raise FileNotFoundError(f"'{weights}' not found")
    try:
        flat = load_file(str(weights))
    except Exception as e:  # safetensors raises its own error types for malformed files
        raise WeightsError(f"'{weights}' is not a readable safetensors file: {e}") from None
    model = nnx.eval_shape(lambda: VQGAN(cfg, rngs=nnx.Rngs(0)))
    model = _materialize(model)
    return assign_params(model, flat, str(weights)), cfg


def _materialize(abstract: VQGAN) -> VQGAN:
    """Concrete zero parameters for an abstract (eval_shape) model, to be overwritten."""
    graphdef, state = nnx.split(abstract)
    state = jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), state)
    return nnx.merge(graphdef, state)


# ---------------------------------------------------------------------------------------------
# LWM's layout


def lwm_path(path: tuple[str | int, ...], num_levels: int) -> tuple[str, ...]:
    """The LWM (linen) parameter path of one of our parameter paths."""
    head, rest = path[0], list(path[1:])
    if head in ("quant_conv", "post_quant_conv"):
        return (head, *map(str, rest))
    if head == "quantizer":
        return ("quantize", *map(str, rest))
    if head not in ("encoder", "decoder"):
        raise KeyError(path)
    part = rest.pop(0)
    if part == "conv_in":
        return (head, "Conv_0", *map(str, rest))
    if part == "conv_out":
        return (head, "Conv_1", *map(str, rest))
    if part == "norm_out":
        return (head, "GroupNorm_0", *map(str, rest))
    if part == "mid":
        j, layer, leaf = rest
        return (head, "MidBlock_0", f"ResnetBlock_{j}", _RES[str(layer)], str(leaf))
    if part in ("down", "up"):
        level = int(rest.pop(0))
        if part == "down":
            block = f"DownsamplingBlock_{level}"
        else:  # linen names the decoder's levels in creation order: coarsest first
            block = f"UpsamplingBlock_{num_levels - 1 - level}"
        kind = rest.pop(0)
        if kind == "res":
            j, layer, leaf = rest
            return (head, block, f"ResnetBlock_{j}", _RES[str(layer)], str(leaf))
        if kind == "downsample":
            return (head, block, "Downsample_0", "Conv_0", *map(str, rest))
        if kind == "upsample":
            return (head, block, "Upsample_0", "Conv_0", *map(str, rest))
    raise KeyError(path)


def _flatten(tree: Mapping[str, Any], prefix: tuple[str, ...] = ()) -> dict[tuple[str, ...], Any]:
    out: dict[tuple[str, ...], Any] = {}
    for key, value in tree.items():
        if isinstance(value, Mapping):
            out.update(_flatten(value, (*prefix, key)))
        else:
            out[(*prefix, key)] = value
    return out


def import_lwm_params(
    tree: Mapping[str, Any], cfg: VQGANModelConfig, *, source: str = "<LWM params>"
) -> VQGAN:
    """Our `VQGAN` holding LWM's parameters (``tree``: LWM's nested dict, optionally under a
    top-level ``params`` key). Missing, unexpected or mis-shaped tensors are a `WeightsError`."""
    if set(tree) == {"params"}:
        tree = tree["params"]
    if not isinstance(tree, Mapping):
        raise WeightsError(f"'{source}': expected a dict of parameters, got {type(tree).__name__}")
    theirs = _flatten(tree)
    model = _materialize(nnx.eval_shape(lambda: VQGAN(cfg, rngs=nnx.Rngs(0))))
    levels = len(cfg.channel_mult)
    flat: dict[str, Any] = {}
    for path, _ in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        key = lwm_path(path, levels)
        if key in theirs:
            flat[".".join(str(k) for k in path)] = theirs.pop(key)
        else:
            raise WeightsError(f"'{source}': missing LWM parameter '{'/'.join(key)}'")
    if theirs:
        names = sorted("/".join(k) for k in theirs)
        raise WeightsError(
            f"'{source}': {len(names)} parameters that LWM's VQGAN with this config does not "
            f"have, e.g. {names[:3]} (is the config right?)"
        )
    return assign_params(model, flat, source)


def export_lwm_params(model: VQGAN) -> dict[str, Any]:
    """Our parameters as LWM's nested dict of numpy arrays."""
    levels = len(model.cfg.channel_mult)
    tree: dict[str, Any] = {}
    for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        node = tree
        *parents, leaf = lwm_path(path, levels)
        for key in parents:
            node = node.setdefault(key, {})
        node[leaf] = np.asarray(jax.device_get(var[...]))
    return tree
