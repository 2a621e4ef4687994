"""Compile (without running) ring attention alone, forward and forward+backward, for a mesh
of devices this host may not have, and print the temporaries per device that the compiler
plans, one JSON line per mode. Compares the block kernels (``--kernel xla`` / ``pallas``);
for a TPU topology the Pallas kernels go through libtpu's Mosaic compiler.

    # needs libtpu (pip install -e '.[tpu]', in its own virtual environment: docs/aot.md)
    TPU_ACCELERATOR_TYPE=v5p-8 TPU_WORKER_HOSTNAMES=localhost \\
      python benchmarks/aot_attention.py --topology v5p:2x2x1 --mesh 1,1,4,1 --seq 32768 --kernel pallas

    # one v5e chip: ours against JAX's splash attention, what `bench_attention.py --platform
    # tpu` times, here only compiled (the memory of both without a TPU)
    TPU_ACCELERATOR_TYPE=v5litepod-1 TPU_WORKER_HOSTNAMES=localhost \
      python benchmarks/aot_attention.py --topology v5e:1x1 --mesh 1,1,1,1 --seq 131072 \
      --block 1024 --impls ours,splash --no-segments

Shapes: batch 1, ``--heads`` query and key/value heads of ``--head-dim``, bfloat16, one segment id per
token (the packed-row path; ``--no-segments``: positions only, as `bench_attention.py` runs one
document), causal, blocks of ``--block``, positions 0..seq-1. ``fwd`` returns the output,
``fwd_bwd`` the gradients of ``sum(out * cotangent)``, as `bench_attention.py` times them.
"""

from __future__ import annotations

