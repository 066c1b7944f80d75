"""Building, verifying and calling the C++ decode-attention kernel of the ``cpu`` backend.

The kernel (``cpu_attention.cpp``, next to this file) reads the ``torch`` backend's
:class:`~kvpolicy.formats.packed.PackedTensor` directly (keys grouped per channel, values
grouped per token) and blocks of scaled table codes (:class:`~kvpolicy.formats.codebook.ScaledBlock`:
one scale per token, and either one index per channel into a table of values, as the codebook scheme's
:class:`~kvpolicy.formats.codebook.CodebookTensor`, or one index per four channels into a table of points
of four coordinates, as a plugin format may store), for keys and values in any combination: 2, 3 or 4
bits (tables of points: 2 or 3), float16 / bfloat16 / float32 metadata. It is compiled with
:func:`torch.utils.cpp_extension.load_inline` (``-O3 -march=native``, OpenMP through
``at::parallel_for``) the first time it is needed in an environment, and kept as
``<kvpolicy cache>/extensions/<name>/<name>.so`` (the kvpolicy cache directory:
``$KVPOLICY_CACHE_DIR``, else the platform's user cache). The name carries a hash of the source, the
flags, the torch version and the CPU, so a changed source (or another CPU sharing the cache
directory) builds anew. Building needs a C++ compiler with OpenMP (``g++``) and ``ninja``; either
missing, or a failing build, raises :class:`~kvpolicy.errors.ConfigError`.

Loading compiled code runs it, so nothing is loaded that this user did not build:

- every directory from the cache root down to the build directory is created with mode ``0o700``
  and must be owned by the current user and not writable by group or others, and every directory
  above the cache root must be owned by root or the current user and not writable by group or
  others unless it is sticky (like ``/tmp``), else :class:`~kvpolicy.errors.ConfigError`
  (:func:`kvpolicy.paths.private_dir`);
- the build runs in a fresh private staging directory, in a child process (torch's ``load_inline``
  imports what it built, and this process must not import anything unverified); the object's
  sha256 is then recorded under the user's *state* directory (``$KVPOLICY_STATE_DIR``, else
  ``~/.local/state/kvpolicy``; ``0o700`` directories, ``0o600`` file), apart from the cache, so the
  record is not in the reach of whoever could write the cache directory;
- before every load the object is opened once (not through a symbolic link) and checked on that
  descriptor (a regular file, owned by the current user, not writable by group or others); its
  bytes are read from it, hashed and compared with that record, and those very bytes are imported:
  from a sealed anonymous memory file (``memfd_create``, through ``/proc/self/fd``) on Linux, else
  from a private copy in a fresh ``0o700`` directory. A missing record or a mismatch rebuilds; a
  file swapped in at the object's path after the hash is never the one imported.

Builds are serialised by a lock file ``build.lock`` in the build directory; a process waits for it
at most ``$KVPOLICY_BUILD_LOCK_TIMEOUT`` seconds (default 300) and then raises, naming the file (a
build killed hard leaves it behind).
"""

from __future__ import annotations

import hashlib
import importlib.machinery
import importlib.util
import json
import math
import os
import platform
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from kvpolicy import paths
from kvpolicy.errors import ConfigError
from kvpolicy.paths import cache_dir, private_dir, state_dir

SOURCE = Path(__file__).with_name("cpu_attention.cpp")
#: ``-march=native``: the build is for this machine's CPU (AVX2 / AVX-512 where present: ~20 % faster
#: than the baseline x86-64 here); the CPU's identity is part of the build's name
CFLAGS = ("-O3", "-march=native", "-fopenmp")
LDFLAGS = ("-fopenmp",)
#: file name suffix of a Python extension module (what torch's cpp_extension produces)
LIB_EXT = ".pyd" if sys.platform == "win32" else ".so"
#: environment variable: seconds to wait for another process's build lock
LOCK_TIMEOUT_ENV = "KVPOLICY_BUILD_LOCK_TIMEOUT"
DEFAULT_LOCK_TIMEOUT = 300.0
LOCK_NAME = "build.lock"
_STAGING_PREFIX = ".staging-"
_LOCK_POLL_SECONDS = 0.1
_WHAT = "the cpu backend's compiled kernel"
#: the largest compiled object read (the kernel is about 1 MB)
MAX_LIBRARY_BYTES = 256 << 20
#: run in a child process: build with torch (which imports the result there, not here); on failure
#: print the error alone (torch's carries the compiler's output), without the traceback
_BUILD_SCRIPT = """
import json, sys
from torch.utils.cpp_extension import load_inline
try:
    load_inline(**json.load(sys.stdin))
except Exception as exc:
    sys.exit(f"{type(exc).__name__}: {exc}")
"""

