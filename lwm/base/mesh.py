"""The (dp, fsdp, sp, tp) device mesh and the one table mapping logical axis names to mesh axes."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

__all__ = [
    "LOGICAL_AXIS_RULES",
    "MESH_AXES",
    "MeshError",
    "logical_sharding",
    "logical_to_spec",
    "make_mesh",
    "mesh_axis_sizes",
    "parse_mesh_shape",
    "shard_bytes",
    "shard_shape",
    "tpu_topology_devices",
    "use_cpu_devices",
    "PLATFORMS",
    "use_platform",
]

MESH_AXES: tuple[str, str, str, str] = ("dp", "fsdp", "sp", "tp")

MeshAxes = str | tuple[str, ...] | None

BATCH_AXES: tuple[str, str] = ("dp", "fsdp")  # the batch is split over these
SEQUENCE_AXIS = "sp"  # and the sequence over this one (ring attention's ring)

# Logical axis name -> mesh axes. Parameters: large matrices are sharded over ('fsdp', 'sp') on
# their model-dimension side and over 'tp' on the other, so sequence-parallel devices also hold a
# slice of the weights. Activations: batch over ('dp', 'fsdp'), length over 'sp', heads over 'tp'.
LOGICAL_AXIS_RULES: dict[str, MeshAxes] = {
    # parameters
    "embed": ("fsdp", "sp"),
    "mlp": "tp",
    "heads": "tp",
    "kv_heads": "tp",
    "head_dim": None,
    "vocab": "tp",
    "layers": None,  # the stacked-layers (scan) axis
    "norm": None,
    "grid": None,  # the rows or columns of the vision code grid (`model.vision_grid`)
    # activations
    "batch": BATCH_AXES,
    "length": SEQUENCE_AXIS,
    "act_heads": "tp",
    "act_kv_heads": "tp",
    "act_embed": None,
    "act_mlp": "tp",
    "act_vocab": "tp",
}


class MeshError(ValueError):
    """A mesh shape or a sharding rule is invalid; the message names the spec and the problem."""


class _DeviceCountError(MeshError):
    """A mesh needs more (or fewer) devices than there are; ``needed`` says how many."""

    def __init__(self, message: str, needed: int):
        super().__init__(message)
        self.needed = needed


def use_cpu_devices(count: int) -> None:
    """Run JAX on ``count`` devices of the host CPU (the `--cpu-devices N` of the commands):
    what ``XLA_FLAGS=--xla_force_host_platform_device_count=N JAX_PLATFORMS=cpu`` does, as a
    call. It must come before anything asks JAX for its devices."""
    if count < 1:
        raise MeshError(f"--cpu-devices {count}: expected a positive number of devices")
    try:
        jax.config.update("jax_platforms", "cpu")
        jax.config.update("jax_num_cpu_devices", count)
    except RuntimeError:
        raise MeshError(
            f"--cpu-devices {count}: JAX has already started with "
            f"{len(jax.devices())} device(s); the CPU devices must be set before it starts"
        ) from None


PLATFORMS = ("cpu", "tpu", "gpu", "auto")  # the benchmark scripts' and recipes' --platform
_JAX_NAMES = {"tpu": "tpu", "gpu": "cuda"}  # jax_platforms' name of each accelerator
_HOW_TO_INSTALL = {"tpu": "pip install -e '.[tpu]'", "gpu": "pip install -e '.[cuda12]'"}


def use_platform(platform: str, cpu_devices: int = 8) -> str:
    """Pick the devices JAX starts with, as the benchmark scripts' ``--platform`` does: ``cpu``
    `cpu_devices` simulated devices of the host CPU (never an installed libtpu), ``tpu`` the
    TPU chips, ``gpu`` the NVIDIA GPUs (CUDA), ``auto`` whatever JAX picks (an accelerator if
    one is there, else one CPU device). It must come before anything asks JAX for its devices;
    every choice but ``cpu`` starts JAX (a host without the accelerator is a `MeshError`).
    Returns the platform JAX runs on (``cpu``, ``tpu`` or ``gpu``)."""
    if platform == "cpu":
        use_cpu_devices(cpu_devices)
        return "cpu"
    if platform not in PLATFORMS:
        raise MeshError(f"--platform {platform}: expected one of {', '.join(PLATFORMS)}")
    if platform != "auto":
        # no effect once JAX has started: checked below
        jax.config.update("jax_platforms", _JAX_NAMES[platform])
    try:
        started = jax.devices()[0].platform
    except (RuntimeError, AssertionError) as e:  # JAX 0.10 asserts when no plugin is installed
        what = {"tpu": "TPU", "gpu": "CUDA GPU"}.get(platform, "device")
        why = str(e).splitlines()[0] if str(e) else f"not installed: {_HOW_TO_INSTALL[platform]}"
        raise MeshError(f"--platform {platform}: JAX finds no {what} ({why})") from None
    if platform != "auto" and started != platform:
        raise MeshError(
            f"--platform {platform}: JAX has already started on {started}; the platform must be "
            "set before it starts"
        )
    return started


def tpu_topology_devices(topology: str) -> list:
    """The devices of a TPU slice of ``topology`` (``v5p:8x8x4``) to compile for without it,
    as `tools/aot_compile.py` does: a `MeshError` naming ``--topology`` where JAX cannot
    describe it (no libtpu installed, or a name libtpu does not know)."""
    from jax.experimental import topologies

    kwargs = {}
    dims = [int(n) for n in topology.partition(":")[2].split("x") if n.isdigit()]
    if dims and math.prod(dims) < 4:  # fewer chips than a host's default 2x2: one host of them
        kwargs["chips_per_host_bounds"] = (*dims, 1, 1)[:3]
    try:
        desc = topologies.get_topology_desc(platform="tpu", topology_name=topology, **kwargs)
        return list(desc.devices)
    except RuntimeError as e:
        why = str(e).splitlines()[0] if str(e) else type(e).__name__
        if "not installed" in why:
            why = "JAX's TPU support (libtpu) is not installed: pip install -e '.[tpu]'"
        raise MeshError(f"--topology {topology}: {why}") from None


def parse_mesh_shape(spec: str | Sequence[int], num_devices: int) -> tuple[int, int, int, int]:
    """Resolve a "dp,fsdp,sp,tp" shape (one entry may be -1) against `num_devices` devices."""
    text = spec if isinstance(spec, str) else ",".join(str(s) for s in spec)
    if num_devices < 1:
        raise MeshError(
            f"mesh shape '{text}': the number of devices must be positive, got {num_devices}"
        )
    if isinstance(spec, str):
        items: list[object] = [s.strip() for s in spec.split(",")]
    else:
        items = list(spec)
    if len(items) != len(MESH_AXES):
        raise MeshError(
            f"mesh shape '{text}' must have {len(MESH_AXES)} comma-separated integers "
            f"({','.join(MESH_AXES)}), got {len(items)}"
        )
    sizes: list[int] = []
    for item in items:
        size = _as_int(item)
        if size is None:
            raise MeshError(f"mesh shape '{text}': {str(item)!r} is not an integer")
        if size == 0 or size < -1:
            raise MeshError(
                f"mesh shape '{text}': axis sizes must be positive integers or a single -1, got {size}"
            )
        sizes.append(size)
    if sizes.count(-1) > 1:
        raise MeshError(f"mesh shape '{text}' has more than one -1; at most one axis may be -1")
    fixed = math.prod(s for s in sizes if s != -1)
    if -1 in sizes:
        if num_devices % fixed:
            raise MeshError(
                f"mesh shape '{text}': {num_devices} devices cannot be split evenly; the fixed "
                f"axes multiply to {fixed}, which does not divide {num_devices}"
            )
        sizes[sizes.index(-1)] = num_devices // fixed
    elif fixed != num_devices:
        raise _DeviceCountError(
            f"mesh shape '{text}' needs {fixed} devices but {num_devices} "
            f"{'is' if num_devices == 1 else 'are'} available",
            fixed,
        )
    dp, fsdp, sp, tp = sizes
    return dp, fsdp, sp, tp


def _as_int(item: object) -> int | None:
    if isinstance(item, bool):
        return None
    if isinstance(item, int):
        return item
    if isinstance(item, str):
        try:
            return int(item)
        except ValueError:
            return None
    return None


def make_mesh(spec: str | Sequence[int], devices: Sequence[jax.Device] | None = None) -> Mesh:
    """Build the (dp, fsdp, sp, tp) mesh with automatic sharding on every axis."""
    devices = list(jax.devices() if devices is None else devices)
    try:
        shape = parse_mesh_shape(spec, len(devices))
    except _DeviceCountError as e:
        if not devices or any(d.platform != "cpu" for d in devices):
            raise
        raise MeshError(
            f"{e}; on a CPU, run the lwm command with --cpu-devices {e.needed} to simulate "
            f"{e.needed} devices (or set XLA_FLAGS=--xla_force_host_platform_device_count="
            f"{e.needed})"
        ) from None
    axis_types = (AxisType.Auto,) * len(MESH_AXES)
    try:
        return jax.make_mesh(shape, MESH_AXES, axis_types=axis_types, devices=devices)
    except AssertionError:
        # jax's topology-aware ordering refuses devices that are not one per chip (TPU v4
        # cores outside "megacore" mode, as topology descriptions list them): keep their order.
        return Mesh(np.asarray(devices).reshape(shape), MESH_AXES, axis_types=axis_types)


def mesh_axis_sizes(shape: Sequence[int]) -> dict[str, int]:
    """{axis name: size} for a resolved mesh shape (same form as `Mesh.shape`)."""
    return dict(zip(MESH_AXES, shape, strict=True))


def logical_to_spec(
    logical_axes: Sequence[str | None], rules: Mapping[str, MeshAxes] = LOGICAL_AXIS_RULES
) -> PartitionSpec:
    """PartitionSpec for an array whose dimensions carry these logical names (None = replicated)."""
    entries: list[MeshAxes] = []
    used: dict[str, str | None] = {}
    for name in logical_axes:
        if name is None:
            entries.append(None)
            continue
        if name not in rules:
            raise MeshError(
                f"unknown logical axis '{name}'; known axes: {', '.join(sorted(rules))}"
            )
        mesh_axes = rules[name]
        for axis in _as_tuple(mesh_axes):
            if axis in used:
                raise MeshError(
                    f"logical axes {tuple(logical_axes)} use mesh axis '{axis}' twice "
                    f"(via '{used[axis]}' and '{name}')"
                )
            used[axis] = name
        entries.append(mesh_axes)
    return PartitionSpec(*entries)


def logical_sharding(
    mesh: Mesh,
    logical_axes: Sequence[str | None],
    rules: Mapping[str, MeshAxes] = LOGICAL_AXIS_RULES,
) -> NamedSharding:
    """NamedSharding on `mesh` for an array with these logical dimension names."""
    return NamedSharding(mesh, logical_to_spec(logical_axes, rules))


def shard_shape(
    shape: Sequence[int], spec: PartitionSpec, axis_sizes: Mapping[str, int]
) -> tuple[int, ...]:
    """Per-device shape of an array under `spec` (ceil division where a dimension is uneven).

    `axis_sizes` is `mesh.shape` of a real mesh or `mesh_axis_sizes(...)` of a planned one.
    """
    if len(spec) > len(shape):
        raise MeshError(f"partition spec {spec} has more entries than the shape {tuple(shape)}")
    out = []
    for i, dim in enumerate(shape):
        entry = spec[i] if i < len(spec) else None
        parts = math.prod(axis_sizes[a] for a in _as_tuple(entry))
        out.append(-(-dim // parts))
    return tuple(out)


def shard_bytes(
    shape: Sequence[int], spec: PartitionSpec, axis_sizes: Mapping[str, int], itemsize: int
) -> int:
    """Bytes one device holds of an array of this shape under `spec`."""
    return math.prod(shard_shape(shape, spec, axis_sizes)) * itemsize


def _as_tuple(entry: MeshAxes) -> tuple[str, ...]:
    if entry is None:
        return ()
    if isinstance(entry, str):
        return (entry,)
    return tuple(entry)


def batch_devices(mesh: Mesh) -> int:
    """How many ways a batch is split: the product of the mesh's `BATCH_AXES`."""
    return math.prod(mesh.shape[axis] for axis in BATCH_AXES)


def check_batch_fits(mesh: Mesh, batch_size: int, seq_len: int) -> None:
    """Batches are sharded batch over (dp, fsdp) and length over sp: both must divide evenly."""
    data = batch_devices(mesh)
    if batch_size % data:
        raise MeshError(
            f"batch size {batch_size} is not divisible by dp x fsdp = {data} devices of the mesh "
            f"{dict(mesh.shape)}"
        )
    if seq_len % mesh.shape["sp"]:
        raise MeshError(
            f"sequence length {seq_len} is not divisible by sp = {mesh.shape['sp']} devices of "
            f"the mesh {dict(mesh.shape)}"
        )
