"""What cuDNN's packed-sequence attention computes on this GPU: several documents per row,
given as segment offsets and lengths (``q_offsets``, ``q_seqlen`` of JAX's private
`jax._src.cudnn.fused_attention_stablehlo.dot_product_attention`, Hopper or later): the alternative to
how the cuDNN path runs packed rows (a piece that holds a document boundary is one cuDNN call
with its mask as a bias; docs/benchmarks.md). It answers, against dense float32 attention with
the same documents (causal within each document, GQA):

1. ``check``: is the output right; what layout its float32 softmax statistics have (each
   candidate layout's largest error against the log-sum-exp of every query), which decides
   whether they can be combined across ring steps as our pairs' are; and are JAX's own
   gradients through it right (what one packed call per row on one GPU would use).
2. ``time``: fwd+bwd at ``--seq`` with ``--docs`` equal documents, against one causal cuDNN call
   over the whole row (an upper bound), and our blockwise attention given the documents'
   positions and segment ids on the cuDNN path (pieces with a bias, each decided at run
   time), on it told ``in_order`` (every piece on and below the diagonal, nothing decided at
   run time) and on the XLA kernel.

One JSON line per measurement; with ``--out DIR`` the statistics and reference log-sum-exps of
the check are also saved there (``.npy``).

    python scripts/probe_cudnn_packed.py --platform gpu --out "$OUT/packed"
    python scripts/probe_cudnn_packed.py --platform cpu   # lowers the calls for CUDA, no run
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
from steps import failed_status  # scripts/steps.py


def main() -> int:
    p = argparse.ArgumentParser(
        description="What cuDNN's packed-sequence attention (several documents per row, as "
        "segment offsets and lengths) computes on this GPU, against dense float32 attention "
        "with the same documents: whether it is right, and how fast it is."
    )
    p.add_argument(
        "--platform",
        choices=("cpu", "gpu"),
        default="gpu",
        help="gpu: check and time (default); cpu: only lower the calls for CUDA, no run",
    )
    p.add_argument("--seq", type=int, default=8192, help="tokens per row in the timing")
    p.add_argument("--docs", type=int, default=4, help="equal documents per row in the timing")
    p.add_argument("--heads", type=int, default=32, help="query and key/value heads in the timing")
    p.add_argument("--head-dim", type=int, default=128, help="head dimension in the timing")
    p.add_argument("--repeats", type=int, default=5, help="timed calls per measurement")
    p.add_argument("--out", help="folder for the check's arrays (.npy)")
    p.add_argument(
        "--no-check", action="store_true", help="only the timing (the check does not use --seq)"
    )
    args = p.parse_args()
    import os

    os.environ.setdefault("JAX_PLATFORMS", "cuda" if args.platform == "gpu" else "cpu")
    # each line as soon as it is made (a step cut off by its time limit keeps what it has), and
    # the timing of our paths even where cuDNN's packed call fails its check
    try:
        for line in [] if args.no_check else check(args):
            print(json.dumps(line), flush=True)
    except Exception as e:  # e.g. a cuDNN or GPU without the packed layout
        print(json.dumps({"probe": "cudnn_packed_check", "status": failed_status(e)}), flush=True)
    for line in timing(args):
        print(json.dumps(line), flush=True)
    return 0


def packed(lengths: list[int], slots: int):
    """Offsets ``[1, slots + 1]`` and lengths ``[1, slots]`` of documents laid end to end, -1
    where there is none (the layout JAX's packed-attention test uses); segment ids and
    positions of each token."""
    starts = np.cumsum([0, *lengths[:-1]])
    offsets = np.full((1, slots + 1), -1, np.int32)
    seqlen = np.full((1, slots), -1, np.int32)
    offsets[0, : len(lengths)] = starts
    seqlen[0, : len(lengths)] = lengths
    seg = np.concatenate([np.full(n, i + 1, np.int32) for i, n in enumerate(lengths)])[None]
    pos = np.concatenate([np.arange(n, dtype=np.int32) for n in lengths])[None]
    return offsets, seqlen, seg, pos


def reference(q, k, v, seg, pos, scale):
    """Dense float32 attention, causal within each document: output and log-sum-exp
    ``[b, heads, t]``."""
    import jax.numpy as jnp

    h, kvh = q.shape[2], k.shape[2]
    kf = jnp.repeat(k.astype(jnp.float32), h // kvh, axis=2)
    vf = jnp.repeat(v.astype(jnp.float32), h // kvh, axis=2)
    s = jnp.einsum("bthd,bshd->bhts", q.astype(jnp.float32), kf) * scale
    seen = (seg[:, :, None] == seg[:, None, :]) & (pos[:, None, :] <= pos[:, :, None])
    s = jnp.where(seen[:, None], s, -jnp.inf)
    lse = jnp.max(s, -1) + jnp.log(jnp.sum(jnp.exp(s - jnp.max(s, -1, keepdims=True)), -1))
    out = jnp.einsum("bhts,bshd->bthd", jnp.exp(s - lse[..., None]), vf)
    return out, lse


def cudnn_packed(q, k, v, offsets, seqlen, scale, residual=False):
    from jax._src.cudnn import fused_attention_stablehlo as fa

    return fa.dot_product_attention(
        q, k, v, None, None, seqlen, seqlen, offsets, offsets,
        scale=scale, mask_type=fa.MaskType.PADDING_CAUSAL, qkv_layout="BTNH",
        return_residual=residual,
    )  # fmt: skip


def inputs(t: int, heads: int, kv_heads: int, dim: int, seed: int = 0):
    import jax
    import jax.numpy as jnp

    keys = jax.random.split(jax.random.key(seed), 4)
    shapes = [(1, t, heads, dim), (1, t, kv_heads, dim), (1, t, kv_heads, dim), (1, t, heads, dim)]
    return [jax.random.normal(key, s, jnp.bfloat16) for key, s in zip(keys, shapes, strict=True)]


def check(args) -> list[dict]:
    import jax
    import jax.numpy as jnp

    t, heads, kvh, dim, scale = 1024, 8, 4, 64, 0.125
    lengths, slots = [300, 200, 424, 100], 6  # two empty slots: padded with -1
    offsets, seqlen, seg, pos = packed(lengths, slots)
    q, k, v, g = inputs(t, heads, kvh, dim)
    if args.platform == "cpu":
        return [lowered_for_cuda(q, k, v, offsets, seqlen, scale)]
    out, stats = jax.jit(lambda q, k, v: cudnn_packed(q, k, v, offsets, seqlen, scale, True))(
        q, k, v
    )
    ref_out, ref_lse = reference(q, k, v, jnp.asarray(seg), jnp.asarray(pos), scale)
    stats = np.asarray(stats, np.float32)
    ref_lse = np.asarray(ref_lse)
    lines = [
        {
            "probe": "cudnn_packed_forward",
            "out_max_err": float(jnp.max(jnp.abs(out.astype(jnp.float32) - ref_out))),
            "out_scale": float(jnp.max(jnp.abs(ref_out))),
            "stats_shape": list(stats.shape),
            "stats_dtype": str(stats.dtype),
        }
    ]
    # Candidate layouts of the statistics ([batch * slots, heads, t]).
    candidates = {"by_token": stats[0], "by_token_log2": stats[0] / np.log2(np.e)}
    by_segment = np.full_like(ref_lse[0], np.nan)  # slot i: segment i from its own index 0
    at_token = np.full_like(ref_lse[0], np.nan)  # slot i: segment i at its tokens' indices
    for i, (start, n) in enumerate(zip(offsets[0], lengths, strict=False)):
        by_segment[:, start : start + n] = stats[i, :, :n]
        at_token[:, start : start + n] = stats[i, :, start : start + n]
    candidates["by_segment"] = by_segment
    candidates["by_segment_at_token"] = at_token
    # ragged: the statistics of all tokens one after another, [tokens, heads] or [heads, tokens]
    flat = stats.reshape(-1)[: t * heads]
    candidates["ragged_token_major"] = flat.reshape(t, heads).T
    candidates["ragged_head_major"] = flat.reshape(heads, t)
    for name, got in candidates.items():
        lines.append(
            {
                "probe": "cudnn_packed_stats_layout",
                "candidate": name,
                "max_err": float(np.nanmax(np.abs(got - ref_lse[0]))),
            }
        )
    if args.out:
        folder = Path(args.out)
        folder.mkdir(parents=True, exist_ok=True)
        np.save(folder / "stats.npy", stats)
        np.save(folder / "ref_lse.npy", ref_lse)

    def loss(fn):
        return lambda q, k, v: jnp.sum(fn(q, k, v).astype(jnp.float32) * g.astype(jnp.float32))

    grads = jax.jit(jax.grad(loss(lambda q, k, v: cudnn_packed(q, k, v, offsets, seqlen, scale)),
                             argnums=(0, 1, 2)))(q, k, v)  # fmt: skip
    ref = jax.grad(
        loss(lambda q, k, v: reference(q, k, v, jnp.asarray(seg), jnp.asarray(pos), scale)[0]),
        argnums=(0, 1, 2),
    )(*(x.astype(jnp.float32) for x in (q, k, v)))
    for name, a, b in zip(("dq", "dk", "dv"), grads, ref, strict=True):
        rel = jnp.max(jnp.abs(a.astype(jnp.float32) - b)) / jnp.max(jnp.abs(b))
        lines.append({"probe": "cudnn_packed_gradient", "grad": name, "rel_err": float(rel)})
    return lines


def lowered_for_cuda(q, k, v, offsets, seqlen, scale) -> dict:
    """On a CPU host: the packed call's forward and JAX's gradient lower to StableHLO for CUDA
    (cuDNN's checks of the GPU itself skipped)."""
    from unittest import mock

    import jax
    import jax.numpy as jnp
    from jax._src.cudnn import fused_attention_stablehlo as fa

    def loss(q, k, v):
        return jnp.sum(cudnn_packed(q, k, v, offsets, seqlen, scale).astype(jnp.float32))

    with (
        mock.patch.object(fa, "check_cudnn_version", lambda: 91000),
        mock.patch.object(fa, "check_is_flash_attention", lambda *a, **k: None),
        mock.patch.object(fa, "check_compute_capability", lambda *a: True),
    ):
        step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))
        text = step.trace(q, k, v).lower(lowering_platforms=("cuda",)).as_text()
    return {
        "probe": "cudnn_packed_lowering",
        "forward": "__cudnn$fmhaSoftmax" in text,
        "backward": "__cudnn$fmhaSoftmaxBackward" in text,
    }


