"""Running the steps of a pipeline script (`recipes/demo.py`, `recipes/text_to_video.py`,
`recipes/long_context.py`): each step is a command a user could type, printed before it runs
and timed; a failed step stops the script with the step's exit status."""

from __future__ import annotations

import math
import shlex
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run_step(
    cmd: list[str], who: str, *, env: dict[str, str] | None = None, capture: bool = False
) -> str:
    """Run ``cmd`` in the repository root; returns its stdout when ``capture``."""
    print(f"\n$ {shlex.join(cmd)}", flush=True)
    t0 = time.perf_counter()
    result = subprocess.run(
        cmd, cwd=ROOT, env=env, text=True, stdout=subprocess.PIPE if capture else None
    )
    if result.returncode != 0:
        print(f"{who}: step failed (exit {result.returncode}): {shlex.join(cmd)}", file=sys.stderr)
        sys.exit(result.returncode)
    print(f"  ({time.perf_counter() - t0:.0f} s)", flush=True)
    return result.stdout or ""


def demo_vqgan_command(
    lwm: list[str],
    cpu: list[str],
    output: Path,
    steps: int,
    manifest: Path,
    seed: int | None = None,
) -> list[str]:
    """`lwm vqgan train` of the demo's VQGAN (configs/vqgan/demo.yaml) on ``manifest``'s
    videos: the step every pipeline script runs when it is given no trained VQGAN. Dead codes
    are restarted during the first half of the ``steps``, as the config does for its own; a
    ``seed`` other than None is the VQGAN's `seed` (the config's, 0, otherwise)."""
    return (
        [*lwm, "vqgan", "train", *cpu, "--config", "configs/vqgan/demo.yaml"]
        + [f"train.output_dir={output}", f"train.steps={steps}"]
        + [f"quantizer.restart_until={steps // 2}"]
        + [f"data.manifest={manifest}"]
        + ([] if seed is None else [f"seed={seed}"])
    )


def check_vqgan_seed(output: Path, seed: int | None) -> None:
    """Refuse (`ValueError`) a ``seed`` other than the one the VQGAN already under ``output``
    trained from (its config.yaml's `seed`): a rerun would resume that run, or keep it as
    finished, under another seed's name. None, or no run there yet, passes."""
    if seed is None or not (output / "config.yaml").is_file():
        return
    from vqgan.weights import read_config

    found = read_config(output).seed
    if found != seed:
        raise ValueError(
            f"--vqgan-seed {seed}: {output} holds a VQGAN trained from seed {found}; "
            "rerun with that seed, or give another --out"
        )


def check_vqgan(path: str) -> None:
    """Refuse (ValueError), before any step, a ``--vqgan`` folder the steps could not load:
    `vqgan.load_model` reads ``model.safetensors`` or a training output's ``checkpoints/``
    (``path`` is taken from the repository root, where the steps run)."""
    import vqgan

    folder = ROOT / path
    if not folder.exists():
        raise ValueError(f"--vqgan '{path}' does not exist")
    try:
        vqgan.check_saved(folder)
    except FileNotFoundError as e:
        raise ValueError(f"--vqgan: {e}") from None


def check_mesh(flag: str, mesh: str, platform: str = "cpu") -> None:
    """Refuse (MeshError, a ValueError), before any step, a mesh (option ``flag``) that the
    simulated devices of the steps cannot form: on a cpu there are as many as the mesh has
    (``--cpu-devices``), so it must give every axis's size. On a tpu or gpu the steps see the
    chips JAX finds, and the first step that builds the mesh says what does not fit (asking JAX
    here would hold the chip in this process too)."""
    from lwm.base.mesh import MeshError, parse_mesh_shape

    if platform != "cpu":
        return
    items = [s.strip() for s in mesh.split(",")]
    if "-1" in items:
        raise MeshError(
            f"{flag} '{mesh}': on cpu the simulated devices are as many as the mesh has: give "
            "every axis's size, not -1"
        )
    devices = math.prod(int(s) for s in items if s.isdigit()) or 1
    try:
        parse_mesh_shape(mesh, devices)
    except MeshError as e:
        raise MeshError(f"{flag}: {e}") from None


def check_choices(*given: tuple[str, str, Sequence[str]]) -> None:
    """Refuse (ValueError, one line) the first comma-separated value of an option that is not
    one of its known ones: ``(flag, text, known)`` for each option."""
    for flag, text, known in given:
        if bad := [x for x in text.split(",") if x not in known]:
            raise ValueError(f"unknown {flag} {bad[0]!r} (known: {', '.join(known)})")


def failed_status(error: BaseException) -> str:
    """A measurement's status when it raised: ``failed: TYPE: the message's first line``
    (with ``LWM_TRACEBACK=1``, the traceback on stderr too: `lwm.cli.note_failure`)."""
    from lwm.cli import note_failure

    note_failure(error)
    name = type(error).__name__
    return (
        f"failed: {name}: {str(error).splitlines()[0][:200]}" if str(error) else f"failed: {name}"
    )


def add_platform_argument(parser, cpu_devices: int = 1) -> None:
    """``--platform`` (and ``--cpu-devices``) as every benchmark script takes them."""
    from lwm.base.mesh import PLATFORMS

    parser.add_argument(
        "--platform",
        choices=PLATFORMS,
        default="cpu",
        help="cpu: simulated devices of the host CPU (default); tpu: the TPU chips; gpu: the "
        "NVIDIA GPUs; auto: what JAX picks",
    )
    parser.add_argument(
        "--cpu-devices",
        type=int,
        default=cpu_devices,
        help=f"simulated devices with --platform cpu (default {cpu_devices})",
    )


def start_platform(args) -> str:
    """Start JAX on ``args.platform`` (`add_platform_argument`) before anything asks it for
    devices: a platform that is not there is a `lwm.base.mesh.MeshError` (a ValueError: one
    line, exit 2, under `lwm.cli.run_reporting_errors`). Returns the platform JAX runs on."""
    from lwm.base.mesh import use_platform

    if args.cpu_devices < 1:
        raise ValueError(f"--cpu-devices must be at least 1, not {args.cpu_devices}")
    return use_platform(args.platform, cpu_devices=args.cpu_devices)
