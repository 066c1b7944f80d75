"""The ``cpu`` backend's compiled-kernel cache: private directories (and safe directories above them), the
sha256 record checked before every load on the very bytes imported, and a bounded wait for another build's
lock file.

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
        #: sha256 of what each import read, at the moment of import
        self.imported: list[str] = []
        #: the path each import was given
        self.import_paths: list[Path] = []
        #: called just before each import, after the hash (a test's swap goes here)
        self.before_import = lambda: None
        real_import = cpu_attention._import_module
        monkeypatch.setattr(cpu_attention, "loaded_from", cpu_attention.loaded_from)

        def compile_extension(name: str, source: str, staging: Path) -> Path:
            self.builds += 1
            assert name == self.name and not any(staging.iterdir()), "builds start from an empty staging directory"
            built = staging / f"{name}{cpu_attention.LIB_EXT}"
            shutil.copyfile(self.good, built)
            return built

        def spy(name: str, library: Path):
            self.before_import()
            self.import_paths.append(library)
            self.imported.append(sha256(library))
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
    assert callable(cpu_kernel.attend) and cpu_attention.loaded_from is not None
    return Kernel(monkeypatch, tmp_path, cpu_attention.loaded_from)


def test_build_creates_private_directories_and_records_the_object(kernel):
    module = kernel.load()
    assert kernel.builds == 1 and callable(module.attend)
    assert kernel.imported == [kernel.good_sha] and kernel.import_paths != [kernel.library]
    assert cpu_attention.loaded_from == kernel.library and mode(kernel.library) == 0o600
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
    assert kernel.imported == [kernel.good_sha]
    assert sha256(kernel.library) == kernel.good_sha


def test_changed_object_is_rebuilt_with_a_warning(kernel):
    kernel.load()
    with kernel.library.open("ab") as fh:
        fh.write(b"tampered")
    with pytest.warns(RuntimeWarning, match="does not match the sha256 recorded"):
        kernel.load()
    assert kernel.builds == 2
    assert kernel.imported == [kernel.good_sha] * 2
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
    # as root the build directory is someone else's; otherwise the first directory found owned by the
    # real user (the cache's parent, checked before the cache) is not "ours" any more
    expected = [kernel.library.parent] if me == 0 else [kernel.cache, *kernel.cache.parents]
    assert any(f"refusing to use {d} " in str(info.value) or f" {d} on the way" in str(info.value) for d in expected)
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
    assert kernel.builds == 0 and kernel.imported == [kernel.good_sha]


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


# ------------------------------------------------------------------ what is hashed is what is imported
@pytest.mark.parametrize("via", ["memfd", "private copy"])
def test_object_swapped_between_hash_and_import_is_never_imported(kernel, monkeypatch, via):
    """The swap happens after the object was read and hashed, just before the import: what is imported
    is still the verified bytes (a sealed memory file, or a private copy), never the planted object."""
    if via == "memfd" and not cpu_attention._memfd_available():
        pytest.skip("no memfd_create / /proc here")
    if via == "private copy":
        monkeypatch.setattr(cpu_attention, "_memfd_available", lambda: False)
    kernel.load()
    planted = kernel.good.read_bytes() + b"planted"
    build_dir = kernel.library.parent

    def swap() -> None:
        if via == "memfd":  # the reported attack: the whole build directory replaced by another
            build_dir.rename(build_dir.with_name(build_dir.name + "-moved"))
            build_dir.mkdir(mode=0o700)
            kernel.library.write_bytes(planted)
        else:  # the copy lives in the build directory: swap the object itself
            swapped = build_dir / "swapped.so"
            swapped.write_bytes(planted)
            os.replace(swapped, kernel.library)

    kernel.before_import = swap
    module = kernel.load()
    assert callable(module.attend)
    assert sha256(kernel.library) == hashlib.sha256(planted).hexdigest()  # the swap did happen
    assert kernel.imported == [kernel.good_sha, kernel.good_sha] and kernel.builds == 1
    assert kernel.library not in kernel.import_paths
    if via == "private copy":
        assert kernel.import_paths[-1].parent.parent == build_dir
        assert not kernel.import_paths[-1].exists()  # the copy is removed after the import
    assert not list(build_dir.glob(".load-*"))


def test_symbolic_link_at_the_object_path_is_never_followed(kernel):
    """A link to an object with the right digest is not loaded either: the object is opened without
    following links. The build replaces the link; import_verified refuses it outright."""
    kernel.load()
    elsewhere = kernel.cache / "elsewhere.so"
    shutil.copyfile(kernel.good, elsewhere)
    kernel.library.unlink()
    kernel.library.symlink_to(elsewhere)
    with pytest.raises(ConfigError, match=r"refusing to read .* it is a symbolic link"):
        cpu_attention.import_verified(kernel.name, kernel.library, kernel.record)
    with pytest.warns(RuntimeWarning, match="symbolic link"):
        kernel.load()
    assert kernel.builds == 2 and not kernel.library.is_symlink()
    assert kernel.imported == [kernel.good_sha] * 2


def test_fifo_at_the_object_path_is_refused_at_once(kernel):
    kernel.load()
    kernel.library.unlink()
    os.mkfifo(kernel.library)
    t0 = time.monotonic()
    with pytest.raises(ConfigError, match=r"it is a FIFO; only a regular file is used"):
        cpu_attention.import_verified(kernel.name, kernel.library, kernel.record)
    assert time.monotonic() - t0 < 5  # not waiting for a writer
    with pytest.warns(RuntimeWarning, match="FIFO"):
        kernel.load()
    assert kernel.builds == 2 and kernel.library.is_file()


def test_object_writable_by_others_is_not_imported(kernel):
    kernel.load()
    kernel.library.chmod(0o666)
    with pytest.raises(ConfigError, match=r"mode 0o666 lets its group or others write to it"):
        cpu_attention.import_verified(kernel.name, kernel.library, kernel.record)
    with pytest.warns(RuntimeWarning, match="0o666"):
        kernel.load()
    assert kernel.builds == 2 and mode(kernel.library) == 0o600


# ------------------------------------------------------------------ the directories above the cache
def _use(monkeypatch, kernel: Kernel, cache: Path, state: Path | None = None) -> None:
    monkeypatch.setenv("KVPOLICY_CACHE_DIR", str(cache))
    if state is not None:
        monkeypatch.setenv("KVPOLICY_STATE_DIR", str(state))
    kernel.cache = cache
    kernel.library = cpu_attention.library_path(kernel.name)


@pytest.mark.parametrize("perm", [0o775, 0o777, 0o757])
def test_writable_directory_above_the_cache_is_refused(kernel, monkeypatch, tmp_path, perm):
    team = tmp_path / "team"
    team.mkdir()
    team.chmod(perm)
    _use(monkeypatch, kernel, team / "me" / "kvpolicy")
    with pytest.raises(ConfigError, match="on the way to it has mode") as info:
        kernel.load()
    message = str(info.value)
    assert f"refusing to use {kernel.cache} " in message and f"{team} on the way to it has mode {perm:#o}" in message
    assert "sticky" in message and kernel.builds == 0 and kernel.imported == []


def test_writable_directory_above_the_state_directory_is_refused(kernel, monkeypatch, tmp_path):
    team = tmp_path / "team"
    team.mkdir()
    team.chmod(0o770)
    _use(monkeypatch, kernel, tmp_path / "cache", team / "state")
    with pytest.raises(ConfigError, match=f"{team} on the way to it has mode 0o770"):
        kernel.load()
    assert kernel.imported == []


def test_sticky_directory_above_the_cache_is_allowed(kernel, monkeypatch, tmp_path):
    """Like /tmp: others may add entries there but not rename or remove ours."""
    shared = tmp_path / "shared-tmp"
    shared.mkdir()
    shared.chmod(0o1777)
    _use(monkeypatch, kernel, shared / "kvpolicy")
    kernel.load()
    assert kernel.builds == 1 and kernel.imported == [kernel.good_sha]


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() != 0, reason="needs root to give files away")
def test_directory_or_link_above_the_cache_owned_by_another_user_is_refused(kernel, monkeypatch, tmp_path):
    theirs = tmp_path / "theirs"
    theirs.mkdir(mode=0o755)
    os.chown(theirs, 65534, 65534)
    _use(monkeypatch, kernel, theirs / "kvpolicy")
    with pytest.raises(ConfigError, match=r"theirs on the way to it is owned by uid 65534 \(only root or you"):
        kernel.load()
    mine = tmp_path / "mine"
    mine.mkdir()
    link = tmp_path / "link"
    link.symlink_to(mine)
    os.lchown(link, 65534, 65534)
    _use(monkeypatch, kernel, link / "kvpolicy")
    with pytest.raises(ConfigError, match=r"link on the way to it is a symbolic link owned by uid 65534"):
        kernel.load()
    assert kernel.builds == 0 and kernel.imported == []
