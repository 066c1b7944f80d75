"""One writer per run directory: an exclusive lock on a file inside it, held while a command writes it.

``kvpolicy ablate`` (running a grid or ``--merge``) and ``kvpolicy tune`` hold the lock of their run
directory from before any work until they exit. A second command on the same directory is refused at
once instead of computing every cell a second time. The lock is ``flock`` on ``OUT/.kvpolicy.lock``
(which records the holder's process id); the system releases it when the holder exits, however it
exits, so a run that was killed leaves no stale lock behind. The file itself stays.

``flock`` locks are advisory and local to one machine's kernel: on a network file system two machines
may both get one (NFS emulates ``flock`` with its own locks, which need the server's support). Where
``fcntl`` is missing (Windows) nothing is locked.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from kvpolicy.errors import ConfigError

try:
    import fcntl
except ImportError:  # pragma: no cover - Windows
    fcntl = None  # type: ignore[assignment]

#: the lock file inside a run directory
LOCK = ".kvpolicy.lock"


@contextmanager
def hold_run_dir(out: Path, flag: str = "--out") -> Iterator[Path]:
    """Create ``out`` if needed and hold its lock until the ``with`` block ends.

    Parameters
    ----------
    out : Path
        The run directory.
    flag : str
        The flag that named it, for messages.

    Yields
    ------
    Path
        ``out``.

    Raises
    ------
    ConfigError
        Another process holds the lock (the message names the directory and that process), or the
        directory or its lock file cannot be created.
    """
    path = out / LOCK
    try:
        out.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as exc:
        raise ConfigError(f"{flag} {str(out)!r}: cannot create its lock file {LOCK} ({exc.strerror}); "
                          f"choose another {flag}") from None  # fmt: skip
    try:
        if fcntl is not None:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                raise ConfigError(
                    f"{flag} {str(out)!r} is in use: another kvpolicy run{_holder(fd)} holds its lock ({path}); "
                    f"wait for it to finish (then run again: finished cells are kept) or choose another {flag}"
                ) from None
            os.ftruncate(fd, 0)
            os.write(fd, f"{os.getpid()}\n".encode())
        yield out
    finally:
        os.close(fd)  # releases the lock


def _holder(fd: int) -> str:
    """`` (process N)`` from the lock file, or nothing when it records no process id."""
    try:
        text = os.pread(fd, 32, 0).decode("ascii", "replace").strip()
    except OSError:
        return ""
    return f" (process {text})" if text.isdigit() else ""
