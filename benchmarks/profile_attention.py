"""Where the time of one attention fwd+bwd call goes, per implementation, on one device.

For each implementation and sequence length it compiles ``grad(sum(attention(q, k, v) * ct))``,
times it (median wall time of ``--repeats`` calls, as `benchmarks/bench_attention.py` does), then
records ``--trace-calls`` calls with JAX's profiler and reads the trace back
(`jax.profiler.ProfileData`): the device time the kernels took per call, the gap between the
wall time and that busy time, and the kernels that took the most. It also counts the ops of
the optimized HLO that cost time without doing attention (conditionals, copies, transposes,
custom calls). One JSON line per implementation and length.

Implementations (all bfloat16, causal, one document, ``--heads`` x ``--head-dim``):

- ``cudnn``: ``jax.nn.dot_product_attention(implementation="cudnn")``, the reference;
- ``raw``: one custom VJP around the same two private cuDNN calls `lwm.attention.cudnn` makes
  (forward with its float32 log-sum-exp, backward from the global output and log-sum-exp),
  nothing else: the floor of our API;
- ``ours-cudnn``: `lwm.attention.ring_attention` with ``kernel="cudnn"`` on a one-device mesh,
  positions passed (what `benchmarks/bench_attention.py` times);
- ``ours-cudnn-doc``: the same without positions, ``layout="zigzag"`` (one document in a
  known order: no run-time choice at all, `lwm.attention.cudnn`);
- ``ours-noswitch``: the same with every pair's run-time choice of kernel (``lax.switch``)
  replaced by its causal branch while tracing (right for these inputs: one document, in order):
  what the choice costs.

Command (on an NVIDIA GPU)::

    python3 benchmarks/profile_attention.py --platform gpu --seqs 8192,32768

On a CPU (``--platform cpu``: ``raw`` and ``ours-cudnn`` run the emulated kernels, ``cudnn``
is left out) it only checks that the script runs.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import glob
import json
import os
import re
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from lwm.attention import attention_flops, ring_attention
from lwm.attention import cudnn as cudnn_mod
from lwm.base.mesh import MeshError, use_platform

HLO_OPS = ("conditional", "while", "copy", "transpose", "custom-call", "fusion", "all-reduce")


def info(msg: str) -> None:
    print(f"[profile_attention] {msg}", file=sys.stderr, flush=True)


def raw_cudnn(q: jax.Array, k: jax.Array, v: jax.Array, emulate: bool) -> jax.Array:
    """The two cuDNN calls of `lwm.attention.cudnn` and nothing around them."""
    fwd, bwd = (
        (cudnn_mod.kernels._emulated_fwd, cudnn_mod.kernels._emulated_bwd)
        if emulate
        else (cudnn_mod.kernels._cudnn_fwd, cudnn_mod.kernels._cudnn_bwd)
    )
    scale = q.shape[-1] ** -0.5

    @jax.custom_vjp
    def attn(q, k, v):
        return fwd(q, k, v, True, scale)[0]

    def attn_fwd(q, k, v):
        out, lse = fwd(q, k, v, True, scale)
        return out, (q, k, v, out, lse)

    def attn_bwd(res, dout):
        q, k, v, out, lse = res
        return bwd(q, k, v, out, lse, dout, True, scale)

    attn.defvjp(attn_fwd, attn_bwd)
    return attn(q, k, v)


@contextlib.contextmanager
def causal_pairs_only() -> Iterator[None]:
    """While tracing: every pair of `lwm.attention.cudnn` runs its causal branch, unchosen."""
    saved = cudnn_mod.pairs._switch
    cudnn_mod.pairs._switch = lambda kind, branches, *ops: branches[cudnn_mod.CAUSAL](*ops)
    try:
        yield
    finally:
        cudnn_mod.pairs._switch = saved


def implementations(mesh: jax.sharding.Mesh, emulate: bool) -> dict[str, Callable[..., Any]]:
    def cudnn(q, k, v, positions):
        del positions
        return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn")

    def raw(q, k, v, positions):
        del positions
        return raw_cudnn(q, k, v, emulate)

    def ours(q, k, v, positions):
        return ring_attention(
            q, k, v, mesh=mesh, causal=True, q_positions=positions, kv_positions=positions,
            kernel="cudnn",
        )  # fmt: skip

    def ours_document(q, k, v, positions):
        del positions  # one device: the zigzag order is the sequence's own
        return ring_attention(q, k, v, mesh=mesh, causal=True, kernel="cudnn", layout="zigzag")

    return {
        "cudnn": cudnn,
        "raw": raw,
        "ours-cudnn": ours,
        "ours-noswitch": ours,
        "ours-cudnn-doc": ours_document,
    }


PATCHES = {"ours-noswitch": causal_pairs_only}


def fwd_bwd(attn: Callable[..., Any]) -> Callable[..., Any]:
    def step(q, k, v, ct, positions):
        def loss(q, k, v):
            return jnp.sum(attn(q, k, v, positions).astype(jnp.float32) * ct)

        return jax.grad(loss, argnums=(0, 1, 2))(q, k, v)

    return jax.jit(step)


def hlo_counts(text: str) -> dict[str, int]:
    """How many of each `HLO_OPS` the optimized HLO has (all computations)."""
    counts = collections.Counter()
    for op in HLO_OPS:
        counts[op] = len(re.findall(rf"= [^=]*? {re.escape(op)}\(", text))
    return dict(counts)


def cudnn_calls(text: str) -> list[str]:
    return sorted(set(re.findall(r'custom_call_target="(__cudnn[^"]*)"', text)))


def device_events(trace_dir: str) -> tuple[dict[str, list[tuple[str, str, int, int]]], dict]:
    """Events ``(kind, name, start_ns, duration_ns)`` of each device plane's stream lines
    (``kernel``) and XLA-op line (``op``), and the event count of every plane's lines."""
    paths = glob.glob(os.path.join(trace_dir, "**", "*.xplane.pb"), recursive=True)
    if not paths:
        return {}, {}
    data = jax.profiler.ProfileData.from_file(paths[0])
    planes: dict[str, list[tuple[str, str, int, int]]] = {}
    layout = {}
    for plane in data.planes:
        layout[plane.name] = {line.name: sum(1 for _ in line.events) for line in plane.lines}
        if not plane.name.startswith("/device:"):
            continue
        events = []
        for line in plane.lines:
            if line.name.startswith("Stream") or line.name in ("XLA Ops",):
                kind = "op" if line.name == "XLA Ops" else "kernel"
                events += [(kind, e.name, int(e.start_ns), int(e.duration_ns)) for e in line.events]
        planes[plane.name] = events
    return planes, layout


