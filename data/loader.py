"""`TokenDatasetLoader`: training batches from an `lwm tokenize` dataset (tfds data source).

Each epoch the examples are shuffled by ``(seed, epoch)`` and laid out in rows of ``seq_len``:

- ``pack=True``: documents follow each other in a row, each with its own segment id (1, 2, ..;
  0 is padding) and positions restarting at 0, so attention never crosses a document. A
  document that does not fit in the rest of a row starts the next row (the rest is padding); a
  document longer than ``seq_len`` is split into ``seq_len`` pieces, each starting a row with
  positions from 0 (its last piece may be followed by other documents). Every token of the
  dataset is in exactly one row per epoch.
- ``pack=False``: one example per row, padded; an example longer than ``seq_len`` is truncated
  (its tail is dropped).

The plan (which pieces go in which row) is computed on every host from the example lengths
alone (``num_tokens-SPLIT.npy``, no record is decoded for it), the same on every host. Global
batch ``b`` is rows ``b*batch_size .. (b+1)*batch_size - 1``; host ``i`` of ``n`` takes its
``batch_size / n`` consecutive rows of each batch and reads only the examples in them, so hosts
read disjoint shares that together cover the dataset. The last batch of an epoch is completed
with padding rows, so every host has the same number of batches.

The state is ``{epoch, batch}`` (plus what checks that it belongs to this dataset): identical on
every host, JSON-serialisable, and a restored loader yields exactly the batches the original
would have. Targets are made in document order (`data.batches.make_training_batch`), then the
zigzag ``layout`` (if any) permutes each row.
"""

from __future__ import annotations

import os
from collections import OrderedDict
from pathlib import Path
from typing import Any

import numpy as np

from data.batches import make_training_batch
from data.dataset_io import read_lengths

__all__ = ["PackingPlan", "TokenDatasetLoader", "plan_epoch"]

STATE_KIND = "token_dataset"


class PackingPlan:
    """Rows of one epoch: row ``r`` holds pieces ``row_offsets[r] .. row_offsets[r+1]-1``,
    piece ``p`` being tokens ``start[p] : start[p] + length[p]`` of example ``example[p]``."""

    def __init__(self, example, start, length, row_offsets):
        self.example = np.asarray(example, np.int64)
        self.start = np.asarray(start, np.int64)
        self.length = np.asarray(length, np.int64)
        self.row_offsets = np.asarray(row_offsets, np.int64)

    @property
    def num_rows(self) -> int:
        return len(self.row_offsets) - 1

    def row(self, r: int) -> list[tuple[int, int, int]]:
        """The pieces of row ``r`` as (example, start, length); empty past the last row."""
        if r >= self.num_rows:
            return []
        lo, hi = self.row_offsets[r], self.row_offsets[r + 1]
        return [
            (int(e), int(s), int(n))
            for e, s, n in zip(
                self.example[lo:hi], self.start[lo:hi], self.length[lo:hi], strict=True
            )
        ]


def plan_epoch(order: np.ndarray, lengths: np.ndarray, seq_len: int, pack: bool) -> PackingPlan:
    """The rows of an epoch that visits the examples in ``order`` (module docstring)."""
    example: list[int] = []
    start: list[int] = []
    length: list[int] = []
    offsets = [0]
    used = 0

    def place(ex: int, s: int, n: int) -> None:
        nonlocal used
        if used and n > seq_len - used:  # close the row
            offsets.append(len(example))
            used = 0
        example.append(ex)
        start.append(s)
        length.append(n)
        used += n

    for ex in order.tolist():
        total = int(lengths[ex])
        if total == 0:
            continue
        if not pack:
            place(ex, 0, min(total, seq_len))
            offsets.append(len(example))
            used = 0
            continue
        for s in range(0, total, seq_len):
            place(ex, s, min(seq_len, total - s))
    if used:
        offsets.append(len(example))
    return PackingPlan(example, start, length, offsets)


