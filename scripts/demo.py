"""The project's main job, run by the README's first command.

Until the end-to-end demo (tokenize -> train -> answer) lands, this runs the largest real piece
of the pipeline that exists: the `tiny` model's attention layer as training would run it, with
ring attention over 8 simulated devices on a long sequence in the zigzag layout, checked against
single-device blockwise attention, with the per-device memory and the causal work balance.

    python scripts/demo.py                     # 16K tokens, tiny config's heads
    python scripts/demo.py --seq 32768 --config configs/tiny.yaml
"""

from __future__ import annotations

import os

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()

import argparse  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from lwm.attention import blockwise_attention, ring_attention  # noqa: E402
from lwm.attention.layout import (  # noqa: E402
    inverse_permutation,
    ring_schedule_work,
    ring_step_balance,
    zigzag_permutation,
)
from lwm.config import load_config  # noqa: E402
from lwm.info import param_counts  # noqa: E402
from lwm.mesh import make_mesh  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="configs/tiny.yaml")
    parser.add_argument("--seq", type=int, default=16384)
    parser.add_argument("--mesh", default="1,1,8,1", help="dp,fsdp,sp,tp")
    args = parser.parse_args()

    cfg = load_config(args.config).model
    counts = param_counts(cfg)
    mesh = make_mesh(args.mesh)
    sp = mesh.shape["sp"]
    print(
        f"model {args.config}: {counts.total:,} parameters; attention {cfg.num_heads} heads "
        f"({cfg.num_kv_heads} kv), head_dim {cfg.head_dim}; mesh {dict(mesh.shape)}",
        flush=True,
    )

    perm = zigzag_permutation(args.seq, sp)
    rng = np.random.default_rng(0)
    shape_q = (1, args.seq, cfg.num_heads, cfg.head_dim)
    shape_kv = (1, args.seq, cfg.num_kv_heads, cfg.head_dim)
    q, k, v = (jnp.asarray(rng.normal(size=s), jnp.float32) for s in (shape_q, shape_kv, shape_kv))
    pos = jnp.asarray(perm, jnp.int32)[None]
    block = dict(block_q=cfg.block_q, block_k=cfg.block_k)

    def ring_loss(q, k, v):
        out = ring_attention(q, k, v, mesh=mesh, q_positions=pos, kv_positions=pos, **block)
        return jnp.mean(out**2), out

    def single_loss(q, k, v):
        out = blockwise_attention(q, k, v, **block)
        return jnp.mean(out**2), out

    results = {}
    for name, fn, inputs in (
        ("ring (zigzag)", ring_loss, (q[:, perm], k[:, perm], v[:, perm])),
        ("blockwise, 1 device", single_loss, (q, k, v)),
    ):
        step = jax.jit(jax.value_and_grad(fn, argnums=(0, 1, 2), has_aux=True))
        compiled = step.lower(*inputs).compile()
        temp = compiled.memory_analysis().temp_size_in_bytes
        t0 = time.perf_counter()
        (_, out), grads = jax.block_until_ready(compiled(*inputs))
        dt = time.perf_counter() - t0
        results[name] = (out, grads)
        print(
            f"{name:>20}: forward+backward over {args.seq:,} tokens in {dt:.2f} s, "
            f"temp memory per device {temp / 2**20:.1f} MiB",
            flush=True,
        )

    inv = inverse_permutation(perm)
    ring_out, ring_grads = results["ring (zigzag)"]
    ref_out, ref_grads = results["blockwise, 1 device"]
    err = float(jnp.max(jnp.abs(ring_out[:, inv] - ref_out)))
    gerr = max(
        float(jnp.max(jnp.abs(g[:, inv] - r)) / jnp.max(jnp.abs(r)))
        for g, r in zip(ring_grads, ref_grads, strict=True)
    )
    print(f"ring vs single device: output max abs diff {err:.2e}, gradient rel diff {gerr:.2e}")
    for layout in ("contiguous", "zigzag"):
        work = ring_schedule_work(args.seq, sp, layout=layout, **block)
        print(
            f"causal ring steps, {layout:>10}: busiest-device time / mean work = "
            f"{ring_step_balance(work):.2f}"
        )
    ok = err <= 1e-4 and gerr <= 1e-3
    print("demo: OK" if ok else "demo: MISMATCH")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
