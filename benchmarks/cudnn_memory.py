"""Temporary memory the compiler plans on the `cudnn` attention path, with cuDNN's two kernels
replaced by cheap stand-ins (so only our code around them counts), on one CPU device: for the
gradient of a few attention layers, or for the whole train step of LWM-7B's width. It isolated
why the 7b-4l train step did not fit one H200 with `attention_kernel: cudnn` at 32K, and later
at 128K (docs/benchmarks.md, "Measured on the H200" and "Memory of the general path"): inside
a `lax.scan` over the layers, JAX hoisted what depends on positions alone out of the scan,
with temporaries that grow with the square of the sequence.

    python benchmarks/cudnn_memory.py --seq 8192 --cases plain,scan,scan-nosplit,scan-xla
    python benchmarks/cudnn_memory.py --seq 131072 --cases step,step-doc,step-general,step-in-order

Attention cases: ``plain`` (``--layers`` layers unrolled), ``scan`` (in a `lax.scan`, as
`scan_layers`), ``-nosplit`` (general pairs not cut into pieces of ``--piece`` tokens),
``-xla`` (the XLA kernel instead of cuDNN pairs), ``-doc`` (no positions given: one document
in order, the schedule that decides nothing at run time), ``-in-order`` (positions given and
``in_order``: the masked pieces' schedule). Train-step cases (configs/7b.yaml with ``--layers``
layers, bf16 compute, float32 parameters and AdamW, remat ``nothing_saveable``, batch 1, as
`benchmarks/bench_train.py --sizes 7b-4l` compiles it): ``step`` and ``step-band`` (as many
processes compile it: the known-order schedule or the in-order one, chosen per step by one
`lax.cond`; the latter for the loader's plan's reach, 4,096 tokens here), ``step-doc``,
``step-general``, ``step-in-order`` and ``step-in-order-band`` (the step compiled for rows of
one order, as one process of `lwm train` compiles one per order that occurs:
`lwm.model.ROW_ORDERS`; the last for rows in order whose queries look back at most 4,096 tokens,
each piece's band of key pieces); ``KEY=VALUE``
overrides apply to these. One JSON line each.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys

from lwm.base.mesh import use_cpu_devices


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seq", type=int, default=8192, help="tokens in the row")
    p.add_argument("--heads", type=int, default=32, help="heads of the attention cases")
    p.add_argument(
        "--head-dim", type=int, default=128, help="head dimension of the attention cases"
    )
    p.add_argument(
        "--layers", type=int, default=4, help="attention layers, or the train step's model layers"
    )
    p.add_argument("--piece", type=int, help="lwm.attention.cudnn.pairs.PIECE (default 4096)")
    p.add_argument(
        "--cases",
        default="plain,scan,scan-nosplit,scan-xla",
        help="comma-separated: attention plain or scan, then -nosplit, -xla, -doc or "
        f"-in-order; train step {', '.join(STEP_ROWS)} (default plain,scan,scan-nosplit,scan-xla)",
    )
    p.add_argument(
        "overrides", nargs="*", metavar="KEY=VALUE", help="config overrides for step cases"
    )
    args = p.parse_intermixed_args()
    import re

    from lwm.config import ConfigError

    attention = r"(plain|scan)(-nosplit)?(-xla)?(-doc|-in-order)?"  # the docstring's grammar
    for case in args.cases.split(","):
        if not (case in STEP_ROWS or re.fullmatch(attention, case)):
            print(
                f"cudnn_memory: error: unknown case '{case}' (attention: plain or scan, "
                f"then -nosplit, -xla, -doc or -in-order; train step: {', '.join(STEP_ROWS)})",
                file=sys.stderr,
            )
            return 2
    use_cpu_devices(1)  # once the input is checked: bad input costs no start of JAX
    for case in args.cases.split(","):
        try:
            print(json.dumps(probe(case, args)), flush=True)
        except ConfigError as e:
            print(f"cudnn_memory: error: {e}", file=sys.stderr)
            return 2
    return 0


@contextlib.contextmanager
def stand_ins(case: str, piece: int | None):
    """cuDNN's kernels as cheap functions with its output conventions (a mask bias read, so
    that building it counts); `lwm.attention.cudnn.pairs.PIECE` set. Restored after."""
    import jax.numpy as jnp
    from jax import lax

    from lwm.attention.blocks import F32
    from lwm.attention.cudnn import kernels, pairs

    saved = (kernels._emulated_fwd, kernels._emulated_bwd, pairs.PIECE)

    def read(bias):
        return 0.0 if bias is None else jnp.mean(bias.astype(F32))

    # Each stand-in starts at an optimization barrier, opaque as cuDNN's custom call: else XLA
    # moves their float32 converts out of the loops over pieces, converting whole arrays
    # once (planned memory cuDNN's bf16 kernels never take).
    def fwd(q, k, v, causal, scale, bias=None):
        q, k, v, bias = lax.optimization_barrier((q, k, v, bias))
        b, t, h, _ = q.shape
        lse = jnp.zeros((b, h, t), F32) + jnp.mean(k) + read(bias)
        return (q * jnp.mean(v)).astype(q.dtype), lse

    def bwd(q, k, v, out, lse, dout, causal, scale, bias=None):
        q, k, v, out, lse, dout, bias = lax.optimization_barrier((q, k, v, out, lse, dout, bias))
        s = jnp.mean(lse) + jnp.mean(dout.astype(F32)) + read(bias)
        return (q * s).astype(q.dtype), (k * s).astype(k.dtype), (v * s).astype(v.dtype)

    kernels._emulated_fwd, kernels._emulated_bwd = fwd, bwd
    if piece:
        pairs.PIECE = piece
    if "nosplit" in case:
        pairs.PIECE = 1 << 30
    try:
        yield
    finally:
        kernels._emulated_fwd, kernels._emulated_bwd, pairs.PIECE = saved


def probe(case: str, args: argparse.Namespace) -> dict:
    from lwm.attention.cudnn import pairs

    with stand_ins(case, args.piece):
        piece = pairs.PIECE
        compiled = (step_compiled if case.startswith("step") else attention_compiled)(case, args)
        temp = compiled.memory_analysis().temp_size_in_bytes
    return {
        "bench": "cudnn_memory_probe",
        "case": case,
        "seq": args.seq,
        "layers": args.layers,
        "piece": piece,
        **({"overrides": args.overrides} if args.overrides else {}),
        "temp_gib": temp / 2**30,
    }


def attention_compiled(case: str, args: argparse.Namespace):
    import jax
    import jax.numpy as jnp

    from lwm.attention import blockwise_attention

    kernel = "xla" if "xla" in case else "cudnn"
    x = jax.ShapeDtypeStruct((1, args.seq, args.heads, args.head_dim), jnp.bfloat16)
    w = jax.ShapeDtypeStruct((args.layers, args.head_dim), jnp.bfloat16)
    pos = jax.ShapeDtypeStruct((1, args.seq), jnp.int32)

    def layer(x, wl, pos):
        if case.endswith("-doc"):  # one document in order: nothing decided at run time
            return blockwise_attention(x * wl, x, x, kernel=kernel)
        seg = jnp.ones_like(pos)
        return blockwise_attention(
            x * wl, x, x, kernel=kernel, q_positions=pos, kv_positions=pos,
            q_segment_ids=seg, kv_segment_ids=seg, in_order=case.endswith("-in-order"),
        )  # fmt: skip

    def loss(w, x, pos):
        if case.startswith("scan"):
            x, _ = jax.lax.scan(lambda x, wl: (layer(x, wl, pos), None), x, w)
        else:
            for i in range(args.layers):
                x = layer(x, w[i], pos)
        return jnp.sum(x.astype(jnp.float32))

    return jax.jit(jax.grad(loss)).lower(w, x, pos).compile()


# the train-step cases: the `rows` and `reach` each compiles the step for
# (`lwm.train_step.train_step`); the band: no query looking back more than one piece
STEP_ROWS = {
    "step": (None, 0),
    "step-band": (None, 4096),
    "step-doc": ("one_document", 0),
    "step-general": ("any", 0),
    "step-in-order": ("in_order", 0),
    "step-in-order-band": ("in_order", 4096),
}


def step_compiled(case: str, args: argparse.Namespace):
    import lwm.train_step as ts
    from lwm.config import ConfigError

    if case not in STEP_ROWS:
        raise ConfigError(f"unknown case '{case}'; the train-step cases are {', '.join(STEP_ROWS)}")
    from lwm.base.mesh import make_mesh
    from lwm.config import load_config

    overrides = [
        f"model.num_layers={args.layers}",
        f"model.max_seq_len={args.seq}",
        "model.attention=blockwise",
        "model.attention_kernel=cudnn",  # on the CPU: the stand-ins above
        "model.block_q=512",
        "model.block_k=512",
        "model.remat_policy=nothing_saveable",
        "model.dtype=bfloat16",
        *args.overrides,
    ]
    cfg = load_config("configs/7b.yaml", overrides).model
    mesh = make_mesh((1, 1, 1, 1))
    tx, _ = ts.make_optimizer(1e-4)
    graphdef, params, opt_state = ts.abstract_train_state(cfg, mesh, tx)
    batch = ts.abstract_batch(mesh, 1, args.seq)
    rows, reach = STEP_ROWS[case]
    step = ts.jit_train_step(graphdef, tx, mesh, params, opt_state, rows=rows, reach=reach)
    return step.lower(params, opt_state, batch).compile()


if __name__ == "__main__":
    from lwm.cli import run_reporting_errors

    raise SystemExit(run_reporting_errors("cudnn_memory", main, also=(ValueError,)))