class TokenDatasetLoader:
    """This host's share of each global batch of an `lwm tokenize` dataset (module docstring)."""

    def __init__(
        self,
        path: str | os.PathLike,
        *,
        split: str = "train",
        seed: int = 0,
        pack: bool = True,
        batch_size: int,
        seq_len: int,
        process_index: int = 0,
        process_count: int = 1,
        layout: np.ndarray | None = None,
    ):
        import tensorflow_datasets as tfds

        if batch_size % process_count:
            raise ValueError(
                f"batch size {batch_size} is not divisible by the {process_count} processes"
            )
        if not 0 <= process_index < process_count:
            raise ValueError(f"process_index {process_index} not in [0, {process_count})")
        path = Path(path)
        if not (path / "dataset_info.json").is_file():
            raise FileNotFoundError(
                f"'{path}' is not a token dataset (no dataset_info.json); make one with "
                "`lwm tokenize`"
            )
        builder = tfds.builder_from_directory(os.fspath(path))
        if split not in builder.info.splits:
            raise ValueError(
                f"dataset '{path}' has no split '{split}'; it has {', '.join(builder.info.splits)}"
            )
        self.path, self.split = path, split
        self.metadata = dict(builder.info.metadata or {})
        self.source = builder.as_data_source(split)
        self.lengths = read_lengths(path, split, self.source)
        if not self.lengths.sum():
            raise ValueError(f"dataset '{path}' split '{split}' has no tokens")
        self.seed, self.pack = seed, pack
        self.batch_size, self.seq_len = batch_size, seq_len
        self.local_rows = batch_size // process_count
        self.first_row = process_index * self.local_rows
        self.layout = layout
        self.epoch = 0
        self.batch = 0  # next batch of the epoch
        self._plan: tuple[int, PackingPlan] | None = None
        self._cache: OrderedDict[int, dict[str, np.ndarray]] = OrderedDict()

    # -- the loader protocol ----------------------------------------------------------------

    def state(self) -> dict[str, Any]:
        return {
            "kind": STATE_KIND,
            "epoch": self.epoch,
            "batch": self.batch,
            "seed": self.seed,
            "pack": self.pack,
            "seq_len": self.seq_len,
            "batch_size": self.batch_size,
            "num_examples": len(self.lengths),
        }

    def restore(self, state: dict[str, Any]) -> None:
        expected = self.state()
        keys = ("kind", "seed", "pack", "seq_len", "batch_size", "num_examples")
        differ = [k for k in keys if state.get(k) != expected[k]]
        if differ:
            raise ValueError(
                f"loader state {state} does not belong to this loader of '{self.path}' "
                f"({', '.join(differ)} differ)"
            )
        self.epoch, self.batch = int(state["epoch"]), int(state["batch"])

    def __iter__(self) -> TokenDatasetLoader:
        return self

    def __next__(self) -> dict[str, np.ndarray]:
        plan = self.plan(self.epoch)
        if self.batch >= self.batches_in_epoch(self.epoch):
            self.epoch, self.batch = self.epoch + 1, 0
            plan = self.plan(self.epoch)
        first = self.batch * self.batch_size + self.first_row
        rows = [plan.row(first + r) for r in range(self.local_rows)]
        self.batch += 1
        return self._assemble(rows)

    # -- planning ---------------------------------------------------------------------------

    def order(self, epoch: int) -> np.ndarray:
        """The order in which epoch ``epoch`` visits the examples."""
        return np.random.default_rng([self.seed, epoch]).permutation(len(self.lengths))

    def plan(self, epoch: int) -> PackingPlan:
        if self._plan is None or self._plan[0] != epoch:
            self._plan = (
                epoch,
                plan_epoch(self.order(epoch), self.lengths, self.seq_len, self.pack),
            )
        return self._plan[1]

    def batches_in_epoch(self, epoch: int) -> int:
        return -(-self.plan(epoch).num_rows // self.batch_size)

    # -- reading ----------------------------------------------------------------------------

    def _example(self, index: int) -> dict[str, np.ndarray]:
        if index in self._cache:
            self._cache.move_to_end(index)
            return self._cache[index]
        record = self.source[index]
        example = {k: np.asarray(record[k]) for k in ("tokens", "vision_mask", "loss_mask")}
        self._cache[index] = example
        if len(self._cache) > 16:  # a long document spans consecutive rows
            self._cache.popitem(last=False)
        return example

    def _assemble(self, rows: list[list[tuple[int, int, int]]]) -> dict[str, np.ndarray]:
        shape = (len(rows), self.seq_len)
        tokens = np.zeros(shape, np.int32)
        vision = np.zeros(shape, np.bool_)
        loss = np.zeros(shape, np.float32)
        segments = np.zeros(shape, np.int32)
        positions = np.zeros(shape, np.int32)
        for r, pieces in enumerate(rows):
            at = 0
            for segment, (ex, start, n) in enumerate(pieces, 1):
                example = self._example(ex)
                piece = slice(start, start + n)
                tokens[r, at : at + n] = example["tokens"][piece]
                vision[r, at : at + n] = example["vision_mask"][piece]
                loss[r, at : at + n] = example["loss_mask"][piece]
                segments[r, at : at + n] = segment
                positions[r, at : at + n] = np.arange(n)
                at += n
        return make_training_batch(tokens, vision, loss, segments, positions, self.layout)
