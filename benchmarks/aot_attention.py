"""Compile (without running) ring attention alone, forward and forward+backward, for a mesh
of devices this host may not have, and print the temporaries per device that the compiler
plans, one JSON line per mode. Compares the block kernels (``--kernel xla`` / ``pallas``);
for a TPU topology the Pallas kernels go through libtpu's Mosaic compiler.

    # needs libtpu (pip install -e '.[tpu]', in its own virtual environment: docs/aot.md)
    TPU_ACCELERATOR_TYPE=v5p-8 TPU_WORKER_HOSTNAMES=localhost \\
      python benchmarks/aot_attention.py --topology v5p:2x2x1 --mesh 1,1,4,1 --seq 32768 --kernel pallas

Shapes: batch 1, ``--heads`` query and key/value heads of 128, bfloat16, one segment id per
token (the packed-row path), causal, blocks of ``--block``, positions 0..seq-1; the loss of
the backward is the sum of the output.
"""

from __future__ import annotations

import argparse
import json
import time


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--topology", required=True, help="TPU topology, e.g. v5p:2x2x1")
    p.add_argument("--mesh", required=True, help="dp,fsdp,sp,tp")
    p.add_argument("--seq", type=int, default=32768, help="tokens in the sequence")
    p.add_argument("--heads", type=int, default=32, help="query and key/value heads, of 128")
    p.add_argument("--block", type=int, default=512, help="block_q = block_k")
    p.add_argument(
        "--kernel", default="pallas", choices=("xla", "pallas"), help="block kernel: xla or pallas"
    )
    args = p.parse_args()

    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from lwm.attention import ring_attention
    from lwm.base.mesh import make_mesh, tpu_topology_devices

    devices = tpu_topology_devices(args.topology)
    mesh = make_mesh(args.mesh, devices=devices)
    x = NamedSharding(mesh, P(None, "sp", None, None))
    shape = (1, args.seq, args.heads, 128)
    qkv = jax.ShapeDtypeStruct(shape, jnp.bfloat16, sharding=x)
    pos = jax.ShapeDtypeStruct(
        (1, args.seq), jnp.int32, sharding=NamedSharding(mesh, P(None, "sp"))
    )

    def loss(q, k, v, pos):
        seg = jnp.zeros_like(pos)
        out = ring_attention(
            q, k, v, mesh=mesh, q_positions=pos, kv_positions=pos, q_segment_ids=seg,
            kv_segment_ids=seg, block_q=args.block, block_k=args.block, kernel=args.kernel,
        )  # fmt: skip
        return jnp.sum(out.astype(jnp.float32))

    for mode, fn in (("fwd", loss), ("fwd_bwd", jax.grad(loss, argnums=(0, 1, 2)))):
        start = time.perf_counter()
        compiled = jax.jit(fn).lower(qkv, qkv, qkv, pos).compile()
        mem = compiled.memory_analysis()
        row = {
            "bench": "aot_attention",
            "topology": args.topology,
            "mesh": args.mesh,
            "seq": args.seq,
            "kernel": args.kernel,
            "mode": mode,
            "compile_s": round(time.perf_counter() - start, 1),
            "temp_mib": round(mem.temp_size_in_bytes / 2**20, 1),
            "argument_mib": round(mem.argument_size_in_bytes / 2**20, 1),
        }
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    from lwm.cli import run_reporting_errors

    raise SystemExit(run_reporting_errors("aot_attention", main, also=(ValueError,)))
