"""Writing files so that a reader never sees half of one: everything is written to a
temporary name beside the target (same folder, so the rename is atomic on POSIX) and renamed
over it when complete; on any error the temporary file is removed and the target is untouched.
The file gets the permissions a plain open() would give it (0666 less the umask).

    with atomic_path("out/codes.npy") as tmp:     # tmp: "out/.codes.XXXX.npy"
        np.save(tmp, codes)
    write_text("out/config.yaml", text)
    write_jsonl("out/results.jsonl", rows)
"""

from __future__ import annotations

import errno
import json
import os
import tempfile
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

__all__ = ["atomic_path", "write_bytes", "write_jsonl", "write_text"]


def _umask() -> int:
    """The process's umask, read without setting it where the system says it (Linux): setting
    it to read it, as `os.umask` does, would give a file another thread makes meanwhile the
    mode 0666."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except OSError:
        pass
    mask = os.umask(0)
    os.umask(mask)
    return mask


@contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[Path]:
    """A temporary path beside ``path`` with the same suffix (so writers that pick a format by
    suffix still work), renamed to ``path`` when the block ends without an error. The parent
    folder is created if needed."""
    path = Path(path)
    if path.is_dir():  # before anything is written beside it
        raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), str(path))
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.stem}.", suffix=path.suffix, dir=path.parent)
    os.close(fd)
    os.chmod(tmp, 0o666 & ~_umask())  # mkstemp's 0600, made what open() would give
    try:
        yield Path(tmp)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_bytes(path: str | os.PathLike, data: bytes) -> None:
    with atomic_path(path) as tmp:
        tmp.write_bytes(data)


def write_text(path: str | os.PathLike, text: str) -> None:
    with atomic_path(path) as tmp:
        tmp.write_text(text)


def write_jsonl(path: str | os.PathLike, rows: Iterable[Any]) -> None:
    """One JSON document per line."""
    write_text(path, "".join(json.dumps(row) + "\n" for row in rows))
