"""Where kvpolicy keeps files it fetches or builds (the reference models, datasets, compiled kernels),
and the checks that what it loads from there is what it verified.

Two kinds of checks, shared by everything kvpolicy loads from its directories:

- **Directories.** :func:`private_dir` creates a cache or state directory (mode ``0o700``) and checks
  it and everything above it (:func:`check_private`, :func:`check_ancestors`), so that nobody but
  the current user (and the superuser) can put, rename or replace anything on the way to a file.
- **Files.** :func:`open_checked` opens a file once, without following a symbolic link, and checks on
  that open descriptor that it is a regular file (not a FIFO, a device or a directory), owned by the
  current user and not writable by others, and not larger than expected. What is hashed is then
  read from that descriptor, and what is loaded is a private copy made from it in a
  :func:`staging_dir` (the lab's ``kvpolicy_lab.eval.wheels.stage_file`` also tries a hard link to
  the same inode): a file swapped in by path after the hash is never the one loaded.
"""

from __future__ import annotations

import errno
import hashlib
import os
import shutil
import stat
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import platformdirs

from kvpolicy.errors import ConfigError

#: permission bits of the directories kvpolicy creates for compiled code, models and records
PRIVATE_DIR_MODE = 0o700
#: permission bits of the files kvpolicy writes there
PRIVATE_FILE_MODE = 0o600
#: name prefix of the private directories things are staged in while they are loaded
STAGING_PREFIX = ".load-"
#: staging directories older than this (seconds) are left by killed processes: removed
STALE_STAGING_SECONDS = 24 * 3600.0
_CHUNK = 1 << 20
_FIX = "set KVPOLICY_CACHE_DIR / KVPOLICY_STATE_DIR to a directory of your own"


def cache_dir() -> Path:
    """The user cache directory of kvpolicy.

    Returns
    -------
    Path
        ``$KVPOLICY_CACHE_DIR`` if set, else ``platformdirs.user_cache_dir("kvpolicy")``
        (``~/.cache/kvpolicy`` on Linux).
    """
    env = os.environ.get("KVPOLICY_CACHE_DIR")
    if env:
        return Path(env).expanduser()
    return Path(platformdirs.user_cache_dir("kvpolicy"))


def state_dir() -> Path:
    """The user state directory of kvpolicy: where it records what it built (kept apart from the cache).

    Returns
    -------
    Path
        ``$KVPOLICY_STATE_DIR`` if set, else ``platformdirs.user_state_dir("kvpolicy")``
        (``~/.local/state/kvpolicy`` on Linux).
    """
    env = os.environ.get("KVPOLICY_STATE_DIR")
    if env:
        return Path(env).expanduser()
    return Path(platformdirs.user_state_dir("kvpolicy"))


def current_uid() -> int | None:
    """The effective user id of this process; ``None`` where the platform has none (Windows)."""
    geteuid = getattr(os, "geteuid", None)
    return geteuid() if geteuid is not None else None


def _private_problems(st: os.stat_result, uid: int) -> list[str]:
    """What keeps a file or directory with status ``st`` from being private to ``uid``."""
    mode = stat.S_IMODE(st.st_mode)
    problems = []
    if st.st_uid != uid:
        problems.append(f"it is owned by uid {st.st_uid}, not by you (uid {uid})")
    if mode & (stat.S_IWGRP | stat.S_IWOTH):
        problems.append(f"its mode {mode:#o} lets its group or others write to it")
    return problems


def _private_error(path: Path, what: str, problems: list[str]) -> ConfigError:
    return ConfigError(
        f"refusing to use {path} for {what}: {' and '.join(problems)}. kvpolicy loads code and models "
        "from there, so it must be owned by the user running kvpolicy and not writable by group or "
        f"others (e.g. chmod go-w {path}, or {_FIX})"
    )


def check_private(path: Path, what: str) -> None:
    """Raise unless ``path`` is owned by the current user and not writable by group or others.

    The path is followed through symbolic links (what matters is what would be read). Nothing is
    checked where the platform has no user ids (Windows).

    Parameters
    ----------
    path : Path
        An existing file or directory.
    what : str
        What the path is for, in the error message (e.g. ``"the cpu backend's kernel cache"``).

    Raises
    ------
    ConfigError
        If ``path`` is owned by another user, or is writable by its group or by others; the message
        names the path, its owner and mode, and what is required.
    """
    uid = current_uid()
    if uid is None:
        return
    problems = _private_problems(Path(path).stat(), uid)
    if problems:
        raise _private_error(path, what, problems)


