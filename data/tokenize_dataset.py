"""`lwm tokenize`: videos, images and text to LWM token streams in a tfds array_record dataset.

Pipeline (`data.chunk_encoder`): worker processes decode, sample, resize and crop the media of the items in dataset
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
``OUT.partial/dataset`` and renamed to ``OUT``: ``OUT`` appears only complete (`data.workdir`).

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
import os
import shutil
import sys
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import numpy as np

from data.chunk_encoder import (
    ChunkEncoder,
    DecodeStream,
    EncoderPipeline,
    default_workers,
    start_workers,
)
from data.decode import DecodeOptions
from data.manifest import Item, read_inputs
from data.tokens import NUM_CODES, TextCodec
from data.workdir import (
    NothingTokenizedError,
    TokenizeError,
    chunk_plan,
    chunk_range,
    done_chunks,
    open_work_dir,
    publish,
    read_chunk_infos,
    work_dir,
)
from lwm.base.files import write_text

if TYPE_CHECKING:
    from jax.sharding import Mesh

__all__ = [
    "Encoder",
    "NothingTokenizedError",
    "TokenizeError",
    "TokenizeOptions",
    "TokenizeSummary",
    "merge_dataset",
    "tokenize_dataset",
]

# --video-loss: which records train on their video tokens (None: the default of
# `data.tokens.build_example`, i.e. every record but a QA record's).
LEARN_VIDEO: dict[str, bool | None] = {"captioned": None, "all": True, "none": False}

# How far decoding may run ahead of the encoder, in bytes of decoded frames: all of the demo's
# 8,000 frames of 32x32, 21 batches of 64 frames of 256x256.
DECODE_AHEAD_BYTES = 256 << 20


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
    workers: int | None = None  # decoding processes; None: `default_workers()`
    batch_frames: int = 64
    chunk_size: int = 256
    strict: bool = False
    progress: bool = True
    video_loss: str = "captioned"  # which records learn their video: captioned, all, none
    text_first_ratio: float = (
        0.0  # captioned videos written caption-first (`data.tokens.text_first`)
    )
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
    started: float = 0.0  # time.perf_counter() when encoding starts
    startup: float = 0.0  # seconds before it: reading inputs, loading and compiling the VQGAN
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
    workers: int = 0  # decoding processes used

    def lines(self) -> list[str]:
        out = []
        if self.role:
            out.append(f"{self.role}: made {self.chunks_here} of the {self.chunks} chunks")
        if self.published or not self.role:  # a shared job's counts are its publisher's
            out.append(
                f"{self.items} items: {self.ok} ok, {self.failed} failed"
                + (f" (the errors: {self.errors_path})" if self.failed else "")
            )
        if self.seconds:  # not `merge_dataset`, which encodes nothing
            busy = 100 * self.encode_seconds / self.seconds
            resumed = self.resumed_chunks
            out.append(
                f"{self.frames} frames encoded in {self.seconds:.1f} s "
                f"({self.frames / self.seconds:.1f} frames/s, {self.workers} decoding "
                f"worker{'s' * (self.workers != 1)}; {self.startup:.1f} s of start-up before); "
                f"encoder busy {busy:.0f}% of the time"
                + (f"; {resumed} chunks from an earlier run" if resumed else "")
            )
        if self.published:
            out.append(f"wrote {self.output} ({self.ok} records, {self.tokens} tokens)")
        elif self.role.startswith("shard"):
            out.append(
                f"{self.chunks_left} of {self.chunks} chunks still to do in {self.work}"
                if self.chunks_left
                else f"every chunk is done: publish with `lwm tokenize merge --out {self.output}`"
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
    ``distributed``: this process is one of a `jax.distributed` job that shares the chunks.
    With decoding workers (``opts.workers`` not 0; the default is one per core), they are
    spawned processes, which import the calling script again: call this under
    ``if __name__ == "__main__":`` (Python's rule for spawned processes), or with
    ``workers=0``."""
    log = log or (lambda msg: print(msg, file=sys.stderr))
    out = Path(opts.output)
    work = work_dir(out)
    if not 0.0 <= opts.text_first_ratio <= 1.0:
        raise TokenizeError(f"--text-first-ratio must lie in [0, 1], got {opts.text_first_ratio}")
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
    began = time.perf_counter()
    workers = default_workers() if opts.workers is None else opts.workers
    pool = start_workers(workers)  # they start while the VQGAN loads and compiles
    try:
        return _tokenize(opts, encoder, log, mesh, distributed, out, work, workers, pool, began)
    finally:
        if pool is not None:
            pool.terminate()