def timing(args) -> Iterator[dict]:
    """One line per implementation, each as soon as it is timed."""
    if args.platform == "cpu":
        return
    import jax
    import jax.numpy as jnp

    from lwm.attention import blockwise_attention, keys_precede_queries

    t, docs = args.seq, args.docs
    lengths = [t // docs] * (docs - 1) + [t - t // docs * (docs - 1)]  # the last takes the rest
    offsets, seqlen, seg, pos = packed(lengths, docs)
    seg, pos = jnp.asarray(seg), jnp.asarray(pos)
    q, k, v, g = inputs(t, args.heads, args.heads, args.head_dim)
    scale = args.head_dim**-0.5

    def ours(kernel, in_order=False):
        return lambda q, k, v: blockwise_attention(
            q, k, v, q_positions=pos, kv_positions=pos, q_segment_ids=seg, kv_segment_ids=seg,
            kernel=kernel, in_order=in_order,
        )  # fmt: skip

    assert bool(keys_precede_queries(pos, seg))  # what in_order takes for granted

    impls = {
        "cudnn-packed": lambda q, k, v: cudnn_packed(q, k, v, offsets, seqlen, scale),
        "cudnn-one-causal-call": lambda q, k, v: jax.nn.dot_product_attention(
            q, k, v, is_causal=True, implementation="cudnn"
        ),
        "ours-cudnn": ours("cudnn"),
        "ours-cudnn-in-order": ours("cudnn", in_order=True),
        "ours-xla": ours("xla"),
    }
    for name, fn in impls.items():

        def loss(q, k, v, fn=fn):
            return jnp.sum(fn(q, k, v).astype(jnp.float32) * g.astype(jnp.float32))

        step = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
        try:
            jax.block_until_ready(step(q, k, v))
            times = []
            for _ in range(args.repeats):
                t0 = time.perf_counter()
                jax.block_until_ready(step(q, k, v))
                times.append(time.perf_counter() - t0)
            rec = {"time_ms": round(statistics.median(times) * 1e3, 3)}
        except Exception as e:  # e.g. a cuDNN too old for packed rows
            rec = {"status": failed_status(e)}
        yield {"probe": "cudnn_packed_time", "impl": name, "seq": t, "docs": docs, **rec}


if __name__ == "__main__":
    from lwm.cli import run_reporting_errors

    raise SystemExit(run_reporting_errors("probe_cudnn_packed", main, also=(ValueError,)))