_lock = threading.Lock()
_module: Any = None
#: the object in the kernel cache the loaded module's bytes were read and verified from (the module
#: itself is imported from those bytes, so its ``__file__`` names a descriptor or a removed copy)
loaded_from: Path | None = None


def cpu_identity() -> str:
    """The machine type and (Linux) the CPU model and instruction-set flags: a ``-march=native`` build
    made on one CPU is never loaded on another through a shared cache directory."""
    ident = [platform.machine(), platform.processor()]
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("model name", "flags")):
                ident.append(line)
            if len(ident) >= 4:
                break
    except OSError:
        pass
    return "\n".join(ident)


def extension_name(source: str) -> str:
    """``kvpolicy_cpu_attention_<hash>``: the hash covers the source, the flags, the torch version and the CPU."""
    parts = [source, *CFLAGS, *LDFLAGS, torch.__version__, cpu_identity()]
    digest = hashlib.sha256("\n".join(parts).encode()).hexdigest()
    return f"kvpolicy_cpu_attention_{digest[:12]}"


def build_directory(name: str) -> Path:
    """Where the extension ``name`` is built and kept."""
    return cache_dir() / "extensions" / name


def library_path(name: str) -> Path:
    """The compiled extension ``name``: ``<build directory>/<name>.so``."""
    return build_directory(name) / f"{name}{LIB_EXT}"


def record_path(library: Path) -> Path:
    """Where the sha256 of ``library`` is recorded: ``<state dir>/kernels/<name>-<hash of its path>.sha256``.

    One record per path, so two cache directories (``$KVPOLICY_CACHE_DIR``) each have their own. The
    directory is resolved, not the object (what is at the object's path does not change the key).
    """
    key = hashlib.sha256(str(Path(library).parent.resolve() / Path(library).name).encode()).hexdigest()[:16]
    return state_dir() / "kernels" / f"{Path(library).stem}-{key}.sha256"


def lock_timeout() -> float:
    """Seconds to wait for another process's build lock: ``$KVPOLICY_BUILD_LOCK_TIMEOUT``, else 300.

    Raises
    ------
    ConfigError
        If the variable is set to something other than a finite number of seconds ``>= 0``.
    """
    raw = os.environ.get(LOCK_TIMEOUT_ENV, "").strip()
    if not raw:
        return DEFAULT_LOCK_TIMEOUT
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value < 0:
        raise ConfigError(f"{LOCK_TIMEOUT_ENV}={raw!r} is not allowed: it must be a number of seconds >= 0")
    return value


def sha256_file(path: Path) -> str:
    """The hex sha256 of the private file ``path``, read from one checked open (:func:`kvpolicy.paths.open_checked`).

    Raises
    ------
    ConfigError
        If ``path`` is a symbolic link, not a regular file, owned by another user or writable by others.
    """
    fd = paths.open_checked(path, _WHAT, max_size=MAX_LIBRARY_BYTES)
    try:
        return paths.sha256_fd(fd, MAX_LIBRARY_BYTES)
    finally:
        os.close(fd)


def read_record(record: Path) -> str | None:
    """The sha256 recorded in ``record``; ``None`` if there is none (or it is unreadable as one).

    Raises
    ------
    ConfigError
        If the record exists but is a symbolic link or not a regular file, or is owned by another user
        or writable by group or others.
    """
    text = paths.read_private_text(record, _WHAT + " (its sha256 record)")
    if text is None:
        return None
    fields = text.split()
    digest = fields[0].lower() if fields else ""
    if len(digest) != 64 or any(c not in "0123456789abcdef" for c in digest):
        return None
    return digest


def write_record(record: Path, digest: str, library: Path) -> None:
    """Record ``digest`` as the sha256 of ``library`` in ``record`` (``0o600``, in ``0o700`` directories).

    The file reads like ``sha256sum`` output (``<hex>  <path>``), so ``sha256sum -c`` can check it.
    """
    paths.write_private_text(record, f"{digest}  {library}\n", state_dir(), _WHAT + " (its sha256 records)")


