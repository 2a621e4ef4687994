"""Throughput of `lwm tokenize` on a folder of synthetic videos: videos/s, frames/s and the
share of the time the VQGAN encoder is busy, for several numbers of decoding workers.

    python benchmarks/bench_tokenize.py --videos 64 --size 64 --frames 16 --workers 0,1,2 \
        --vqgan-config configs/vqgan/tiny.yaml

``--vqgan PATH`` uses a saved VQGAN instead of a randomly initialised one of ``--vqgan-config``
(the encoder's speed does not depend on its weights). The videos (H.264 MP4, written by
`data.synthetic`) and the VQGAN are made once, untimed, in ``--work`` (default: a temporary
folder); each measured run tokenizes the whole folder into a fresh output and includes the
start of its worker processes and the encoder's compilation, as a user's run does.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from lwm.scripting import add_platform_argument, start_platform  # noqa: E402


def make_vqgan(config: str, directory: Path) -> Path:
    from flax import nnx

    from vqgan.config import load_vqgan_config
    from vqgan.model import VQGAN
    from vqgan.weights import save_weights

    cfg = load_vqgan_config(config)
    return save_weights(directory, VQGAN(cfg.model, rngs=nnx.Rngs(0)), cfg)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--videos", type=int, default=64, help="synthetic videos to tokenize")
    parser.add_argument("--size", type=int, default=64, help="frame height and width")
    parser.add_argument("--frames", type=int, default=16, help="frames per video")
    parser.add_argument("--workers", default="0,1,2", help="comma-separated worker counts")
    parser.add_argument(
        "--batch-frames", type=int, default=64, help="frames per VQGAN encode batch"
    )
    parser.add_argument("--vqgan", help="a saved VQGAN (default: random, of --vqgan-config)")
    parser.add_argument(
        "--vqgan-config",
        default=str(REPO / "configs/vqgan/tiny.yaml"),
        help="config of the random VQGAN (default configs/vqgan/tiny.yaml)",
    )
    parser.add_argument("--work", type=Path, help="folder for the videos and outputs")
    add_platform_argument(parser)
    args = parser.parse_args(argv)
    platform = start_platform(args)

    from data.synthetic import write_dataset
    from data.tokenize_dataset import TokenizeOptions, tokenize_dataset
    from lwm.base.mesh import make_mesh

    work = args.work or Path(tempfile.mkdtemp(prefix="bench_tokenize."))
    videos = work / "videos"
    if not (videos / "videos").is_dir():
        write_dataset(videos, args.videos, seed=0, size=args.size, num_frames=args.frames)
    vqgan = Path(args.vqgan) if args.vqgan else make_vqgan(args.vqgan_config, work / "vqgan")
    results = []
    for workers in (int(w) for w in args.workers.split(",")):
        out = work / f"out_w{workers}"
        shutil.rmtree(out, ignore_errors=True)
        opts = TokenizeOptions(
            input=str(videos / "videos"),  # the folder itself: every video, no captions
            output=str(out),
            vqgan=str(vqgan),
            workers=workers,
            batch_frames=args.batch_frames,
            progress=False,
        )
        start = time.perf_counter()
        summary = tokenize_dataset(opts, log=lambda _msg: None, mesh=make_mesh("1,-1,1,1"))
        wall = time.perf_counter() - start
        row = {
            "bench": "tokenize",
            "platform": platform,
            "workers": workers,
            "videos": summary.ok,
            "frames": summary.frames,
            "seconds": round(wall, 2),
            "videos_per_s": round(summary.ok / wall, 2),
            "frames_per_s": round(summary.frames / wall, 1),
            "encoder_busy_pct": round(100 * summary.encode_seconds / summary.seconds, 1),
        }
        results.append(row)
        print(json.dumps(row), flush=True)
    if args.work is None:
        shutil.rmtree(work)
    return 0


if __name__ == "__main__":
    from lwm.cli import run_reporting_errors

    raise SystemExit(run_reporting_errors("bench_tokenize", main, also=(ValueError,)))
