"""One chunk of a `lwm tokenize` job: the media of its items decoded in worker processes (in
order, a bounded number ahead), their frames gathered into full batches of ``batch_frames`` for
the VQGAN (the last batch padded, so one compiled program serves every call), and each finished
item made into one record (`data.tokens.build_example`), written as the chunk's array_record
shard and its JSON summary (`data.workdir`)."""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import multiprocessing
import multiprocessing.pool
import os
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from data import dataset_io
from data.decode import Decoded, DecodeOptions, decode_item
from data.manifest import Item
from data.tokens import build_example, text_first
from data.workdir import chunk_json, chunk_shard, write_json
from data.workers import spawn_pool, usable_cores

__all__ = [
    "ChunkEncoder",
    "DecodeStream",
    "EncoderPipeline",
    "default_workers",
    "start_workers",
]


class EncoderPipeline:
    """Batches of frames through the encoder for all the chunks of a run, with ``depth``
    batches dispatched and not yet collected (default two: the encoder has the next batch
    queued when it finishes one), so that it computes while this process receives decoded
    items and builds records.

    A `vqgan` tokenizer (``encode_chunk``/``place`` on device arrays) is called asynchronously
    and a helper thread notes when each batch is ready; any other encoder (``encode``) is
    called synchronously. ``busy`` is how long the encoder has had work: the union of the
    intervals from each batch's dispatch to its completion."""

    def __init__(self, encoder: Any, depth: int = 2):
        self.encoder = encoder
        self.depth = depth
        self.busy = 0.0
        self._last_done = 0.0
        self._inflight: deque = deque()
        self._waiter: ThreadPoolExecutor | None = None

    def submit(self, batch: np.ndarray, deliver: Callable[[np.ndarray], None]) -> None:
        """Encode ``batch`` ``[batch_frames, H, W, 3]``; ``deliver(codes)`` is called with its
        codes when it is collected (once ``depth`` later batches are submitted, or in `drain`)."""
        t0 = time.perf_counter()
        enc = self.encoder
        if hasattr(enc, "encode_chunk") and getattr(enc, "batch_size", None) == len(batch):
            codes: Any = enc.encode_chunk(enc.place(batch))  # returns at once
            if self._waiter is None:
                self._waiter = ThreadPoolExecutor(1, thread_name_prefix="encoder-ready")
            done: Any = self._waiter.submit(_ready_at, codes)
        else:
            codes = np.asarray(enc.encode(batch[None]))[0]
            done = time.perf_counter()
        self._inflight.append((codes, t0, done, deliver))
        while len(self._inflight) > self.depth:
            self._collect()

    def drain(self) -> None:
        """Collect every batch in flight."""
        while self._inflight:
            self._collect()

    def _collect(self) -> None:
        codes, t0, done, deliver = self._inflight.popleft()
        codes = np.asarray(codes)
        done = done if isinstance(done, float) else done.result()
        self.busy += max(0.0, done - max(t0, self._last_done))
        self._last_done = max(self._last_done, done)
        deliver(codes)

    def close(self) -> None:
        if self._waiter is not None:
            self._waiter.shutdown()
            self._waiter = None


def _ready_at(array: Any) -> float:
    array.block_until_ready()
    return time.perf_counter()


class ChunkEncoder:
    """The records of one chunk, its items added in order (`add`, `add_same_as`)."""

    def __init__(
        self,
        items,
        codec,
        pipeline: EncoderPipeline,
        batch_frames,
        summary,
        bar,
        log,
        learn_video=None,
        text_first_ratio=0.0,
    ):
        self.items, self.codec, self.pipeline = items, codec, pipeline
        self.learn_video, self.text_first_ratio = learn_video, text_first_ratio
        self.batch_frames, self.summary, self.bar, self.log = batch_frames, summary, bar, log
        self.queue: deque[tuple[int, np.ndarray]] = deque()  # frames waiting for the encoder
        self.queued = 0
        self.codes: dict[int, list[np.ndarray]] = {}
        self.wanted: dict[int, int] = {}  # item -> frames it needs
        self.records: dict[int, dict[str, Any]] = {}
        self.errors: dict[int, str] = {}
        self.frames = 0
        self.in_flight = 0  # batches of this chunk not yet collected
        self.finished = False
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
        """Send what is queued to the encoder; the chunk is `done` once its batches are back."""
        while self.queued:
            self._encode(min(self.queued, self.batch_frames))
        self.finished = True

    @property
    def done(self) -> bool:
        """Finished, and every batch collected: its records are complete."""
        return self.finished and not self.in_flight

    def _encode(self, n: int) -> None:
        """Send the first ``n`` queued frames to the encoder as one batch (padded to
        ``batch_frames``, so one compiled program serves every call)."""
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
        if n < self.batch_frames:  # the last batch of a chunk
            pad = np.zeros((self.batch_frames - n, *batch.shape[1:]), batch.dtype)
            batch = np.concatenate([batch, pad])
        self.queued -= n
        self.in_flight += 1
        self.pipeline.submit(batch, lambda codes: self._deliver(codes[:n], owners))

    def _deliver(self, codes: np.ndarray, owners: list[tuple[int, int]]) -> None:
        """The codes of one batch, given to the items whose frames it held."""
        self.in_flight -= 1
        n = len(codes)
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