import argparse
import json
import time
from functools import partial


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--topology", required=True, help="TPU topology, e.g. v5p:2x2x1")
    p.add_argument("--mesh", required=True, help="dp,fsdp,sp,tp")
    p.add_argument("--seq", type=int, default=32768, help="tokens in the sequence")
    p.add_argument("--heads", type=int, default=32, help="query and key/value heads")
    p.add_argument("--head-dim", type=int, default=128, help="each head's width (default 128)")
    p.add_argument("--block", type=int, default=512, help="block_q = block_k")
    p.add_argument(
        "--kernel", default="pallas", choices=("xla", "pallas"), help="block kernel: xla or pallas"
    )
    p.add_argument(
        "--impls",
        default="ours",
        help="comma-separated: ours (ring_attention), splash (JAX's splash attention, one "
        "device, [batch, heads, seq, head_dim] inputs), splash-seq (splash from [batch, seq, "
        "heads, head_dim] inputs, transposed in the call as MaxText does), splash-sm (splash "
        "reading q, k, v with the sequence minor), ours-hm (ours on one device given splash's "
        "layout, swapped in the call); default ours",
    )
    p.add_argument("--no-segments", action="store_true", help="positions only, no segment ids")
    p.add_argument(
        "--projections",
        action="store_true",
        help="attention as a model runs it: q, k, v projected from activations [batch, seq, "
        "heads x head_dim] and the output projected back (fwd+bwd: the gradients of the "
        "activations and the four weights); each impl's projections write the layout it "
        "takes, so a layout change can fold into them",
    )
    args = p.parse_args()
    impls = [i for i in args.impls.split(",") if i]
    known = ("ours", "ours-hm", "splash", "splash-seq", "splash-sm")
    if bad := [i for i in impls if i not in known]:
        raise ValueError(f"unknown --impls {bad[0]!r} (known: {', '.join(known)})")

    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from lwm.attention import ring_attention
    from lwm.base.mesh import make_mesh, tpu_topology_devices

    devices = tpu_topology_devices(args.topology)
    mesh = make_mesh(args.mesh, devices=devices)
    x = NamedSharding(mesh, P(None, "sp", None, None))
    hd = args.head_dim
    shape = (1, args.seq, args.heads, hd)
    pos = jax.ShapeDtypeStruct(
        (1, args.seq), jnp.int32, sharding=NamedSharding(mesh, P(None, "sp"))
    )

    def ours(q, k, v, pos, axis_name="sp"):
        seg = None if args.no_segments else jnp.zeros_like(pos)
        return ring_attention(
            q, k, v, mesh=mesh, axis_name=axis_name, q_positions=pos, kv_positions=pos,
            q_segment_ids=seg, kv_segment_ids=seg, block_q=args.block, block_k=args.block,
            kernel=args.kernel,
        )  # fmt: skip

    def ours_hm(q, k, v, pos):
        """Ours on one device given ``[batch, heads, seq, head_dim]``, swapped to the API's
        layout and back: XLA folds the swaps into the kernel's head-major blocking."""
        from bench_attention import swapped  # benchmarks/, beside this script

        return swapped(partial(ours, axis_name=None))(q, k, v, pos)

    def reference(name):
        import bench_attention  # benchmarks/, beside this script

        bench_attention.DEVICES = 1
        attention = bench_attention.IMPL_FNS[name](mesh, args.block)

        def attend(q, k, v, pos):
            segments = None if args.no_segments else jnp.zeros_like(pos)
            return attention(q, k, v, pos, segments)

        return attend

    def modes(attend):
        def fwd_bwd(q, k, v, pos, ct):
            return jax.grad(lambda *a: jnp.sum(attend(*a, pos) * ct), argnums=(0, 1, 2))(q, k, v)

        return (("fwd", lambda q, k, v, pos, ct: attend(q, k, v, pos)), ("fwd_bwd", fwd_bwd))

    width = args.heads * hd
    acts = jax.ShapeDtypeStruct(
        (1, args.seq, width), jnp.bfloat16, sharding=NamedSharding(mesh, P(None, "sp", None))
    )
    replicated = NamedSharding(mesh, P())
    w_in = jax.ShapeDtypeStruct((width, args.heads, hd), jnp.bfloat16, sharding=replicated)
    w_out = jax.ShapeDtypeStruct((args.heads, hd, width), jnp.bfloat16, sharding=replicated)

    def projected(attend, head_major):
        """x -> q, k, v (in the layout ``attend`` takes) -> attention -> x's shape."""
        layout = "bhsd" if head_major else "bshd"

        def fn(x, wq, wk, wv, wo, pos, ct):
            q, k, v = (jnp.einsum(f"bsD,Dhd->{layout}", x, w) for w in (wq, wk, wv))
            return jnp.einsum(f"{layout},hdD->bsD", attend(q, k, v, pos), wo)

        def fwd_bwd(x, wq, wk, wv, wo, pos, ct):
            loss = lambda *a: jnp.sum(fn(*a, pos, ct) * ct)  # noqa: E731
            return jax.grad(loss, argnums=(0, 1, 2, 3, 4))(x, wq, wk, wv, wo)

        return (("fwd", fn), ("fwd_bwd", fwd_bwd))

    for impl in impls:
        head_major = impl in ("splash", "splash-sm", "ours-hm")
        if impl != "ours" and mesh.size != 1:
            raise ValueError("the splash impl compiles for one device (--mesh 1,1,1,1)")
        dims = (1, args.heads, args.seq, hd) if head_major else shape
        qkv = jax.ShapeDtypeStruct(dims, jnp.bfloat16, sharding=x)
        attend = {"ours": ours, "ours-hm": ours_hm}.get(impl) or reference(impl)
        if args.projections:
            cases = projected(attend, head_major)
            inputs = (acts, w_in, w_in, w_in, w_out, pos, acts)
        else:
            cases = modes(attend)
            inputs = (qkv, qkv, qkv, pos, qkv)
        for mode, fn in cases:
            start = time.perf_counter()
            compiled = jax.jit(fn).lower(*inputs).compile()
            mem = compiled.memory_analysis()
            row = {
                "bench": "aot_attention",
                "topology": args.topology,
                "mesh": args.mesh,
                "seq": args.seq,
                "head_dim": hd,
                "impl": impl,
                "kernel": args.kernel if impl.startswith("ours") else None,
                "block": args.block,
                "mode": mode,
                "projections": args.projections,
                "compile_s": round(time.perf_counter() - start, 1),
                "temp_mib": round(mem.temp_size_in_bytes / 2**20, 1),
                "argument_mib": round(mem.argument_size_in_bytes / 2**20, 1),
            }
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    from lwm.cli import run_reporting_errors

    raise SystemExit(run_reporting_errors("aot_attention", main, also=(ValueError,)))
