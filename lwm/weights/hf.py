"""Hugging Face LLaMA folders (``config.json`` + ``*.safetensors``) in and out.

    cfg = model_config_from_hf("Llama-2-7b-hf", dtype="bfloat16", param_dtype="bfloat16")
    model = load_hf_llama("Llama-2-7b-hf", cfg, mesh=mesh)
    save_hf_llama(model, "exported")          # loads with transformers.LlamaForCausalLM

Mapping (torch ``Linear`` weights are ``[out, in]``; ours are ``[in, out]``, so transposed):

    model.embed_tokens.weight                       embed_text
    model.layers.{i}.input_layernorm.weight         layers.{i}.attn_norm
    model.layers.{i}.self_attn.{q,k,v,o}_proj.weight   layers.{i}.attn.{q,k,v,o}     (T)
    model.layers.{i}.post_attention_layernorm.weight    layers.{i}.mlp_norm
    model.layers.{i}.mlp.{gate,up,down}_proj.weight    layers.{i}.mlp.{gate,up,down} (T)
    model.norm.weight                               final_norm
    lm_head.weight                                  lm_head                       (T)

Hugging Face's q/k projections are already in the rotate-half RoPE layout we use, so nothing
is permuted. A text checkpoint has no vision embedding or head: they are initialised as
`create_model` would (same seed), and the export leaves them out.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import safetensors.numpy
from jax.sharding import Mesh
from safetensors import safe_open

from lwm.base.files import atomic_path
from lwm.config import ModelConfig
from lwm.model import LWMModel
from lwm.weights.common import (
    VISION_PARAMS,
    ParamSink,
    WeightsError,
    iter_host_params,
    layer_names,
    np_dtype,
)

__all__ = ["hf_config_from_model", "load_hf_llama", "model_config_from_hf", "save_hf_llama"]

CONFIG_FILE = "config.json"
INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
DEFAULT_MAX_SHARD_BYTES = 5 * 2**30

# Per-layer suffix -> (HF name under model.layers.{i}., transpose)
_LAYER_MAP: dict[str, tuple[str, bool]] = {
    "attn_norm": ("input_layernorm.weight", False),
    "attn.q": ("self_attn.q_proj.weight", True),
    "attn.k": ("self_attn.k_proj.weight", True),
    "attn.v": ("self_attn.v_proj.weight", True),
    "attn.o": ("self_attn.o_proj.weight", True),
    "mlp_norm": ("post_attention_layernorm.weight", False),
    "mlp.gate": ("mlp.gate_proj.weight", True),
    "mlp.up": ("mlp.up_proj.weight", True),
    "mlp.down": ("mlp.down_proj.weight", True),
}
_TOP_MAP: dict[str, tuple[str, bool]] = {
    "embed_text": ("model.embed_tokens.weight", False),
    "final_norm": ("model.norm.weight", False),
    "lm_head": ("lm_head.weight", True),
}
_SAFETENSORS_DTYPES = {
    "BF16": ml_dtypes.bfloat16,
    "F16": np.float16,
    "F32": np.float32,
    "F64": np.float64,
}


def _tensor_map(cfg: ModelConfig) -> dict[str, tuple[str, bool]]:
    """Our per-layer name -> (HF tensor name, transposed) for every text parameter."""
    out = {"embed_text": _TOP_MAP["embed_text"]}
    for i in range(cfg.num_layers):
        for suffix in layer_names(cfg):
            hf, t = _LAYER_MAP[suffix]
            out[f"layers.{i}.{suffix}"] = (f"model.layers.{i}.{hf}", t)
    out["final_norm"] = _TOP_MAP["final_norm"]
    if not cfg.tie_word_embeddings:
        out["lm_head"] = _TOP_MAP["lm_head"]
    return out


# ---------------------------------------------------------------------------------------------
# Config


def _read_config(folder: Path) -> dict[str, Any]:
    path = folder / CONFIG_FILE
    if not folder.is_dir():
        raise WeightsError(f"Hugging Face folder '{folder}' does not exist")
    if not path.is_file():
        raise WeightsError(f"'{folder}' is not a Hugging Face model folder: no {CONFIG_FILE}")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise WeightsError(f"{path}: not valid JSON: {e}") from None


def _rope_theta(hf: Mapping[str, Any], where: str) -> float:
    params = hf.get("rope_parameters")  # transformers >= 5
    if params is None:
        params = hf.get("rope_scaling")  # transformers 4: None unless scaled
        theta = hf.get("rope_theta", 10000.0)
    else:
        theta = params.get("rope_theta", hf.get("rope_theta", 10000.0))
    if params is not None:
        kind = params.get("rope_type", params.get("type", "default"))
        if kind != "default":
            raise WeightsError(
                f"{where}: RoPE scaling '{kind}' is not supported (only unscaled RoPE); "
                f"rope parameters: {params}"
            )
    return float(theta)


def model_config_from_hf(
    folder_or_config: str | os.PathLike | Mapping[str, Any], **overrides: Any
) -> ModelConfig:
    """A `ModelConfig` for a Hugging Face LLaMA config (a folder or its ``config.json`` as a
    dict); ``overrides`` set any other field (dtype, attention, scan_layers, ...).

    Unsupported: RoPE scaling, attention or MLP biases, activations other than SiLU, and model
    types other than ``llama``; each is a `WeightsError` naming the setting.
    """
    if isinstance(folder_or_config, Mapping):
        hf, where = dict(folder_or_config), "Hugging Face config"
    else:
        folder = Path(folder_or_config)
        hf, where = _read_config(folder), str(folder / CONFIG_FILE)
    if hf.get("model_type") != "llama":
        raise WeightsError(
            f"{where}: model_type {hf.get('model_type')!r} is not supported (only 'llama')"
        )
    for flag in ("attention_bias", "mlp_bias"):
        if hf.get(flag):
            raise WeightsError(f"{where}: {flag}=true is not supported (the model has no biases)")
    if hf.get("hidden_act", "silu") != "silu":
        raise WeightsError(f"{where}: hidden_act {hf['hidden_act']!r} is not supported (silu)")
    try:
        fields: dict[str, Any] = dict(
            text_vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_layers=hf["num_hidden_layers"],
            num_heads=hf["num_attention_heads"],
            num_kv_heads=hf.get("num_key_value_heads") or hf["num_attention_heads"],
            rope_theta=_rope_theta(hf, where),
            rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
            max_seq_len=hf.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        )
    except KeyError as e:
        raise WeightsError(f"{where}: missing key {e.args[0]!r}") from None
    if hf.get("head_dim"):
        fields["head_dim"] = hf["head_dim"]
    fields.update(overrides)
    return ModelConfig(**fields)


def hf_config_from_model(cfg: ModelConfig, *, dtype: str | None = None) -> dict[str, Any]:
    """The ``config.json`` of the text model, readable by transformers 4.x and 5.x."""
    if cfg.rope_dims is not None:
        raise WeightsError(
            f"LLaMA rotates every dimension of a head: model.rope_dims {cfg.rope_dims} "
            f"(of head_dim {cfg.head_dim}) cannot be saved in its format"
        )
    dtype = dtype or cfg.param_dtype
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": cfg.text_vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": cfg.max_seq_len,
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_scaling": None,
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "initializer_range": cfg.initializer_range,
        "torch_dtype": dtype,
    }


def _check_config(hf_cfg: ModelConfig, cfg: ModelConfig, where: str) -> None:
    fields = (
        "text_vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_layers",
        "num_heads",
        "num_kv_heads",
        "head_dim",
        "rope_theta",
        "rope_dims",
        "rms_norm_eps",
        "tie_word_embeddings",
    )
    bad = [
        f"model.{f}: {getattr(hf_cfg, f)!r} there, {getattr(cfg, f)!r} here"
        for f in fields
        if getattr(hf_cfg, f) != getattr(cfg, f)
    ]
    if bad:
        raise WeightsError(
            f"{where} does not match the model config ({'; '.join(bad)}); set those model "
            "keys to the checkpoint's (in Python: model_config_from_hf)"
        )


# ---------------------------------------------------------------------------------------------
# Reading


def _weight_files(folder: Path) -> dict[str, Path]:
    """Tensor name -> the safetensors file holding it."""
    index = folder / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise WeightsError(f"{index}: not a safetensors index ({e})") from None
        files = {name: folder / file for name, file in weight_map.items()}
        for path in sorted(set(files.values())):
            if not path.is_file():
                raise WeightsError(f"{index} names '{path.name}', which does not exist")
        return files
    paths = sorted(folder.glob("*.safetensors"))
    if not paths:
        raise WeightsError(f"'{folder}' has no *.safetensors files (nor {INDEX_FILE})")
    files = {}
    for path in paths:
        with safe_open(path, framework="numpy") as f:
            files.update(dict.fromkeys(f.keys(), path))
    return files


def _shapes(files: Mapping[str, Path]) -> dict[str, tuple[int, ...]]:
    shapes = {}
    for path in sorted(set(files.values())):
        with safe_open(path, framework="numpy") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                shapes[name] = tuple(f.get_slice(name).get_shape())
    return shapes


def _read_raw(path: Path, name: str) -> np.ndarray:
    """One tensor read straight from the file layout (8-byte header length, JSON header, data),
    for safetensors versions whose numpy reader lacks a dtype such as bfloat16."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        info = json.loads(f.read(n))[name]
    dtype = _SAFETENSORS_DTYPES.get(info["dtype"])
    if dtype is None:
        raise WeightsError(f"{path}: tensor '{name}' has unsupported dtype {info['dtype']}")
    start, end = info["data_offsets"]
    data = np.memmap(path, dtype=np.uint8, mode="r", offset=8 + n + start, shape=(end - start,))
    return np.array(data.view(dtype).reshape(info["shape"]))