def _tokenize(opts, encoder, log, mesh, distributed, out, work, workers, pool, began):
    """`tokenize_dataset` once its checks pass and its workers are starting."""
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
    open_work_dir(work, job)

    num_chunks = -(-len(items) // opts.chunk_size)
    done = done_chunks(work, num_chunks)
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
    plans = {c: chunk_plan(items, chunk_range(c, opts.chunk_size, len(items))) for c in todo}
    indices = [i for c in todo for i, first in plans[c] if first is None]
    # Decoding starts now, while the encoder compiles, and runs ahead of the encoder by up to
    # `DECODE_AHEAD_BYTES` of frames (at least two batches): the decoders fill the queue during
    # the start-up, and the encoder finds its next batch decoded.
    ahead = max(2 * opts.batch_frames, DECODE_AHEAD_BYTES // (3 * encoder.resolution**2))
    stream = DecodeStream(items, indices, decode_opts, workers, frames_ahead=ahead, pool=pool)
    pipeline = EncoderPipeline(encoder)  # two batches in flight, across chunks
    saver = ThreadPoolExecutor(1, thread_name_prefix="chunk-writer")  # writes overlap encoding
    saves, open_chunks = [], deque()
    bar = None

    def save_done() -> None:  # the chunks whose records are complete, in order
        while open_chunks and open_chunks[0][0].done:
            done, c = open_chunks.popleft()
            saves.append(saver.submit(done.save, work, c))

    try:
        if indices and getattr(encoder, "batch_size", None) == opts.batch_frames:
            # compile the encoder now (the decoders work meanwhile), not on the first batch
            res = encoder.resolution
            frames = np.zeros((encoder.batch_size, res, res, 3), np.uint8)
            encoder.encode_chunk(encoder.place(frames)).block_until_ready()
        start = summary.started = time.perf_counter()
        summary.startup = start - began
        bar = _progress(opts, sum(len(plans[c]) for c in todo), role)
        summary.workers = workers
        for c in todo:
            chunk = ChunkEncoder(
                items,
                codec,
                pipeline,
                opts.batch_frames,
                summary,
                bar,
                log,
                LEARN_VIDEO[opts.video_loss],
                opts.text_first_ratio,
            )
            for i, first in plans[c]:
                if first is not None:  # the same file as item `first`: reuse its codes
                    chunk.add_same_as(i, first)
                    continue
                decoded = next(stream)
                assert decoded.index == i, (decoded.index, i)
                chunk.add(decoded)
                save_done()
            chunk.finish()
            open_chunks.append((chunk, c))
            save_done()
        pipeline.drain()
        summary.encode_seconds = pipeline.busy
        save_done()
        for saved in saves:
            saved.result()  # a write that failed fails the run
    finally:
        stream.close()  # stops feeding the workers (the caller stops them)
        saver.shutdown()
        pipeline.close()
        if bar is not None:
            bar.close()
    summary.seconds = time.perf_counter() - start
    if distributed:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices("lwm tokenize: every chunk written")
        if jax.process_index() != 0:
            return summary  # process 0 publishes
    if opts.shard is not None:
        summary.chunks_left = int(num_chunks - done_chunks(work, num_chunks).sum())
        return summary
    return _finish(work, out, num_chunks, opts.strict, job, summary, log)


def merge_dataset(output: str, *, strict: bool = False, log=None) -> TokenizeSummary:
    """Publish the dataset of a job whose chunks were made by independent shards (`--shard`):
    ``output`` appears once every chunk is done; a chunk not done is an error naming it."""
    log = log or (lambda msg: print(msg, file=sys.stderr))
    out = Path(output)
    work = work_dir(out)
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
# the job, publishing, progress


def _job(opts: TokenizeOptions, items: list[Item], codec: TextCodec, encoder: Encoder) -> dict:
    """Everything the records depend on; a rerun continues only a job with the same values."""
    listing = json.dumps([item.to_json() for item in items], sort_keys=True).encode()
    # how the VQGAN computes its codes (on TPUs its codes depend on it; named where not the
    # default, so that jobs begun before it was recorded continue)
    precision = getattr(getattr(encoder, "config", None), "matmul_precision", "default")
    extra = {} if precision == "default" else {"vqgan_matmul_precision": precision}
    return extra | {
        "input": os.path.abspath(opts.input),
        "items": len(items),
        "items_sha256": hashlib.sha256(listing).hexdigest(),
        "vqgan": os.path.abspath(opts.vqgan),
        # its weights: a VQGAN folder trained on between runs is another VQGAN
        "vqgan_weights": getattr(encoder, "fingerprint", None),
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
        "text_first_ratio": opts.text_first_ratio,
    }


def _finish(
    work: Path,
    out: Path,
    num_chunks: int,
    strict: bool,
    job: dict,
    summary: TokenizeSummary,
    log,
) -> TokenizeSummary:
    """Count the job's records and failures, write ``OUT.errors.txt``, and publish ``OUT``
    unless ``strict`` and something failed."""
    infos = read_chunk_infos(work, num_chunks)
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
    if summary.ok == 0:  # nothing worth resuming: a rerun after fixing the inputs starts anew
        shutil.rmtree(work, ignore_errors=True)
        raise NothingTokenizedError(
            f"no item could be tokenized; nothing written (see {errors_path})"
        )
    publish(work, out, infos, job)
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