def is_verified(library: Path, record: Path, warn: bool = True) -> bool:
    """True if ``library`` exists and its sha256 is the one recorded when this user built it.

    A mismatch (the object changed since it was built), or an object that cannot be used as it is (a
    symbolic link, not a regular file, writable by group or others), returns False like a missing
    record, and warns if ``warn``: the kernel is then built again, replacing it. This only decides
    whether to build; :func:`import_verified` checks again on the bytes it imports.
    """
    expected = read_record(record)
    if expected is None:
        return False
    try:
        actual = sha256_file(library)
    except FileNotFoundError:
        return False
    except ConfigError as exc:
        if warn:
            warnings.warn(f"{exc}; not loading it, building the kernel again", RuntimeWarning, stacklevel=3)
        return False
    if actual != expected:
        if warn:
            warnings.warn(
                f"{library} does not match the sha256 recorded in {record} when it was built (expected "
                f"{expected}, found {actual}): it changed since; not loading it, building the kernel again",
                RuntimeWarning,
                stacklevel=3,
            )
        return False
    return True


def import_verified(name: str, library: Path, record: Path) -> Any:
    """Read ``library`` once, compare its sha256 with ``record`` and import those very bytes as ``name``.

    ``library`` is opened once without following a symbolic link and checked on the descriptor
    (:func:`kvpolicy.paths.open_checked`: a regular file, owned by the current user, not writable by
    group or others); its bytes are read from that descriptor, hashed, and imported from a sealed
    anonymous memory file (Linux) or a private copy (:func:`_import_bytes`), never from ``library``
    again.

    Raises
    ------
    ConfigError
        If ``library`` fails those checks, there is no record or the sha256 differs (nothing is loaded
        then).
    """
    expected = read_record(record)
    fd = paths.open_checked(library, _WHAT, max_size=MAX_LIBRARY_BYTES)
    try:
        data = paths.read_fd(fd, MAX_LIBRARY_BYTES)
    finally:
        os.close(fd)
    actual = hashlib.sha256(data).hexdigest()
    if expected is None or actual != expected:
        raise ConfigError(
            f"refusing to load {library}: its sha256 {actual} does not match the one recorded when it was built "
            f"({expected or 'no record'} in {record}); delete {library.parent} to build it again"
        )
    return _import_bytes(name, data, library.parent)


def _memfd_available() -> bool:
    """Whether verified bytes can be imported from an anonymous memory file (Linux with ``/proc``)."""
    return hasattr(os, "memfd_create") and os.path.isdir("/proc/self/fd")


def _import_bytes(name: str, data: bytes, build_dir: Path) -> Any:
    """Import the extension module ``name`` from exactly ``data``.

    On Linux the bytes go into an anonymous memory file (``memfd_create``), sealed against any
    change, and are imported through ``/proc/self/fd/<n>``: no path anybody could swap. Elsewhere they
    are written to ``<name>.so`` in a fresh ``0o700`` directory inside ``build_dir`` (a private
    directory), removed after the import.
    """
    fd = _memfd(name, data) if _memfd_available() else None
    if fd is not None:
        try:
            return _import_module(name, Path(f"/proc/self/fd/{fd}"))
        finally:
            os.close(fd)
    with paths.staging_dir(build_dir) as stage:
        copy = stage / f"{name}{LIB_EXT}"
        with os.fdopen(os.open(copy, os.O_WRONLY | os.O_CREAT | os.O_EXCL, paths.PRIVATE_FILE_MODE), "wb") as fh:
            fh.write(data)
        return _import_module(name, copy)


