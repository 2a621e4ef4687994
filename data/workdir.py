"""The work directory of a `lwm tokenize` job (``OUT.partial``) and the dataset published from it.

    OUT.partial/job.json                    everything the records depend on (a rerun continues
                                            only the same job)
    OUT.partial/chunk-NNNNN.array_record    chunk NNNNN's records (items in input order)
    OUT.partial/chunk-NNNNN.json            its summary, written last: the chunk is done
    OUT.partial/dataset/                    the dataset being assembled, renamed to OUT

Chunks do not depend on which process made them; `publish` links their shards into one tfds
dataset with the job's metadata and renames it to ``OUT`` in one step.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import numpy as np

from data import dataset_io
from data.manifest import Item
from data.tokens import frame_markers
from lwm.base.files import write_text

__all__ = [
    "SPLIT",
    "NothingTokenizedError",
    "TokenizeError",
    "chunk_json",
    "chunk_plan",
    "chunk_range",
    "chunk_shard",
    "done_chunks",
    "open_work_dir",
    "publish",
    "read_chunk_infos",
    "work_dir",
    "write_json",
]

SPLIT = "train"


class TokenizeError(Exception):
    """The job cannot run as asked (existing output, a work directory of other arguments...):
    refused as bad input, nothing written (`lwm tokenize` exits with status 2)."""


class NothingTokenizedError(TokenizeError):
    """The job ran and no item could be tokenized (every one is listed in ``OUT.errors.txt``):
    `lwm tokenize` exits with status 1, as for ``--strict`` with failed items."""


def chunk_plan(items: list[Item], indices: range) -> list[tuple[int, int | None]]:
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


def work_dir(out: Path) -> Path:
    return out.with_name(out.name + ".partial")


def done_chunks(work: Path, num_chunks: int) -> np.ndarray:
    """bool [num_chunks]: which chunks are done (their JSON, written last, exists)."""
    return np.asarray([chunk_json(work, c).is_file() for c in range(num_chunks)], bool)


def chunk_range(c: int, size: int, total: int) -> range:
    return range(c * size, min((c + 1) * size, total))


def chunk_shard(work: Path, c: int) -> Path:
    return work / f"chunk-{c:05d}.array_record"


def chunk_json(work: Path, c: int) -> Path:
    return work / f"chunk-{c:05d}.json"


def write_json(path: Path, data: Any) -> None:
    write_text(path, json.dumps(data, indent=1) + "\n")


def open_work_dir(work: Path, job: dict) -> None:
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
    write_json(path, job)
    # Processes of one job start together and may each have written it: all the same job.
    if json.loads(path.read_text()) != job:
        open_work_dir(work, job)  # another process's different job: the error above


def read_chunk_infos(work: Path, num_chunks: int) -> list[dict[str, Any]]:
    """The summaries of every chunk; a chunk not done is a `TokenizeError` naming it."""
    missing = np.flatnonzero(~done_chunks(work, num_chunks))
    if len(missing):
        shown = ", ".join(str(c) for c in missing[:8]) + (", ..." if len(missing) > 8 else "")
        raise TokenizeError(
            f"{len(missing)} of {num_chunks} chunks are not done in '{work}' (chunk {shown}); "
            "run the shards that make them (or the whole command) again, then merge"
        )
    return [json.loads(chunk_json(work, c).read_text()) for c in range(num_chunks)]


def publish(work: Path, out: Path, infos: list[dict[str, Any]], job: dict[str, Any]) -> None:
    """Assemble the dataset from the chunks (``infos``: `read_chunk_infos`) in
    ``work/dataset``, rename it to ``out`` and remove ``work``."""
    num_chunks = len(infos)
    counts = {"items": job["items"]}
    staging = work / "dataset"
    if staging.exists():
        shutil.rmtree(staging)
    staging.mkdir()
    shards = [c for c in range(num_chunks) if infos[c]["count"]]
    for n, c in enumerate(shards):
        target = staging / dataset_io.shard_name(SPLIT, n, len(shards))
        try:
            os.link(chunk_shard(work, c), target)
        except OSError:
            shutil.copyfile(chunk_shard(work, c), target)
    lengths = np.asarray([n for c in shards for n in infos[c]["lengths"]], np.int32)
    np.save(dataset_io.lengths_path(staging, SPLIT), lengths, allow_pickle=False)
    metadata = {
        "format": "lwm-tokens/1",
        "text_tokenizer": job["text_tokenizer"],
        "markers": {
            "vision_start": job["text_tokenizer"]["vision_start"],
            "vision_end": job["text_tokenizer"]["vision_end"],
            **frame_markers(),
        },
        "vqgan": {
            "path": job["vqgan"],
            "weights": job.get("vqgan_weights"),
            "matmul_precision": job.get("vqgan_matmul_precision", "default"),
            "resolution": job["resolution"],
            "tokens_per_frame": job["tokens_per_frame"],
            "codebook_size": job["codebook_size"],
        },
        "sampling": {k: job[k] for k in ("fps", "max_frames", "min_frames")},
        "video_loss": job["video_loss"],
        "text_first_ratio": job["text_first_ratio"],
        "input": job["input"],
        "counts": {
            "items": counts["items"],
            "records": sum(info["count"] for info in infos),
            "failed": sum(len(info["errors"]) for info in infos),
            "tokens": sum(sum(info["lengths"]) for info in infos),
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
