"""Benchmark causal attention: ours (ring, zigzag; or blockwise on one device) against LWM's
`ringattention` package and dense attention on 8 simulated CPU devices, against JAX's own TPU
kernels (splash attention, Pallas flash attention) on a TPU, and against cuDNN on a GPU; plus
single-device blockwise efficiency and long contexts.

Prints one JSON line per measurement on stdout; progress goes to stderr. Needs the bench extra
(``.venv/bin/pip install -e '.[dev,bench]'``) for the ``ringattention`` reference.

Commands (the ones behind ``docs/benchmarks.md``; raw output in ``docs/data/bench_attention.jsonl``)::

    # default sweep: ours / ringattention / dense, fwd and fwd_bwd, seq 4K..32K, after checking
    # ours and ringattention against dense (outputs and gradients) at seq 2048
    .venv/bin/python benchmarks/bench_attention.py --check
    # single-device blockwise forward vs a matmul of the same FLOPs
    .venv/bin/python benchmarks/bench_attention.py --efficiency-only --repeats 7
    # long context, ours only (fwd 64K and 128K, fwd_bwd 32K); cases can be run one at a time
    .venv/bin/python benchmarks/bench_attention.py --long --repeats 1
    .venv/bin/python benchmarks/bench_attention.py --long --long-cases fwd:131072 --repeats 1
    # one target case with more rounds
    .venv/bin/python benchmarks/bench_attention.py --seqs 16384 --modes fwd_bwd \
        --impls ours,ringattention --repeats 5

    # a quick smoke run while developing
    .venv/bin/python benchmarks/bench_attention.py --seqs 2048 --block 256 --repeats 1 --check

    # one TPU chip: ours (Pallas kernel) against splash and flash attention, each at its best
    # of the blocks given; 32 heads x 128, bfloat16
    python benchmarks/bench_attention.py --platform tpu --seqs 8192,32768 --block 512,1024 --check
    # GQA (32 query / 8 key-value heads), and packed rows of 1K-token documents
    python benchmarks/bench_attention.py --platform tpu --kv-heads 8 --seqs 32768
    python benchmarks/bench_attention.py --platform tpu --doc-len 1024 --seqs 32768

FLOP convention (``tflops`` field): a causal forward counts the two matmuls (QK^T and PV),
``4 * b * h * s^2 * d``, halved for the causal mask; a backward pass counts 2.5x the forward
(five matmuls: QK^T recomputed, dV, dP, dQ, dK), so ``fwd_bwd`` = 3.5x ``fwd``.

Timing: each (mode, seq) compiles every implementation first, then times them round-robin
(``--repeats`` rounds), so a change in the load of a shared machine hits all alike; ``time_s`` is
the median wall time, ``min_s`` the fastest call, ``cpu_s`` the median CPU time of this process
(all threads; less sensitive to other users of a shared machine), ``host_load_1m`` the load
average when the case finished.

Memory: ``temp_bytes_per_device`` and ``arg_bytes_per_device`` come from
``compiled.memory_analysis()``. For an SPMD program (``shard_map`` or automatic sharding) over
the 8 simulated CPU devices XLA compiles one per-device program, so these numbers are per
device (checked: a shard_map whose body makes a 4 MiB temporary on each of 8 devices reports
4 MiB). Before running, a case whose predicted total (8 x (temp + args + output)) exceeds the
memory available on the host is recorded as ``{"status": "oom"}`` instead of being run, since
the kernel's OOM killer would otherwise take the whole process.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import types
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from lwm.attention import (
    attention_flops,
    blockwise_attention,
    dense_attention,
    ring_attention,
)
from lwm.attention.layout import ring_block_size, zigzag_permutation
from lwm.base.mesh import MeshError
from lwm.cli import note_failure
from lwm.scripting import add_platform_argument, start_platform

# The case's shape; on a GPU (``--platform gpu``) main() sets the devices JAX sees, and the
# defaults become LWM-7B's attention (32 heads of 128) in bfloat16.
PLATFORM = "cpu"  # --platform, set by main()
DEVICES = 8
BATCH = 1
HEADS = 8
HEAD_DIM = 64
DTYPE = jnp.float32
BWD_FLOP_FACTOR = 3.5  # fwd (1) + bwd (2.5)
# ours: the XLA block kernel (or --kernel); ours-cudnn: cuDNN blocks in our ring/blockwise,
# given positions (each pair's kind decided at run time, as for packed rows); ours-cudnn-doc:
# the same without positions (one document in zigzag order: every kind known when tracing);
# cudnn: jax.nn.dot_product_attention(implementation="cudnn") on the whole sequence (one device)
# ours-blockwise: `blockwise_attention` (no ring); splash, flash: JAX's TPU kernels
# (jax.experimental.pallas.ops.tpu), called with their own [batch, heads, seq, head_dim] layout;
# splash-seq: splash called from [batch, seq, heads, head_dim] activations, transposed in the
# call as MaxText does (ours takes that layout); ours-hm: ours-blockwise given splash's
# [batch, heads, seq, head_dim], the layout its Pallas kernel blocks (no copies); ours-hdm:
# ours-hm with the head dimension minor for narrow heads too (the kernel before seq-minor
# heads); splash-sm: splash reading q, k, v with the sequence minor (QKVLayout.SEQ_MINOR)
IMPLS = (
    "ours", "ours-blockwise", "ours-hm", "ours-hdm", "ours-cudnn", "ours-cudnn-doc", "cudnn",
    "splash", "splash-seq", "splash-sm", "flash", "ringattention", "dense",
)  # fmt: skip
CPU_IMPLS = ("ours", "ringattention", "dense")  # the default impls per platform
GPU_IMPLS = ("ours", "ours-cudnn", "ours-cudnn-doc", "cudnn", "ringattention")
TPU_IMPLS = ("ours", "ours-blockwise", "ours-hm", "splash", "splash-seq", "flash")
HEAD_MAJOR = (
    "splash",
    "splash-sm",
    "flash",
    "ours-hm",
    "ours-hdm",
)  # impls given [batch, heads, seq, head_dim]
KV_HEADS = None  # --kv-heads (None: as many as the query heads)
DOC_LEN = None  # --doc-len: packed rows of documents this long (segment ids, positions restart)
KERNEL = "xla"
MODES = ("fwd", "fwd_bwd")
LONG_CASES = ("fwd:65536", "fwd:131072", "fwd_bwd:32768")
X_SPEC = P(("dp", "fsdp"), "sp", "tp", None)
POS_SPEC = P(("dp", "fsdp"), "sp")

AttnFn = Callable[..., jax.Array]


@dataclass(frozen=True)
class Case:
    impl: str
    mode: str
    seq: int
    block: int = 512  # --block: the block size asked for (`block_used` says what runs)


@dataclass
class Inputs:
    q: jax.Array
    k: jax.Array
    v: jax.Array
    cotangent: jax.Array
    positions: jax.Array  # the zigzag permutation, [batch, seq], sharded like the tokens
    segments: jax.Array | None = None  # with --doc-len: each token's document, [batch, seq]
    head_major: tuple | None = None  # q, k, v, cotangent as [batch, heads, seq, head_dim]


# --------------------------------------------------------------------------------------------
# Output


def emit(record: dict[str, Any]) -> None:
    print(json.dumps(record), flush=True)


def info(msg: str) -> None:
    print(f"[bench_attention] {msg}", file=sys.stderr, flush=True)


# --------------------------------------------------------------------------------------------
# Setup


def make_mesh() -> Mesh:
    return jax.make_mesh(
        (1, 1, DEVICES, 1),
        ("dp", "fsdp", "sp", "tp"),
        axis_types=(jax.sharding.AxisType.Auto,) * 4,
    )


def import_ringattention() -> Callable[..., jax.Array]:
    """Import LWM's ``ringattention`` (v0.1.2), which calls ``jax.lib.xla_bridge.get_backend``
    at import time; that module is gone on jax >= 0.8, so map it to ``jax.extend.backend``."""
    import jax.extend.backend

    bridge = getattr(jax.lib, "xla_bridge", None)
    if bridge is None:
        bridge = types.ModuleType("jax.lib.xla_bridge")
        jax.lib.xla_bridge = bridge
        sys.modules["jax.lib.xla_bridge"] = bridge
    if not hasattr(bridge, "get_backend"):
        bridge.get_backend = jax.extend.backend.get_backend
    try:
        from ringattention import ringattention
    except ImportError as e:
        raise SystemExit(
            f"bench_attention: cannot import ringattention ({e}); install the bench extra: "
            ".venv/bin/pip install -e '.[dev,bench]', or leave it out with --impls ours,dense"
        ) from e
    return ringattention


def make_inputs(mesh: Mesh, seq: int, seed: int = 0) -> Inputs:
    """Random q, k, v, cotangent, taken to be already in zigzag order; positions = the
    permutation. (The reference and dense read the same arrays as contiguous tokens.)"""
    keys = jax.random.split(jax.random.key(seed), 4)
    shape = (BATCH, seq, HEADS, HEAD_DIM)
    kv_shape = (BATCH, seq, KV_HEADS or HEADS, HEAD_DIM)
    x_sharding = NamedSharding(mesh, X_SPEC)
    q, k, v, ct = (
        jax.device_put(jax.random.normal(key, s, DTYPE), x_sharding)
        for key, s in zip(keys, (shape, kv_shape, kv_shape, shape), strict=True)
    )
    perm = zigzag_permutation(seq, DEVICES).astype(np.int32)
    segments = None
    if DOC_LEN:  # documents packed one after another: positions restart, segment ids count up
        segments = jax.device_put(
            np.broadcast_to(perm // DOC_LEN, (BATCH, seq)).copy(), NamedSharding(mesh, POS_SPEC)
        )
        perm = perm % DOC_LEN
    positions = jax.device_put(
        np.broadcast_to(perm, (BATCH, seq)).copy(), NamedSharding(mesh, POS_SPEC)
    )
    head_major = None
    if DEVICES == 1:  # JAX's TPU kernels' own layout, made once outside the timed calls
        head_major = tuple(jnp.swapaxes(x, 1, 2) for x in (q, k, v, ct))
    return Inputs(q, k, v, ct, positions, segments, head_major)


# --------------------------------------------------------------------------------------------
# The three implementations, as f(q, k, v, positions) -> out on global arrays


def one_device(impl: str, how: str) -> None:
    """Refuse an impl that runs on one device when the case has several (ValueError)."""
    if DEVICES != 1:
        raise ValueError(f"the {impl} impl runs on one device ({how})")


def ours_fn(
    mesh: Mesh, block: int, kernel: str | None = None, positions_given: bool = True
) -> AttnFn:
    """Our ring attention given the zigzag positions, or (``positions_given=False``) told the
    order instead (``layout="zigzag"``): the same attention, which the cuDNN kernel then
    schedules without run-time choices (`lwm.attention.cudnn`)."""

    def f(q, k, v, positions, segments=None):
        kw = dict(q_positions=positions, kv_positions=positions)
        if segments is not None:
            kw.update(q_segment_ids=segments, kv_segment_ids=segments)
        return ring_attention(
            q, k, v, mesh=mesh, causal=True, block_q=block, block_k=block,
            kernel=kernel or KERNEL, layout="zigzag", **(kw if positions_given else {}),
        )  # fmt: skip

    return f


def blockwise_fn(mesh: Mesh, block: int) -> AttnFn:
    """`blockwise_attention` on the whole sequence (one device: no ring, no shard_map)."""
    del mesh
    one_device("ours-blockwise", "--cpu-devices 1 on a cpu")

    def f(q, k, v, positions, segments=None):
        return blockwise_attention(
            q, k, v, causal=True, q_positions=positions, kv_positions=positions,
            q_segment_ids=segments, kv_segment_ids=segments, block_q=block, block_k=block,
            kernel=KERNEL,
        )  # fmt: skip

    return f


def swapped(attend: Callable) -> Callable:
    """``attend`` called from arrays with the sequence and head axes the other way round
    (``[batch, seq, heads, head_dim]`` <-> ``[batch, heads, seq, head_dim]``): q, k, v swapped
    in, the output swapped back."""

    def f(q, k, v, *rest):
        q, k, v = (jnp.swapaxes(x, 1, 2) for x in (q, k, v))
        return jnp.swapaxes(attend(q, k, v, *rest), 1, 2)

    return f


def blockwise_hm_fn(mesh: Mesh, block: int) -> AttnFn:
    """`blockwise_fn` given ``[batch, heads, seq, head_dim]`` arrays, as splash is: swapped to
    the API's ``[batch, seq, heads, head_dim]`` and back, which XLA folds into the Pallas
    kernel's own head-major blocking (no copies), as it does between a model's projections."""
    return swapped(blockwise_fn(mesh, block))


def splash_fn(mesh: Mesh, block: int, seq_minor: bool = False) -> AttnFn:
    """JAX's splash attention (`jax.experimental.pallas.ops.tpu.splash_attention`) as MaxText
    calls it: a static causal mask, the documents of a packed row as segment ids, queries
    scaled outside the kernel, the same block size for every one of its tiles, vmapped over
    the batch. Inputs ``[batch, heads, seq, head_dim]``; key/value heads may be fewer (GQA).
    ``seq_minor``: its kernels read q, k, v with the sequence minor (``QKVLayout.SEQ_MINOR``,
    what a TPU lays ``[.., seq, 64]`` arrays as)."""
    del mesh
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as sk
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as sm

    one_device("splash", "--platform tpu on one chip")

    def f(q, k, v, positions, segments=None):
        del positions  # contiguous order (one device: the zigzag permutation is the identity)
        seq = q.shape[2]
        b = min(block, seq)
        sizes = sk.BlockSizes(
            block_q=b, block_kv=b, block_kv_compute=b, block_q_dkv=b, block_kv_dkv=b,
            block_kv_dkv_compute=b, block_q_dq=b, block_kv_dq=b,
            **(dict.fromkeys(("q_layout", "k_layout", "v_layout"), sk.QKVLayout.SEQ_MINOR)
               if seq_minor else {}),
        )  # fmt: skip
        mask = sm.MultiHeadMask([sm.CausalMask((seq, seq))] * q.shape[1])
        kernel = sk.make_splash_mha(mask, head_shards=1, q_seq_shards=1, block_sizes=sizes)
        q = q * jnp.asarray(q.shape[-1] ** -0.5, q.dtype)
        if segments is None:
            return jax.vmap(kernel)(q, k, v)
        ids = sk.SegmentIds(q=segments, kv=segments)
        return jax.vmap(kernel)(q, k, v, segment_ids=ids)

    return f


def blockwise_hdm_fn(mesh: Mesh, block: int) -> AttnFn:
    """`blockwise_hm_fn` with the head dimension minor whatever the heads' width (before
    `lwm.attention.blockwise.SEQ_MINOR_BELOW`: heads narrower than 128 lanes copied in)."""
    import lwm.attention.blockwise as blockwise_module

    attend = blockwise_hm_fn(mesh, block)

    def f(*args):
        below, blockwise_module.SEQ_MINOR_BELOW = blockwise_module.SEQ_MINOR_BELOW, 0
        try:  # read when the call is traced
            return attend(*args)
        finally:
            blockwise_module.SEQ_MINOR_BELOW = below

    return f


def splash_seq_fn(mesh: Mesh, block: int) -> AttnFn:
    """`splash_fn` called from ``[batch, seq, heads, head_dim]`` arrays, as a model whose
    activations are laid out so (ours, MaxText's) calls it: transposed in, and out."""
    return swapped(splash_fn(mesh, block))


def flash_fn(mesh: Mesh, block: int) -> AttnFn:
    """JAX's Pallas TPU flash attention (`jax.experimental.pallas.ops.tpu.flash_attention`),
    causal by index, one block size for every tile; ``[batch, heads, seq, head_dim]``. It has
    no GQA: key/value heads are repeated to the query heads inside the call."""
    del mesh
    from jax.experimental.pallas.ops.tpu import flash_attention as fa

    one_device("flash", "--platform tpu on one chip")

    def f(q, k, v, positions, segments=None):
        del positions
        seq = q.shape[2]
        b = min(block, seq)
        sizes = fa.BlockSizes(
            block_q=b, block_k_major=b, block_k=b, block_b=1, block_q_major_dkv=b,
            block_k_major_dkv=b, block_k_dkv=b, block_q_dkv=b, block_k_major_dq=b, block_k_dq=b,
            block_q_dq=b,
        )  # fmt: skip
        if k.shape[1] != q.shape[1]:
            k, v = (jnp.repeat(x, q.shape[1] // x.shape[1], axis=1) for x in (k, v))
        ids = None if segments is None else fa.SegmentIds(q=segments, kv=segments)
        return fa.flash_attention(
            q, k, v, segment_ids=ids, causal=True, sm_scale=q.shape[-1] ** -0.5,
            block_sizes=sizes,
        )  # fmt: skip

    return f


def cudnn_fn(mesh: Mesh, block: int) -> AttnFn:
    """cuDNN's fused attention on the whole (unsharded) sequence: the speed our ring's cuDNN
    blocks are measured against."""
    del block
    one_device("cudnn", "--platform gpu with one GPU")

    def f(q, k, v, positions, segments=None):
        del positions  # contiguous order (one device: the zigzag permutation is the identity)
        if segments is not None:
            raise ValueError("the cudnn impl runs one document per row (no --doc-len)")
        return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn")

    return f


def reference_fn(mesh: Mesh, block: int) -> AttnFn:
    """LWM's ring attention as LWM calls it, minus the bias and segment ids (None: no padding
    and one segment, so it does the same work as ours). Contiguous layout (it derives
    positions from the device index), ``causal_block_size=1`` = token-level causal mask.
    Its chunk sizes must divide the shard length (it does not clamp or pad)."""
    ringattention = import_ringattention()
    local = partial(
        ringattention,
        axis_name="sp",
        float32_logits=True,
        cache_idx=None,
        blockwise_kwargs=dict(
            causal_block_size=1,
            deterministic=True,
            dropout_rng=None,
            attn_pdrop=0.0,
            query_chunk_size=block,
            key_chunk_size=block,
            policy=jax.checkpoint_policies.nothing_saveable,
            dtype=jnp.float32,
            precision=None,
            prevent_cse=True,  # no effect here: its jax.checkpoint sits inside a custom_vjp
        ),
    )

    def body(q, k, v):
        return local(q, k, v, None, None)

    # ringattention's scans start from unmarked jnp.zeros carries: it needs check_vma=False.
    sharded = jax.shard_map(
        body, mesh=mesh, in_specs=(X_SPEC,) * 3, out_specs=X_SPEC, check_vma=False
    )

    def f(q, k, v, positions, segments=None):
        del positions
        if segments is not None:
            raise ValueError("the ringattention impl runs one document per row (no --doc-len)")
        return sharded(q, k, v)

    return f


def dense_fn(mesh: Mesh, block: int) -> AttnFn:
    del mesh, block

    def f(q, k, v, positions, segments=None):
        if segments is None:  # contiguous order
            return dense_attention(q, k, v, causal=True)
        return dense_attention(
            q, k, v, causal=True, q_positions=positions, kv_positions=positions,
            q_segment_ids=segments, kv_segment_ids=segments,
        )  # fmt: skip

    return f


IMPL_FNS: dict[str, Callable[[Mesh, int], AttnFn]] = {
    "ours": ours_fn,
    "ours-cudnn": partial(ours_fn, kernel="cudnn"),
    "ours-cudnn-doc": partial(ours_fn, kernel="cudnn", positions_given=False),
    "ours-blockwise": blockwise_fn,
    "ours-hm": blockwise_hm_fn,
    "ours-hdm": blockwise_hdm_fn,
    "cudnn": cudnn_fn,
    "splash": splash_fn,
    "splash-seq": splash_seq_fn,
    "splash-sm": partial(splash_fn, seq_minor=True),
    "flash": flash_fn,
    "ringattention": reference_fn,
    "dense": dense_fn,
}


def jitted_step(
    attn: AttnFn, mode: str, mesh: Mesh, head_major: bool = False
) -> tuple[Any, Callable[[Inputs], tuple]]:
    """Jit ``attn`` for one mode; return it and how to pick its arguments from `Inputs`
    (``head_major``: the ``[batch, heads, seq, head_dim]`` copies, on one device)."""
    x_sh = NamedSharding(mesh, X_SPEC if not head_major else P(("dp", "fsdp"), "tp", "sp", None))
    pos_sh = NamedSharding(mesh, POS_SPEC)

    def tensors(a: Inputs) -> tuple:
        return a.head_major if head_major else (a.q, a.k, a.v, a.cotangent)

    if mode == "fwd":
        fn = jax.jit(attn, in_shardings=(x_sh, x_sh, x_sh, pos_sh, pos_sh), out_shardings=x_sh)
        return fn, lambda a: (*tensors(a)[:3], a.positions, a.segments)

    def loss_grad(q, k, v, ct, positions, segments):
        def loss(q, k, v):
            return jnp.sum(attn(q, k, v, positions, segments) * ct)

        return jax.grad(loss, argnums=(0, 1, 2))(q, k, v)

    fn = jax.jit(loss_grad, in_shardings=(x_sh,) * 4 + (pos_sh,) * 2, out_shardings=(x_sh,) * 3)
    return fn, lambda a: (*tensors(a), a.positions, a.segments)


# --------------------------------------------------------------------------------------------
# Measuring


def available_bytes() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 1 << 62


def is_oom(err: BaseException) -> bool:
    text = f"{type(err).__name__} {err}".lower()
    return any(
        w in text
        for w in (
            "resource_exhausted",
            "out of memory",
            "oom",
            "memoryerror",
            "failed to allocate",
            "bad_alloc",
        )
    )


def timed_call(compiled: Any, args: Sequence[Any]) -> tuple[float, float]:
    """Wall and process CPU seconds of one call. On a shared machine the CPU time (all threads
    of this process) is less sensitive to other users' load than the wall time."""
    t0, c0 = time.perf_counter(), time.process_time()
    jax.block_until_ready(compiled(*args))
    return time.perf_counter() - t0, time.process_time() - c0


def time_calls(compiled: Any, args: Sequence[Any], repeats: int) -> list[float]:
    return [timed_call(compiled, args)[0] for _ in range(repeats)]


@dataclass
class Prepared:
    """One compiled case waiting to be timed; ``compiled`` is None once it has failed."""

    case: Case
    record: dict[str, Any]
    compiled: Any
    args: tuple
    times: list[float]
    cpu_times: list[float] = field(default_factory=list)


def block_used(impl: str, seq: int, block: int) -> int | None:
    """The block size ``impl`` computes with at ``seq`` for a given ``--block``: our ring
    tiles each shard's zigzag halves (`ring_block_size`), one device clamps it to the
    sequence, the reference package takes it as given, cuDNN and dense have none."""
    if impl.startswith("ours"):
        return ring_block_size(seq // DEVICES, block) if DEVICES > 1 else min(block, seq)
    if impl in (*HEAD_MAJOR, "splash-seq"):
        return min(block, seq)
    return block if impl == "ringattention" else None


def base_record(case: Case, block: int) -> dict[str, Any]:
    return {
        "bench": "attention",
        "impl": case.impl,
        "mode": case.mode,
        "seq": case.seq,
        "heads": HEADS,
        "kv_heads": KV_HEADS or HEADS,
        "head_dim": HEAD_DIM,
        "doc_len": DOC_LEN,
        "dtype": jnp.dtype(DTYPE).name,
        "devices": DEVICES,
        "platform": PLATFORM,
        "kernel": {
            "ours": KERNEL,
            "ours-blockwise": KERNEL,
            "ours-hm": KERNEL,
            "ours-hdm": KERNEL,
            "ours-cudnn": "cudnn",
            "ours-cudnn-doc": "cudnn",
        }.get(case.impl),  # fmt: skip
        "block": block_used(case.impl, case.seq, block),
    }


def memory_fields(compiled: Any) -> dict[str, int]:
    """Per-device sizes: XLA compiles one program per device for an SPMD computation."""
    mem = compiled.memory_analysis()
    return {
        "temp_bytes_per_device": int(mem.temp_size_in_bytes),
        "arg_bytes_per_device": int(mem.argument_size_in_bytes),
        "out_bytes_per_device": int(mem.output_size_in_bytes),
    }


def memory_guard(fields: dict[str, int], devices: int) -> str | None:
    """Why a case must not run (it would exceed host memory), or None."""
    need = devices * sum(fields.values())
    avail = available_bytes()
    if need > 0.85 * avail:
        return (
            f"predicted {need / 2**30:.1f} GiB > 85% of {avail / 2**30:.1f} GiB available; not run"
        )
    return None


def failure(err: BaseException) -> dict[str, str]:
    """A failed case's status and first line (the traceback on stderr with LWM_TRACEBACK=1)."""
    note_failure(err)
    return {"status": "oom" if is_oom(err) else "error", "error": str(err).splitlines()[0][:300]}


def prepare_case(case: Case, mesh: Mesh, inputs: Inputs) -> Prepared:
    """Jit, compile (timed) and check memory; nothing is run yet."""
    info(f"compile {case.impl} {case.mode} seq={case.seq} block={case.block}")
    record = base_record(case, case.block)
    try:
        attn = IMPL_FNS[case.impl](mesh, case.block)
        fn, pick = jitted_step(attn, case.mode, mesh, case.impl in HEAD_MAJOR)
        args = pick(inputs)
        t0 = time.perf_counter()
        compiled = fn.lower(*args).compile()
        record["compile_s"] = round(time.perf_counter() - t0, 3)
        record.update(memory_fields(compiled))
    except Exception as e:  # a failed case (compile error, OOM) is a result, not a crash
        record.update(failure(e))
        return Prepared(case, record, None, (), [])
    reason = memory_guard(memory_fields(compiled), DEVICES) if PLATFORM == "cpu" else None
    if reason:
        record.update(status="oom", reason=reason)
        compiled = None
    return Prepared(case, record, compiled, args, [])


def time_interleaved(cases: Sequence[Prepared], repeats: int) -> None:
    """Time ``repeats`` calls of each case, round-robin, so that a change in the load of the
    shared machine hits every implementation alike; each is called once first, untimed (the
    first call after compiling also allocates)."""
    for round_ in range(1 + repeats):  # round 0: the untimed call
        for p in cases:
            if p.compiled is None:
                continue
            try:
                wall, cpu = timed_call(p.compiled, p.args)
                if round_:
                    p.times.append(wall)
                    p.cpu_times.append(cpu)
            except Exception as e:  # e.g. an allocation failure while running
                p.record.update(failure(e))
                p.compiled = None


def finish(p: Prepared) -> dict[str, Any]:
    """The JSON record of a timed case: median time, FLOP rate."""
    record = p.record
    if p.compiled is not None and p.times:
        t = statistics.median(p.times)
        flops = attention_flops(BATCH, p.case.seq, p.case.seq, HEADS, HEAD_DIM, causal=True)
        flops *= BWD_FLOP_FACTOR if p.case.mode == "fwd_bwd" else 1.0
        record.update(
            time_s=round(t, 4),
            min_s=round(min(p.times), 4),
            cpu_s=round(statistics.median(p.cpu_times), 4),
            times_s=[round(x, 4) for x in p.times],
            tflops=round(flops / t / 1e12, 5),
            status="ok",
            host_load_1m=round(os.getloadavg()[0], 2),  # the machine is shared: context for times
        )
    info(
        f"{p.case.impl} {p.case.mode} seq={p.case.seq} block={record.get('block')}: "
        f"{record.get('status')} "
        f"time={record.get('time_s')} temp/dev={record.get('temp_bytes_per_device')}"
    )
    return record


def run_cases(
    cases: Sequence[Case], mesh: Mesh, inputs: Inputs, args: argparse.Namespace
) -> dict[str, dict[str, Any]]:
    """Time every case (round-robin); emit each record; return each impl's fastest record
    over the blocks it ran with (its best block size)."""
    prepared = [prepare_case(c, mesh, inputs) for c in cases]
    time_interleaved(prepared, args.repeats)
    best: dict[str, dict[str, Any]] = {}
    for p in prepared:
        record = finish(p)
        emit(record)
        old = best.get(p.case.impl)
        if (
            old is None
            or old.get("status") != "ok"
            or (record.get("status") == "ok" and record["time_s"] < old["time_s"])
        ):
            best[p.case.impl] = record
        p.compiled = None  # frees the executable before the next mode's compiles
    return best


RATIOS = (
    ("ours", "splash"),
    ("ours-blockwise", "splash"),
    ("ours-hm", "splash"),
    ("ours-hm", "splash-sm"),
    ("ours-hdm", "splash"),
    ("ours", "splash-seq"),
    ("ours-blockwise", "splash-seq"),
    ("ours", "flash"),
    ("ours", "ringattention"),
    ("ours-cudnn", "cudnn"),
    ("ours-cudnn-doc", "cudnn"),
    ("ours-cudnn", "ringattention"),
)


def ratio_records(mode: str, seq: int, results: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """Speed (reference time / ours) and temp memory (ours / reference) of each pair run."""
    out = []
    for mine, theirs in RATIOS:
        ours, ref = results.get(mine), results.get(theirs)
        if not ours or not ref or ours.get("status") != "ok" or ref.get("status") != "ok":
            continue
        out.append(
            {
                "bench": "attention_ratio",
                "mode": mode,
                "seq": seq,
                "ours": mine,
                "reference": theirs,
                "ours_block": ours.get("block"),
                "reference_block": ref.get("block"),
                "speedup": round(ref["time_s"] / ours["time_s"], 3),
                "temp_bytes_ratio": round(
                    ours["temp_bytes_per_device"] / max(ref["temp_bytes_per_device"], 1), 3
                ),
            }
        )
    return out


# --------------------------------------------------------------------------------------------
# Parts of the benchmark


def check_against_dense(mesh: Mesh, block: int, seq: int, impls: Sequence[str]) -> None:
    """Each implementation must match dense attention, output and gradients, each in its own
    token order (ours: zigzag positions; the others: contiguous). The error is relative to the
    largest reference value; bfloat16 inputs are held to 2e-2, float32 to 1e-4."""
    if seq % (DEVICES * block):
        raise SystemExit(
            f"bench_attention: --check-seq {seq} must be a multiple of {DEVICES} x block"
        )
    a = make_inputs(mesh, seq, seed=1)

    def dense_zigzag(q, k, v, positions, segments=None):
        return dense_attention(
            q, k, v, causal=True, q_positions=positions, kv_positions=positions,
            q_segment_ids=segments, kv_segment_ids=segments,
        )  # fmt: skip

    tol = 1e-4 if jnp.dtype(DTYPE) == jnp.float32 else 2e-2  # DTYPE is numpy's type, not jnp's
    for impl in (i for i in impls if i != "dense"):
        dense = dense_zigzag if impl.startswith("ours") or DOC_LEN else dense_fn(mesh, block)
        head_major = impl in HEAD_MAJOR
        for mode in MODES:
            fn, pick = jitted_step(IMPL_FNS[impl](mesh, block), mode, mesh, head_major)
            want_fn, want_pick = jitted_step(dense, mode, mesh)
            got = jax.tree.leaves(fn(*pick(a)))
            if head_major:  # back to [batch, seq, heads, head_dim], as dense gives
                got = [jnp.swapaxes(x, 1, 2) for x in got]
            want = [x.astype(jnp.float32) for x in jax.tree.leaves(want_fn(*want_pick(a)))]
            err = max(
                float(jnp.max(jnp.abs(g.astype(jnp.float32) - w)) / jnp.max(jnp.abs(w)))
                for g, w in zip(got, want, strict=True)
            )
            emit(
                {
                    "bench": "attention_check",
                    "impl": impl,
                    "mode": mode,
                    "seq": seq,
                    "block": block_used(impl, seq, block),
                    "heads": HEADS,
                    "kv_heads": KV_HEADS or HEADS,
                    "head_dim": HEAD_DIM,
                    "doc_len": DOC_LEN,
                    "dtype": jnp.dtype(DTYPE).name,
                    "platform": PLATFORM,
                    "max_rel_err_vs_dense": err,
                    "status": "ok" if err < tol else "mismatch",
                }
            )


def blocks_of(impl: str, blocks: Sequence[int]) -> list[int]:
    """The --block values an impl runs with: each (dense and cuDNN have no blocks: the first)."""
    return [blocks[0]] if impl in ("dense", "cudnn") else list(blocks)


def run_sweep(args: argparse.Namespace, mesh: Mesh) -> None:
    for seq in args.seqs:
        inputs = make_inputs(mesh, seq)
        for mode in args.modes:
            impls = [i for i in args.impls if i != "dense" or seq <= args.dense_max_seq]
            if len(impls) < len(args.impls):
                info(f"dense {mode} seq={seq}: skipped (> --dense-max-seq {args.dense_max_seq})")
            cases = [Case(i, mode, seq, b) for i in impls for b in blocks_of(i, args.block)]
            results = run_cases(cases, mesh, inputs, args)
            for ratio in ratio_records(mode, seq, results):
                emit(ratio)
        del inputs


def run_long(args: argparse.Namespace, mesh: Mesh) -> None:
    for spec in args.long_cases:
        mode, seq = parse_long_case(spec)
        inputs = make_inputs(mesh, seq)
        prepared = prepare_case(Case("ours", mode, seq, args.block[0]), mesh, inputs)
        time_interleaved([prepared], args.repeats)
        emit(finish(prepared) | {"long": True})
        del inputs, prepared


def round_robin_medians(calls: dict[str, tuple[Any, tuple]], repeats: int) -> dict[str, float]:
    """Compile each ``name -> (jitted, args)``, warm it up, then time the calls round-robin;
    median seconds per name."""
    compiled = {name: (fn.lower(*a).compile(), a) for name, (fn, a) in calls.items()}
    for c, a in compiled.values():
        jax.block_until_ready(c(*a))  # warm-up, not timed
    times: dict[str, list[float]] = {name: [] for name in compiled}
    for _ in range(repeats):
        for name, (c, a) in compiled.items():
            times[name] += time_calls(c, a, 1)
    return {name: statistics.median(t) for name, t in times.items()}


def run_efficiency(args: argparse.Namespace) -> None:
    """Single-device blockwise forward vs a matmul of the same FLOPs as non-causal attention
    (at seq 4096: 4*h*s^2*d = 2 * 2048 * 4096 * 2048). Causal counts only the live half."""
    dev = jax.devices()[0]
    seq = args.efficiency_seq
    keys = jax.random.split(jax.random.key(2), 3)
    shape = (1, seq, HEADS, HEAD_DIM)
    q, k, v = (jax.device_put(jax.random.normal(key, shape, jnp.float32), dev) for key in keys)
    full_flops = attention_flops(1, seq, seq, HEADS, HEAD_DIM, causal=False)
    m = round((full_flops / 4) ** (1 / 3))  # [m, 2m] @ [2m, m]: 4 m^3 FLOPs
    a = jax.device_put(jax.random.normal(keys[0], (m, 2 * m), jnp.float32), dev)
    b = jax.device_put(jax.random.normal(keys[1], (2 * m, m), jnp.float32), dev)
    info(f"efficiency: matmul [{m},{2 * m}]@[{2 * m},{m}] vs blockwise seq={seq} on {dev}")
    calls = {"matmul": (jax.jit(jnp.matmul), (a, b))}
    for causal in (False, True):
        block = args.block[0]
        fn = partial(blockwise_attention, causal=causal, block_q=block, block_k=block)
        calls[f"causal={causal}"] = (jax.jit(fn), (q, k, v))
    medians = round_robin_medians(calls, args.repeats)
    mm_tflops = 4.0 * m**3 / medians["matmul"] / 1e12
    for causal in (False, True):
        t = medians[f"causal={causal}"]
        bw_tflops = attention_flops(1, seq, seq, HEADS, HEAD_DIM, causal=causal) / t / 1e12
        emit(
            {
                "bench": "blockwise_efficiency",
                "causal": causal,
                "seq": seq,
                "heads": HEADS,
                "head_dim": HEAD_DIM,
                "block": min(block, seq),
                "time_s": round(t, 4),
                "blockwise_tflops": round(bw_tflops, 5),
                "matmul_time_s": round(medians["matmul"], 4),
                "matmul_tflops": round(mm_tflops, 5),
                "matmul_shape": [m, 2 * m, m],
                "fraction": round(bw_tflops / mm_tflops, 4),
            }
        )


# --------------------------------------------------------------------------------------------
# Command line


def parse_long_case(spec: str) -> tuple[str, int]:
    mode, _, seq = spec.partition(":")
    if mode not in MODES or not seq.isdigit():
        raise SystemExit(
            f"bench_attention: bad --long-cases entry '{spec}'; want MODE:SEQ "
            f"with MODE in {MODES}, e.g. fwd:65536"
        )
    return mode, int(seq)


def csv_ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def csv_choices(choices: Sequence[str]) -> Callable[[str], list[str]]:
    def parse(text: str) -> list[str]:
        items = [x for x in text.split(",") if x]
        bad = [x for x in items if x not in choices]
        if bad:
            raise argparse.ArgumentTypeError(f"unknown {bad}; choose from {list(choices)}")
        return items

    return parse


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--seqs",
        type=csv_ints,
        default=[4096, 8192, 16384, 32768],
        help="comma-separated sequence lengths, each a multiple of 2 x devices (16 on cpu; "
        "default 4096,8192,16384,32768)",
    )
    p.add_argument(
        "--modes",
        type=csv_choices(MODES),
        default=list(MODES),
        help=f"comma-separated, of {','.join(MODES)} (default both)",
    )
    p.add_argument(
        "--impls",
        type=csv_choices(IMPLS),
        help=f"comma-separated, of {','.join(IMPLS)} (default {','.join(CPU_IMPLS)} on cpu, "
        f"{','.join(GPU_IMPLS)} on gpu)",
    )
    p.add_argument(
        "--block",
        type=csv_ints,
        default=[512],
        help="block_q = block_k, at least 1 (default 512); comma-separated to run each impl "
        "with each and compare each impl's fastest (e.g. 512,1024); the ringattention impl "
        "needs it to divide seq / devices",
    )
    p.add_argument(
        "--repeats", type=int, default=3, help="timed calls per case, at least 1 (median)"
    )
    p.add_argument(
        "--dense-max-seq",
        type=int,
        default=16384,
        help="skip dense above this length (default 16384)",
    )
    p.add_argument(
        "--check",
        action="store_true",
        help="first check ours and ringattention against dense at --check-seq",
    )
    p.add_argument("--check-only", action="store_true", help="run --check and stop (nothing timed)")
    p.add_argument(
        "--check-seq",
        type=int,
        default=2048,
        help="sequence length of --check, a multiple of devices x --check-block (default 2048)",
    )
    p.add_argument(
        "--check-block",
        type=int,
        default=128,
        help="block for --check (default 128 = the zigzag chunk at seq 2048)",
    )
    p.add_argument(
        "--long",
        action="store_true",
        help="run only the long-context cases of ours (see --long-cases)",
    )
    p.add_argument(
        "--long-cases",
        nargs="+",
        default=list(LONG_CASES),
        help=f"MODE:SEQ cases for --long (default {' '.join(LONG_CASES)})",
    )
    p.add_argument(
        "--efficiency-only",
        action="store_true",
        help="run only the single-device blockwise vs matmul comparison",
    )
    p.add_argument(
        "--efficiency", action="store_true", help="also run the efficiency part after the sweep"
    )
    p.add_argument(
        "--efficiency-seq",
        type=int,
        default=4096,
        help="sequence length of the efficiency part (default 4096)",
    )
    add_platform_argument(p, cpu_devices=8)  # --cpu-devices 1 runs what one GPU runs
    p.add_argument("--heads", type=int, help="query heads (default 8 on cpu, 32 on an accelerator)")
    p.add_argument(
        "--kv-heads",
        type=int,
        help="key/value heads, dividing --heads (GQA; default: as many as --heads)",
    )
    p.add_argument(
        "--head-dim", type=int, help="head dimension (default 64 on cpu, 128 on an accelerator)"
    )
    p.add_argument(
        "--doc-len",
        type=int,
        help="packed rows: documents of this many tokens one after another (segment ids, "
        "positions restarting); default one document per row",
    )
    p.add_argument(
        "--dtype",
        choices=("float32", "bfloat16"),
        help="default float32 on cpu, bfloat16 on an accelerator",
    )
    p.add_argument(
        "--kernel",
        choices=("xla", "pallas", "cudnn", "auto"),
        help="block kernel of the 'ours' impls (default pallas on a tpu, else xla)",
    )
    p.add_argument(
        "--cudnn-piece",
        type=int,
        help="longest piece of a shard per cuDNN call (lwm.attention.cudnn.pairs.PIECE, default 4096)",
    )
    return p.parse_args(argv)


def check_args(args: argparse.Namespace, devices: int | None) -> None:
    """Refuse, before any output, the options no case can run with (ValueError: one line);
    with ``devices`` None (not known before JAX starts on an accelerator), those that do not
    depend on the number of devices."""
    for flag, value in (
        ("--heads", args.heads),
        ("--kv-heads", args.kv_heads),
        ("--head-dim", args.head_dim),
        ("--doc-len", args.doc_len),
        *(("--block", b) for b in args.block or [0]),
        ("--repeats", args.repeats),
    ):
        if value is not None and value < 1:
            raise ValueError(f"{flag} must be at least 1, not {value}")
    heads = args.heads or HEADS
    if args.kv_heads and heads % args.kv_heads:
        raise ValueError(f"--kv-heads {args.kv_heads} does not divide the {heads} query heads")
    if args.efficiency_only or devices is None:
        return
    # the zigzag layout gives each device two equal chunks: a multiple of 2 x devices
    seqs = [parse_long_case(c)[1] for c in args.long_cases] if args.long else args.seqs
    flag = "--long-cases" if args.long else "--seqs"
    for seq in seqs:
        if seq < 1 or seq % (2 * devices):
            raise ValueError(
                f"{flag}: sequence length {seq} is not a positive multiple of 2 x {devices} "
                f"devices = {2 * devices}"
            )
    if "ringattention" in args.impls and not args.long:
        # LWM's ringattention reshapes each shard into --block chunks: no clamping or padding
        for seq, block in ((s, b) for s in args.seqs for b in args.block):
            if (seq // devices) % block:
                raise ValueError(
                    f"--block {block} does not divide the {seq // devices} tokens per "
                    f"device of seq {seq} (over {devices} devices), which the ringattention "
                    "impl needs"
                )


def main(argv: Sequence[str] | None = None) -> None:
    global PLATFORM, DEVICES, HEADS, KV_HEADS, HEAD_DIM, DOC_LEN, DTYPE, KERNEL
    args = parse_args(argv)
    # what can be checked before JAX starts (bad input costs no start-up); again with the
    # devices JAX finds
    check_args(args, args.cpu_devices if args.platform == "cpu" else None)
    try:  # before JAX has devices
        PLATFORM = start_platform(args)
    except MeshError as e:
        raise SystemExit(f"bench_attention: error: {e}") from None
    if args.impls is None:
        args.impls = list({"gpu": GPU_IMPLS, "tpu": TPU_IMPLS}.get(PLATFORM, CPU_IMPLS))
    if PLATFORM != "gpu" and "cudnn" in args.impls:
        # ours-cudnn and ours-cudnn-doc run there with cuDNN's dense stand-in (lwm.attention.cudnn)
        raise SystemExit("bench_attention: the cudnn impl needs --platform gpu")
    if PLATFORM != "tpu" and {"splash", "splash-seq", "flash"} & set(args.impls):
        raise SystemExit("bench_attention: the splash and flash impls need --platform tpu")
    accelerator = PLATFORM != "cpu"
    DEVICES = jax.device_count() if accelerator else args.cpu_devices
    check_args(args, DEVICES)
    HEADS = args.heads if args.heads is not None else (32 if accelerator else HEADS)
    KV_HEADS = args.kv_heads
    HEAD_DIM = args.head_dim if args.head_dim is not None else (128 if accelerator else HEAD_DIM)
    DOC_LEN = args.doc_len
    DTYPE = jnp.dtype(args.dtype or ("bfloat16" if accelerator else "float32")).type
    KERNEL = args.kernel or ("pallas" if PLATFORM == "tpu" else "xla")
    if args.cudnn_piece:
        import lwm.attention.cudnn.pairs

        lwm.attention.cudnn.pairs.PIECE = args.cudnn_piece
    info(
        f"jax {jax.__version__}, {len(jax.devices())} {jax.devices()[0].platform} devices, "
        f"{os.cpu_count()} host cores"
    )
    if args.efficiency_only:
        run_efficiency(args)
        return
    mesh = make_mesh()
    if args.check:
        check_against_dense(mesh, args.check_block, args.check_seq, args.impls)
        if args.check_only:
            return
    if args.long:
        run_long(args, mesh)
        return
    run_sweep(args, mesh)
    if args.efficiency:
        run_efficiency(args)


if __name__ == "__main__":
    from lwm.cli import run_reporting_errors

    raise SystemExit(run_reporting_errors("bench_attention", main, also=(ValueError,)))