def _memfd(name: str, data: bytes) -> int | None:
    """An anonymous memory file holding ``data``, sealed against writes where the platform allows;
    ``None`` if one cannot be made (e.g. a sandbox forbids ``memfd_create``)."""
    import fcntl

    sealing = getattr(os, "MFD_ALLOW_SEALING", 0)
    try:
        fd = os.memfd_create(name, os.MFD_CLOEXEC | sealing)
    except OSError:
        return None
    try:
        with os.fdopen(os.dup(fd), "wb") as fh:
            fh.write(data)
        seals = 0
        for seal in ("F_SEAL_WRITE", "F_SEAL_GROW", "F_SEAL_SHRINK", "F_SEAL_SEAL"):
            seals |= getattr(fcntl, seal, 0)
        if sealing and seals and hasattr(fcntl, "F_ADD_SEALS"):
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, seals)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _import_module(name: str, library: Path) -> Any:
    """Import the extension module ``name`` from the file ``library`` (as torch's ``load`` does)."""
    loader = importlib.machinery.ExtensionFileLoader(name, str(library))
    spec = importlib.util.spec_from_file_location(name, library, loader=loader)
    if spec is None or spec.loader is None:
        raise ConfigError(f"{library} cannot be imported as the Python extension module {name!r}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@contextmanager
def build_lock(lock: Path, timeout: float) -> Iterator[None]:
    """Hold the lock file ``lock`` (created exclusively) for the duration; wait at most ``timeout`` s for it.

    Raises
    ------
    ConfigError
        If the file is still there after ``timeout`` seconds; the message names it and says to delete it
        if no build is running (a build killed hard leaves it behind).
    """
    deadline = time.monotonic() + timeout
    while True:
        try:
            fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
            break
        except FileExistsError:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise ConfigError(_lock_timeout_message(lock, timeout)) from None
            time.sleep(min(_LOCK_POLL_SECONDS, remaining))
    try:
        with os.fdopen(fd, "w") as fh:
            fh.write(f"pid {os.getpid()} on {socket.gethostname()} since {time.strftime('%Y-%m-%d %H:%M:%S')}\n")
        yield
    finally:
        lock.unlink(missing_ok=True)


def _lock_timeout_message(lock: Path, timeout: float) -> str:
    try:
        holder = lock.read_text(errors="replace").strip()[:200] or "no holder written"
    except OSError:
        holder = "gone now"
    return (
        f"backend 'cpu' waited {timeout:g} s for the lock file {lock} of another build of its C++ kernel "
        f"({holder}). A build takes under a minute; if no kvpolicy process is building it now (a killed "
        f"build leaves the file behind), delete {lock} and retry; or wait longer with {LOCK_TIMEOUT_ENV}=<seconds>"
    )


def _tool_path() -> str:
    """``PATH`` with this interpreter's ``bin/`` first: a ``ninja`` installed in the environment is found
    even when the environment is not activated (``.venv/bin/kvpolicy demo``)."""
    return os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])


def _require_toolchain() -> str:
    """The C++ compiler to use (``$CXX``, else ``c++``), after checking it and ``ninja`` are on PATH."""
    cxx = os.environ.get("CXX", "c++")
    if shutil.which(cxx) is None:
        raise ConfigError(
            f"backend 'cpu' compiles a C++ kernel and found no C++ compiler ({cxx!r} is not on PATH); install "
            "one with OpenMP support (e.g. apt install g++), or set CXX, or use backend='torch'"
        )
    if shutil.which("ninja", path=_tool_path()) is None:
        raise ConfigError(
            "backend 'cpu' compiles a C++ kernel with torch.utils.cpp_extension, which needs the ninja build "
            "tool on PATH; install it with: pip install ninja (and activate the environment so its bin/ "
            "directory is on PATH), or use backend='torch'"
        )
    return cxx


def compile_extension(name: str, source: str, staging: Path) -> Path:
    """Compile the extension ``name`` from ``source`` in the empty directory ``staging``; return the object.

    torch's ``load_inline`` imports what it builds, so it runs in a child process (working directory
    ``staging``, this process's ``sys.path``); this process imports nothing here.

    Raises
    ------
    ConfigError
        If the build fails (the message carries the end of the compiler's output).
    """
    cxx = _require_toolchain()
    args = {
        "name": name,
        "cpp_sources": [source],
        "functions": ["attend"],
        "extra_cflags": list(CFLAGS),
        "extra_ldflags": list(LDFLAGS),
        "build_directory": str(staging),
        "verbose": False,
    }
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p), "PATH": _tool_path()}
    proc = subprocess.run(
        [sys.executable, "-c", _BUILD_SCRIPT],
        input=json.dumps(args),
        capture_output=True,
        text=True,
        cwd=staging,
        env=env,
        check=False,
    )
    built = staging / f"{name}{LIB_EXT}"
    if proc.returncode != 0 or not built.is_file():
        output = (proc.stderr or proc.stdout or "").strip()[-4000:]
        raise ConfigError(
            f"backend 'cpu' could not build its C++ kernel in {staging.parent} with {cxx!r} "
            f"(exit code {proc.returncode}):"
            f"\n{output}\nit needs a C++17 compiler with OpenMP (e.g. g++) and ninja (pip install ninja); "
            "or use backend='torch'"
        )
    return built


