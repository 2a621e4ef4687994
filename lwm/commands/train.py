"""Train the model: sharded over the config's mesh, with orbax checkpoints and exact resume.

  lwm train --config configs/tiny.yaml train.steps=200 --mesh 1,2,2,2 --cpu-devices 8
  lwm train --config configs/7b_128k.yaml train.init_from=run:runs/7b_32k --out runs/7b_128k

Rerun the same command to resume from the newest checkpoint in --out (train.output_dir;
default runs/default, whatever the config; a folder that already holds a run is resumed, and
train.init_from then does not apply: give each stage its own --out). SIGTERM or Ctrl-C saves
a checkpoint first (exit 143 or 130). Metrics: OUT/metrics.jsonl and OUT/tensorboard. A
config that does not fit its dataset or the run in --out is refused before the first step
(exit 2); a run that fails (a NaN loss) exits 1.
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

from lwm.base.config import has_checkpoint
from lwm.commands import add_config_arguments, config_overrides
from lwm.config import load_config


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_arguments(parser, "configs/tiny.yaml", out=True, required=True)


def run(args: argparse.Namespace) -> int:
    import jax

    from lwm.base.distributed import init_distributed
    from lwm.base.lock import output_lock
    from lwm.base.mesh import make_mesh
    from lwm.base.signals import exit_status
    from lwm.train import TrainingError, train

    cfg = load_config(args.config, config_overrides(args))
    out = cfg.train.output_dir
    if Path(out).exists() and not Path(out).is_dir():
        raise FileExistsError(f"train.output_dir '{out}' is a file, not a folder")
    new = not Path(out).exists()
    init_distributed(cfg.distributed)  # before anything asks JAX for its devices
    mesh = make_mesh(cfg.mesh.shape)  # the one mesh of this process
    if jax.process_index() == 0:  # the chips, the mesh and the attention kernel they run
        from lwm.commands.info import describe_devices

        mesh_text = ",".join(str(n) for n in mesh.shape.values())
        print(f"lwm train: {describe_devices(cfg, mesh)[2:]}; mesh {mesh_text}", file=sys.stderr)
    try:
        # One run per output folder (the processes of one job share it, one lock each).
        with output_lock(
            Path(out) / ".lock",
            what=f"train.output_dir '{out}'",
            member=jax.process_index(),
            warn=lambda msg: print(f"lwm train: warning: {msg}", file=sys.stderr),
        ):
            result = train(cfg, mesh=mesh)
    except TrainingError as e:
        _remove_if_untrained(Path(out), new)
        print(f"lwm train: error: {e}", file=sys.stderr)
        return 1
    except BaseException:
        _remove_if_untrained(Path(out), new)
        raise
    if result.stopped_by is not None:
        return exit_status(result.stopped_by)
    print(
        f"lwm train: done at step {result.step}; checkpoints and metrics in {out}", file=sys.stderr
    )
    return 0


def _remove_if_untrained(out: Path, new: bool) -> None:
    """Remove the output folder a run made and stopped in before its first step: bad input
    leaves nothing behind. A run that trained keeps its metrics; one job of many processes
    keeps everything (they share the folder)."""
    import jax

    if not new or jax.process_count() > 1 or not out.is_dir():
        return
    metrics = out / "metrics.jsonl"
    if metrics.is_file() and metrics.stat().st_size > 0:
        return
    if has_checkpoint(out):
        return
    shutil.rmtree(out, ignore_errors=True)
