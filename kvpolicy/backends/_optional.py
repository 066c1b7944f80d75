"""What a backend needs beyond torch: optional packages (imported when the backend is constructed), build tools,
and the checks that say, without building anything, whether they are here (:meth:`Backend.usability`)."""

from __future__ import annotations

import importlib
import importlib.util
import os
import shutil
import sys
from pathlib import Path
from types import ModuleType

from kvpolicy.backends.base import Usability
from kvpolicy.errors import ConfigError, MissingDependencyError


def require(module: str, backend: str, install: str) -> ModuleType:
    """Import ``module`` for ``backend`` or raise :class:`MissingDependencyError` naming what to install.

    Parameters
    ----------
    module : str
        Dotted module name (``"triton"``).
    backend : str
        The backend's registered name, used in the message.
    install : str
        What ``pip install`` takes to install the package (``'"kvpolicy[triton]"'``, or a plugin's own
        requirement).
    """
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise MissingDependencyError(
            f"backend {backend!r} needs the package providing {module!r}, which is not installed "
            f"({exc}); install it with: pip install {install}"
        ) from exc


def installed(module: str) -> bool:
    """Whether ``module`` (dotted) can be imported here, found without importing it."""
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a parent package missing, or a broken install
        return False


def missing(package: str, install: str) -> Usability:
    """The :class:`Usability` of a backend whose ``package`` is not installed (``install``: see :func:`require`)."""
    return Usability(False, f"needs the {package} package: pip install {install}")


def ninja() -> bool:
    """``ninja`` on ``PATH`` or beside this interpreter (where ``pip install ninja`` puts it): torch needs it to
    build C++ extensions."""
    path = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])
    return shutil.which("ninja", path=path) is not None


def refuse_fitted_ranges(backend: str, fmt: object, role: str = "") -> None:
    """Raise :class:`ConfigError` if ``fmt`` fits its ranges (``fit`` other than ``"minmax"``): a backend whose
    library chooses every group's range itself cannot store them."""
    fit = getattr(fmt, "fit", "minmax")
    if fit != "minmax":
        param = f"{role}_fit" if role else "fit"
        raise ConfigError(
            f"backend {backend!r} does not fit min-max ranges with {param}={fit!r}; it supports fit in ['minmax'] "
            f"(fit='mse': backends 'torch', 'cpu' and 'triton'). Pass {param}='minmax' to use backend {backend!r}"
        )