def build(name: str, source: str, library: Path, record: Path) -> None:
    """Compile ``name`` in a fresh private staging directory, record its sha256, then move it to ``library``.

    Nothing already in the build directory (objects, ninja files) takes part in the build. Called with
    the build lock held, so staging directories already there are left by killed builds: removed.
    """
    for stale in library.parent.glob(_STAGING_PREFIX + "*"):
        shutil.rmtree(stale, ignore_errors=True)
    staging = Path(tempfile.mkdtemp(prefix=_STAGING_PREFIX, dir=library.parent))  # created 0o700
    try:
        built = compile_extension(name, source, staging)
        built.chmod(paths.PRIVATE_FILE_MODE)  # the compiler honours the umask: 0o664 with umask 002
        write_record(record, sha256_file(built), library)
        os.replace(built, library)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def load() -> Any:
    """Build (first time in an environment), verify and load the kernel module; cached for the process.

    Raises
    ------
    ConfigError
        If a directory of the kernel cache (or of its sha256 records) is owned by another user or
        writable by group or others, or a directory above them fails
        :func:`kvpolicy.paths.check_ancestors`; if another build's lock file stays longer than
        ``$KVPOLICY_BUILD_LOCK_TIMEOUT`` seconds; if there is no C++ compiler or no ``ninja``, or the build
        fails (the message carries the compiler's error and what to install).
    """
    global _module, loaded_from
    with _lock:
        if _module is not None:
            return _module
        source = SOURCE.read_text()
        name = extension_name(source)
        library = library_path(name)
        private_dir(library.parent, cache_dir(), _WHAT)
        record = record_path(library)
        private_dir(record.parent, state_dir(), _WHAT + " (its sha256 records)")
        if not is_verified(library, record):
            with build_lock(library.parent / LOCK_NAME, lock_timeout()):
                if not is_verified(library, record, warn=False):  # another process may have built it while we waited
                    print(
                        "kvpolicy: compiling the cpu backend's C++ kernel (once per environment, under a minute)",
                        file=sys.stderr,
                        flush=True,
                    )
                    build(name, source, library, record)
        module = import_verified(name, library, record)
        _module, loaded_from = module, library
        return module


@torch.compiler.assume_constant_result
def _threads() -> int:
    """``torch.get_num_threads()``; a constant of the graph while ``torch.compile`` traces (a compiled step
    keeps the splits of the thread count it was traced under)."""
    return torch.get_num_threads()


def default_splits(programs: int, n_tiles: int, threads: int | None = None) -> int:
    """Token splits per (batch, head): with fewer (batch, head) pairs than ``4 ×`` threads (``threads``; by
    default :func:`_threads`), split each pair's key groups so every thread gets work; at least 4 key groups
    per split."""
    if threads is None:
        threads = _threads()
    if threads <= 1 or programs >= 4 * threads:
        return 1
    want = -(-4 * threads // max(1, programs))
    return max(1, min(want, n_tiles // 4))


# ---------------------------------------------------------------------------------------------- the custom operator
@torch.library.custom_op("kvpolicy::cpu_attend", mutates_args=())
def _attend_op(
    query: torch.Tensor,
    k_codes: torch.Tensor, k_scales: torch.Tensor, k_zeros: torch.Tensor | None, k_table: torch.Tensor | None,
    k_bits: int, k_group: int,
    v_codes: torch.Tensor, v_scales: torch.Tensor, v_zeros: torch.Tensor | None, v_table: torch.Tensor | None,
    v_bits: int, v_group: int,
    splits: int, k_base: torch.Tensor | None, v_base: torch.Tensor | None, steps: torch.Tensor | None,
    bias: torch.Tensor | None, value_dim: int,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """The kernel's ``attend`` as ``torch.ops.kvpolicy.cpu_attend`` (``value_dim``: the values' head dim, which
    the fake implementation gives the output): what ``torch.compile`` sees of the kernel, one operator of
    known output shapes, never the extension call. An eager call goes straight to the loaded module's
    ``attend`` (a custom operator's dispatch costs microseconds per call): ``CpuBackend.attend`` chooses."""
    return load().attend(
        query, k_codes, k_scales, k_zeros, k_table, k_bits, k_group,
        v_codes, v_scales, v_zeros, v_table, v_bits, v_group, splits, k_base, v_base, steps, bias,
    )  # fmt: skip


@_attend_op.register_fake
def _attend_fake(query: torch.Tensor, *args: Any) -> tuple[torch.Tensor, torch.Tensor]:
    b, h, nq, _ = query.shape
    return query.new_empty((b, h, nq, args[-1]), dtype=torch.float32), query.new_empty((b, h, nq), dtype=torch.float32)
