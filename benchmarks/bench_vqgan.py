"""Frames/s of VQGAN encode and decode through `VideoTokenizer` (batch sweep, float32 and
bfloat16 compute), and the time spent outside the jitted call (host-side checks, padding,
transfers to and from the device, reshapes).

    python benchmarks/bench_vqgan.py                                   # LWM's preset at 256x256
    python benchmarks/bench_vqgan.py --config configs/vqgan/small.yaml --batches 8,32,128
    python benchmarks/bench_vqgan.py --compare-lwm                     # ours vs LWM's architecture

``--compare-lwm``: ours (`vqgan.model.VQGAN`, NNX) and LWM's architecture as LWM's code writes
it (`benchmarks/lwm_vqgan_reference.py`, linen), with the same weights (ours exported in LWM's
parameter names), each jitted on the same frames already on the device (float frames in
[-1, 1] -> codes; codes -> clipped frames), timed round-robin (``--repeats`` rounds, median),
float32 and bfloat16 (the reference in bfloat16: its parameters and frames cast, as its code
has no compute-dtype setting). One line per (op, dtype, impl) and one with ours / LWM's
frames/s.

One JSON line per measurement:
  {"bench": "vqgan", "op": "encode", "dtype": "float32", "batch": 2, "device_s": ...,
   "total_s": ..., "outside_s": ..., "frames_per_s": ..., "device_frames_per_s": ...}
``device_s``: the jitted program alone on arrays already on the device (best of --repeats);
``total_s``: `tok.encode(uint8 numpy frames)` / `tok.decode(numpy codes)` end to end (best of
--repeats); ``outside_s = total_s - device_s``. Parameters are random (speed does not depend
on their values). Compilation happens in an untimed warm-up call.
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from collections.abc import Callable

import jax
import numpy as np

from lwm.base.mesh import make_mesh
from lwm.scripting import add_platform_argument, check_choices, start_platform
from vqgan.config import load_vqgan_config
from vqgan.model import init_model
from vqgan.tokenizer import VideoTokenizer


def _best(fn: Callable[[], object], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--config", default="configs/vqgan/lwm.yaml", help="the VQGAN's config (its model)"
    )
    parser.add_argument("--batches", default="1,2,4", help="frames per call, comma-separated")
    parser.add_argument(
        "--dtypes", default="float32,bfloat16", help="compute dtypes: float32, bfloat16"
    )
    parser.add_argument("--ops", default="encode,decode", help="encode, decode or both")
    parser.add_argument("--repeats", type=int, default=2, help="timed calls (best, or median)")
    parser.add_argument("--mesh", default="1,-1,1,1", help="dp,fsdp,sp,tp for the tokenizer")
    parser.add_argument(
        "--compare-lwm",
        action="store_true",
        help="ours vs LWM's architecture, side by side (a config with LWM's 32 GroupNorm "
        "groups, e.g. the default)",
    )
    add_platform_argument(parser)
    args = parser.parse_args()
    check_choices(
        ("--ops", args.ops, ("encode", "decode")),
        ("--dtypes", args.dtypes, ("float32", "bfloat16")),
    )
    if min(int(b) for b in args.batches.split(",")) < 1 or args.repeats < 1:
        raise ValueError("--batches and --repeats must be at least 1")
    args.platform = start_platform(args)
    if args.compare_lwm:
        compare_lwm(args)
        return

    base = load_vqgan_config(args.config).model
    mesh = make_mesh(args.mesh)
    res = base.resolution
    rng = np.random.default_rng(0)
    print(
        json.dumps(
            {
                "config": args.config,
                "resolution": res,
                "tokens_per_frame": base.tokens_per_frame,
                "platform": args.platform,
                "devices": f"{len(jax.devices())} x {jax.devices()[0].device_kind}",
                "mesh": dict(mesh.shape),
                "machine": platform.processor() or platform.machine(),
            }
        ),
        flush=True,
    )
    for dtype in args.dtypes.split(","):
        cfg = base.model_copy(update={"dtype": dtype})
        model = init_model(cfg)
        for batch in (int(b) for b in args.batches.split(",")):
            tok = VideoTokenizer(model, mesh=mesh, batch_size=batch)
            n = tok.batch_size
            frames = rng.integers(0, 256, (1, n, res, res, 3), dtype=np.uint8)
            codes = rng.integers(0, tok.codebook_size, (1, n, *tok.codes_shape), dtype=np.int32)
            for op in args.ops.split(","):
                if op == "encode":
                    host, chunk, call = frames, tok.place(frames[0]), tok.encode_chunk
                    public = tok.encode
                else:
                    host, chunk, call = codes, tok.place(codes[0]), tok.decode_chunk
                    public = tok.decode
                start = time.perf_counter()
                public(host)  # compile + first run
                compile_s = time.perf_counter() - start
                device_s = _best(
                    lambda call=call, chunk=chunk: call(chunk).block_until_ready(), args.repeats
                )
                total_s = _best(lambda public=public, host=host: public(host), args.repeats)
                row = {
                    "bench": "vqgan",
                    "op": op,
                    "dtype": dtype,
                    "batch": n,
                    "device_s": round(device_s, 4),
                    "total_s": round(total_s, 4),
                    "outside_s": round(total_s - device_s, 4),
                    "frames_per_s": round(n / total_s, 3),
                    "device_frames_per_s": round(n / device_s, 3),
                    "first_call_s": round(compile_s, 2),
                }
                print(json.dumps(row), flush=True)


def _compare_one(
    base, dtype: str, frames, repeats: int, ops: list[str]
) -> dict[tuple[str, str], list[float]]:
    """Wall times of each (op, impl) of ``ops`` for one compute dtype, round-robin."""
    import jax.numpy as jnp
    from flax import nnx
    from lwm_vqgan_reference import LWMVQGAN

    from vqgan.weights import export_lwm_params

    ours = init_model(base.model_copy(update={"dtype": dtype}))
    ref = LWMVQGAN(base)
    params = jax.tree.map(lambda a: jnp.asarray(a, dtype), export_lwm_params(ours))
    ref_frames = frames.astype(dtype)
    # Ours as `VideoTokenizer` runs it: the parameters split off once, merged inside jax.jit
    # (nnx.jit of the whole module would add a graph traversal in Python to every call).
    graphdef, state = nnx.split(ours)
    ours_enc = jax.jit(lambda s, x: nnx.merge(graphdef, s).encode(x).codes)
    ours_dec = jax.jit(lambda s, c: nnx.merge(graphdef, s).decode_codes(c))
    ref_enc = jax.jit(lambda p, x: ref.apply({"params": p}, x, method=LWMVQGAN.encode)[1])
    ref_dec = jax.jit(lambda p, c: ref.apply({"params": p}, c, method=LWMVQGAN.decode))
    codes = ours_enc(state, frames)
    calls = {
        ("encode", "ours"): lambda: ours_enc(state, frames),
        ("encode", "lwm"): lambda: ref_enc(params, ref_frames),
        ("decode", "ours"): lambda: ours_dec(state, codes),
        ("decode", "lwm"): lambda: ref_dec(params, codes),
    }
    calls = {key: fn for key, fn in calls.items() if key[0] in ops}
    for fn in calls.values():
        jax.block_until_ready(fn())  # compile and run once, untimed
    times: dict[tuple[str, str], list[float]] = {key: [] for key in calls}
    for _ in range(repeats):
        for key, fn in calls.items():
            start = time.perf_counter()
            jax.block_until_ready(fn())
            times[key].append(time.perf_counter() - start)
    return times


def compare_lwm(args: argparse.Namespace) -> None:
    import statistics

    import jax.numpy as jnp
    from lwm_vqgan_reference import check_config

    base = load_vqgan_config(args.config).model
    check_config(base)  # a config LWM's architecture cannot take: one line, before any output
    res = base.resolution
    ops = args.ops.split(",")
    for batch in (int(b) for b in args.batches.split(",")):
        frames = np.random.default_rng(0).uniform(-1, 1, (batch, res, res, 3))
        frames = jnp.asarray(frames, jnp.float32)
        head = {"config": args.config, "batch": batch, "compare": "lwm", "platform": args.platform}
        print(json.dumps(head), flush=True)
        for dtype in args.dtypes.split(","):
            times = _compare_one(base, dtype, frames, args.repeats, ops)
            for op in ops:
                fps = {}
                for impl in ("ours", "lwm"):
                    t = statistics.median(times[(op, impl)])
                    fps[impl] = batch / t
                    row = {"bench": "vqgan", "op": op, "dtype": dtype, "impl": impl, "batch": batch}
                    row |= {"time_s": round(t, 4), "frames_per_s": round(fps[impl], 3)}
                    print(json.dumps(row), flush=True)
                ratio = round(fps["ours"] / fps["lwm"], 3)
                ratio_row = {"bench": "vqgan", "op": op, "dtype": dtype, "ours_vs_lwm": ratio}
                print(json.dumps(ratio_row), flush=True)


if __name__ == "__main__":
    from lwm.cli import run_reporting_errors

    raise SystemExit(run_reporting_errors("bench_vqgan", main, also=(ValueError,)))
