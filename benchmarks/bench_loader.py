"""The training loader alone: batches/s and tokens/s of `data.loader.TokenDatasetLoader` reading
each batch when asked (``read_threads=0``, the loader before grain) and reading ahead with grain
(``--threads`` threads, ``--prefetch`` batches), side by side in one process; and the time a
step waits for its batch when a step takes ``--step-ms`` (simulated by sleeping, which releases
the GIL as an XLA step does).

    python benchmarks/bench_loader.py                       # seq_len 1024 and 32768, batch 8
    python benchmarks/bench_loader.py --seq-lens 1024 --batches 200 --step-ms 50
    python benchmarks/bench_loader.py --seq-lens 832 --batch 4 --step-ms 18 --device-prefetch 2
    python benchmarks/bench_loader.py --seq-lens 832 --batch 4 --step-ms 10 --step-python-ms 6 \
        --device-prefetch 2 --read-processes 2

``--device-prefetch N`` adds readers that also move each batch to the default device, as
`lwm train` does (its fields in one array, `lwm.train_step.pack_batch`, one transfer): grain
with the transfer in the loop, and grain behind `lwm.train.BatchPrefetch` (reading, packing and
the transfer in a thread, ``N`` steps ahead); beside the latter the same with a transfer per
field (the batch dict, as `lwm train` moved it before); ``--read-processes P`` one more, with
reading and packing in ``P`` worker processes. ``--step-python-ms`` spends
part of each step in Python, as a training loop does between steps on a fast chip.

The dataset is made once, untimed, in ``--work`` (default: a temporary folder): records of
token streams with lengths drawn from ``--min-len``..``--max-len`` (the demo's records are
~400 tokens, real videos thousands), enough for every measured batch. One JSON line per
measurement.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from lwm.scripting import add_platform_argument, start_platform  # noqa: E402


def make_dataset(directory: Path, tokens: int, min_len: int, max_len: int, seed: int = 0) -> Path:
    """Records of random lengths holding at least ``tokens`` tokens, in 8 shards."""
    from data import dataset_io

    rng = np.random.default_rng(seed)
    lengths = []
    while sum(lengths) < tokens:
        lengths.append(int(rng.integers(min_len, max_len + 1)))
    directory.mkdir(parents=True)
    shards, per = 8, -(-len(lengths) // 8)
    counts, total_bytes = [], 0
    for s in range(shards):
        writer = dataset_io.ShardWriter(directory / dataset_io.shard_name("train", s, shards))
        for n in lengths[s * per : (s + 1) * per]:
            writer.write(
                {
                    "tokens": rng.integers(0, 4096, n, dtype=np.int32),
                    "vision_mask": rng.random(n) < 0.8,
                    "loss_mask": np.ones(n, np.uint8),
                    "source": "",
                    "kind": "video",
                    "num_frames": 1,
                }
            )
        writer.close()
        counts.append(writer.count)
        total_bytes += writer.num_bytes
    np.save(dataset_io.lengths_path(directory, "train"), np.asarray(lengths, np.int32))
    dataset_io.write_metadata(directory, "train", counts, total_bytes, {}, "bench_loader")
    return directory


def measure(
    path: Path,
    *,
    seq_len: int,
    batch: int,
    batches: int,
    threads: int,
    prefetch: int,
    step_s: float,
    transfer: str = "",
    device_prefetch: int = 0,
    processes: int = 0,
    step_python_s: float = 0.0,
) -> dict:
    import jax

    from data.loader import TokenDatasetLoader
    from lwm.train import BatchPrefetch
    from lwm.train_step import pack_batch

    loader = TokenDatasetLoader(
        path,
        batch_size=batch,
        seq_len=seq_len,
        read_threads=threads,
        prefetch=prefetch,
        read_processes=processes,
    )
    device = jax.devices()[0]

    def take(_step=None):
        local = next(loader)
        if not transfer:
            return local
        moved = jax.device_put(pack_batch(local) if transfer == "packed" else local, device)
        return jax.block_until_ready(moved), loader.state()

    take()  # plans the epoch and starts grain's threads: not timed
    t0 = time.perf_counter()
    for _ in range(batches):
        take()
    alone = time.perf_counter() - t0
    ahead = BatchPrefetch(take, range(batches), depth=device_prefetch) if device_prefetch else None
    waits = []
    for _ in range(batches):
        t = time.perf_counter()
        ahead.get() if ahead else take()
        waits.append(time.perf_counter() - t)
        if ahead:
            ahead.taken()  # the step is dispatched
        busy_until = time.perf_counter() + step_python_s
        while time.perf_counter() < busy_until:  # the loop's Python, holding the GIL
            pass
        time.sleep(step_s - step_python_s)  # the step
    if ahead:
        ahead.close()
    loader.close()
    wait = float(np.mean(waits))
    reader = f"grain, {threads} threads, {prefetch} ahead" if threads else "plain (no grain)"
    if processes:
        reader = f"grain, {processes} worker processes of {max(threads, 1)} threads"
    if transfer:
        reader += ", one transfer" if transfer == "packed" else ", a transfer per field"
    if device_prefetch:
        reader += f", on the device {device_prefetch} steps ahead in a thread"
    elif transfer:
        reader += ", to the device in the loop"
    return {
        "bench": "loader",
        "reader": reader,
        "seq_len": seq_len,
        "batch_size": batch,
        "batches_per_s": batches / alone,
        "tokens_per_s": batches * batch * seq_len / alone,
        "step_ms": 1e3 * step_s,
        "step_python_ms": 1e3 * step_python_s,
        "data_wait_ms": 1e3 * wait,
        "data_wait_median_ms": 1e3 * float(np.median(waits)),
        "data_wait_share": wait / (wait + step_s),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seq-lens", default="1024,32768", help="row lengths, comma-separated")
    p.add_argument("--batch", type=int, default=8, help="rows per batch")
    p.add_argument("--batches", type=int, default=40, help="batches per measurement")
    p.add_argument("--threads", type=int, default=2, help="grain read threads (beside 0)")
    p.add_argument("--prefetch", type=int, default=4, help="batches grain reads ahead")
    p.add_argument("--step-ms", type=float, default=100.0, help="simulated step time")
    p.add_argument("--min-len", type=int, default=256, help="shortest document, in tokens")
    p.add_argument("--max-len", type=int, default=4096, help="longest document, in tokens")
    p.add_argument("--work", help="folder for the dataset (default: temporary)")
    p.add_argument(
        "--device-prefetch",
        type=int,
        default=0,
        help="also measure grain with each batch moved to the device, in the loop and N steps "
        "ahead in lwm train's thread (0: not)",
    )
    p.add_argument(
        "--step-python-ms",
        type=float,
        default=0.0,
        help="of each simulated step, this much spent in Python holding the interpreter lock "
        "(the training loop's own work on a fast chip), the rest asleep",
    )
    p.add_argument(
        "--read-processes",
        type=int,
        default=0,
        help="with --device-prefetch, also grain in N worker processes (lwm train's "
        "data.read_processes), on the device ahead in the thread (0: not)",
    )
    add_platform_argument(p)
    args = p.parse_args(argv)
    if not 0 <= args.step_python_ms <= args.step_ms:
        raise ValueError(f"--step-python-ms {args.step_python_ms} is not in [0, --step-ms]")
    if args.read_processes < 0:
        raise ValueError(f"--read-processes {args.read_processes} is negative")
    if min(args.batch, args.batches, args.prefetch, args.min_len) < 1 or args.threads < 0:
        raise ValueError(
            "--batch, --batches, --prefetch and --min-len must be at least 1, --threads 0"
        )
    if args.device_prefetch < 0:
        raise ValueError(f"--device-prefetch {args.device_prefetch} is negative")
    if args.min_len > args.max_len:
        raise ValueError(f"--min-len {args.min_len} is more than --max-len {args.max_len}")

    platform = start_platform(args)  # where --device-prefetch moves batches
    seq_lens = [int(s) for s in args.seq_lens.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(args.work or tmp)
        for seq_len in seq_lens:
            # every measured batch (2 x batches, + 1 untimed, per reader) from one epoch
            tokens = 4 * (2 * args.batches + 1) * args.batch * seq_len
            path = work / f"tokens-{seq_len}"
            if not path.exists():
                make_dataset(path, tokens, args.min_len, args.max_len)
            readers = [(0, "", 0, 0), (args.threads, "", 0, 0)]
            if args.device_prefetch:
                ahead = args.device_prefetch
                readers += [
                    (args.threads, "packed", 0, 0),
                    (args.threads, "packed", ahead, 0),
                    (args.threads, "fields", ahead, 0),
                ]
                if args.read_processes:
                    readers.append((args.threads, "packed", ahead, args.read_processes))
            for threads, transfer, ahead, processes in readers:
                row = measure(
                    path,
                    seq_len=seq_len,
                    batch=args.batch,
                    batches=args.batches,
                    threads=threads,
                    prefetch=args.prefetch,
                    step_s=args.step_ms / 1e3,
                    transfer=transfer,
                    device_prefetch=ahead,
                    processes=processes,
                    step_python_s=args.step_python_ms / 1e3,
                )
                print(json.dumps({**row, "platform": platform}), flush=True)
    return 0


if __name__ == "__main__":
    from lwm.cli import run_reporting_errors

    raise SystemExit(run_reporting_errors("bench_loader", main, also=(ValueError,)))
