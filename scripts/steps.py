"""Running the steps of a pipeline script (`scripts/demo.py`, `scripts/text_to_video.py`,
`scripts/long_context.py`): each step is a command a user could type, printed before it runs
and timed; a failed step stops the script with the step's exit status."""

from __future__ import annotations

import shlex
import subprocess
import sys
import time
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
    lwm: list[str], cpu: list[str], output: Path, steps: int, manifest: Path
) -> list[str]:
    """`lwm vqgan train` of the demo's VQGAN (configs/vqgan/demo.yaml) on ``manifest``'s
    videos: the step every pipeline script runs when it is given no trained VQGAN."""
    return (
        [*lwm, "vqgan", "train", *cpu, "--config", "configs/vqgan/demo.yaml"]
        + [f"train.output_dir={output}", f"train.steps={steps}"]
        + [f"data.manifest={manifest}"]
    )
