"""One chunk of a `lwm tokenize` job: the media of its items decoded in worker processes (in
order, a bounded number ahead), their frames gathered into full batches of ``batch_frames`` for
the VQGAN (the last batch padded, so one compiled program serves every call), and each finished
item made into one record (`data.tokens.build_example`), written as the chunk's array_record
shard and its JSON summary (`data.workdir`)."""

from __future__ import annotations

import multiprocessing
import os
import sys
import time
from collections import deque
from collections.abc import Iterator
from typing import Any

import numpy as np

from data import dataset_io
from data.decode import Decoded, DecodeOptions, decode_item
from data.manifest import Item
from data.tokens import build_example, text_first
from data.workdir import chunk_json, chunk_shard, write_json

__all__ = ["ChunkEncoder", "decode_stream"]


class ChunkEncoder:
    """The records of one chunk, its items added in order (`add`, `add_same_as`)."""

    def __init__(
        self,
        items,
        codec,
        encoder,
        batch_frames,
        summary,
        bar,
        log,
        learn_video=None,
        text_first_ratio=0.0,
    ):
        self.items, self.codec, self.encoder = items, codec, encoder
        self.learn_video, self.text_first_ratio = learn_video, text_first_ratio
        self.batch_frames, self.summary, self.bar, self.log = batch_frames, summary, bar, log
        self.queue: deque[tuple[int, np.ndarray]] = deque()  # frames waiting for the encoder
        self.queued = 0
        self.codes: dict[int, list[np.ndarray]] = {}
        self.wanted: dict[int, int] = {}  # item -> frames it needs
        self.records: dict[int, dict[str, Any]] = {}
        self.errors: dict[int, str] = {}
        self.frames = 0
        self.done_codes: dict[int, np.ndarray] = {}  # codes of items that others repeat
        self.repeats: dict[int, list[int]] = {}  # item -> later items of the same file

    def add_same_as(self, index: int, first: int) -> None:
        """Item ``index`` reads the same file as the earlier item ``first`` of this chunk."""
        if self.bar is not None:
            self.bar.update(1)
        if first in self.errors:
            self._fail(index, self.errors[first].replace(f"{self.items[first].path}: ", "", 1))
        elif first in self.done_codes:
            self._record(index, self.done_codes[first])
        else:
            self.repeats.setdefault(first, []).append(index)

    def add(self, d: Decoded) -> None:
        if self.bar is not None:
            self.bar.update(1)
        if d.error is not None:
            self.errors[d.index] = d.error
            self._report(d.error)
        elif d.frames is None:
            self._record(d.index, None)
        else:
            self.wanted[d.index] = len(d.frames)
            self.codes[d.index] = []
            self.queue.append((d.index, d.frames))
            self.queued += len(d.frames)
            while self.queued >= self.batch_frames:
                self._encode(self.batch_frames)

    def finish(self) -> None:
        while self.queued:
            self._encode(min(self.queued, self.batch_frames))

    def _encode(self, n: int) -> None:
        """Encode the first ``n`` queued frames (one batch, padded to ``batch_frames``)."""
        parts, owners, left = [], [], n
        while left:
            index, frames = self.queue[0]
            take = frames[:left]
            parts.append(take)
            owners.append((index, len(take)))
            if len(take) == len(frames):
                self.queue.popleft()
            else:
                self.queue[0] = (index, frames[len(take) :])
            left -= len(take)
        batch = np.concatenate(parts)
        if n < self.batch_frames:  # the last batch of a chunk: same shape, same program
            pad = np.zeros((self.batch_frames - n, *batch.shape[1:]), batch.dtype)
            batch = np.concatenate([batch, pad])
        t0 = time.perf_counter()
        codes = np.asarray(self.encoder.encode(batch[None]))[0, :n]
        self.summary.encode_seconds += time.perf_counter() - t0
        self.queued -= n
        self.frames += n
        self.summary.frames += n
        if self.bar is not None:
            elapsed = time.perf_counter() - self.summary.started
            self.bar.set_postfix_str(f"{self.summary.frames / max(elapsed, 1e-9):.1f} frames/s")
        at = 0
        for index, count in owners:
            self.codes[index].append(codes[at : at + count])
            at += count
            if sum(len(c) for c in self.codes[index]) == self.wanted[index]:
                item_codes = np.concatenate(self.codes.pop(index))
                self._record(index, item_codes)
                for later in self.repeats.pop(index, []):
                    self._record(later, item_codes)

    def _fail(self, index: int, problem: str) -> None:
        item: Item = self.items[index]
        error = f"{item.path or f'text item {index}'}: {problem}"
        self.errors[index] = error
        self._report(error)

    def _record(self, index: int, codes: np.ndarray | None) -> None:
        item: Item = self.items[index]
        if codes is not None:
            self.done_codes[index] = codes
        try:
            streams = build_example(
                self.codec,
                codes,
                text=item.text,
                qa=item.qa_dicts(),
                learn_video=self.learn_video,
                text_first=text_first(index, self.text_first_ratio),
            )
        except ValueError as e:
            self._fail(index, str(e))
            return
        self.records[index] = {
            **streams,
            "source": item.path or "",
            "kind": item.kind,
            "num_frames": 0 if codes is None else len(codes),
        }

    def _report(self, error: str) -> None:
        if self.bar is not None:
            self.bar.write(f"failed: {error}", file=sys.stderr)
        else:
            self.log(f"failed: {error}")

    def save(self, work: os.PathLike, c: int) -> None:
        writer = dataset_io.ShardWriter(chunk_shard(work, c))
        lengths = []
        for index in sorted(self.records):
            record = self.records[index]
            writer.write(record)
            lengths.append(len(record["tokens"]))
        writer.close()
        info = {
            "count": writer.count,
            "num_bytes": writer.num_bytes,
            "lengths": lengths,
            "vision_tokens": int(sum(r["vision_mask"].sum() for r in self.records.values())),
            "frames": self.frames,
            "errors": [self.errors[i] for i in sorted(self.errors)],
        }
        write_json(chunk_json(work, c), info)


def _worker_init() -> None:
    os.environ["JAX_PLATFORMS"] = (
        "cpu"  # workers resize on the CPU; the accelerator is the encoder's
    )


def decode_stream(
    items: list[Item], indices: list[int], options: DecodeOptions, workers: int
) -> Iterator[Decoded]:
    if workers <= 0 or not indices:
        for i in indices:
            yield decode_item(i, items[i], options)
        return
    ahead = 2 * workers + 2
    ctx = multiprocessing.get_context("spawn")  # no fork of a process that holds JAX state
    with ctx.Pool(workers, initializer=_worker_init) as pool:
        pending: deque = deque()
        upcoming = iter(indices)

        def submit() -> None:
            i = next(upcoming, None)
            if i is not None:
                pending.append(pool.apply_async(decode_item, (i, items[i], options)))

        for _ in range(ahead):
            submit()
        while pending:
            result = pending.popleft().get()
            submit()
            yield result
