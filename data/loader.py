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
- ``qa_turns="isolated"``: each document's segment ids and positions come by turn
  (`data.tokens.record_turns`, `data.batches.turn_segment_ids`): every question turn of a QA
  record sees the record's video and itself, at the positions right after the video, and not
  the other turns. A later piece of a split document is one turn 0.
- ``qa_turns="mixed"``: each epoch a share ``chained_share`` of the records, drawn by
  ``(seed, epoch)``, is chained (one turn 0, each turn after the ones before it, as `lwm chat`
  asks) and the others isolated, so a model learns every question as the first turn and also
  after other turns.
- A record's answers marked ``"learn": "alone"`` (``loss_mask`` `data.tokens.LOSS_ALONE`) are
  learned where their turn is isolated and not where it is chained (``qa_turns="chained"``,
  a chained record of ``mixed``, a later piece of a split record): there an earlier turn gives
  them away (`data.tokens.loss_weight`).

The plan (which pieces go in which row) is computed on every host from the example lengths
alone (``num_tokens-SPLIT.npy``, no record is decoded for it), the same on every host. Global
batch ``b`` is rows ``b*batch_size .. (b+1)*batch_size - 1``; host ``i`` of ``n`` takes its
``batch_size / n`` consecutive rows of each batch and reads only the examples in them, so hosts
read disjoint shares that together cover the dataset. The last batch of an epoch is completed
with padding rows, so every host has the same number of batches.

