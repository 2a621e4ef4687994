"""What every weight format shares: per-layer parameter names, placing host tensors directly
into their shardings, and reading a model's parameters back one tensor at a time.

Formats speak in *per-layer* names (``layers.{i}.attn.q``) whatever ``cfg.scan_layers`` is;
`ParamSink` stacks layers on the devices when the model scans them, and `iter_host_params`
slices them apart again. Only one source tensor is on the host at a time.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Iterable, Iterator

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from lwm.base.mesh import logical_to_spec
from lwm.config import ModelConfig
from lwm.info import VISION_PARAMS, ParamSpec, param_specs
from lwm.model import LWMModel, state_shardings

__all__ = [
    "VISION_PARAMS",
    "ParamSink",
    "WeightsError",
    "flat_params",
    "host_layer_stack",
    "host_param",
    "iter_host_params",
    "layer_names",
    "np_dtype",
    "unstacked_specs",
]

_LAYER = re.compile(r"layers\.(\d+)\.(.+)")


class WeightsError(ValueError):
    """A checkpoint does not fit the model, or cannot be read; the message names the file and
    the tensor."""


def unstacked_specs(cfg: ModelConfig) -> dict[str, ParamSpec]:
    """`param_specs` with per-layer names (``layers.{i}.…``) even when the model scans layers."""
    return param_specs(cfg.model_copy(update={"scan_layers": False}))


def layer_names(cfg: ModelConfig) -> list[str]:
    """The per-layer parameter suffixes (``attn.q``, ``mlp_norm``, ...)."""
    return [n.split(".", 2)[2] for n in unstacked_specs(cfg) if n.startswith("layers.0.")]


def np_dtype(name: str) -> np.dtype:
    """The numpy dtype of ``"float32"``, ``"bfloat16"``, ... (bfloat16 from ml_dtypes)."""
    return np.dtype(jnp.dtype(name))


def _named(path: tuple) -> str:
    return ".".join(str(p) for p in path)


def flat_params(model: LWMModel) -> dict[str, jax.Array]:
    """``{dotted name: array}`` of the model's parameters, as in `param_specs` (stacked names
    when the model scans its layers)."""
    return {_named(p): v[...] for p, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}


def host_param(
    model: LWMModel, name: str, params: dict[str, jax.Array] | None = None
) -> np.ndarray:
    """Per-layer parameter ``name`` copied to the host (a scanned model's layer is sliced on
    the devices first). ``params``: `flat_params(model)`, when the caller already has it."""
    params = flat_params(model) if params is None else params
    m = _LAYER.fullmatch(name)
    if model.cfg.scan_layers and m:
        value = params[f"layers.{m.group(2)}"][int(m.group(1))]
    else:
        value = params[name]
    return np.asarray(jax.device_get(value))


def host_layer_stack(
    model: LWMModel, suffix: str, params: dict[str, jax.Array] | None = None
) -> np.ndarray:
    """All layers of ``layers.*.{suffix}`` on the host, stacked ``[num_layers, ...]``."""
    params = flat_params(model) if params is None else params
    if model.cfg.scan_layers:
        return np.asarray(jax.device_get(params[f"layers.{suffix}"]))
    layers = range(model.cfg.num_layers)
    return np.stack([host_param(model, f"layers.{i}.{suffix}", params) for i in layers])


def iter_host_params(model: LWMModel) -> Iterator[tuple[str, np.ndarray]]:
    """``(per-layer name, host array)`` for every parameter in table order, one tensor on the
    host at a time."""
    params = flat_params(model)
    for name in unstacked_specs(model.cfg):
        yield name, host_param(model, name, params)


def _sharding(mesh: Mesh | None, axes: tuple[str, ...]) -> NamedSharding | None:
    if mesh is None:
        return None
    return NamedSharding(mesh, logical_to_spec(axes) if axes else P())


def _place(host: np.ndarray, sharding: NamedSharding | None) -> jax.Array:
    host = np.ascontiguousarray(host)
    if sharding is None:
        return jax.device_put(host)
    return jax.device_put(host, sharding)


class ParamSink:
    """Collects a model's parameters from host tensors and builds the `LWMModel`.

    Each `put` checks the shape, casts to ``cfg.param_dtype`` and places the tensor straight
    into its sharding on ``mesh`` (or on the default device), so the host holds one tensor at a
    time. With ``cfg.scan_layers``, per-layer tensors are stacked on the devices once all layers
    of a parameter have arrived. ``source`` names the checkpoint in error messages.
    """

    def __init__(self, cfg: ModelConfig, mesh: Mesh | None, source: str | os.PathLike):
        self.cfg, self.mesh, self.source = cfg, mesh, str(source)
        self.specs = unstacked_specs(cfg)
        self.dtype = np_dtype(cfg.param_dtype)
        self._arrays: dict[str, jax.Array] = {}  # model names (stacked when scanning)
        self._pieces: dict[str, dict[int, jax.Array]] = {}  # suffix -> layer -> array
        self._received: set[str] = set()  # per-layer names

    def check(
        self, name: str, shape: tuple[int, ...], tensor: str, where: str | None = None
    ) -> ParamSpec:
        """The spec of per-layer parameter ``name`` if ``shape`` fits it, else a `WeightsError`
        naming ``tensor``, both shapes and ``where`` (default: the source)."""
        spec = self.specs.get(name)
        where = where or self.source
        if spec is None:
            raise WeightsError(f"{where}: tensor '{tensor}' has no place in the model")
        if tuple(shape) != spec.shape:
            raise WeightsError(
                f"{where}: tensor '{tensor}' has shape {tuple(shape)}, but the model's "
                f"'{name}' needs {spec.shape}"
            )
        return spec

    def put(self, name: str, array: np.ndarray, *, tensor: str) -> None:
        """Place the host ``array`` as per-layer parameter ``name`` (``tensor``: its name in the
        checkpoint, for messages)."""
        spec = self.check(name, array.shape, tensor)
        host = np.asarray(array).astype(self.dtype, copy=False)
        m = _LAYER.fullmatch(name)
        if self.cfg.scan_layers and m:
            layer, suffix = int(m.group(1)), m.group(2)
            pieces = self._pieces.setdefault(suffix, {})
            pieces[layer] = _place(host, _sharding(self.mesh, spec.axes))
            if len(pieces) == self.cfg.num_layers:
                del self._pieces[suffix]
                stacked = [pieces[i] for i in range(self.cfg.num_layers)]
                self._arrays[f"layers.{suffix}"] = self._stack(spec, stacked)
        else:
            self._arrays[name] = _place(host, _sharding(self.mesh, spec.axes))
        self._received.add(name)

    def put_stacked(self, suffix: str, array: np.ndarray, *, tensor: str) -> None:
        """Place all layers of ``layers.*.{suffix}`` at once from ``[num_layers, ...]``."""
        layers = self.cfg.num_layers
        spec = self.check(f"layers.0.{suffix}", array.shape[1:], tensor)
        if array.shape[0] != layers:
            raise WeightsError(
                f"{self.source}: tensor '{tensor}' has shape {tuple(array.shape)}, but the model "
                f"needs {(layers, *spec.shape)} ({layers} stacked layers)"
            )
        if not self.cfg.scan_layers:
            for i in range(layers):
                self.put(f"layers.{i}.{suffix}", array[i], tensor=f"{tensor}[{i}]")
            return
        host = np.asarray(array).astype(self.dtype, copy=False)
        self._arrays[f"layers.{suffix}"] = _place(
            host, _sharding(self.mesh, ("layers", *spec.axes))
        )
        self._received.update(f"layers.{i}.{suffix}" for i in range(layers))

    def _stack(self, spec: ParamSpec, pieces: list[jax.Array]) -> jax.Array:
        sharding = _sharding(self.mesh, ("layers", *spec.axes))
        if sharding is None:
            return jnp.stack(pieces)
        return jax.jit(lambda *xs: jnp.stack(xs), out_shardings=sharding)(*pieces)

    def missing(self) -> list[str]:
        """Per-layer names that have not been put yet, in table order."""
        return [n for n in self.specs if n not in self._received]

    def build(self, *, initialise: Iterable[str] = (), seed: int = 0) -> LWMModel:
        """The model. Parameters in ``initialise`` that were not put get the random draws of
        `create_model(cfg, seed=seed)` (only those are computed, in a jitted initialiser, which
        may round the last bit apart from an eager one); any other missing parameter is an
        error."""
        cfg, mesh = self.cfg, self.mesh
        allowed = set(initialise)
        missing = self.missing()
        if bad := [n for n in missing if n not in allowed]:
            more = f" (and {len(bad) - 5} more)" if len(bad) > 5 else ""
            raise WeightsError(
                f"{self.source}: no tensor for {', '.join(repr(n) for n in bad[:5])}{more}"
            )

        def make() -> LWMModel:
            return LWMModel(cfg, rngs=nnx.Rngs(seed), mesh=mesh)

        graphdef, abstract = nnx.split(nnx.eval_shape(make))
        names = [_named(p) for p, _ in nnx.to_flat_state(abstract)]
        todo = [n for n in names if n not in self._arrays]
        if todo:
            self._arrays.update(_initialise(make, abstract, mesh, todo))
        pure: dict = {}
        for name in names:
            node = pure
            *parents, leaf = name.split(".")
            for part in parents:
                node = node.setdefault(int(part) if part.isdigit() else part, {})
            node[int(leaf) if leaf.isdigit() else leaf] = self._arrays[name]
        nnx.replace_by_pure_dict(abstract, pure)
        return nnx.merge(graphdef, abstract)


def _initialise(
    make: Callable[[], LWMModel], abstract: nnx.State, mesh: Mesh | None, names: list[str]
) -> dict[str, jax.Array]:
    """Fresh values for some parameters only: the full initialiser is jitted and everything
    but ``names`` is dead code that XLA removes."""

    def init() -> dict[str, jax.Array]:
        state = nnx.state(make(), nnx.Param)
        flat = {_named(p): v[...] for p, v in nnx.to_flat_state(state)}
        return {n: flat[n] for n in names}

    if mesh is None:
        return jax.jit(init)()
    shardings = {_named(p): s for p, s in nnx.to_flat_state(state_shardings(abstract, mesh))}
    return jax.jit(init, out_shardings={n: shardings[n] for n in names})()
