"""`lwm tokenize`: videos, images and text to LWM token streams in a tfds array_record dataset.

Pipeline: worker processes decode, sample, resize and crop the media of the items in dataset
order (`data.decode`, a bounded number in flight); the main process gathers their frames into
full batches of ``batch_frames`` and encodes them with the VQGAN (jitted), so the encoder is fed
while the workers read; each finished item becomes one record (`data.tokens.build_example`).
A file named by several items of a chunk (a caption line and a QA line of one video) is decoded
and encoded once.

Resumable: the items are cut into chunks of ``chunk_size`` (in input order); a finished chunk is
written to ``OUT.partial/chunk-NNNNN.array_record`` with its summary ``chunk-NNNNN.json`` (written
last: a chunk is done when its JSON exists). A rerun with the same arguments skips the done
chunks; encoder batches never span chunks, so every chunk's records are the same whether or not
the run was interrupted. When all chunks are done the dataset is assembled in
``OUT.partial/dataset`` and renamed to ``OUT``: ``OUT`` appears only complete.

Many hosts share the chunks (the work directory must be on a file system they all see):
- the processes of a ``jax.distributed`` job (``distributed=True``): process 0 lists the chunks
  still to do and sends the list to all (a rerun after a host died spreads the rest evenly); each
  process takes every N-th of them and encodes on its own devices; after a barrier, process 0
  publishes;
- independent shards (``shard=(I, N)``, for schedulers without JAX's coordinator): shard I makes
  the chunks ``c`` with ``c % N == I`` and publishes nothing; `merge_dataset` (``lwm tokenize
  --merge OUT``) publishes once every chunk is done.
Chunks do not depend on who made them, so any mix of these (and a one-process rerun) continues
the same job and gives the same dataset.

Failures (missing, empty, unreadable or truncated files, too few frames) are items without a
record: one line each, ``PATH: problem``, in ``OUT.errors.txt`` (beside ``OUT``), and counted in
the summary. With ``strict``, any failure leaves ``OUT`` unwritten and makes a non-zero exit; the
work directory is kept, so rerunning without ``--strict`` publishes the records at once.
"""

from __future__ import annotations

import hashlib
import json
import multiprocessing
import os
import shutil
import sys
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from data import dataset_io
from data.decode import Decoded, DecodeOptions, decode_item
from data.manifest import Item, read_inputs
from data.tokens import EOF_ID, EOV_ID, NUM_CODES, TextCodec, build_example
from lwm.base.files import write_text

if TYPE_CHECKING:
    from jax.sharding import Mesh

__all__ = [
    "Encoder",
    "TokenizeError",
    "TokenizeOptions",
    "TokenizeSummary",
    "merge_dataset",
    "tokenize_dataset",
]

SPLIT = "train"
# --video-loss: which records train on their video tokens (None: the default of
# `data.tokens.build_example`, i.e. every record but a QA record's).
LEARN_VIDEO: dict[str, bool | None] = {"captioned": None, "all": True, "none": False}


class TokenizeError(Exception):
    """The job cannot run as asked (existing output, a work directory of other arguments...)."""


class Encoder(Protocol):
    """What the pipeline needs of a VQGAN (`vqgan.load_tokenizer` gives one)."""

    resolution: int
    tokens_per_frame: int
    codebook_size: int

    def encode(self, frames: np.ndarray) -> np.ndarray: ...


@dataclass
class TokenizeOptions:
    input: str
    output: str
    vqgan: str
    tokenizer: str | None = None
    fps: float | None = None
    max_frames: int | None = None
    min_frames: int = 1
    workers: int = 2
    batch_frames: int = 64
    chunk_size: int = 256
    strict: bool = False
    progress: bool = True
    video_loss: str = "captioned"  # which records learn their video: captioned, all, none
    shard: tuple[int, int] | None = None  # (I, N): make the chunks c % N == I, publish nothing