Reading runs on grain (`grain.MapDataset` -> `IterDataset`): global batch ``g`` (counted over
all epochs) is one element, made by a pure function of ``g`` from the plan, and ``read_threads``
background threads read and pack the next ``prefetch`` batches while the step runs
(``read_threads=0``: each batch is read when asked for, in the caller's thread, without grain).
With ``read_processes`` > 0 that work runs in as many worker processes (grain's
``mp_prefetch``, batches in order), so that it does not share the interpreter lock of the
process that trains.

The state is grain's iterator state (the next global batch; with worker processes, none:
their pipeline starts at that batch) with ``{epoch, batch}`` and what checks that it belongs to
this dataset: identical on every host, JSON-serialisable, and a
restored loader yields exactly the batches the original would have (batches read ahead but not
yet taken are not part of it). Targets are made in document order
(`data.batches.make_training_batch`), then the zigzag ``layout`` (if any) permutes each row.
"""

from __future__ import annotations

import os
import threading
import time
from collections import OrderedDict
from pathlib import Path
from typing import Any

import numpy as np

from data.batches import (
    MAX_TURN_DOCUMENTS,
    MAX_TURNS,
    QA_CHAINED_SHARE,
    QA_TURNS,
    WindowSpec,
    make_training_batch,
    turn_segment_ids,
)
from data.dataset_io import check_features_file, read_lengths
from data.tokens import frame_cells, frame_window, loss_weight, record_turns, window_offsets

__all__ = ["PackingPlan", "TokenDatasetLoader", "plan_epoch"]

STATE_KIND = "token_dataset"
# What a loader keeps of the records it read (`TokenDatasetLoader.record`), per process.
RECORD_CACHE_BYTES = 256 << 20


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


def _exit_with_parent(_index: int, _count: int) -> None:
    """In each worker process (`read_processes`): end it once the training process is gone,
    as after a kill -9, instead of leaving it waiting to hand over its next batch."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(0)

    threading.Thread(target=watch, name="lwm-parent-watch", daemon=True).start()


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
        window: WindowSpec | None = None,
        read_threads: int = 2,
        prefetch: int = 4,
        read_processes: int = 0,
        qa_turns: str = "chained",
        chained_share: float = QA_CHAINED_SHARE,
    ):
        import tensorflow_datasets as tfds

        if qa_turns not in QA_TURNS:
            raise ValueError(f"unknown qa_turns {qa_turns!r}; choose one of {', '.join(QA_TURNS)}")
        if not 0.0 <= chained_share <= 1.0:
            raise ValueError(f"chained_share {chained_share} is not in [0, 1]")
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
        check_features_file(path)  # before tfds imports the modules it names
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
        self.seed, self.pack, self.qa_turns = seed, pack, qa_turns
        self.chained_share = float(chained_share) if qa_turns == "mixed" else None
        self._turn_ids: tuple[list[int], int] | None = None  # </vision> ids, EOS id
        if qa_turns != "chained":
            text = self.metadata.get("text_tokenizer") or {}
            if text.get("eos_id") is None or not text.get("vision_end"):
                raise ValueError(
                    f"dataset '{path}': {qa_turns} QA turns need the EOS id and the </vision> ids "
                    "of its text tokenizer (metadata.json, text_tokenizer), which it lacks"
                )
            self._turn_ids = ([int(i) for i in text["vision_end"]], int(text["eos_id"]))
        self.batch_size, self.seq_len = batch_size, seq_len
        self.local_rows = batch_size // process_count
        self.first_row = process_index * self.local_rows
        self.layout, self.window = layout, window
        self.read_threads, self.prefetch = read_threads, prefetch
        if read_processes < 0:
            raise ValueError(f"read_processes {read_processes} is negative")
        self.read_processes = read_processes
        self._lock = threading.RLock()  # plans are made once, by whichever thread needs one
        self._plans: dict[int, PackingPlan] = {}
        self._chained: dict[int, np.ndarray] = {}
        self._records: OrderedDict[int, dict[str, np.ndarray]] = OrderedDict()  # `record`
        self._record_bytes = 0
        self._epoch_starts = [0]  # global batch at which each epoch starts
        self._next = 0  # the next global batch to hand out
        self._iterator = None  # grain's, made on first use
        self._resume: dict | None = None  # grain state to start it from

    # -- the loader protocol ----------------------------------------------------------------

    def state(self) -> dict[str, Any]:
        epoch, batch = self.locate(self._next)
        state = {
            "kind": STATE_KIND,
            "epoch": epoch,
            "batch": batch,
            "seed": self.seed,
            "pack": self.pack,
            "qa_turns": self.qa_turns,
            "chained_share": self.chained_share,
            "seq_len": self.seq_len,
            "batch_size": self.batch_size,
            "num_examples": len(self.lengths),
        }
        if self._iterator is not None and not self.read_processes:
            state["grain"] = self._iterator.get_state()
        return state

    def restore(self, state: dict[str, Any]) -> None:
        expected = self.state()
        keys = ("kind", "seed", "pack", "seq_len", "batch_size", "num_examples")
        differ = [k for k in keys if state.get(k) != expected[k]]
        if state.get("qa_turns", "chained") != self.qa_turns:  # states before it had chained
            differ.append("qa_turns")
        if state.get("chained_share") != self.chained_share:
            differ.append("chained_share")
        if differ:
            raise ValueError(
                f"loader state {state} does not belong to this loader of '{self.path}' "
                f"({', '.join(differ)} differ)"
            )
        self._next = self.global_batch(int(state["epoch"]), int(state["batch"]))
        # grain's state of a dataset whose element i is global batch i (a state saved without
        # grain, read_threads=0, is the same position in grain's form)
        self._resume = state.get("grain") or {"next_index": self._next}
        if int(self._resume.get("next_index", -1)) != self._next:
            raise ValueError(f"loader state {state}: grain's position is not its epoch/batch")
        self.close()

    def __iter__(self) -> TokenDatasetLoader:
        return self

    def close(self) -> None:
        """Stop reading ahead (the worker processes of `read_processes`, if started)."""
        iterator, self._iterator = self._iterator, None
        if iterator is not None and hasattr(iterator, "close"):
            iterator.close()

    def __getstate__(self) -> dict[str, Any]:
        """What a worker process gets (`read_processes`): the loader without its lock and
        iterator."""
        state = dict(self.__dict__)
        state.update(_lock=None, _iterator=None, _resume=None, _records=OrderedDict())
        state["_record_bytes"] = 0  # each worker keeps the records it reads itself
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.RLock()

    def __next__(self) -> dict[str, np.ndarray]:
        if not self.read_threads and not self.read_processes:
            out = self.read(self._next)
        else:
            if self._iterator is None:
                self._iterator = self._start()
            out = next(self._iterator)
        self._next += 1
        return out

    def _start(self):
        import grain

        if self.read_processes:  # element i: global batch next + i, read in the workers
            from absl import flags

            if not flags.FLAGS.is_parsed():  # grain's workers read absl flags (their defaults)
                flags.FLAGS.mark_as_parsed()
            dataset = grain.MapDataset.range(self._next, 2**62).map(self.read)
            options = grain.ReadOptions(
                num_threads=max(self.read_threads, 1), prefetch_buffer_size=self.prefetch
            )
            workers = grain.MultiprocessingOptions(
                num_workers=self.read_processes, per_worker_buffer_size=self.prefetch
            )
            dataset = dataset.to_iter_dataset(options)
            return iter(dataset.mp_prefetch(workers, worker_init_fn=_exit_with_parent))
        dataset = grain.MapDataset.range(0, 2**62).map(self.read)  # element g: global batch g
        options = grain.ReadOptions(
            num_threads=self.read_threads, prefetch_buffer_size=self.prefetch
        )
        iterator = iter(dataset.to_iter_dataset(options))
        if self._resume is not None:
            iterator.set_state(self._resume)
        elif self._next:
            iterator.set_state({"next_index": self._next})
        return iterator

    # -- planning ---------------------------------------------------------------------------

    def order(self, epoch: int) -> np.ndarray:
        """The order in which epoch ``epoch`` visits the examples."""
        return np.random.default_rng([self.seed, epoch]).permutation(len(self.lengths))

    def _per_epoch(self, cache: dict[int, Any], epoch: int, make: Any) -> Any:
        """``make()`` of epoch ``epoch``, made once (by whichever thread needs it first)."""
        with self._lock:
            if epoch not in cache:
                if len(cache) >= 3:  # epochs are visited in order: keep the recent ones
                    del cache[min(cache)]
                cache[epoch] = make()
            return cache[epoch]

    def plan(self, epoch: int) -> PackingPlan:
        return self._per_epoch(
            self._plans,
            epoch,
            lambda: plan_epoch(self.order(epoch), self.lengths, self.seq_len, self.pack),
        )

    def chained_records(self, epoch: int) -> np.ndarray | None:
        """With ``qa_turns="mixed"``, which records epoch ``epoch`` keeps chained (a boolean
        per example, a share ``chained_share`` of them drawn by ``(seed, epoch)``); else None."""
        share = self.chained_share
        if share is None:
            return None
        rng = np.random.default_rng([self.seed, epoch, 1])
        return self._per_epoch(self._chained, epoch, lambda: rng.random(len(self.lengths)) < share)

    def batches_in_epoch(self, epoch: int) -> int:
        return -(-self.plan(epoch).num_rows // self.batch_size)

    def global_batch(self, epoch: int, batch: int) -> int:
        """The global batch index of batch ``batch`` of epoch ``epoch``."""
        with self._lock:
            while len(self._epoch_starts) <= epoch:
                e = len(self._epoch_starts) - 1
                self._epoch_starts.append(self._epoch_starts[-1] + self.batches_in_epoch(e))
            return self._epoch_starts[epoch] + batch

    def locate(self, g: int) -> tuple[int, int]:
        """(epoch, batch within it) of global batch ``g``."""
        epoch = 0
        while self.global_batch(epoch + 1, 0) <= g:
            epoch += 1
        return epoch, g - self.global_batch(epoch, 0)

    def look_back(self, g: int) -> int:
        """How far back, counting itself, any query of global batch ``g`` looks over every
        host's rows (`lwm.attention.look_back` of their segment ids, where a record's QA turns
        are one document): its longest piece of a document or run of padding. From the plan
        alone, so the same on every host without a record read (`lwm train` with many
        processes compiles its step for it)."""
        epoch, batch = self.locate(g)
        plan = self.plan(epoch)
        longest = 0
        for r in range(batch * self.batch_size, (batch + 1) * self.batch_size):
            lengths = [n for _, _, n in plan.row(r)]
            longest = max(longest, *lengths, self.seq_len - sum(lengths))
        return longest

    def last_look_back(self) -> int:
        """`look_back` of the global batch last handed out."""
        return self.look_back(self._next - 1)

    # -- reading ----------------------------------------------------------------------------

    def read(self, g: int) -> dict[str, np.ndarray]:
        """This host's rows of global batch ``g``: a pure function of ``g`` (thread-safe)."""
        epoch, batch = self.locate(g)
        plan = self.plan(epoch)
        first = batch * self.batch_size + self.first_row
        rows = [plan.row(first + r) for r in range(self.local_rows)]
        return self._assemble(rows, self.chained_records(epoch))

    def warm(self) -> threading.Thread | None:
        """Work out, in a background thread, the records this host reads in the rest of the
        epoch the loader is at, in the order it reads them, until they fill half the record
        cache (`record`): the first epoch's batches then cost what a later epoch's cost. Called
        while the train step compiles, that work is off the training loop's path. Returns the
        thread; None where worker processes read (each keeps the records it reads itself)."""
        if self.read_processes:
            return None
        epoch, batch = self.locate(self._next)
        plan = self.plan(epoch)

        def examples():
            seen: set[int] = set()
            for b in range(batch, self.batches_in_epoch(epoch)):
                first = b * self.batch_size + self.first_row
                for r in range(first, min(first + self.local_rows, plan.num_rows)):
                    for ex, _, _ in plan.row(r):
                        if ex not in seen:
                            seen.add(ex)
                            yield ex

        def run() -> None:
            try:
                for ex in examples():
                    if self._record_bytes > RECORD_CACHE_BYTES // 2:
                        return
                    self.record(ex)
            except Exception:  # noqa: BLE001 - a batch that reads it raises it where it counts
                return

        thread = threading.Thread(target=run, name="lwm-record-warm", daemon=True)
        thread.start()
        return thread

    def record(self, ex: int) -> dict[str, np.ndarray]:
        """Record ``ex`` with what batches take from it (its frame cells, QA turns, window),
        worked out once and kept while the records kept stay under `RECORD_CACHE_BYTES`: the
        records of a small dataset are visited every epoch, and on a fast chip the Python that
        makes a batch shares the interpreter with the training loop."""
        with self._lock:
            found = self._records.get(ex)
            if found is not None:
                self._records.move_to_end(ex)
                return found
        record = self.source[ex]
        example = {k: np.asarray(record[k]) for k in ("tokens", "vision_mask", "loss_mask")}
        example["cells"] = frame_cells(example["tokens"], example["vision_mask"])
        if self._turn_ids is not None:
            turn, turn_pos = record_turns(
                example["tokens"], example["vision_mask"], *self._turn_ids
            )
            if turn.max() > MAX_TURNS:
                raise ValueError(
                    f"record {ex} of '{self.path}' has {turn.max()} QA turns; "
                    f"QA turns allow at most {MAX_TURNS}"
                )
            example["turn"], example["positions"] = turn, turn_pos
        if self.window is not None:  # of the whole record, as the cells
            example["window"] = frame_window(
                example["tokens"], example["vision_mask"], *self.window, cells=example["cells"]
            )
        size = sum(a.nbytes for a in example.values())
        with self._lock:
            if ex not in self._records and size <= RECORD_CACHE_BYTES:
                self._records[ex] = example
                self._record_bytes += size
                while self._record_bytes > RECORD_CACHE_BYTES:
                    _, dropped = self._records.popitem(last=False)
                    self._record_bytes -= sum(a.nbytes for a in dropped.values())
        return example

    def _assemble(
        self, rows: list[list[tuple[int, int, int]]], chained: np.ndarray | None = None
    ) -> dict[str, np.ndarray]:
        shape = (len(rows), self.seq_len)
        tokens = np.zeros(shape, np.int32)
        vision = np.zeros(shape, np.bool_)
        loss = np.zeros(shape, np.float32)
        segments = np.zeros(shape, np.int32)
        positions = np.zeros(shape, np.int32)
        cells = np.full(shape, -1, np.int32)
        window = None
        if self.window is not None:
            window = np.full((*shape, len(window_offsets(self.window[1]))), -1, np.int32)
        examples: dict[int, dict[str, np.ndarray]] = {}  # a long document spans rows
        for r, pieces in enumerate(rows):
            at = 0
            if self._turn_ids is not None and len(pieces) >= MAX_TURN_DOCUMENTS:
                raise ValueError(
                    f"a row of {len(pieces)} documents: QA turns allow at most "
                    f"{MAX_TURN_DOCUMENTS - 1} per row"
                )
            for segment, (ex, start, n) in enumerate(pieces, 1):
                if ex not in examples:  # once per batch, even if too large to keep
                    examples[ex] = self.record(ex)
                example = examples[ex]
                piece = slice(start, start + n)
                tokens[r, at : at + n] = example["tokens"][piece]
                vision[r, at : at + n] = example["vision_mask"][piece]
                segments[r, at : at + n] = segment
                positions[r, at : at + n] = np.arange(n)
                # A later piece of a record longer than a row has no video before it in its
                # row, and a chained record sees all of itself: one turn 0, positions from 0
                # as without turns, and its "alone" answers not learned (`loss_weight`).
                whole = self._turn_ids is None or start > 0 or (chained is not None and chained[ex])
                loss[r, at : at + n] = loss_weight(example["loss_mask"][piece], whole)
                if self._turn_ids is not None:
                    turn = 0 if whole else example["turn"][piece]
                    segments[r, at : at + n] = turn_segment_ids(segment, turn)
                    if not whole:
                        positions[r, at : at + n] = example["positions"][piece]
                cells[r, at : at + n] = example["cells"][piece]
                if window is not None:
                    window[r, at : at + n] = example["window"][piece]
                at += n
            # Padding (segment 0) counts its positions too: then no query of it sees a later
            # key, and a row of documents packed in order is in order whole
            # (`lwm.attention.keys_precede_queries`, the cuDNN kernel's `in_order` schedule).
            # Nothing real sees padding, and it has no targets, so the loss is the same.
            positions[r, at:] = np.arange(self.seq_len - at)
        return make_training_batch(
            tokens, vision, loss, segments, positions, self.layout, cells, window
        )
