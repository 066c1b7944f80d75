"""Where kvpolicy keeps files it fetches or builds (the reference model, compiled kernels), and the
checks on directories that compiled code is loaded from."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import platformdirs

from kvpolicy.errors import ConfigError

#: permission bits of the directories kvpolicy creates for compiled code and its records
PRIVATE_DIR_MODE = 0o700


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
    st = path.stat()
    mode = stat.S_IMODE(st.st_mode)
    problems = []
    if st.st_uid != uid:
        problems.append(f"it is owned by uid {st.st_uid}, not by you (uid {uid})")
    if mode & (stat.S_IWGRP | stat.S_IWOTH):
        problems.append(f"its mode {mode:#o} lets its group or others write to it")
    if problems:
        raise ConfigError(
            f"refusing to use {path} for {what}: {' and '.join(problems)}. kvpolicy loads compiled code "
            "from there, so it must be owned by the user running kvpolicy and not writable by group or "
            f"others (e.g. chmod go-w {path}, or use a directory of your own: set KVPOLICY_CACHE_DIR / "
            "KVPOLICY_STATE_DIR)"
        )


def private_dir(path: Path, root: Path, what: str) -> Path:
    """Create ``path`` (mode ``0o700``) and check it and every directory between it and ``root``.

    Every directory from ``root`` down to ``path`` (both included) is created if missing, with mode
    ``0o700`` (less the umask), and then must pass :func:`check_private`. Missing directories above
    ``root`` are created with the default mode and are not checked.

    Parameters
    ----------
    path : Path
        The directory wanted; ``root`` itself or below it.
    root : Path
        The top directory of the checks (the kvpolicy cache or state directory).
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
        If one of the directories is owned by another user or writable by group or others.
    """
    path, root = Path(path), Path(root)
    try:
        below = path.relative_to(root).parts
    except ValueError as exc:
        raise ValueError(f"path {path} is not inside the directory {root} it should be checked up to") from exc
    root.parent.mkdir(parents=True, exist_ok=True)
    chain = [root, *(root.joinpath(*below[: i + 1]) for i in range(len(below)))]
    for directory in chain:
        try:
            directory.mkdir(mode=PRIVATE_DIR_MODE, exist_ok=True)
        except FileExistsError as exc:
            raise ConfigError(f"refusing to use {directory} for {what}: it exists and is not a directory") from exc
        check_private(directory, what)
    return path