def _decoder_setup() -> None:
    os.environ["JAX_PLATFORMS"] = (
        "cpu"  # workers resize on the CPU; the accelerator is the encoder's
    )
    with contextlib.suppress(ImportError):  # a missing decord is reported per file
        import decord  # noqa: F401  (imported now, while the main process loads its VQGAN)


def default_workers() -> int:
    """Decoding processes for `lwm tokenize` when not told: one per CPU core this process may
    use, less one for the main process (which feeds the encoder), and at least two, so that
    decoding goes on while one worker waits on a file. (On the 2-core development machine two
    workers beat one with the demo's 8 simulated devices, 14.6 s against 19.0 s, and were
    within noise of it on one device.)"""
    return max(2, usable_cores() - 1)


def start_workers(workers: int) -> multiprocessing.pool.Pool | None:
    """``workers`` decoding processes (none for 0), started now: a caller that starts them
    before loading its VQGAN has them ready, imports done, by the time it wants frames."""
    if workers <= 0:
        return None
    return spawn_pool(workers, _decoder_setup)


GROUP_ITEMS = 16  # the most items in one task sent to a worker


class DecodeStream:
    """The decoded items ``indices``, in order (an iterator; `close` stops it early).

    ``workers`` > 0: decoded by that many worker processes (``pool``, from `start_workers`
    and left running, or the stream's own), fed by a helper thread from the moment the stream
    is made, so decoding starts while the caller still prepares its encoder. The thread keeps
    the items decoded and not yet taken, with those in flight, at no fewer than
    ``2 * workers + 2`` items and at up to ``frames_ahead`` frames (counted from the items
    decoded so far): a consumer that takes a batch of frames at a time (the encoder) finds
    the next batches decoded, and the decoders run on while it encodes. Items go to the
    workers in groups (at most `GROUP_ITEMS`; short clips cost less in decoding than one
    task's round trip), and each worker decodes with one thread. A worker's exception is
    raised by the consumer's `next` after the items before it.

    ``workers`` = 0: each item is decoded when it is asked for, in this process."""

    def __init__(
        self,
        items: list[Item],
        indices: list[int],
        options: DecodeOptions,
        workers: int,
        *,
        frames_ahead: int = 0,
        pool: multiprocessing.pool.Pool | None = None,
    ):
        self._items = items
        self._upcoming = iter(indices)
        self._workers = workers
        self._frames_ahead = frames_ahead
        self._pool = pool
        self._own = False
        self._thread: threading.Thread | None = None
        if workers <= 0 or not indices:
            self._options = options
            return
        # One decoding thread per worker: the workers are one per core already, and a pool of
        # threads per video costs more than it gains on short clips (1.5 against 2.2 ms for one
        # of the demo's 4-frame videos; the frames are the same).
        self._options = dataclasses.replace(options, decoder_threads=1)
        if pool is None:
            self._pool, self._own = start_workers(workers), True
        self._cond = threading.Condition()
        self._ready: deque[Decoded] = deque()  # decoded, not yet taken, in order
        self._ready_frames = 0
        self._failure: BaseException | None = None
        self._fed = False  # every item decoded and handed over (or the feeding failed)
        self._closed = False
        # Set while the feeder has nothing in flight and waits for the consumer to take an item,
        # or has handed over every item: until the consumer takes one, what is decoded ahead
        # stays as it is and the workers are idle (tests wait for it instead of sleeping).
        self.quiet = threading.Event()
        self._thread = threading.Thread(target=self._feed, name="decode-feeder", daemon=True)
        self._thread.start()

    def __iter__(self) -> DecodeStream:
        return self

    def __next__(self) -> Decoded:
        if self._thread is None:
            i = next(self._upcoming)  # StopIteration at the end
            return decode_item(i, self._items[i], self._options)
        with self._cond:
            while not self._ready and not self._fed:
                self._cond.wait()
            if self._ready:
                result = self._ready.popleft()
                self._ready_frames -= _frames(result)
                self._cond.notify_all()
                return result
            failure = self._failure
        self.close()  # the end (or a failure): the stream's own workers stop now
        if failure is not None:
            raise failure
        raise StopIteration

    @property
    def decoded_ahead(self) -> int:
        """Items decoded and not yet taken."""
        if self._thread is None:
            return 0
        with self._cond:
            return len(self._ready)

    def close(self) -> None:
        """Stop feeding the workers (the items in flight are dropped); stop the stream's own
        workers. A caller's pool is left running."""
        if self._thread is not None:
            with self._cond:
                self._closed = True
                self._cond.notify_all()
            self._thread.join()
        if self._own and self._pool is not None:
            self._pool.terminate()
            self._own = False

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.close()

    def _room(self, items_ahead: int, frames_ahead: float) -> bool:
        """Whether to send the workers more items, with ``items_ahead`` items (about
        ``frames_ahead`` frames) decoded or in flight and not yet taken."""
        if items_ahead < 2 * self._workers + 2:
            return True
        return bool(self._frames_ahead) and 0 < frames_ahead < self._frames_ahead

    def _feed(self) -> None:
        pool, workers = self._pool, self._workers
        assert pool is not None
        pending: deque = deque()  # the workers' tasks, in order
        in_flight = seen_items = seen_frames = 0
        exhausted = False
        try:
            while True:
                with self._cond:
                    if self._closed:
                        return
                    ready_items, ready_frames = len(self._ready), self._ready_frames
                # Frames per item, from the items decoded so far (none yet: the items bound).
                per_item = seen_frames / seen_items if seen_items else 0.0
                wanted = max(
                    2 * workers + 2,
                    self._frames_ahead / per_item if self._frames_ahead and per_item else 0,
                )
                size = int(max(1, min(GROUP_ITEMS, wanted // (2 * workers))))
                while not exhausted and self._room(
                    ready_items + in_flight, ready_frames + in_flight * per_item
                ):
                    group = list(itertools.islice(self._upcoming, size))
                    if not group:
                        exhausted = True
                        break
                    tasks = [(i, self._items[i]) for i in group]
                    pending.append(pool.apply_async(_decode_group, (tasks, self._options)))
                    in_flight += len(group)
                if pending:
                    task = pending[0]
                    while not task.ready():  # wait for the oldest task, unless closed
                        task.wait(0.05)
                        if self._closed:
                            return
                    pending.popleft()
                    decoded = task.get()  # a worker's exception is raised here
                    frames = sum(_frames(d) for d in decoded)
                    in_flight -= len(decoded)
                    seen_items += len(decoded)
                    seen_frames += frames
                    with self._cond:
                        self._ready.extend(decoded)
                        self._ready_frames += frames
                        self._cond.notify_all()
                    continue
                if exhausted:
                    return  # every item submitted and handed over
                with self._cond:  # full: wait until the consumer takes an item (or closes)
                    self.quiet.set()
                    while not self._closed and (len(self._ready), self._ready_frames) == (
                        ready_items,
                        ready_frames,
                    ):
                        self._cond.wait()
                    self.quiet.clear()
        except BaseException as e:  # noqa: BLE001  (handed to the consumer)
            with self._cond:
                self._failure = e
        finally:
            with self._cond:
                self._fed = True
                self._cond.notify_all()
            self.quiet.set()


def _frames(d: Decoded) -> int:
    return 0 if d.frames is None else len(d.frames)


def _decode_group(tasks: list[tuple[int, Item]], options: DecodeOptions) -> list[Decoded]:
    return [decode_item(i, item, options) for i, item in tasks]