def _ancestor_problem(st: os.stat_result, uid: int) -> str | None:
    """Why a directory with status ``st`` above a private directory is unsafe for ``uid``; None if safe."""
    mode = stat.S_IMODE(st.st_mode)
    if not stat.S_ISDIR(st.st_mode):
        return "is not a directory"
    if st.st_uid not in (0, uid):
        return f"is owned by uid {st.st_uid} (only root or you, uid {uid}, may own it)"
    if mode & (stat.S_IWGRP | stat.S_IWOTH) and not mode & stat.S_ISVTX:
        return f"has mode {mode:#o}: its group or others can write to it (and it is not sticky)"
    return None


def check_ancestors(path: Path, what: str) -> None:
    """Raise unless nobody but root and the current user can rename or replace anything above ``path``.

    The rule is OpenSSH's for ``~/.ssh``: every directory above ``path`` (as given, made absolute,
    and as resolved through symbolic links) must be owned by root or by the current user and must not
    be writable by group or others, except a *sticky* directory such as ``/tmp`` (mode ``1777``),
    where others may add entries but not rename or remove those of another user. Every symbolic link
    on the way (``path`` itself included) must be owned by root or the current user too. Directories
    that do not exist yet are skipped. Nothing is checked where the platform has no user ids.

    Parameters
    ----------
    path : Path
        The directory whose parents are checked (the kvpolicy cache or state directory).
    what : str
        What ``path`` is for, in the error message.

    Raises
    ------
    ConfigError
        If a directory above ``path`` is owned by another user (not root), or is group- or
        other-writable without being sticky, or a symbolic link on the way is owned by another user;
        the message names the directory, its owner and mode, and what is allowed.
    """
    uid = current_uid()
    if uid is None:
        return
    given = Path(os.path.abspath(path))
    for component in (given, *given.parents):
        try:
            st = os.lstat(component)
        except FileNotFoundError:
            continue
        if stat.S_ISLNK(st.st_mode) and st.st_uid not in (0, uid):
            raise _ancestor_error(path, what, component, f"is a symbolic link owned by uid {st.st_uid}")
    seen: set[Path] = set()
    for directory in (*given.parents, *Path(os.path.realpath(given)).parents):
        if directory in seen:
            continue
        seen.add(directory)
        try:
            st = os.stat(directory)
        except FileNotFoundError:
            continue
        problem = _ancestor_problem(st, uid)
        if problem:
            raise _ancestor_error(path, what, directory, problem)


def _ancestor_error(path: Path, what: str, where: Path, problem: str) -> ConfigError:
    return ConfigError(
        f"refusing to use {path} for {what}: {where} on the way to it {problem}. Whoever else can write "
        "there could rename the directories below it and put their own files in their place, so every "
        "directory above it must be owned by root or by you and not writable by group or others (a "
        f"sticky directory such as /tmp is allowed), and every symbolic link on the way owned by root or "
        f"by you; {_FIX} whose parents are like that (e.g. under your home directory)"
    )


def private_dir(path: Path, root: Path, what: str) -> Path:
    """Create ``path`` (mode ``0o700``) and check it, every directory between it and ``root``, and above.

    Every directory from ``root`` down to ``path`` (both included) is created if missing, with mode
    ``0o700`` (less the umask), and then must pass :func:`check_private`; the directories above
    ``root`` (created with the default mode if missing) must pass :func:`check_ancestors`.

    Parameters
    ----------
    path : Path
        The directory wanted; ``root`` itself or below it.
    root : Path
        The top directory of the private checks (the kvpolicy cache or state directory, or a model's
        cache directory).
    what : str
        What the directory is for, in error messages.

    Returns
    -------
    Path
        ``path``.

    Raises
    ------
    ValueError
        If ``path`` is not ``root`` or below it.
    ConfigError
        If one of the directories is owned by another user or writable by group or others, or a
        directory above ``root`` fails :func:`check_ancestors`.
    """
    path, root = Path(path), Path(root)
    try:
        below = path.relative_to(root).parts
    except ValueError as exc:
        raise ValueError(f"path {path} is not inside the directory {root} it should be checked up to") from exc
    root.parent.mkdir(parents=True, exist_ok=True)
    check_ancestors(root, what)
    chain = [root, *(root.joinpath(*below[: i + 1]) for i in range(len(below)))]
    for directory in chain:
        try:
            directory.mkdir(mode=PRIVATE_DIR_MODE, exist_ok=True)
        except FileExistsError as exc:
            raise ConfigError(f"refusing to use {directory} for {what}: it exists and is not a directory") from exc
        check_private(directory, what)
    return path


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISDIR, "a directory"),
                       (stat.S_ISSOCK, "a socket")):  # fmt: skip
        if test(mode):
            return name
    return "not a regular file"