def summarize(events: list[tuple[str, str, int, int]], calls: int, top: int) -> dict[str, Any]:
    kernels = [(n, s, d) for kind, n, s, d in events if kind == "kernel"]
    if not kernels:
        ops = [(n, s, d) for kind, n, s, d in events if kind == "op"]
        kernels = ops
    by_name: dict[str, list[int]] = collections.defaultdict(list)
    for name, _, dur in kernels:
        by_name[name].append(dur)
    busy = sum(d for _, _, d in kernels)
    span = (max(s + d for _, s, d in kernels) - min(s for _, s, _ in kernels)) if kernels else 0
    ranked = sorted(by_name.items(), key=lambda kv: -sum(kv[1]))[:top]
    return {
        "kernel_ms_per_call": round(busy / calls / 1e6, 4),
        "span_ms_per_call": round(span / calls / 1e6, 4),
        "kernels_per_call": round(len(kernels) / calls, 1),
        "top": [
            {
                "name": name[:120],
                "ms_per_call": round(sum(d) / calls / 1e6, 4),
                "count_per_call": round(len(d) / calls, 2),
            }
            for name, d in ranked
        ],
    }


def profile_case(
    impl: str, fn: Callable[..., Any], args: tuple, seq: int, opts: argparse.Namespace
) -> dict[str, Any]:
    heads, dim = opts.heads, opts.head_dim
    record: dict[str, Any] = {"bench": "attention_profile", "impl": impl, "seq": seq}
    if opts.compiler_options:
        record["compiler_options"] = opts.compiler_options
    try:
        with PATCHES.get(impl, contextlib.nullcontext)():
            compiled = fn.lower(*args).compile(opts.compiler_options or None)
    except Exception as e:  # a refused shape is a result, not a crash
        return record | {"status": "error", "error": str(e).splitlines()[0][:300]}
    mem = compiled.memory_analysis()
    text = compiled.as_text()
    record.update(
        temp_bytes=int(mem.temp_size_in_bytes), hlo=hlo_counts(text), cudnn=cudnn_calls(text)
    )
    for _ in range(2):
        jax.block_until_ready(compiled(*args))
    times = []
    for _ in range(opts.repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(compiled(*args))
        times.append(time.perf_counter() - t0)
    t = statistics.median(times)
    flops = 3.5 * attention_flops(1, seq, seq, heads, dim, causal=True)
    record.update(time_ms=round(t * 1e3, 3), tflops=round(flops / t / 1e12, 1))
    with tempfile.TemporaryDirectory() as trace_dir:
        jax.block_until_ready(compiled(*args))
        with jax.profiler.trace(trace_dir):
            for _ in range(opts.trace_calls):
                jax.block_until_ready(compiled(*args))
        planes, layout = device_events(trace_dir)
    record["trace_lines"] = layout
    if planes:
        name, events = next(iter(sorted(planes.items())))
        record["plane"] = name
        record.update(summarize(events, opts.trace_calls, opts.top))
    else:
        record["plane"] = None
    return record | {"status": "ok"}


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--platform",
        choices=("cpu", "gpu"),
        default="gpu",
        help="gpu: the first GPU (default); cpu: one CPU device, emulated kernels, no cudnn",
    )
    p.add_argument("--seqs", default="8192,32768", help="comma-separated (default 8192,32768)")
    p.add_argument(
        "--impls",
        default="cudnn,raw,ours-cudnn,ours-cudnn-doc,ours-noswitch",
        help="comma-separated, of cudnn,raw,ours-cudnn,ours-cudnn-doc,ours-noswitch (default "
        "all; cudnn is left out on cpu)",
    )
    p.add_argument("--heads", type=int, default=32, help="query and key/value heads")
    p.add_argument("--head-dim", type=int, default=128, help="dimension of each head")
    p.add_argument("--repeats", type=int, default=5, help="timed calls per case (median)")
    p.add_argument(
        "--trace-calls",
        type=int,
        default=3,
        help="calls recorded with JAX's profiler; kernel times are per call (default 3)",
    )
    p.add_argument(
        "--top", type=int, default=12, help="kernels listed, those that took the most time"
    )
    p.add_argument(
        "--compiler-options",
        type=json.loads,
        default={},
        help="XLA options for every compile, as JSON, e.g. '{\"xla_gpu_graph_min_graph_size\": 1}'",
    )
    opts = p.parse_args(argv)
    try:
        use_platform(opts.platform, cpu_devices=1)
    except MeshError as e:
        raise SystemExit(f"profile_attention: error: {e}") from None
    emulate = opts.platform != "gpu"
    mesh = jax.make_mesh(
        (1, 1, 1, 1), ("dp", "fsdp", "sp", "tp"), axis_types=(jax.sharding.AxisType.Auto,) * 4
    )
    impls = implementations(mesh, emulate)
    names = [n for n in opts.impls.split(",") if n]
    unknown = [n for n in names if n not in impls]
    if unknown:
        raise SystemExit(f"profile_attention: unknown --impls {unknown}; choose from {list(impls)}")
    if emulate:
        names = [n for n in names if n != "cudnn"]
    info(f"jax {jax.__version__} on {jax.devices()[0]}")
    for seq in (int(s) for s in opts.seqs.split(",") if s):
        keys = jax.random.split(jax.random.key(0), 4)
        shape = (1, seq, opts.heads, opts.head_dim)
        q, k, v, ct = (jax.random.normal(key, shape, jnp.bfloat16) for key in keys)
        positions = jnp.asarray(np.arange(seq, dtype=np.int32)[None])
        for name in names:
            info(f"{name} seq={seq}")
            record = profile_case(name, fwd_bwd(impls[name]), (q, k, v, ct, positions), seq, opts)
            print(json.dumps(record), flush=True)


if __name__ == "__main__":
    from lwm.cli import run_reporting_errors

    raise SystemExit(run_reporting_errors("profile_attention", main, also=(ValueError,)))