@dataclass
class TokenizeSummary:
    items: int = 0
    ok: int = 0
    failed: int = 0
    frames: int = 0  # frames encoded in this run
    tokens: int = 0  # tokens in the dataset
    seconds: float = 0.0
    encode_seconds: float = 0.0
    started: float = 0.0  # time.perf_counter() at the start of the run
    resumed_chunks: int = 0
    published: bool = False
    output: str = ""
    chunks: int = 0  # chunks of the job
    chunks_here: int = 0  # chunks this process made (all of them unless shared)
    chunks_left: int = 0  # chunks of the job not done when this process finished
    role: str = ""  # "shard I/N" or "process I of N" when the job is shared
    work: str = ""
    errors_path: str | None = None
    errors: list[str] = field(default_factory=list)

    def lines(self) -> list[str]:
        if not self.seconds:  # `merge_dataset`: nothing encoded here
            return [
                f"{self.items} items: {self.ok} ok, {self.failed} failed"
                + (f" (the errors: {self.errors_path})" if self.failed else ""),
                *(
                    [f"wrote {self.output} ({self.ok} records, {self.tokens} tokens)"]
                    * self.published
                ),
            ]
        busy = 100 * self.encode_seconds / self.seconds if self.seconds else 0.0
        rate = self.frames / self.seconds if self.seconds else 0.0
        out = [
            f"{self.items} items: {self.ok} ok, {self.failed} failed"
            + (f" (the errors: {self.errors_path})" if self.failed else ""),
            f"{self.frames} frames encoded in {self.seconds:.1f} s ({rate:.1f} frames/s); "
            f"encoder busy {busy:.0f}% of the time"
            + (
                f"; {self.resumed_chunks} chunks from an earlier run" if self.resumed_chunks else ""
            ),
        ]
        if self.role and not self.published:  # the job's counts are process 0's to tell
            out = out[1:]
        if self.role:
            out.insert(0, f"{self.role}: made {self.chunks_here} of the {self.chunks} chunks")
        if self.published:
            out.append(f"wrote {self.output} ({self.ok} records, {self.tokens} tokens)")
        elif self.role.startswith("shard"):
            out.append(
                f"{self.chunks_left} of {self.chunks} chunks still to do in {self.work}"
                if self.chunks_left
                else f"every chunk is done: publish with `lwm tokenize --merge {self.output}`"
            )
        return out


