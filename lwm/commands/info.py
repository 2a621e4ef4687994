"""Describe a config without building the model: the devices JAX sees (and the attention
kernel the config runs on them), the resolved config, parameter counts, FLOPs per token and
per-device bytes of parameters and optimizer state (AdamW's, or Muon's with
`train.optimizer=muon`) on the config's mesh.

  lwm info --config configs/7b.yaml
  lwm info --config configs/7b_1m.yaml --mesh 1,-1,32,1 --devices 256

(`lwm info CONFIG`, the config as a positional argument, still works for one release, with a
deprecation notice.)
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import TYPE_CHECKING

from lwm.base.mesh import MESH_AXES, make_mesh, mesh_axis_sizes, parse_mesh_shape
from lwm.commands import add_config_arguments, config_overrides, deprecated, positive_int
from lwm.config import Config, config_to_yaml, load_config
from lwm.info import flops_per_token, memory_per_device, param_counts

if TYPE_CHECKING:
    from jax.sharding import Mesh

GIB = 1024**3


def add_arguments(parser: argparse.ArgumentParser) -> None:
    # --cpu-devices: describe the config on N simulated CPU devices, as the verbs run
    add_config_arguments(parser, "configs/7b.yaml", required=True)
    parser.add_argument(
        "--devices",
        type=positive_int,
        metavar="N",
        help="plan for a mesh of N devices without having them (default: the devices JAX sees)",
    )


def parse_args(parser: argparse.ArgumentParser, argv: Sequence[str]) -> argparse.Namespace:
    """The verb's arguments; without --config, the first positional argument that is not a
    KEY=VALUE override is the config (the old spelling, with a deprecation notice)."""
    argv = list(argv)
    if not any(a == "--config" or a.startswith("--config=") for a in argv):
        valued = {s for a in parser._actions if a.nargs != 0 for s in a.option_strings}
        i = 0
        while i < len(argv) and argv[i] != "--":
            arg = argv[i]
            if arg in valued:
                i += 2
                continue
            if not arg.startswith("-") and "=" not in arg:
                deprecated(parser.prog, "the config as a positional argument", f"--config {arg}")
                argv[i : i + 1] = ["--config", arg]
                break
            i += 1
    return parser.parse_intermixed_args(argv)


def run(args: argparse.Namespace) -> int:
    config = load_config(args.config, config_overrides(args))
    if args.devices is None:
        mesh = make_mesh(config.mesh.shape)
        axis_sizes, num_devices = dict(mesh.shape), mesh.size
        print(describe_devices(config, mesh))
    else:
        axis_sizes = mesh_axis_sizes(parse_mesh_shape(config.mesh.shape, args.devices))
        num_devices = args.devices
    capacity = device_memory() if args.devices is None else None
    print(format_info(config, args.config, axis_sizes, num_devices, capacity))
    return 0


def device_memory() -> int | None:
    """Bytes of memory one device offers (a TPU's or GPU's ``bytes_limit``), or None where
    JAX does not say (CPUs)."""
    import jax

    stats = jax.devices()[0].memory_stats() or {}
    return stats.get("bytes_limit")


def capacity_line(state: int, capacity: int, what: str = "parameters and optimizer state") -> str:
    """What ``state`` bytes (``what``) take of one device's memory of ``capacity`` bytes; the
    rest is for activations and temporaries (which `lwm train` and `tools/aot_compile.py`
    measure)."""
    return (
        f"  {'device memory':<{LABEL}} {capacity / GIB:8.2f} GiB: {what} "
        f"take {state / capacity:.0%}, {max(capacity - state, 0) / GIB:.2f} GiB left for "
        "activations"
    )


def describe_devices(config: Config, mesh: Mesh | None = None) -> str:
    """One line: the devices JAX sees, the attention block kernel the config runs there (and
    why cuDNN's would not run its inputs), and with ``mesh`` the orders of rows whose
    attention schedules `lwm train` compiles apart (`lwm.train_step.row_orders`)."""
    import jax

    from lwm.train_step import model_kernel, row_orders

    model = config.model
    devices = jax.devices()
    kinds = sorted({d.device_kind for d in devices})
    kernel, emulated, refused = model_kernel(model, devices[0].platform)
    how = " (emulated)" if emulated else ""
    if refused:  # as each attention call falls back
        kernel, how = "xla", f": cudnn refuses {refused}"
    line = (
        f"# devices: {len(devices)} x {', '.join(kinds)} ({devices[0].platform}, jax "
        f"{jax.__version__}); attention_kernel {model.attention_kernel} -> {kernel}{how}"
    )
    if mesh is not None and len(orders := row_orders(model, mesh)) > 1:
        line += f"; rows with their own schedules: {', '.join(orders)}"
    return line


def format_info(
    config: Config,
    source: str,
    axis_sizes: dict[str, int],
    num_devices: int,
    capacity: int | None = None,
) -> str:
    """The report printed by `lwm info`; with ``capacity`` (a device's bytes), what the
    parameters and optimizer state take of it."""
    model = config.model
    counts = param_counts(model)
    flops = flops_per_token(model)
    memory = memory_per_device(model, axis_sizes, config.train.optimizer)
    mesh_text = " ".join(f"{axis}={axis_sizes[axis]}" for axis in MESH_AXES)
    # train.offload_optimizer: the optimizer state lives in the host's memory between steps
    host_optimizer = config.train.offload_optimizer
    on_device = memory.params + (0 if host_optimizer else memory.optimizer)
    adamw = config.train.optimizer == "adamw"
    state = "AdamW state" if adamw else "Muon + AdamW state"
    where = "host memory" if host_optimizer else ("2 x float32" if adamw else "float32")
    rows = [
        f"# {source}",
        config_to_yaml(config).rstrip(),
        "",
        "parameters:",
        f"  text     {counts.text:>15,}  ({_short(counts.text)})",
        f"  vision   {counts.vision:>15,}  ({_short(counts.vision)})",
        f"  total    {counts.total:>15,}  ({_short(counts.total)})",
        f"FLOPs per token at seq_len {flops.seq_len:,} (N = {flops.matmul_params:,} matmul params):",
        f"  training  (6N + 12*L*H*S)  {flops.train:.3e}",
        f"  inference (2N)             {flops.inference:.3e}",
        f"per device on mesh {mesh_text} ({num_devices} device{'s' * (num_devices != 1)}):",
        _gib_row(f"parameters ({model.param_dtype})", memory.params),
        _gib_row(f"{state} ({where})", memory.optimizer),
        _gib_row("total on the device" if host_optimizer else "total", on_device),
    ]
    if capacity is not None:
        what = "parameters" if host_optimizer else "parameters and optimizer state"
        rows.append(capacity_line(on_device, capacity, what))
    return "\n".join(rows)


LABEL = 32  # the width of the memory rows' labels


def _gib_row(label: str, nbytes: int) -> str:
    return f"  {label:<{LABEL}} {nbytes / GIB:8.2f} GiB"


def _short(n: int) -> str:
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f}{unit}"
    return str(n)
