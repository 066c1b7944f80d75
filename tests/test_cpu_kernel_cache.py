"""The ``cpu`` backend's compiled-kernel cache: private directories, the sha256 record checked before every
load, and a bounded wait for another build's lock file.

Compiling takes tens of seconds, so these tests replace the compiler step (``compile_extension``) with a
copy of the kernel the session fixture built: everything around it (directories, records, the lock,
the verified import) is the real code.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import stat
import threading
import time
from pathlib import Path

import pytest

from kvpolicy import paths
from kvpolicy.errors import ConfigError
from kvpolicy.kernels import cpu_attention

pytestmark = pytest.mark.usefixtures("cpu_kernel")


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


class Kernel:
    """A fresh cache and state directory, a counting stand-in for the compiler and a spy on the import."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, tmp_path: Path, good: Path) -> None:
        self.cache = tmp_path / "cache"
        self.state = tmp_path / "state"
        monkeypatch.setenv("KVPOLICY_CACHE_DIR", str(self.cache))
        monkeypatch.setenv("KVPOLICY_STATE_DIR", str(self.state))
        monkeypatch.delenv(cpu_attention.LOCK_TIMEOUT_ENV, raising=False)
        monkeypatch.setattr(cpu_attention, "_module", None)
        self.good = good
        self.good_sha = sha256(good)
        self.name = cpu_attention.extension_name(cpu_attention.SOURCE.read_text())
        self.library = cpu_attention.library_path(self.name)
        self.builds = 0
        #: (path, sha256 at the moment of import) of every import
        self.imported: list[tuple[Path, str]] = []
        real_import = cpu_attention._import_module

        def compile_extension(name: str, source: str, staging: Path) -> Path:
            self.builds += 1
            assert name == self.name and not any(staging.iterdir()), "builds start from an empty staging directory"
            built = staging / f"{name}{cpu_attention.LIB_EXT}"
            shutil.copyfile(self.good, built)
            return built

        def spy(name: str, library: Path):
            self.imported.append((library, sha256(library)))
            return real_import(name, library)

        monkeypatch.setattr(cpu_attention, "compile_extension", compile_extension)
        monkeypatch.setattr(cpu_attention, "_import_module", spy)

    @property
    def record(self) -> Path:
        return cpu_attention.record_path(self.library)

    def load(self):
        cpu_attention._module = None
        return cpu_attention.load()

    def plant(self, data: bytes) -> None:
        """An object nobody recorded (as if written into the cache by someone else)."""
        paths.private_dir(self.library.parent, self.cache, "test")
        self.library.write_bytes(data)


@pytest.fixture
def kernel(monkeypatch, tmp_path, cpu_kernel) -> Kernel:
    return Kernel(monkeypatch, tmp_path, Path(cpu_kernel.__file__))


def test_build_creates_private_directories_and_records_the_object(kernel):
    module = kernel.load()
    assert kernel.builds == 1 and callable(module.attend)
    assert kernel.imported == [(kernel.library, kernel.good_sha)]
    for directory in (kernel.cache, kernel.cache / "extensions", kernel.library.parent):
        assert mode(directory) == 0o700, directory
    assert kernel.record.is_relative_to(kernel.state) and not kernel.record.is_relative_to(kernel.cache)
    assert mode(kernel.record) == 0o600 and mode(kernel.record.parent) == mode(kernel.state) == 0o700
    assert kernel.record.read_text() == f"{kernel.good_sha}  {kernel.library}\n"
    assert not list(kernel.library.parent.glob(".staging-*")) and not (kernel.library.parent / "build.lock").exists()
    # a verified object is loaded again without building
    kernel.load()
    assert kernel.builds == 1 and len(kernel.imported) == 2


def test_unrecorded_object_is_rebuilt_never_loaded(kernel):
    kernel.plant(kernel.good.read_bytes() + b"planted")
    (kernel.library.parent / ".staging-killed").mkdir()  # left by a killed build: removed
    (kernel.library.parent / ".staging-killed" / "main.o").write_bytes(b"old object")
    kernel.load()
    assert not (kernel.library.parent / ".staging-killed").exists()
    assert kernel.builds == 1
    assert kernel.imported == [(kernel.library, kernel.good_sha)]
    assert sha256(kernel.library) == kernel.good_sha


def test_changed_object_is_rebuilt_with_a_warning(kernel):
    kernel.load()
    with kernel.library.open("ab") as fh:
        fh.write(b"tampered")
    with pytest.warns(RuntimeWarning, match="does not match the sha256 recorded"):
        kernel.load()
    assert kernel.builds == 2
    assert all(digest == kernel.good_sha for _, digest in kernel.imported)
    assert sha256(kernel.library) == kernel.good_sha


def test_import_refuses_an_object_that_does_not_match_its_record(kernel):
    kernel.load()
    with kernel.library.open("ab") as fh:
        fh.write(b"swapped after the check")
    with pytest.raises(ConfigError, match=r"refusing to load .*does not match") as info:
        cpu_attention.import_verified(kernel.name, kernel.library, kernel.record)
    assert str(kernel.library) in str(info.value) and str(kernel.record) in str(info.value)
    kernel.record.unlink()
    with pytest.raises(ConfigError, match="no record"):
        cpu_attention.import_verified(kernel.name, kernel.library, kernel.record)
    assert len(kernel.imported) == 1  # only the first, verified load


