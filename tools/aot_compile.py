"""Compile (without running) the training step of a config for a mesh of devices you may not
have, and print the per-device memory the compiler plans. Lets you check that a context stage
fits before renting the hardware.

    # 8 simulated CPU devices on this host (LWM-7B at 32K tokens):
    python tools/aot_compile.py --config configs/7b.yaml --seq 32768 --mesh 1,1,8,1
    # a TPU topology (needs `pip install -e '.[tpu]'`, which brings libtpu):
    TPU_ACCELERATOR_TYPE=v5p-512 TPU_WORKER_HOSTNAMES=localhost \\
      python tools/aot_compile.py --config configs/7b_1m.yaml --topology v5p:8x8x4 --mesh 1,8,32,1

Prints one JSON line with the compiler's per-device sizes (arguments, outputs, temporaries,
generated code), its cost analysis (FLOPs and bytes accessed) and the parameter / optimizer
bytes per device; a step that the TPU compiler finds too large for the chips' memory is one
line naming the sizes, and exit status 1. The optimizer is the config's ``train.optimizer``
(AdamW unless set; e.g. ``train.optimizer=muon``). ``model.attention_kernel=pallas`` compiles
the Pallas block kernels (for a TPU topology: the Mosaic compiler in libtpu checks them).
"""

from __future__ import annotations

import argparse
import json
import sys
import time


def _parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--config", metavar="FILE", help="a training config (YAML), e.g. configs/7b_1m.yaml"
    )
    p.add_argument(
        "overrides",
        nargs="*",
        metavar="KEY=VALUE",
        help="config overrides, as for lwm train (model.max_seq_len=65536)",
    )
    p.add_argument(
        "--seq", type=int, default=None, help="tokens per sequence (default: max_seq_len)"
    )
    p.add_argument("--batch", type=int, default=1, help="global batch size (sequences)")
    p.add_argument("--mesh", default=None, help="dp,fsdp,sp,tp (default: the config's)")
    p.add_argument("--topology", default=None, help="TPU topology, e.g. v4:8x8x8 or v5p:8x8x4")
    p.add_argument(
        "--cpu-devices", type=int, default=8, help="simulated CPU devices (no --topology)"
    )
    args = p.parse_intermixed_args()  # KEY=VALUE overrides anywhere, as the usage shows
    # the config as the first positional argument: the old spelling, for one release
    if args.config is None and args.overrides and "=" not in args.overrides[0]:
        from lwm.commands import deprecated

        args.config = args.overrides.pop(0)
        deprecated("aot_compile", "the config as a positional argument", f"--config {args.config}")
    if args.config is None:
        p.error("the following arguments are required: --config")
    return args


def main() -> int:
    args = _parse()
    import jax

    from lwm.base.mesh import (
        MeshError,
        check_batch_fits,
        make_mesh,
        tpu_topology_devices,
        use_cpu_devices,
    )
    from lwm.config import ConfigError, load_config
    from lwm.info import memory_per_device
    from lwm.train_step import abstract_batch, abstract_train_state, jit_train_step, make_optimizer

    try:
        if args.topology is None:
            use_cpu_devices(args.cpu_devices)  # before anything asks JAX for its devices
        cfg = load_config(args.config, args.overrides)
        if args.topology is not None:
            devices = tpu_topology_devices(args.topology)
        else:
            devices = jax.devices()
        mesh = make_mesh(args.mesh or cfg.mesh.shape, devices=devices)
        check_batch_fits(mesh, args.batch, args.seq or cfg.model.max_seq_len)
    except (ConfigError, MeshError, FileNotFoundError) as e:
        print(f"aot_compile: error: {e}", file=sys.stderr)
        return 2
    model_cfg = cfg.model
    seq = args.seq or model_cfg.max_seq_len
    if seq > model_cfg.max_seq_len:
        model_cfg = model_cfg.model_copy(update={"max_seq_len": seq})
    tx, _ = make_optimizer(optimizer=cfg.train.optimizer, weight_decay=cfg.train.weight_decay)
    t0 = time.perf_counter()
    graphdef, params, opt_state = abstract_train_state(
        model_cfg, mesh, tx, offload_optimizer=cfg.train.offload_optimizer
    )
    from data.tokens import window_offsets

    window = len(window_offsets(model_cfg.vision_window)) if model_cfg.vision_window else 0
    batch = abstract_batch(mesh, args.batch, seq, window)
    step = jit_train_step(graphdef, tx, mesh, params, opt_state)
    lowered = step.lower(params, opt_state, batch)
    t1 = time.perf_counter()
    try:
        compiled = lowered.compile()
    except Exception as e:  # the TPU compiler refuses a plan beyond the chips' memory
        from lwm.train import out_of_memory

        if (message := out_of_memory(e, args.batch, seq)) is None:
            raise
        print(f"aot_compile: {message}", file=sys.stderr)
        return 1
    t2 = time.perf_counter()
    mem = compiled.memory_analysis()
    cost = compiled.cost_analysis() or {}
    if isinstance(cost, list):  # older JAX: one dict per computation
        cost = cost[0] if cost else {}
    planned = memory_per_device(model_cfg, dict(mesh.shape), cfg.train.optimizer)
    gib = 2**30
    record = {
        "bench": "aot_compile",
        "config": args.config,
        "overrides": args.overrides,
        "platform": devices[0].platform,
        "device_kind": getattr(devices[0], "device_kind", ""),
        "topology": args.topology,
        "devices": len(devices),
        "mesh": dict(mesh.shape),
        "seq": seq,
        "batch": args.batch,
        "lower_s": round(t1 - t0, 1),
        "compile_s": round(t2 - t1, 1),
        "argument_gib": round(mem.argument_size_in_bytes / gib, 3),
        "output_gib": round(mem.output_size_in_bytes / gib, 3),
        "temp_gib": round(mem.temp_size_in_bytes / gib, 3),
        "code_gib": round(mem.generated_code_size_in_bytes / gib, 3),
        "alias_gib": round(mem.alias_size_in_bytes / gib, 3),
        "optimizer": cfg.train.optimizer,
        "params_gib_planned": round(planned.params / gib, 3),
        "optimizer_gib_planned": round(planned.optimizer / gib, 3),
        # XLA's cost analysis of the step, per device; a Pallas kernel counts what its
        # cost estimate says (every tile, an upper bound).
        "tflops": round(cost.get("flops", 0.0) / 1e12, 3),
        "bytes_accessed_gib": round(cost.get("bytes accessed", 0.0) / gib, 3),
    }
    record["peak_gib_estimate"] = round(
        record["argument_gib"] + record["output_gib"] - record["alias_gib"] + record["temp_gib"], 3
    )
    print(json.dumps(record))
    return 0


if __name__ == "__main__":
    from lwm.cli import run_reporting_errors

    raise SystemExit(run_reporting_errors("aot_compile", main, also=(ValueError,)))
