"""The on-disk token dataset: a tfds dataset in array_record format, written without TensorFlow.

    OUT/
      dataset_info.json, features.json, metadata.json     tfds metadata (metadata.json: vocabulary,
                                                          markers, VQGAN, sampling, counts)
      lwm_tokens-train.array_record-00000-of-0000N ..     one record per example
      num_tokens-train.npy                                int32 length of every example, in order

Read it with ``tfds.builder_from_directory(OUT).as_data_source("train")`` (random access, no
TensorFlow): each record is a dict with ``tokens`` int32 ``[n]``, ``vision_mask`` bool ``[n]``,
``loss_mask`` uint8 ``[n]``, ``source`` (bytes: the video/image path, empty for text),
``kind`` (bytes: video/image/text), ``num_frames`` int32. ``num_tokens-*.npy`` lets the loader
plan its packing without decoding every record.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

__all__ = [
    "DATASET_NAME",
    "ShardWriter",
    "check_features_file",
    "features",
    "lengths_path",
    "read_lengths",
    "read_metadata",
    "shard_name",
    "write_metadata",
]

DATASET_NAME = "lwm_tokens"


def features():
    import tensorflow_datasets as tfds

    tensor = tfds.features.Tensor
    raw = tfds.features.Encoding.BYTES  # raw bytes: compact and fast to decode
    return tfds.features.FeaturesDict(
        {
            "tokens": tensor(shape=(None,), dtype=np.int32, encoding=raw),
            "vision_mask": tensor(shape=(None,), dtype=np.bool_, encoding=raw),
            "loss_mask": tensor(shape=(None,), dtype=np.uint8, encoding=raw),
            "source": tfds.features.Text(),
            "kind": tfds.features.Text(),
            "num_frames": tfds.features.Scalar(dtype=np.int32),
        }
    )


def shard_name(split: str, shard: int, num_shards: int) -> str:
    return f"{DATASET_NAME}-{split}.array_record-{shard:05d}-of-{num_shards:05d}"


def lengths_path(directory: str | os.PathLike, split: str) -> Path:
    return Path(directory) / f"num_tokens-{split}.npy"


class ShardWriter:
    """Serialized examples into one array_record file (written under a temporary name)."""

    def __init__(self, path: str | os.PathLike):
        from array_record.python.array_record_module import ArrayRecordWriter

        self.path = Path(path)
        self._tmp = self.path.with_name(f".{self.path.name}.tmp")
        from tensorflow_datasets.core.example_serializer import ExampleSerializer

        self._features = features()
        self._serializer = ExampleSerializer(self._features.get_serialized_info())
        # group_size:1 is what tfds writes for random access.
        self._writer = ArrayRecordWriter(str(self._tmp), "group_size:1")
        self.count = 0
        self.num_bytes = 0

    def write(self, example: dict[str, Any]) -> None:
        # What `features().serialize_example` writes, with the proto's feature map in sorted
        # order: protobuf orders map entries differently in every process otherwise, and the
        # same records would make other bytes on every run.
        proto = self._serializer.get_tf_example(self._features.encode_example(example))
        data = proto.SerializeToString(deterministic=True)
        self._writer.write(data)
        self.count += 1
        self.num_bytes += len(data)

    def close(self) -> None:
        self._writer.close()
        os.replace(self._tmp, self.path)


def write_metadata(
    directory: str | os.PathLike,
    split: str,
    shard_lengths: Sequence[int],
    num_bytes: int,
    metadata: dict[str, Any],
    description: str,
) -> None:
    """dataset_info.json, features.json and metadata.json for shards already in ``directory``."""
    import tensorflow_datasets as tfds

    info = tfds.core.SplitInfo(
        name=split, shard_lengths=list(shard_lengths), num_bytes=num_bytes, filename_template=None
    )
    tfds.folder_dataset.write_metadata(
        data_dir=os.fspath(directory),
        features=features(),
        split_infos=[info],
        version="1.0.0",
        check_data=False,
        description=description,
        metadata=tfds.core.MetadataDict(metadata),
    )


def check_features_file(directory: str | os.PathLike) -> None:
    """Refuse (ValueError) a ``features.json`` that names a feature class outside
    tensorflow_datasets: tfds imports the module of every ``pythonClassName`` it reads, so a
    dataset received from someone else could otherwise make the reader import any module (one
    installed, or one beside where the command runs). Ours name tfds's own classes only."""
    import json

    path = Path(directory) / "features.json"
    if not path.is_file():
        return  # tfds says what is missing
    try:
        content = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"'{path}' is not readable JSON: {e}") from None
    names: list[Any] = []
    stack = [content]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            if "pythonClassName" in node:
                names.append(node["pythonClassName"])
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)
    for name in names:
        if not (isinstance(name, str) and name.startswith("tensorflow_datasets.core.features.")):
            raise ValueError(
                f"'{path}' names the feature class {name!r:.80}, which is not one of "
                "tensorflow_datasets' own: refusing to import it"
            )


def read_lengths(directory: str | os.PathLike, split: str, source: Any) -> np.ndarray:
    """Token counts of every example: from ``num_tokens-SPLIT.npy``, or by reading ``source``
    (a data source of a dataset written by another tool)."""
    path = lengths_path(directory, split)
    if path.is_file():
        lengths = np.load(path, allow_pickle=False).astype(np.int64)
        if len(lengths) != len(source):
            raise ValueError(
                f"'{path}' lists {len(lengths)} examples but the split has {len(source)}"
            )
        return lengths
    return np.asarray([len(source[i]["tokens"]) for i in range(len(source))], np.int64)


def read_metadata(directory: str | os.PathLike) -> dict[str, Any]:
    """``metadata.json`` of a token dataset (text tokenizer, markers, VQGAN, sampling, input)."""
    import json

    path = Path(directory) / "metadata.json"
    if not path.is_file():
        raise FileNotFoundError(f"'{directory}' is not a token dataset (no metadata.json)")
    return json.loads(path.read_text())