def tokenize_dataset(
    opts: TokenizeOptions,
    encoder: Encoder | None = None,
    log=None,
    *,
    mesh: Mesh | None = None,
    distributed: bool = False,
) -> TokenizeSummary:
    """Run the job described by ``opts`` (see the module docstring); returns its summary.
    ``encoder``: the VQGAN (default: `vqgan.load_tokenizer` of ``opts.vqgan`` on ``mesh``, the
    caller's, whose batch axes split each chunk of frames; without one, one device).
    ``distributed``: this process is one of a `jax.distributed` job that shares the chunks."""
    log = log or (lambda msg: print(msg, file=sys.stderr))
    out = Path(opts.output)
    work = _work_dir(out)
    if opts.video_loss not in LEARN_VIDEO:
        raise TokenizeError(
            f"unknown video loss '{opts.video_loss}'; choose one of {', '.join(LEARN_VIDEO)}"
        )
    if opts.shard is not None and distributed:
        raise TokenizeError("--shard is for jobs without JAX's coordinator; use one or the other")
    if opts.shard is not None and not 0 <= opts.shard[0] < opts.shard[1]:
        raise TokenizeError(
            f"--shard {opts.shard[0]}/{opts.shard[1]}: expected I/N with 0 <= I < N"
        )
    if out.exists():
        raise TokenizeError(f"output '{out}' already exists; remove it or choose another --output")
    items = read_inputs(opts.input)
    codec = TextCodec.load(opts.tokenizer)
    if encoder is None:
        import vqgan

        encoder = vqgan.load_tokenizer(opts.vqgan, mesh=mesh, batch_size=opts.batch_frames)
    if encoder.codebook_size > NUM_CODES:
        raise TokenizeError(
            f"VQGAN '{opts.vqgan}' has {encoder.codebook_size} codes; the token stream has room "
            f"for {NUM_CODES}"
        )
    job = _job(opts, items, codec, encoder)
    _open_work_dir(work, job)

    num_chunks = -(-len(items) // opts.chunk_size)
    done = _done_chunks(work, num_chunks)
    role = ""
    if distributed:
        import jax
        from jax.experimental import multihost_utils

        index, count = jax.process_index(), jax.process_count()
        # Process 0's view of what is done, for all: everyone splits the same list.
        done = np.asarray(multihost_utils.broadcast_one_to_all(done.astype(np.int32))) > 0
        todo = [c for c in range(num_chunks) if not done[c]][index::count]
        role = f"process {index} of {count}" if count > 1 else ""
    elif opts.shard is not None:
        index, count = opts.shard
        done[np.arange(num_chunks) % count != index] = False  # other shards' are not resumed
        todo = [c for c in range(num_chunks) if c % count == index and not done[c]]
        role = f"shard {index}/{count}"
    else:
        todo = [c for c in range(num_chunks) if not done[c]]
    summary = TokenizeSummary(
        items=len(items),
        resumed_chunks=int(done.sum()),
        output=str(out),
        chunks=num_chunks,
        chunks_here=len(todo),
        role=role,
        work=str(work),
    )
    if done.any():
        log(f"resuming: {int(done.sum())} of {num_chunks} chunks already done in {work}")
    decode_opts = DecodeOptions(encoder.resolution, opts.fps, opts.max_frames, opts.min_frames)
    plans = {c: _chunk_plan(items, _chunk_range(c, opts.chunk_size, len(items))) for c in todo}
    indices = [i for c in todo for i, first in plans[c] if first is None]
    start = summary.started = time.perf_counter()
    bar = _progress(opts, sum(len(plans[c]) for c in todo), role)
    stream = _decode_stream(items, indices, decode_opts, opts.workers)
    try:
        for c in todo:
            chunk = _Chunk(
                items,
                codec,
                encoder,
                opts.batch_frames,
                summary,
                bar,
                log,
                LEARN_VIDEO[opts.video_loss],
            )
            for i, first in plans[c]:
                if first is not None:  # the same file as item `first`: reuse its codes
                    chunk.add_same_as(i, first)
                    continue
                decoded = next(stream)
                assert decoded.index == i, (decoded.index, i)
                chunk.add(decoded)
            chunk.finish()
            chunk.save(work, c)
    finally:
        stream.close()  # stops the worker processes
        if bar is not None:
            bar.close()
    summary.seconds = time.perf_counter() - start
    if distributed:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices("lwm tokenize: every chunk written")
        if jax.process_index() != 0:
            return summary  # process 0 publishes
    if opts.shard is not None:
        summary.chunks_left = int(num_chunks - _done_chunks(work, num_chunks).sum())
        return summary
    return _finish(work, out, num_chunks, opts.strict, job, summary, log)


def merge_dataset(output: str, *, strict: bool = False, log=None) -> TokenizeSummary:
    """Publish the dataset of a job whose chunks were made by independent shards (`--shard`):
    ``output`` appears once every chunk is done; a chunk not done is an error naming it."""
    log = log or (lambda msg: print(msg, file=sys.stderr))
    out = Path(output)
    work = _work_dir(out)
    if out.exists():
        raise TokenizeError(f"output '{out}' already exists; nothing to merge")
    if not (work / "job.json").is_file():
        raise TokenizeError(
            f"no tokenize job to merge for '{out}': '{work}' does not exist (run the shards, "
            "`lwm tokenize ... --shard I/N`, first)"
        )
    job = json.loads((work / "job.json").read_text())
    num_chunks = -(-job["items"] // job["chunk_size"])
    summary = TokenizeSummary(items=job["items"], output=str(out), chunks=num_chunks)
    return _finish(work, out, num_chunks, strict, job, summary, log)


# ----------------------------------------------------------------------------------------------
# one chunk: frames gathered into full encoder batches, records in item order


class _Chunk:
    def __init__(self, items, codec, encoder, batch_frames, summary, bar, log, learn_video=None):
        self.items, self.codec, self.encoder = items, codec, encoder
        self.learn_video = learn_video
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
                self.codec, codes, text=item.text, qa=item.qa_dicts(), learn_video=self.learn_video
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

    def save(self, work: Path, c: int) -> None:
        writer = dataset_io.ShardWriter(_chunk_shard(work, c))
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
        _write_json(_chunk_json(work, c), info)


# ----------------------------------------------------------------------------------------------
# decoding in worker processes, in order, a bounded number ahead


def _worker_init() -> None:
    os.environ["JAX_PLATFORMS"] = (
        "cpu"  # workers resize on the CPU; the accelerator is the encoder's
    )


def _decode_stream(
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


# ----------------------------------------------------------------------------------------------
# the work directory, and the dataset assembled from it


def _chunk_plan(items: list[Item], indices: range) -> list[tuple[int, int | None]]:
    """(item, earlier item of the chunk with the same file or None): a file named by several
    lines (a caption line and a QA line) is decoded and encoded once per chunk."""
    first: dict[tuple[str, str], int] = {}
    plan = []
    for i in indices:
        item = items[i]
        key = (item.kind, item.path) if item.path is not None else None
        if key is not None and key in first:
            plan.append((i, first[key]))
        else:
            if key is not None:
                first[key] = i
            plan.append((i, None))
    return plan


def _work_dir(out: Path) -> Path:
    return out.with_name(out.name + ".partial")


def _done_chunks(work: Path, num_chunks: int) -> np.ndarray:
    """bool [num_chunks]: which chunks are done (their JSON, written last, exists)."""
    return np.asarray([_chunk_json(work, c).is_file() for c in range(num_chunks)], bool)


def _chunk_range(c: int, size: int, total: int) -> range:
    return range(c * size, min((c + 1) * size, total))


def _chunk_shard(work: Path, c: int) -> Path:
    return work / f"chunk-{c:05d}.array_record"


def _chunk_json(work: Path, c: int) -> Path:
    return work / f"chunk-{c:05d}.json"


def _write_json(path: Path, data: Any) -> None:
    write_text(path, json.dumps(data, indent=1) + "\n")


def _job(opts: TokenizeOptions, items: list[Item], codec: TextCodec, encoder: Encoder) -> dict:
    """Everything the records depend on; a rerun continues only a job with the same values."""
    listing = json.dumps([item.to_json() for item in items], sort_keys=True).encode()
    return {
        "input": str(Path(opts.input).absolute()),
        "items": len(items),
        "items_sha256": hashlib.sha256(listing).hexdigest(),
        "vqgan": str(Path(opts.vqgan).absolute()),
        "resolution": encoder.resolution,
        "tokens_per_frame": encoder.tokens_per_frame,
        "codebook_size": encoder.codebook_size,
        "text_tokenizer": codec.metadata(),
        "fps": opts.fps,
        "max_frames": opts.max_frames,
        "min_frames": opts.min_frames,
        "batch_frames": opts.batch_frames,
        "chunk_size": opts.chunk_size,
        "video_loss": opts.video_loss,
    }


def _open_work_dir(work: Path, job: dict) -> None:
    path = work / "job.json"
    if path.is_file():
        old = json.loads(path.read_text())
        differ = sorted(k for k in set(old) | set(job) if old.get(k) != job.get(k))
        if differ:
            raise TokenizeError(
                f"'{work}' holds an interrupted run with other arguments or inputs "
                f"({', '.join(differ)} differ); rerun with the same arguments to continue it, "
                "or remove it to start over"
            )
        return
    work.mkdir(parents=True, exist_ok=True)
    _write_json(path, job)
    # Processes of one job start together and may each have written it: all the same job.
    if json.loads(path.read_text()) != job:
        _open_work_dir(work, job)  # another process's different job: the error above


def _finish(
    work: Path,
    out: Path,
    num_chunks: int,
    strict: bool,
    job: dict,
    summary: TokenizeSummary,
    log,
) -> TokenizeSummary:
    missing = np.flatnonzero(~_done_chunks(work, num_chunks))
    if len(missing):
        shown = ", ".join(str(c) for c in missing[:8]) + (", ..." if len(missing) > 8 else "")
        raise TokenizeError(
            f"{len(missing)} of {num_chunks} chunks are not done in '{work}' (chunk {shown}); "
            "run the shards that make them (or the whole command) again, then merge"
        )
    infos = [json.loads(_chunk_json(work, c).read_text()) for c in range(num_chunks)]
    summary.errors = [e for info in infos for e in info["errors"]]
    summary.failed = len(summary.errors)
    summary.ok = sum(info["count"] for info in infos)
    summary.tokens = sum(sum(info["lengths"]) for info in infos)
    errors_path = out.with_name(out.name + ".errors.txt")
    if summary.errors:
        write_text(errors_path, "".join(f"{e}\n" for e in summary.errors))
        summary.errors_path = str(errors_path)
    else:
        errors_path.unlink(missing_ok=True)
    if strict and summary.errors:
        log(
            f"--strict: {summary.failed} item(s) failed, so '{out}' is not written; the finished "
            f"work is kept in '{work}' (rerun without --strict to publish it, or remove it after "
            "fixing the inputs)"
        )
        return summary
    if summary.ok == 0:
        raise TokenizeError(f"no item could be tokenized; nothing written (see {errors_path})")

    staging = work / "dataset"
    if staging.exists():
        shutil.rmtree(staging)
    staging.mkdir()
    shards = [c for c in range(num_chunks) if infos[c]["count"]]
    for n, c in enumerate(shards):
        target = staging / dataset_io.shard_name(SPLIT, n, len(shards))
        try:
            os.link(_chunk_shard(work, c), target)
        except OSError:
            shutil.copyfile(_chunk_shard(work, c), target)
    lengths = np.asarray([n for c in shards for n in infos[c]["lengths"]], np.int32)
    np.save(dataset_io.lengths_path(staging, SPLIT), lengths, allow_pickle=False)
    metadata = {
        "format": "lwm-tokens/1",
        "text_tokenizer": job["text_tokenizer"],
        "markers": {
            "vision_start": job["text_tokenizer"]["vision_start"],
            "vision_end": job["text_tokenizer"]["vision_end"],
            "eof": EOF_ID,
            "eov": EOV_ID,
        },
        "vqgan": {
            "path": job["vqgan"],
            "resolution": job["resolution"],
            "tokens_per_frame": job["tokens_per_frame"],
            "codebook_size": job["codebook_size"],
        },
        "sampling": {k: job[k] for k in ("fps", "max_frames", "min_frames")},
        "video_loss": job["video_loss"],
        "input": job["input"],
        "counts": {
            "items": summary.items,
            "records": summary.ok,
            "failed": summary.failed,
            "tokens": summary.tokens,
            "vision_tokens": sum(info["vision_tokens"] for info in infos),
        },
    }
    dataset_io.write_metadata(
        staging,
        SPLIT,
        [infos[c]["count"] for c in shards],
        sum(infos[c]["num_bytes"] for c in shards),
        metadata,
        description=f"LWM token streams made by `lwm tokenize` from {job['input']}",
    )
    os.rename(staging, out)
    shutil.rmtree(work)
    summary.published = True
    return summary


def _progress(opts: TokenizeOptions, total: int, role: str):
    """A bar over the items this process makes, with their number and an ETA."""
    if not opts.progress:
        return None
    from tqdm import tqdm

    return tqdm(
        total=total,
        desc=f"tokenize ({role})" if role else "tokenize",
        unit="item",
        dynamic_ncols=True,
    )
