"""Weight import and export, one module per format, and `load_model` to pick the format.

    model = load_model("hf:Llama-2-7b-hf", cfg, mesh=mesh)       # Hugging Face LLaMA folder
    model = load_model("params::/ckpt/LWM-Chat-1M-Jax/params", cfg, mesh=mesh)   # LWM / tux
    model = load_model("orbax:ckpt/params", cfg, mesh=mesh)      # our own checkpoints
    model = load_model("run:runs/tiny", cfg, mesh=mesh)          # an `lwm train` run (newest)
    model = load_model("ckpt/params", cfg)                       # format detected from the path

Prefixes: ``hf:``, ``lwm:`` (or LWM's own ``params::``, ``trainstate_params::``,
``trainstate::``), ``orbax:``, ``run:``. Without one, a folder with ``config.json`` is Hugging
Face, a folder with ``config.yaml`` and ``checkpoints/`` is a training run, a folder with
orbax metadata is orbax, and a file is an LWM streaming checkpoint.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

from flax import nnx
from jax.sharding import Mesh

from lwm.config import ModelConfig
from lwm.model import LWMModel
from lwm.weights.common import WeightsError
from lwm.weights.hf import load_hf_llama, model_config_from_hf, save_hf_llama
from lwm.weights.lwm_streaming import load_lwm_streaming, save_lwm_streaming
from lwm.weights.orbax_io import is_orbax_checkpoint, load_params, save_params

__all__ = [
    "FORMATS",
    "WeightsError",
    "detect_format",
    "load_hf_llama",
    "load_lwm_streaming",
    "load_model",
    "load_params",
    "model_config_from_hf",
    "save_hf_llama",
    "save_lwm_streaming",
    "save_params",
]

FORMATS = ("hf", "lwm", "orbax", "run")
_LWM_LOAD_TYPES = ("params::", "trainstate_params::", "trainstate::")


def detect_format(source: str | os.PathLike) -> tuple[str, str]:
    """``source`` -> (format, location): the prefix when there is one, else from the path."""
    text = os.fspath(source)
    if text.startswith(_LWM_LOAD_TYPES):
        return "lwm", text
    fmt, sep, rest = text.partition(":")
    if sep and fmt in FORMATS:
        return fmt, rest
    path = Path(text)
    if not path.exists():
        if sep and fmt.isidentifier():  # e.g. `foo:DIR`: a format that does not exist
            known = ", ".join([f"{f}:" for f in FORMATS] + list(_LWM_LOAD_TYPES))
            raise WeightsError(f"'{text}': unknown format '{fmt}:' (known: {known})")
        raise WeightsError(f"checkpoint '{path}' does not exist")
    if path.is_file():
        return "lwm", text
    if (path / "config.json").is_file():
        return "hf", text
    if (path / "config.yaml").is_file() and (path / "checkpoints").is_dir():
        return "run", text
    if is_orbax_checkpoint(path):
        return "orbax", text
    raise WeightsError(
        f"'{path}' is a folder but neither a Hugging Face model (no config.json) nor an orbax "
        "checkpoint (no _CHECKPOINT_METADATA); give the format as hf:, orbax: or lwm:"
    )


def load_model(
    source: str | os.PathLike,
    cfg: ModelConfig,
    mesh: Mesh | None = None,
    log: Callable[[str], None] | None = None,
) -> LWMModel:
    """An `LWMModel` with the weights at ``source`` (see the module docstring), placed directly
    into the shardings of ``mesh``. ``log``: where a run's loading is reported (stderr)."""
    fmt, location = detect_format(source)
    if fmt == "hf":
        return load_hf_llama(location, cfg, mesh)
    if fmt == "orbax":
        return load_params(location, cfg, mesh)
    if fmt == "run":
        from lwm.runs import load_run

        run_cfg, model = load_run(location, mesh=mesh, **({"log": log} if log else {}))
        _check_same_shapes(run_cfg.model, cfg, location)
        # The run's weights under the config asked for (e.g. a longer context, a new theta).
        graphdef = nnx.graphdef(nnx.eval_shape(lambda: LWMModel(cfg, rngs=nnx.Rngs(0), mesh=mesh)))
        return nnx.merge(graphdef, nnx.state(model))
    return load_lwm_streaming(location, cfg, mesh)


def _check_same_shapes(found: ModelConfig, wanted: ModelConfig, where: str) -> None:
    """A run's model may differ in sequence length or rope theta (context stages), not shape."""
    from lwm.info import shape_differences

    if differences := shape_differences(found, wanted):
        raise WeightsError(
            f"the model of run '{where}' has other parameter shapes than the config asks for "
            f"({'; '.join(differences)})"
        )
    if found.vision_codes != wanted.vision_codes:  # the same table, read as other codes
        raise WeightsError(
            f"the model of run '{where}' learned {found.vision_codes or 'every'} vision codes "
            f"(model.vision_codes: {found.vision_codes} there, {wanted.vision_codes} here): "
            "its vision head would score codes it never learned"
        )
