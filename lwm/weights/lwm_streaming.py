"""LWM's released JAX checkpoints: the EasyLM/tux "streaming" msgpack format.

    model = load_lwm_streaming("params::/ckpt/LWM-Chat-1M-Jax/params", cfg, mesh=mesh)
    save_lwm_streaming(model, "/tmp/params")    # LWM's code loads it with params::/tmp/params

The format (tux ``StreamingCheckpointer``, checked against ``haoliuhl/tux`` and
``wilson1yan/tux`` ``tux/checkpoint.py``): a file that is nothing but consecutive msgpack
objects, each a pair ``(key_path, flax.serialization.to_bytes(array))``, where ``key_path`` is
the list of dict keys of the flattened parameter tree. A ``params::`` file holds
``train_state.params['params']`` (keys start at ``transformer``/``lm_head``/``vision_head``);
a ``trainstate::`` file holds the whole train state, whose parameters sit under
``('params', 'params', ...)`` beside ``step`` and ``opt_state`` (which are skipped here).
Released checkpoints are saved with ``float_dtype='bf16'``; tensors are cast to
``cfg.param_dtype``.

Names, from ``LargeWorldModel/LWM`` ``lwm/llama.py`` and ``lwm/vision_llama.py``
(flax ``nn.Dense`` kernels are ``[in, out]`` like ours, ``nn.Embed`` tables ``[vocab, dim]``)::

    transformer/wte/embedding                     embed_text
    transformer/vte/embedding                     embed_vision     (vision models only)
    transformer/h/{i}/attention_norm/kernel       layers.{i}.attn_norm
    transformer/h/{i}/attention/{wq,wk,wv,wo}/kernel   layers.{i}.attn.{q,k,v,o}
    transformer/h/{i}/ffn_norm/kernel             layers.{i}.mlp_norm
    transformer/h/{i}/feed_forward/w1/kernel      layers.{i}.mlp.gate   (w2(silu(w1 x) * w3 x))
    transformer/h/{i}/feed_forward/w2/kernel      layers.{i}.mlp.down
    transformer/h/{i}/feed_forward/w3/kernel      layers.{i}.mlp.up
    transformer/ln_f/kernel                       final_norm
    lm_head/kernel                                lm_head          (absent when tied)
    vision_head/kernel                            vision_head      (absent when tied)

With ``scan_layers=True`` (LWM's default, and what its inference scripts use) the blocks are
one ``nn.scan`` module: ``transformer/h/scan_decoder/...`` with the layer axis at
``param_scan_axis`` (0 by default, 1 possible); both layouts load.

RoPE: LWM rotates interleaved pairs ``(x[2j], x[2j+1])`` (``apply_rotary_emb`` views the head
as complex numbers); we rotate halves ``(x[j], x[j + d/2])``. The output columns of ``wq`` and
``wk`` are permuted per head on import (the permutation of Hugging Face's
``convert_llama_weights_to_hf``) and back on export. LWM's attention has as many K/V heads as
query heads and ``head_dim = hidden / heads``; exporting other shapes is refused.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
from flax.serialization import msgpack_restore, to_bytes
from jax.sharding import Mesh

from lwm.base.files import atomic_path
from lwm.config import ModelConfig
from lwm.model import LWMModel
from lwm.weights.common import (
    ParamSink,
    WeightsError,
    flat_params,
    host_layer_stack,
    host_param,
    np_dtype,
    unstacked_specs,
)

__all__ = [
    "interleaved_to_rotate_half",
    "iter_streaming",
    "load_lwm_streaming",
    "lwm_config",
    "rotate_half_to_interleaved",
    "save_lwm_streaming",
    "split_load_spec",
]

# Per-layer suffix -> LWM's path under the block.
_LAYER_KEYS: dict[str, tuple[str, ...]] = {
    "attn_norm": ("attention_norm", "kernel"),
    "attn.q": ("attention", "wq", "kernel"),
    "attn.k": ("attention", "wk", "kernel"),
    "attn.v": ("attention", "wv", "kernel"),
    "attn.o": ("attention", "wo", "kernel"),
    "mlp_norm": ("ffn_norm", "kernel"),
    "mlp.gate": ("feed_forward", "w1", "kernel"),
    "mlp.down": ("feed_forward", "w2", "kernel"),
    "mlp.up": ("feed_forward", "w3", "kernel"),
}
_TOP_KEYS: dict[str, tuple[str, ...]] = {
    "embed_text": ("transformer", "wte", "embedding"),
    "embed_vision": ("transformer", "vte", "embedding"),
    "final_norm": ("transformer", "ln_f", "kernel"),
    "lm_head": ("lm_head", "kernel"),
    "vision_head": ("vision_head", "kernel"),
}
_ROPE_PARAMS = ("attn.q", "attn.k")
_SCAN_MODULE = "scan_decoder"
_TRAIN_STATE_FIELDS = ("step", "opt_state")  # skipped in trainstate files
_LOAD_TYPES = ("params", "trainstate_params", "trainstate")
_READ_SIZE = 80 * 2**20  # as tux


# ---------------------------------------------------------------------------------------------
# RoPE layouts


def _permute_heads(w: np.ndarray, head_dim: int, pairs_first: bool) -> np.ndarray:
    out = w.shape[-1]
    if out % head_dim:
        raise WeightsError(f"a q/k kernel of width {out} is not whole heads of {head_dim}")
    a, b = (head_dim // 2, 2) if pairs_first else (2, head_dim // 2)
    split = w.reshape(*w.shape[:-1], out // head_dim, a, b)
    return np.swapaxes(split, -1, -2).reshape(w.shape)


def interleaved_to_rotate_half(w: np.ndarray, head_dim: int) -> np.ndarray:
    """Permute the output columns of a q/k kernel ``[..., in, heads * head_dim]`` from
    interleaved RoPE pairs (LWM, Meta's LLaMA) to the rotate-half layout (ours, HF's)."""
    return _permute_heads(w, head_dim, pairs_first=True)


def rotate_half_to_interleaved(w: np.ndarray, head_dim: int) -> np.ndarray:
    """The inverse of `interleaved_to_rotate_half`."""
    return _permute_heads(w, head_dim, pairs_first=False)


# ---------------------------------------------------------------------------------------------
# Reading


def split_load_spec(spec: str | os.PathLike) -> tuple[str, Path]:
    """``'params::PATH'`` (LWM's ``--load_checkpoint`` syntax) or a bare path -> (type, path)."""
    text = os.fspath(spec)
    kind, sep, rest = text.partition("::")
    if not sep:
        return "params", Path(text)
    if kind not in _LOAD_TYPES:
        raise WeightsError(
            f"'{text}': load type '{kind}' is not a streaming checkpoint "
            f"(expected one of {', '.join(t + '::' for t in _LOAD_TYPES)})"
        )
    return kind, Path(rest)


def iter_streaming(path: str | os.PathLike) -> Iterator[tuple[tuple[str, ...], Any]]:
    """``(key path, value)`` for each entry of a streaming checkpoint, one at a time."""
    path = Path(path)
    if not path.is_file():
        what = "is a folder, not a file" if path.is_dir() else "does not exist"
        raise WeightsError(f"LWM checkpoint '{path}' {what}")
    with open(path, "rb") as f:
        unpacker = msgpack.Unpacker(f, read_size=_READ_SIZE, max_buffer_size=0, raw=False)
        try:
            for entry in unpacker:
                if not (isinstance(entry, list | tuple) and len(entry) == 2):
                    raise WeightsError(f"{path}: not a streaming checkpoint (entry {entry!r:.60})")
                key, value = entry
                yield tuple(str(k) for k in key), msgpack_restore(value)
        except (
            msgpack.ExtraData,
            msgpack.FormatError,
            msgpack.StackError,
            ValueError,
            TypeError,
        ) as e:
            if isinstance(e, WeightsError):
                raise
            raise WeightsError(f"{path}: not a streaming checkpoint ({e})") from None


def _param_key(key: tuple[str, ...]) -> tuple[str, ...] | None:
    """The key inside the parameter tree, or None for train-state entries to skip."""
    if key[:2] == ("params", "params"):
        return key[2:]
    if key[:1] == ("params",):
        return key[1:]
    if key[:1] and key[0] in _TRAIN_STATE_FIELDS:
        return None
    return key


def _stacked_layers(
    array: np.ndarray, layer_shape: tuple[int, ...], layers: int, scan_axis: int | None
) -> np.ndarray | None:
    """``[layers, *layer_shape]`` from a scanned kernel with its layer axis at 0 or 1."""
    axis0 = array.shape == (layers, *layer_shape)
    axis1 = array.ndim >= 2 and array.shape == (layer_shape[0], layers, *layer_shape[1:])
    if scan_axis == 0 or (scan_axis is None and axis0):
        return array if axis0 else None
    if scan_axis == 1 or (scan_axis is None and axis1):
        return np.moveaxis(array, 1, 0) if axis1 else None
    return None


def load_lwm_streaming(
    path: str | os.PathLike,
    cfg: ModelConfig,
    mesh: Mesh | None = None,
    *,
    scan_axis: int | None = None,
    seed: int = 0,
) -> LWMModel:
    """An `LWMModel` from an LWM/EasyLM streaming checkpoint (``params::PATH``,
    ``trainstate_params::PATH``, ``trainstate::PATH`` or a bare path), each tensor placed into
    its sharding on ``mesh`` as it is read.

    Per-layer (``h/{i}``) and scanned (``h/scan_decoder``) checkpoints both load, into a model
    with or without ``scan_layers``; ``scan_axis`` (0 or 1) is LWM's ``param_scan_axis`` and is
    detected from the shapes when None. A text-only LWM checkpoint (no ``vte``/``vision_head``)
    loads into the text part; the vision embedding and head are then initialised as
    ``create_model(cfg, seed=seed)`` would. LWM has no grouped-query attention, so ``cfg`` must
    have ``num_kv_heads == num_heads``.
    """
    _, file = split_load_spec(path)
    sink = ParamSink(cfg, mesh, file)
    top = {v: k for k, v in _TOP_KEYS.items()}
    layer = {v: k for k, v in _LAYER_KEYS.items()}
    seen_vision = False
    for raw_key, value in iter_streaming(file):
        key = _param_key(raw_key)
        if key is None:
            continue
        tensor = "/".join(raw_key)
        if not isinstance(value, np.ndarray):
            raise WeightsError(f"{file}: entry '{tensor}' is not an array")
        if not (value.dtype.kind in "biuf" or value.dtype == np_dtype("bfloat16")):
            raise WeightsError(f"{file}: entry '{tensor}' holds {value.dtype}, not numbers")
        if key in top:
            name = top[key]
            if (name == "lm_head" and cfg.tie_word_embeddings) or (
                name == "vision_head" and cfg.tie_vision_embeddings
            ):
                continue  # a tied model has no separate head
            seen_vision |= name == "embed_vision"
            sink.put(name, value, tensor=tensor)
            continue
        if key[:2] != ("transformer", "h") or len(key) < 4 or key[3:] not in layer:
            raise WeightsError(f"{file}: unexpected tensor '{tensor}'")
        suffix = layer[key[3:]]
        if key[2] == _SCAN_MODULE:
            spec = sink.specs[f"layers.0.{suffix}"]
            stacked = _stacked_layers(value, spec.shape, cfg.num_layers, scan_axis)
            if stacked is None:
                raise WeightsError(
                    f"{file}: tensor '{tensor}' has shape {tuple(value.shape)}, but the model "
                    f"needs {cfg.num_layers} stacked layers of {spec.shape}"
                )
            if suffix in _ROPE_PARAMS:
                stacked = interleaved_to_rotate_half(stacked, cfg.head_dim)
            sink.put_stacked(suffix, stacked, tensor=tensor)
        elif key[2].isdigit():
            name = f"layers.{int(key[2])}.{suffix}"
            if suffix in _ROPE_PARAMS:
                sink.check(name, value.shape, tensor)
                value = interleaved_to_rotate_half(value, cfg.head_dim)
            sink.put(name, value, tensor=tensor)
        else:
            raise WeightsError(f"{file}: unexpected tensor '{tensor}'")
        del value
    # A model with `vision_grid` (and `vision_window`) starts those embeddings afresh (LWM has
    # none).
    initialise = ("embed_vision_row", "embed_vision_col", "embed_vision_window")
    if not seen_vision:
        initialise += ("embed_vision", "vision_head")
    missing = [n for n in sink.missing() if n not in initialise]
    if missing:
        names = ", ".join(f"'{'/'.join(_lwm_key(n))}'" for n in missing[:5])
        more = f" (and {len(missing) - 5} more)" if len(missing) > 5 else ""
        raise WeightsError(f"{file}: missing tensor {names}{more}")
    return sink.build(initialise=initialise, seed=seed)


# ---------------------------------------------------------------------------------------------
# Writing


def _lwm_key(name: str, scanned: bool = False) -> tuple[str, ...]:
    if name in _TOP_KEYS:
        return _TOP_KEYS[name]
    _, i, suffix = name.split(".", 2)
    return ("transformer", "h", _SCAN_MODULE if scanned else i, *_LAYER_KEYS[suffix])


def _check_lwm_shapes(cfg: ModelConfig) -> None:
    if cfg.rope_dims is not None:
        raise WeightsError(
            f"LWM's model rotates every dimension of a head: model.rope_dims {cfg.rope_dims} "
            "cannot be saved in its format"
        )
    if cfg.vision_grid is not None:
        raise WeightsError(
            f"LWM's model has no row/column embeddings of vision codes: model.vision_grid "
            f"{list(cfg.vision_grid)} cannot be saved in its format"
        )
    if cfg.num_kv_heads != cfg.num_heads:
        raise WeightsError(
            f"LWM's model has no grouped-query attention: num_kv_heads ({cfg.num_kv_heads}) "
            f"must equal num_heads ({cfg.num_heads}) to save in its format"
        )
    if cfg.head_dim * cfg.num_heads != cfg.hidden_size:
        raise WeightsError(
            f"LWM's model has head_dim = hidden_size / num_heads; head_dim {cfg.head_dim} "
            f"with hidden_size {cfg.hidden_size} and {cfg.num_heads} heads cannot be saved"
        )


def lwm_config(cfg: ModelConfig, *, scan_layers: bool = False) -> dict[str, Any]:
    """LWM's ``VideoLLaMAConfig`` fields for ``cfg`` (for its ``--load_llama_config=json::``)."""
    return {
        "vocab_size": cfg.text_vocab_size,
        "vision_vocab_size": cfg.vision_vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "max_sequence_length": cfg.max_seq_len,
        "rms_norm_eps": cfg.rms_norm_eps,
        "theta": cfg.rope_theta,
        "initializer_range": cfg.initializer_range,
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "tie_vision_embeddings": cfg.tie_vision_embeddings,
        "scan_layers": scan_layers,
        "param_scan_axis": 0,
    }


def save_lwm_streaming(
    model: LWMModel,
    path: str | os.PathLike,
    *,
    scan_layers: bool = False,
    float_dtype: str | None = None,
    text_only: bool = False,
) -> None:
    """Write the model as an LWM ``params::`` streaming checkpoint (LWM's names, interleaved
    RoPE layout) that LWM's code and `load_lwm_streaming` read.

    ``scan_layers`` writes LWM's scanned layout (``h/scan_decoder``, layer axis 0) instead of
    one block per layer; ``float_dtype`` (e.g. ``"bfloat16"``, LWM's default) casts on the way
    out; ``text_only`` leaves out the vision embedding and head (an LWM-Text checkpoint). The
    file is written under a temporary name and renamed when complete.
    """
    cfg = model.cfg
    _check_lwm_shapes(cfg)
    out_dtype = np_dtype(float_dtype) if float_dtype else None
    skip = {"embed_vision", "vision_head"} if text_only else set()
    packer = msgpack.Packer()
    params = flat_params(model)
    names = [n for n in unstacked_specs(cfg) if n not in skip]
    _, file = split_load_spec(path)
    with atomic_path(file) as tmp, open(tmp, "wb") as f:

        def write(key: tuple[str, ...], host: np.ndarray, rope: bool) -> None:
            if rope:
                host = rotate_half_to_interleaved(host, cfg.head_dim)
            if out_dtype is not None:
                host = host.astype(out_dtype, copy=False)
            f.write(packer.pack((list(key), to_bytes(np.ascontiguousarray(host)))))

        for name in names:
            if not name.startswith("layers."):
                write(_lwm_key(name), host_param(model, name, params), rope=False)
            elif not scan_layers:
                rope = name.split(".", 2)[2] in _ROPE_PARAMS
                write(_lwm_key(name), host_param(model, name, params), rope=rope)
            elif name.startswith("layers.0."):  # scanned: one stacked tensor per suffix
                suffix = name.split(".", 2)[2]
                key = _lwm_key(name, scanned=True)
                write(key, host_layer_stack(model, suffix, params), rope=suffix in _ROPE_PARAMS)
