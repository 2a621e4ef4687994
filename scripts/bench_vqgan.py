"""Frames/s of VQGAN encode and decode through `VideoTokenizer` (batch sweep, float32 and
bfloat16 compute), and the time spent outside the jitted call (host-side checks, padding,
transfers to and from the device, reshapes).

    python scripts/bench_vqgan.py                                   # LWM's preset at 256x256
    python scripts/bench_vqgan.py --config configs/vqgan/small.yaml --batches 8,32,128

One JSON line per measurement:
  {"op": "encode", "dtype": "float32", "batch": 2, "device_s": ..., "total_s": ...,
   "outside_s": ..., "frames_per_s": ..., "device_frames_per_s": ...}
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
    parser.add_argument("--config", default="configs/vqgan/lwm.yaml")
    parser.add_argument("--batches", default="1,2,4", help="frames per call")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--ops", default="encode,decode")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--mesh", default="1,-1,1,1")
    args = parser.parse_args()

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


if __name__ == "__main__":
    main()