def _read(f, path: Path, name: str) -> np.ndarray:
    try:
        return f.get_tensor(name)
    except (TypeError, ValueError):
        return _read_raw(path, name)


def load_hf_llama(
    folder: str | os.PathLike, cfg: ModelConfig, mesh: Mesh | None = None, *, seed: int = 0
) -> LWMModel:
    """An `LWMModel` with the weights of a Hugging Face LLaMA folder, each tensor placed
    directly into its sharding on ``mesh``.

    The folder's config must match ``cfg`` in every shape and numerical setting. The vision
    embedding and head are not in a text checkpoint: they are initialised as
    ``create_model(cfg, seed=seed)`` would. Missing, unknown or mis-shaped tensors are a
    `WeightsError` naming the tensor and the file; nothing is loaded then.
    """
    folder = Path(folder)
    hf_cfg = model_config_from_hf(folder)
    _check_config(hf_cfg, cfg, str(folder / CONFIG_FILE))
    files = _weight_files(folder)
    shapes = _shapes(files)
    wanted = _tensor_map(cfg)
    sink = ParamSink(cfg, mesh, folder)

    # Everything is checked before the first tensor is read.
    for name, (hf_name, transpose) in wanted.items():
        if hf_name not in files:
            raise WeightsError(f"{folder}: tensor '{hf_name}' (for '{name}') is missing")
        shape = shapes[hf_name][::-1] if transpose else shapes[hf_name]
        sink.check(name, shape, hf_name, where=str(files[hf_name]))
    known = {hf for hf, _ in wanted.values()}
    for hf_name in files:
        ignorable = hf_name.endswith("rotary_emb.inv_freq") or (
            hf_name == "lm_head.weight" and cfg.tie_word_embeddings
        )
        if hf_name not in known and not ignorable:
            raise WeightsError(f"{files[hf_name]}: unexpected tensor '{hf_name}'")

    by_file: dict[Path, list[str]] = {}
    for name, (hf_name, _) in wanted.items():
        by_file.setdefault(files[hf_name], []).append(name)
    for path, names in by_file.items():
        with safe_open(path, framework="numpy") as f:
            for name in names:
                hf_name, transpose = wanted[name]
                array = _read(f, path, hf_name)
                sink.put(name, array.T if transpose else array, tensor=hf_name)
                del array
    return sink.build(initialise=VISION_PARAMS, seed=seed)


