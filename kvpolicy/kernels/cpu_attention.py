"""Building and calling the C++ decode-attention kernel of the ``cpu`` backend.

The kernel (``cpu_attention.cpp``, next to this file) reads the ``torch`` backend's
:class:`~kvpolicy.backends.torch_backend.PackedTensor` directly: keys grouped per channel, values
grouped per token, 2 or 4 bits, float16 / bfloat16 metadata. It is compiled with
:func:`torch.utils.cpp_extension.load_inline` (``-O3 -march=native``, OpenMP through
``at::parallel_for``) the first time it is needed in an environment, into
``<kvpolicy cache>/extensions/<name>`` (the kvpolicy cache directory: ``$KVPOLICY_CACHE_DIR``, else
the platform's user cache), and loaded from there afterwards. The name carries a hash of the source,
the flags, the torch version and the CPU, so a changed source (or another CPU sharing the cache
directory) builds anew. Building needs a C++ compiler with OpenMP (``g++``) and ``ninja``; either
missing, or a failing build, raises :class:`~kvpolicy.errors.ConfigError`.
"""

from __future__ import annotations

import hashlib
import os
import platform
import shutil
import threading
import time
from pathlib import Path
from typing import Any

import torch

from kvpolicy.errors import ConfigError
from kvpolicy.paths import cache_dir

SOURCE = Path(__file__).with_name("cpu_attention.cpp")
#: ``-march=native``: the build is for this machine's CPU (AVX2 / AVX-512 where present: ~20 % faster
#: than the baseline x86-64 here); the CPU's identity is part of the build's name
CFLAGS = ("-O3", "-march=native", "-fopenmp")
LDFLAGS = ("-fopenmp",)

_lock = threading.Lock()
_module: Any = None
#: seconds the last build (or load of an existing build) took in this process; None before
build_seconds: float | None = None


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
    """Where the extension ``name`` is built."""
    return cache_dir() / "extensions" / name


def load() -> Any:
    """Build (first time in an environment) and load the kernel module; cached for the process.

    Raises
    ------
    ConfigError
        If there is no C++ compiler or no ``ninja``, or the build fails (the message carries the
        compiler's error and what to install).
    """
    global _module, build_seconds
    with _lock:
        if _module is not None:
            return _module
        cxx = os.environ.get("CXX", "c++")
        if shutil.which(cxx) is None:
            raise ConfigError(
                f"backend 'cpu' compiles a C++ kernel and found no C++ compiler ({cxx!r} is not on PATH); install "
                "one with OpenMP support (e.g. apt install g++), or set CXX, or use backend='torch'"
            )
        if shutil.which("ninja") is None:
            raise ConfigError(
                "backend 'cpu' compiles a C++ kernel with torch.utils.cpp_extension, which needs the ninja build "
                "tool on PATH; install it with: pip install ninja (and activate the environment so its bin/ "
                "directory is on PATH), or use backend='torch'"
            )
        source = SOURCE.read_text()
        name = extension_name(source)
        directory = build_directory(name)
        from torch.utils.cpp_extension import load_inline

        t0 = time.perf_counter()
        try:
            directory.mkdir(parents=True, exist_ok=True)
            module = load_inline(
                name=name,
                cpp_sources=[source],
                functions=["attend"],
                extra_cflags=list(CFLAGS),
                extra_ldflags=list(LDFLAGS),
                build_directory=str(directory),
                verbose=False,
            )
        except Exception as exc:  # the compiler's and ninja's errors come as RuntimeError / OSError / ...
            raise ConfigError(
                f"backend 'cpu' could not build its C++ kernel in {directory} with {cxx!r} "
                f"({type(exc).__name__}: {exc}); it needs a C++17 compiler with OpenMP (e.g. g++) and ninja "
                "(pip install ninja); or use backend='torch'"
            ) from exc
        build_seconds = time.perf_counter() - t0
        _module = module
        return module


def default_splits(programs: int, n_tiles: int) -> int:
    """Token splits per (batch, head): with fewer (batch, head) pairs than ``4 ×`` threads, split each
    pair's key groups so every thread gets work; at least 4 key groups per split."""
    threads = torch.get_num_threads()
    if threads <= 1 or programs >= 4 * threads:
        return 1
    want = -(-4 * threads // max(1, programs))
    return max(1, min(want, n_tiles // 4))
