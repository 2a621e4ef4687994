"""Temporary memory the compiler plans for the gradient of a few attention layers on the
`cudnn` path, with cuDNN's two kernels replaced by cheap stand-ins (so only our code around
them counts), on one CPU device. It isolates why the 7b-4l train step at 32K did not fit one
H200 with `attention_kernel: cudnn` (docs/benchmarks.md, "Measured on the H200"): inside a
`lax.scan` over the layers, the XLA fallback's forward inside a pair's `lax.switch` is
compiled with temporaries that grow with the square of the sequence.

    python scripts/probe_cudnn_memory.py --seq 8192 --cases plain,scan,scan-nogenfwd,scan-xla

Cases: ``plain`` (4 layers unrolled), ``scan`` (4 layers in a `lax.scan`, as `scan_layers`),
``-nosplit`` (no 4K pieces), ``-nogenfwd`` / ``-nogenbwd`` (the XLA fallback's forward or
backward stubbed out), ``-xla`` (the XLA kernel instead of cuDNN pairs). One JSON line each.
"""

from __future__ import annotations

import argparse
import json

from lwm.base.mesh import use_cpu_devices


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seq", type=int, default=8192)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--cases", default="plain,scan,scan-nogenfwd,scan-nogenbwd,scan-xla")
    args = p.parse_args()
    use_cpu_devices(1)
    for case in args.cases.split(","):
        print(json.dumps(probe(case, args)), flush=True)
    return 0


def probe(case: str, args: argparse.Namespace) -> dict:
    import jax
    import jax.numpy as jnp

    import lwm.attention.cudnn as cd
    from lwm.attention import blockwise_attention
    from lwm.attention.blocks import F32

    saved = (cd._emulated_fwd, cd._emulated_bwd, cd._xla_pair_fwd, cd._xla_pair_bwd, cd.PIECE)

    def fwd(q, k, v, causal, scale):  # cheap, with cuDNN's output conventions
        b, t, h, _ = q.shape
        return (q * jnp.mean(v)).astype(q.dtype), jnp.zeros((b, h, t), F32) + jnp.mean(k)

    def bwd(q, k, v, out, lse, dout, causal, scale):
        s = jnp.mean(lse) + jnp.mean(dout.astype(F32))
        return (q * s).astype(q.dtype), (k * s).astype(k.dtype), (v * s).astype(v.dtype)

    cd._emulated_fwd, cd._emulated_bwd = fwd, bwd
    if "nosplit" in case:
        cd.PIECE = 1 << 30
    if "nogenfwd" in case:
        cd._xla_pair_fwd = lambda q, k, v, *_: (
            jnp.zeros(q.shape, F32),
            jnp.zeros((q.shape[0], q.shape[2], q.shape[1]), F32),
        )
    if "nogenbwd" in case:
        cd._xla_pair_bwd = lambda q, k, v, *_: (
            jnp.zeros(q.shape, F32),
            jnp.zeros(k.shape, F32),
            jnp.zeros(k.shape, F32),
        )
    kernel = "xla" if "xla" in case else "cudnn"
    x = jax.ShapeDtypeStruct((1, args.seq, args.heads, args.head_dim), jnp.bfloat16)
    w = jax.ShapeDtypeStruct((args.layers, args.head_dim), jnp.bfloat16)
    pos = jax.ShapeDtypeStruct((1, args.seq), jnp.int32)

    def layer(x, wl, pos):
        seg = jnp.ones_like(pos)
        return blockwise_attention(
            x * wl, x, x, kernel=kernel, q_positions=pos, kv_positions=pos,
            q_segment_ids=seg, kv_segment_ids=seg,
        )  # fmt: skip

    def loss(w, x, pos):
        if case.startswith("scan"):
            x, _ = jax.lax.scan(lambda x, wl: (layer(x, wl, pos), None), x, w)
        else:
            for i in range(args.layers):
                x = layer(x, w[i], pos)
        return jnp.sum(x.astype(jnp.float32))

    try:
        compiled = jax.jit(jax.grad(loss)).lower(w, x, pos).compile()
        temp = compiled.memory_analysis().temp_size_in_bytes
    finally:
        cd._emulated_fwd, cd._emulated_bwd, cd._xla_pair_fwd, cd._xla_pair_bwd, cd.PIECE = saved
    return {"bench": "cudnn_memory_probe", "case": case, "seq": args.seq, "temp_gib": temp / 2**30}


if __name__ == "__main__":
    raise SystemExit(main())
