"""One job per output: a lock file that an unrelated second run on the same output is refused by.

    with output_lock("runs/x/.lock", what="train.output_dir 'runs/x'"):
        ...  # the run

The lock is an exclusive `flock` on the file, held for the life of the process, so the kernel
drops it when the holder dies, however it dies (kill -9 included). The file holds who took it
(host, pid, start time, command line): a second run is refused with `LockedError` naming that
holder; a run that finds the file but no lock on it takes the lock over with a warning (the
previous holder died without removing it). On exit the file is removed.

The processes of one job share an output: each takes its own member's lock (`member` 0 is the
plain lock file, member ``i`` adds ``.i``), so two jobs of the same size collide on every
member, and one job's processes never collide with each other. On a file system without
`flock` (some network file systems), the run goes on unlocked with a warning.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

__all__ = ["LockedError", "output_lock"]


class LockedError(RuntimeError):
    """The output is in use by another live run; the message names the holder."""


def _describe(holder: dict) -> str:
    started = holder.get("started")
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(started)) if started else "?"
    command = holder.get("command")
    return f"pid {holder.get('pid', '?')} on host {holder.get('host', '?')} since {when}" + (
        f" ({command})" if command else ""
    )


def _read_holder(fd: int) -> dict | None:
    os.lseek(fd, 0, os.SEEK_SET)
    data = b""
    while chunk := os.read(fd, 65536):
        data += chunk
    if not data.strip():
        return None
    try:
        holder = json.loads(data)
    except ValueError:
        return {"pid": "?", "host": "?", "command": "an unreadable lock file"}
    return holder if isinstance(holder, dict) else None


@contextmanager
def output_lock(
    path: str | os.PathLike,
    *,
    what: str,
    member: int = 0,
    warn: Callable[[str], None] | None = None,
) -> Iterator[None]:
    """Hold the lock file ``path`` (member ``member`` of a job) while the block runs; raise
    `LockedError` if another live process holds it. ``what`` names the output in messages."""
    warn = warn or (lambda msg: print(f"warning: {msg}", file=sys.stderr))
    path = Path(path)
    if member:
        path = path.with_name(f"{path.name}.{member}")
    path.parent.mkdir(parents=True, exist_ok=True)
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            holder = _read_holder(fd) or {}
            os.close(fd)
            if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise LockedError(
                    f"{what} is in use by another run: {_describe(holder)}; wait for it to "
                    f"finish or choose another output (lock file {path})"
                ) from None
            warn(f"cannot lock {path} ({e.strerror}); {what} is not protected from a second run")
            fd = None
            break
        # The file may have been removed (and another created) between open and flock by a
        # holder that was just finishing: only the lock on the file at `path` counts.
        try:
            same = os.stat(path).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:
            same = False
        if same:
            break
        os.close(fd)
    if fd is None:
        yield
        return
    try:
        stale = _read_holder(fd)
        if stale is not None:
            warn(
                f"taking over the lock of {what} left by {_describe(stale)}, which is no "
                "longer running"
            )
        me = {
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "started": time.time(),
            "command": " ".join(["lwm", *sys.argv[1:]])
            if Path(sys.argv[0]).name in ("lwm", "__main__.py")
            else " ".join(sys.argv),
        }
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(me) + "\n").encode(), 0)
        os.fsync(fd)
        yield
    finally:
        try:
            path.unlink(missing_ok=True)  # still ours: we hold the lock on this inode
        finally:
            os.close(fd)