@pytest.mark.parametrize("level", ["root", "extensions", "build"])
@pytest.mark.parametrize("perm", [0o777, 0o770, 0o702])
def test_cache_directory_writable_by_others_is_refused(kernel, level, perm):
    directory = {"root": kernel.cache, "extensions": kernel.cache / "extensions", "build": kernel.library.parent}[level]
    paths.private_dir(kernel.library.parent, kernel.cache, "test")
    kernel.library.write_bytes(b"planted")
    directory.chmod(perm)
    with pytest.raises(ConfigError, match="not writable by group or others") as info:
        kernel.load()
    message = str(info.value)
    assert f"refusing to use {directory} " in message and f"mode {perm:#o}" in message
    assert kernel.builds == 0 and kernel.imported == []


def test_cache_directory_owned_by_another_user_is_refused(kernel, monkeypatch):
    paths.private_dir(kernel.library.parent, kernel.cache, "test")
    me = os.geteuid()
    if me == 0:  # really hand the directory to someone else
        os.chown(kernel.library.parent, 65534, 65534)
        owner = 65534
    else:  # cannot chown: be someone else instead
        monkeypatch.setattr(paths, "current_uid", lambda: me + 1)
        owner = me
    with pytest.raises(ConfigError, match=f"owned by uid {owner}, not by you") as info:
        kernel.load()
    assert str(kernel.cache if me != 0 else kernel.library.parent) in str(info.value)
    assert kernel.builds == 0 and kernel.imported == []


def test_state_directory_and_record_must_be_private(kernel):
    kernel.load()
    kernel.record.chmod(0o666)
    with pytest.raises(ConfigError, match=f"refusing to use {kernel.record} .*mode 0o666"):
        kernel.load()
    kernel.record.chmod(0o600)
    kernel.state.chmod(0o777)
    with pytest.raises(ConfigError, match=f"refusing to use {kernel.state} "):
        kernel.load()
    assert len(kernel.imported) == 1


def test_private_dir_rejects_a_path_outside_its_root(tmp_path):
    with pytest.raises(ValueError, match="is not inside the directory"):
        paths.private_dir(tmp_path / "a", tmp_path / "b", "test")
    (tmp_path / "file").write_text("")
    with pytest.raises(ConfigError, match="is not a directory"):
        paths.private_dir(tmp_path / "file", tmp_path, "test")


def test_stale_lock_file_raises_after_the_timeout(kernel, monkeypatch):
    paths.private_dir(kernel.library.parent, kernel.cache, "test")
    lock = kernel.library.parent / cpu_attention.LOCK_NAME
    lock.write_text("pid 4242 on a-host since 2020-01-01 00:00:00\n")  # left by a killed build
    monkeypatch.setenv(cpu_attention.LOCK_TIMEOUT_ENV, "0.3")
    t0 = time.monotonic()
    with pytest.raises(ConfigError, match=r"waited 0\.3 s for the lock file") as info:
        kernel.load()
    assert 0.3 <= time.monotonic() - t0 < 10
    message = str(info.value)
    assert f"delete {lock}" in message and "pid 4242" in message
    assert lock.exists() and kernel.builds == 0 and kernel.imported == []


def test_waiter_loads_what_the_lock_holder_built(kernel, monkeypatch):
    """Another process holds the lock, builds, records and lets go: the waiter loads its object."""
    paths.private_dir(kernel.library.parent, kernel.cache, "test")
    lock = kernel.library.parent / cpu_attention.LOCK_NAME
    lock.write_text("another process\n")
    monkeypatch.setenv(cpu_attention.LOCK_TIMEOUT_ENV, "30")

    def other_process() -> None:
        shutil.copyfile(kernel.good, kernel.library)
        cpu_attention.write_record(kernel.record, kernel.good_sha, kernel.library)
        lock.unlink()

    timer = threading.Timer(0.3, other_process)
    timer.start()
    try:
        kernel.load()
    finally:
        timer.join()
    assert kernel.builds == 0 and kernel.imported == [(kernel.library, kernel.good_sha)]


def test_lock_is_released_when_the_build_fails(kernel, monkeypatch):
    def failing(name: str, source: str, staging: Path) -> Path:
        raise ConfigError("compiler error")

    monkeypatch.setattr(cpu_attention, "compile_extension", failing)
    with pytest.raises(ConfigError, match="compiler error"):
        kernel.load()
    assert not (kernel.library.parent / cpu_attention.LOCK_NAME).exists()
    assert not kernel.library.exists() and not kernel.record.exists()
    assert not list(kernel.library.parent.glob(".staging-*"))


@pytest.mark.parametrize("value", ["-1", "abc", "inf", "nan"])
def test_lock_timeout_must_be_seconds(monkeypatch, value):
    monkeypatch.setenv(cpu_attention.LOCK_TIMEOUT_ENV, value)
    with pytest.raises(ConfigError, match=f"KVPOLICY_BUILD_LOCK_TIMEOUT='{value}' is not allowed"):
        cpu_attention.lock_timeout()
    monkeypatch.setenv(cpu_attention.LOCK_TIMEOUT_ENV, "2.5")
    assert cpu_attention.lock_timeout() == 2.5
    monkeypatch.delenv(cpu_attention.LOCK_TIMEOUT_ENV)
    assert cpu_attention.lock_timeout() == cpu_attention.DEFAULT_LOCK_TIMEOUT