# ---------------------------------------------------------------------------------------------
# Writing


def _hf_tensors(model: LWMModel, dtype: np.dtype | None) -> Iterator[tuple[str, np.ndarray]]:
    wanted = _tensor_map(model.cfg)
    for name, host in iter_host_params(model):
        if name in VISION_PARAMS:
            continue
        hf_name, transpose = wanted[name]
        if transpose:
            host = host.T
        if dtype is not None:
            host = host.astype(dtype, copy=False)
        yield hf_name, np.ascontiguousarray(host)


def save_hf_llama(
    model: LWMModel,
    folder: str | os.PathLike,
    *,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    dtype: str | None = None,
    overwrite: bool = False,
) -> None:
    """Write the text model as a Hugging Face LLaMA folder that
    ``transformers.LlamaForCausalLM.from_pretrained`` loads: ``config.json`` and
    ``model.safetensors`` (or ``model-0000i-of-0000n.safetensors`` shards of at most
    ``max_shard_bytes`` and ``model.safetensors.index.json``).

    The vision embedding and head have no place in a LLaMA checkpoint and are left out.
    ``dtype`` (e.g. ``"bfloat16"``) casts on the way out; by default the parameters are written
    as they are, and reading them back gives bitwise the same model. Every file is written
    under a temporary name and renamed when complete; an existing export is replaced only with
    ``overwrite=True``.
    """
    cfg = model.cfg
    folder = Path(folder)
    if folder.exists() and not folder.is_dir():
        raise WeightsError(f"'{folder}' exists and is not a folder")
    old = [folder / CONFIG_FILE, folder / INDEX_FILE, *folder.glob("model*.safetensors")]
    old = [p for p in old if p.exists()]
    if old and not overwrite:
        raise WeightsError(
            f"'{folder}' already holds a model ({old[0].name}); pass overwrite=True to replace it"
        )
    folder.mkdir(parents=True, exist_ok=True)
    out_dtype = np_dtype(dtype) if dtype is not None else None

    # Shards are written under temporary names; their final names need the shard count.
    shards: list[tuple[Path, list[str], int]] = []
    current: dict[str, np.ndarray] = {}
    size = 0

    def flush() -> None:
        nonlocal current, size
        tmp = folder / f".shard-{len(shards):05d}.safetensors.tmp-{os.getpid()}"
        safetensors.numpy.save_file(current, str(tmp), metadata={"format": "pt"})
        shards.append((tmp, list(current), size))
        current, size = {}, 0

    try:
        for hf_name, host in _hf_tensors(model, out_dtype):
            if current and size + host.nbytes > max_shard_bytes:
                flush()
            current[hf_name] = host
            size += host.nbytes
        if current:
            flush()
        for p in old:
            p.unlink()
        if len(shards) == 1:
            os.replace(shards[0][0], folder / SINGLE_FILE)
        else:
            weight_map, total = {}, 0
            for i, (tmp, names, nbytes) in enumerate(shards):
                name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
                os.replace(tmp, folder / name)
                weight_map.update(dict.fromkeys(names, name))
                total += nbytes
            index = {"metadata": {"total_size": total}, "weight_map": weight_map}
            with atomic_path(folder / INDEX_FILE) as tmp:
                tmp.write_text(json.dumps(index, indent=2) + "\n")
        hf = hf_config_from_model(cfg, dtype=dtype)
        with atomic_path(folder / CONFIG_FILE) as tmp:
            tmp.write_text(json.dumps(hf, indent=2) + "\n")
    finally:
        for tmp, _, _ in shards:
            if tmp.exists():
                tmp.unlink()
