"""Whether each registered backend can run here, and if not why, for ``kvpolicy list``.

The built-in backends are judged without building anything (``list`` stays fast): a missing package
names the extra that installs it, ``triton`` needs a CUDA GPU or ``TRITON_INTERPRET=1``, ``cpu`` needs a
C++ compiler and ``ninja`` unless its kernel is already built, ``quanto`` needs ``ninja`` for CPU tensors.
A backend from a plugin is constructed once: it runs here when construction succeeds.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from kvpolicy.errors import ConfigError


@dataclass(frozen=True)
class Usability:
    """Whether a backend can run here.

    Parameters
    ----------
    usable : bool
        It can run here (on some device of this machine).
    note : str
        Why not, and what to install or set; or, when usable, a qualification (``"CUDA tensors only"``).
    """

    usable: bool
    note: str = ""


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a parent package missing, or a broken install
        return False


def _ninja() -> bool:
    """``ninja`` on ``PATH`` or beside this interpreter (where ``pip install ninja`` puts it)."""
    path = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])
    return shutil.which("ninja", path=path) is not None


def _missing(package: str, extra: str) -> Usability:
    return Usability(False, f'needs the {package} package: pip install "kvpolicy[{extra}]"')


def _torch() -> Usability:
    return Usability(True)


def _cpu() -> Usability:
    try:
        from kvpolicy.kernels import cpu_attention

        library = cpu_attention.library_path(cpu_attention.extension_name(cpu_attention.SOURCE.read_text()))
        if cpu_attention.is_verified(library, cpu_attention.record_path(library), warn=False):
            return Usability(True, "CPU tensors; its C++ kernel is built")
    except (OSError, ConfigError):
        pass
    cxx = os.environ.get("CXX", "c++")
    if shutil.which(cxx) is None:
        return Usability(False, f"needs a C++ compiler with OpenMP to build its kernel ({cxx!r} is not on PATH; "
                                "e.g. apt install g++, or set CXX)")  # fmt: skip
    if not _ninja():
        return Usability(False, "needs ninja to build its kernel: pip install ninja")
    return Usability(True, "CPU tensors; builds its C++ kernel on first use (under a minute)")


def _triton() -> Usability:
    if not _installed("triton"):
        return _missing("triton", "triton")
    import torch

    if torch.cuda.is_available():
        return Usability(True, "CUDA tensors (compiled kernels)")
    if os.environ.get("TRITON_INTERPRET", "").strip().lower() in ("1", "true", "yes", "on"):
        return Usability(True, "CPU tensors under Triton's interpreter (TRITON_INTERPRET=1; slow)")
    return Usability(False, "no CUDA GPU here; on CPU it runs only under TRITON_INTERPRET=1 (Triton's interpreter, "
                            "slow: for tests and debugging)")  # fmt: skip


def _quanto() -> Usability:
    if not _installed("optimum.quanto"):
        return _missing("optimum-quanto", "quanto")
    if not _ninja():
        return Usability(True, 'CUDA/MPS tensors only: CPU tensors need ninja (pip install "kvpolicy[quanto]")')
    return Usability(True)


def _hqq() -> Usability:
    return Usability(True) if _installed("hqq") else _missing("hqq", "hqq")


#: the built-in backends' checks (none builds or loads anything)
_BUILTIN: dict[str, Callable[[], Usability]] = {
    "torch": _torch, "cpu": _cpu, "triton": _triton, "quanto": _quanto, "hqq": _hqq,
}  # fmt: skip


def backend_usability(name: str) -> Usability:
    """Whether the registered backend ``name`` can run here, and why not.

    Parameters
    ----------
    name : str
        A registered backend name.

    Returns
    -------
    Usability
        A built-in backend is judged from what is installed and present; another one is constructed.
    """
    from kvpolicy import registry

    cls = registry.get("backends", name)
    check = _BUILTIN.get(name)
    if check is not None and getattr(cls, "__module__", "").startswith("kvpolicy."):
        return check()
    try:
        cls()
    except ConfigError as exc:  # includes MissingDependencyError
        return Usability(False, str(exc))
    except Exception as exc:  # a plugin's own failure: reported, not raised
        return Usability(False, f"constructing it raised {type(exc).__name__}: {exc}")
    return Usability(True)
