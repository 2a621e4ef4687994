"""The data `lwm train` reads: the loader its config asks for (`data.source`: synthetic tokens
or an `lwm tokenize` dataset), checked against the model before the first step: the dataset's
frame markers must be this version's (`data.tokens`), and its text vocabulary and VQGAN
codebook must fit the model's tables."""

from __future__ import annotations

import math
from typing import Any

import jax
import numpy as np

from data.batches import Loader, SyntheticTokenLoader
from data.tokens import frame_markers
from lwm.config import Config, ConfigError, ModelConfig

__all__ = [
    "TrainingError",
    "TrainingInputError",
    "build_loader",
    "check_dataset",
    "restore_loader",
    "window_spec",
]


class TrainingError(RuntimeError):
    """The run started and cannot go on (a non-finite loss, trained positions that did not fit
    ...): `lwm train` exits with status 1; the message says why."""


class TrainingInputError(ConfigError):
    """The config does not fit what it names (the dataset, a manifest, the VQGAN, the run in
    ``train.output_dir``): refused before the first step, as bad input (`lwm train` exits with
    status 2, like any `ConfigError`); the message names the setting and the problem."""


def build_loader(cfg: Config, seq_len: int, layout: np.ndarray | None) -> Loader:
    data = cfg.data
    common = dict(
        batch_size=cfg.train.batch_size,
        seq_len=seq_len,
        process_index=jax.process_index(),
        process_count=jax.process_count(),
        layout=layout,
        window=window_spec(cfg.model),
    )
    if data.source == "synthetic":
        return SyntheticTokenLoader(
            text_vocab_size=cfg.model.text_vocab_size, seed=data.shuffle_seed, **common
        )
    from data.loader import TokenDatasetLoader  # the `lwm tokenize` datasets

    try:
        loader = TokenDatasetLoader(
            data.source,
            split=data.split,
            seed=data.shuffle_seed,
            pack=data.pack,
            qa_turns=data.qa_turns,
            chained_share=data.qa_chained_share,
            read_threads=data.read_threads,
            prefetch=data.prefetch,
            read_processes=data.read_processes,
            **common,
        )
    except ValueError as e:  # a dataset that does not fit the settings, or one refused
        raise TrainingInputError(str(e)) from None
    check_dataset(data.source, loader.metadata, cfg.model)
    return loader


# The setting behind each entry of a loader's state that must be the same on a resume.
STATE_SETTINGS = {
    "kind": "data.source",
    "num_examples": "data.source (its examples)",
    "seed": "data.shuffle_seed",
    "pack": "data.pack",
    "qa_turns": "data.qa_turns",
    "chained_share": "data.qa_chained_share",
    "seq_len": "train.seq_len",
    "batch_size": "train.batch_size",
}


def restore_loader(loader: Loader, state: dict[str, Any], run: str) -> None:
    """Put ``loader`` where the checkpoint of the run in ``run`` left its data (``state``); a
    `TrainingInputError` naming the settings when the run read its data otherwise (its place
    in them does not carry over)."""
    try:
        loader.restore(state)
    except ValueError as e:
        ours = loader.state()
        differ = [
            f"{name}: {state.get(key)} there, {ours.get(key)} here"
            for key, name in STATE_SETTINGS.items()
            if (key == "kind" or (key in state and key in ours)) and state.get(key) != ours.get(key)
        ]
        raise TrainingInputError(
            f"train.output_dir '{run}' holds a run that read its data otherwise "
            f"({'; '.join(differ) if differ else e}); resume it with the settings it ran with, "
            f"or start a new run from its weights (train.init_from=run:{run} and another "
            "train.output_dir)"
        ) from None


def window_spec(model: ModelConfig) -> tuple[tuple[int, int], int] | None:
    """What the loader needs to give each code its neighbours (`data.batches.WINDOW_FIELD`),
    or None for a model without `ModelConfig.vision_window`."""
    if not model.vision_window:
        return None
    assert model.vision_grid is not None  # validated with the config
    return tuple(model.vision_grid), model.vision_window


def check_dataset(source: str, metadata: dict[str, Any], model: ModelConfig) -> None:
    """Refuse (`TrainingInputError`, naming both sides) a dataset whose frame markers are not this
    version's or whose text vocabulary, VQGAN codebook or code grid does not fit ``model``'s
    tables."""
    vqgan = metadata.get("vqgan") or {}
    codes = int(vqgan.get("codebook_size", 0))
    if model.vision_codes and codes > model.vision_codes:
        raise TrainingInputError(
            f"dataset '{source}' was tokenized with a VQGAN of {codes} codes, but "
            f"model.vision_codes is {model.vision_codes}"
        )
    per_frame = int(vqgan.get("tokens_per_frame", 0))
    if model.vision_grid is not None and per_frame and math.prod(model.vision_grid) != per_frame:
        rows, cols = model.vision_grid
        raise TrainingInputError(
            f"dataset '{source}' has {per_frame} codes per frame, but model.vision_grid "
            f"[{rows}, {cols}] is a grid of {rows * cols}"
        )
    markers = metadata.get("markers") or {}
    ours = frame_markers()
    if any(markers.get(k, v) != v for k, v in ours.items()):
        found = {k: markers.get(k) for k in ours}
        raise TrainingInputError(
            f"dataset '{source}' marks frames with {found}, but this version's token stream "
            f"uses {ours} (data.tokens): tokenize it again"
        )
    vocab = int(metadata["text_tokenizer"]["vocab_size"])
    if vocab > model.text_vocab_size:
        raise TrainingInputError(
            f"dataset '{source}' was tokenized with a text vocabulary of {vocab} tokens, "
            f"but model.text_vocab_size is {model.text_vocab_size}"
        )
