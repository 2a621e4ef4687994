"""The VQGAN video tokenizer: train it, tokenize a video, look at codes, import LWM's weights.

  lwm vqgan train --config configs/vqgan/small.yaml [--out DIR] [--mesh MESH] [KEY=VALUE ...]
  lwm vqgan encode VIDEO --vqgan runs/vqgan_small [--out codes.npy] [--max-frames N]
  lwm vqgan decode codes.npy --vqgan runs/vqgan_small --out video.mp4   (or .png)
  lwm vqgan import vqgan.pkl --out weights/lwm_vqgan --allow-legacy-pickle

`--vqgan` is anything `vqgan.load_tokenizer` accepts: a training output folder or a folder
with config.yaml and model.safetensors (what `import` writes); `--checkpoint`, its old name,
still works for one release, with a deprecation notice. `train` stopped by Ctrl-C or SIGTERM
saves a checkpoint of the step it finished and exits 130 or 143; the same command resumes it.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from lwm.commands import (
    add_config_arguments,
    add_cpu_devices,
    config_overrides,
    output_file,
    output_folder,
    parse_subcommand,
    positive_int,
)

SUBCOMMANDS: dict[str, argparse.ArgumentParser] = {}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="subcommand", required=True, metavar="SUBCOMMAND")

    p = sub.add_parser(
        "train",
        help="train a VQGAN (resumes from the output folder's checkpoint)",
        description="train a VQGAN (resumes from the output folder's checkpoint)",
    )
    add_config_arguments(p, "configs/vqgan/small.yaml", out=True, required=True)
    SUBCOMMANDS["train"] = p

    p = sub.add_parser(
        "encode",
        help="tokenize a video (or image) into codes",
        description="tokenize a video (or image) into codes",
    )
    p.add_argument("video", help="video file (anything decord reads) or image")
    p.add_argument("--vqgan", metavar="DIR", required=True, help="VQGAN folder")
    p.rename("--checkpoint", "--vqgan")
    p.add_argument("--out", metavar="FILE", help="write the codes [1, T, h, w] to this .npy file")
    p.add_argument(
        "--max-frames",
        type=positive_int,
        metavar="N",
        help="sample at most N frames, evenly spaced",
    )
    add_cpu_devices(p)
    SUBCOMMANDS["encode"] = p

    p = sub.add_parser(
        "decode",
        help="turn codes back into frames (MP4 or PNG)",
        description="turn codes back into frames (MP4 or PNG)",
    )
    p.add_argument("codes", help=".npy of codes [B, T, h, w], [T, h, w] or [h, w]")
    p.add_argument("--vqgan", metavar="DIR", required=True, help="VQGAN folder")
    p.rename("--checkpoint", "--vqgan")
    p.add_argument(
        "--out", metavar="FILE", required=True, help="x.mp4 (the first video) or x.png (all frames)"
    )
    p.add_argument("--fps", type=positive_int, default=8, help="frame rate of the MP4 (default 8)")
    add_cpu_devices(p)
    SUBCOMMANDS["decode"] = p

    p = sub.add_parser(
        "import",
        help="import LWM's pickled VQGAN parameters as safetensors",
        description="import LWM's pickled VQGAN parameters as safetensors",
    )
    p.add_argument("pickle", help="LWM's VQGAN parameter file (a pickle)")
    p.add_argument(
        "--out", metavar="DIR", required=True, help="output folder (config.yaml, model.safetensors)"
    )
    p.add_argument(
        "--config",
        metavar="FILE",
        default=None,
        help="VQGAN config of the weights (default: LWM's, as configs/vqgan/lwm.yaml)",
    )
    p.add_argument(
        "--allow-legacy-pickle",
        action="store_true",
        help="required: read the pickle with the restricted unpickler (containers and numpy only)",
    )
    SUBCOMMANDS["import"] = p


def parse_args(parser: argparse.ArgumentParser, argv: Sequence[str]) -> argparse.Namespace:
    return parse_subcommand(parser, SUBCOMMANDS, argv)


def run(args: argparse.Namespace) -> int:
    from lwm.base.media import VideoError
    from vqgan.legacy_pickle import LegacyPickleError
    from vqgan.weights import WeightsError

    try:
        return {"train": _train, "encode": _encode, "decode": _decode, "import": _import}[
            args.subcommand
        ](args)
    except (LegacyPickleError, WeightsError, VideoError) as e:
        print(f"lwm vqgan: error: {' '.join(str(e).split())}", file=sys.stderr)
        return 2


def _train(args: argparse.Namespace) -> int:
    import jax

    from data.vqgan_frames import load_frames
    from lwm.base.lock import output_lock
    from lwm.base.mesh import make_mesh
    from lwm.base.signals import exit_status
    from vqgan.config import load_vqgan_config
    from vqgan.train import TrainingStopped, train

    cfg = load_vqgan_config(args.config, config_overrides(args))
    mesh = make_mesh(cfg.mesh.shape)
    out = cfg.train.output_dir
    with output_lock(
        Path(out) / ".lock",
        what=f"train.output_dir '{out}'",
        member=jax.process_index(),
        warn=lambda msg: print(f"lwm vqgan: warning: {msg}", file=sys.stderr),
    ):
        try:
            metrics = train(cfg, mesh=mesh, source=lambda: load_frames(cfg))
        except TrainingStopped as stopped:  # saved; it said so
            return exit_status(stopped.signal)
    print(
        f"{cfg.train.output_dir}: held-out PSNR {metrics['psnr']:.2f} dB, codebook used "
        f"{metrics['codebook_used']:.1%}, perplexity {metrics['perplexity']:.1f}"
    )
    return 0


def _encode(args: argparse.Namespace) -> int:
    from lwm.base.media import read_video
    from lwm.base.mesh import make_mesh
    from vqgan import load_tokenizer

    if args.out:
        output_file("--out", args.out)
    frames = read_video(args.video, args.max_frames)
    tok = load_tokenizer(args.vqgan, mesh=make_mesh("1,-1,1,1"))
    codes = tok.encode(frames[None])
    print(
        f"{args.video}: {frames.shape[0]} frames {frames.shape[1]}x{frames.shape[2]} -> codes "
        f"{list(codes.shape)} ({tok.tokens_per_frame} per frame, codebook {tok.codebook_size}, "
        f"{len(np.unique(codes))} distinct)"
    )
    if args.out:
        from lwm.base.files import atomic_path

        out = Path(args.out)
        with atomic_path(out) as tmp, open(tmp, "wb") as f:
            np.save(f, codes)  # a file, not a name: np.save would add .npy to a name
        print(f"wrote {out}")
    else:
        print("frame 0:")
        print(np.array2string(codes[0, 0], max_line_width=200))
    return 0


def _decode(args: argparse.Namespace) -> int:
    from lwm.base.media import VideoError, write_mp4, write_png
    from lwm.base.mesh import make_mesh
    from vqgan import load_tokenizer

    out = output_file("--out", args.out, (".mp4", ".png"))
    path = Path(args.codes)
    if not path.is_file():
        raise FileNotFoundError(f"codes file '{path}' not found")
    try:
        codes = np.load(path, allow_pickle=False)
    except ValueError as e:
        raise VideoError(f"'{path}' is not a numpy .npy file of codes: {e}") from None
    codes = codes.reshape((1,) * (4 - codes.ndim) + codes.shape) if codes.ndim < 4 else codes
    tok = load_tokenizer(args.vqgan, mesh=make_mesh("1,-1,1,1"))
    try:
        frames = tok.decode(codes)
    except ValueError as e:
        raise VideoError(f"'{path}': {e}") from None
    if out.suffix.lower() == ".png":
        write_png(out, np.concatenate([np.concatenate(list(v), axis=1) for v in frames], axis=0))
    else:
        write_mp4(out, frames[0], fps=args.fps)
    print(f"wrote {out} ({frames.shape[1]} frames {frames.shape[2]}x{frames.shape[3]})")
    return 0


def _import(args: argparse.Namespace) -> int:
    from vqgan.config import VQGANConfig, load_vqgan_config
    from vqgan.legacy_pickle import load_legacy_pickle
    from vqgan.weights import import_lwm_params, save_weights

    output_folder("--out", args.out)
    held = [n for n in ("model.safetensors", "checkpoints") if (Path(args.out) / n).exists()]
    if held:  # datasets that name the folder would be read with other weights
        raise FileExistsError(
            f"--out '{args.out}' already holds a VQGAN ({', '.join(held)}); import into a new "
            "folder"
        )
    cfg = load_vqgan_config(args.config) if args.config else VQGANConfig()  # default: LWM's
    tree = load_legacy_pickle(args.pickle, allow_pickle=args.allow_legacy_pickle)
    model = import_lwm_params(tree, cfg.model, source=args.pickle)
    save_weights(args.out, model, cfg)
    print(f"imported {model.num_parameters():,} parameters from {args.pickle} into {args.out}")
    return 0