def open_checked(path: Path, what: str, *, private: bool = True, max_size: int | None = None) -> int:
    """Open the file ``path`` once for reading and check, on the open descriptor, that it may be used.

    The file is opened without following a symbolic link in its last component (``O_NOFOLLOW``) and
    without blocking (``O_NONBLOCK``: a FIFO does not wait for a writer), then checked with
    ``fstat``: it must be a regular file, at most ``max_size`` bytes, and (``private``) owned by the
    current user and not writable by group or others. Hash and read what is used from the returned
    descriptor, never from ``path`` again.

    Parameters
    ----------
    path : Path
        The file.
    what : str
        What the file is, in error messages.
    private : bool
        Also require it to be owned by the current user and not writable by group or others (for
        files in kvpolicy's own directories; not for a wheelhouse of someone else's wheels).
    max_size : int or None
        The largest size allowed, in bytes; ``None``: any size.

    Returns
    -------
    int
        An open, read-only file descriptor (the caller closes it).

    Raises
    ------
    FileNotFoundError
        If ``path`` does not exist.
    ConfigError
        If ``path`` is a symbolic link, not a regular file, larger than ``max_size``, or (``private``)
        owned by another user or writable by group or others; the message names the path and why.
    """
    flags = os.O_RDONLY
    for name in ("O_NOFOLLOW", "O_NONBLOCK", "O_CLOEXEC", "O_BINARY"):
        flags |= getattr(os, name, 0)
    try:
        fd = os.open(path, flags)
    except OSError as exc:
        if exc.errno == errno.ELOOP or os.path.islink(path):  # O_NOFOLLOW's error (ELOOP on Linux)
            raise ConfigError(
                f"refusing to read {path} ({what}): it is a symbolic link; only a regular file is used"
            ) from exc
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ConfigError(
                f"refusing to read {path} ({what}): it is {_kind(st.st_mode)}; only a regular file is used"
            )
        if max_size is not None and st.st_size > max_size:
            raise ConfigError(
                f"refusing to read {path} ({what}): it has {st.st_size:,} bytes, more than the {max_size:,} it may have"
            )
        uid = current_uid()
        if private and uid is not None:
            problems = _private_problems(st, uid)
            if problems:
                raise _private_error(path, what, problems)
        if hasattr(os, "set_blocking"):
            os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def iter_fd(fd: int, limit: int | None = None) -> Iterator[bytes]:
    """The bytes of the open file ``fd`` from its start, in chunks; more than ``limit`` bytes raise."""
    os.lseek(fd, 0, os.SEEK_SET)
    total = 0
    while chunk := os.read(fd, _CHUNK):
        total += len(chunk)
        if limit is not None and total > limit:
            raise ConfigError(f"a file being read grew past the {limit:,} bytes it may have; not used")
        yield chunk


def sha256_fd(fd: int, limit: int | None = None) -> str:
    """The hex sha256 of the open file ``fd``, read from its start (at most ``limit`` bytes)."""
    digest = hashlib.sha256()
    for chunk in iter_fd(fd, limit):
        digest.update(chunk)
    return digest.hexdigest()


def read_fd(fd: int, limit: int | None = None) -> bytes:
    """All the bytes of the open file ``fd``, from its start (at most ``limit`` bytes)."""
    return b"".join(iter_fd(fd, limit))


@contextmanager
def staging_dir(parent: Path) -> Iterator[Path]:
    """A fresh ``0o700`` directory in ``parent`` (a checked private directory), removed afterwards.

    Staging directories left in ``parent`` by killed processes (older than a day) are removed first.
    """
    now = time.time()
    for stale in Path(parent).glob(STAGING_PREFIX + "*"):
        try:
            if now - stale.lstat().st_mtime > STALE_STAGING_SECONDS:
                shutil.rmtree(stale, ignore_errors=True)
        except OSError:
            pass
    stage = Path(tempfile.mkdtemp(prefix=STAGING_PREFIX, dir=parent))  # created 0o700
    try:
        yield stage
    finally:
        shutil.rmtree(stage, ignore_errors=True)


def read_private_text(path: Path, what: str, max_size: int = 1 << 20) -> str | None:
    """The text of the private file ``path`` (read from one checked open); ``None`` if it does not exist.

    Raises
    ------
    ConfigError
        If ``path`` fails :func:`open_checked` (a symbolic link, not a regular file, too large,
        owned by another user or writable by others).
    """
    try:
        fd = open_checked(path, what, max_size=max_size)
    except FileNotFoundError:
        return None
    try:
        return read_fd(fd, max_size).decode(errors="replace")
    finally:
        os.close(fd)


def write_private_text(path: Path, text: str, root: Path, what: str) -> None:
    """Write ``text`` to ``path`` atomically as a ``0o600`` file, its directories made by :func:`private_dir`.

    Parameters
    ----------
    path : Path
        The file; its directory is ``root`` or below it.
    text : str
        What to write.
    root : Path
        The top of the private directories (see :func:`private_dir`).
    what : str
        What the file is, in error messages.
    """
    private_dir(path.parent, root, what)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)  # created 0o600
    try:
        with os.fdopen(fd, "w") as fh:
            fh.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
