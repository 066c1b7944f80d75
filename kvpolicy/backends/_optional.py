"""Optional third-party packages behind a backend: imported when the backend is constructed."""

from __future__ import annotations

import importlib
from types import ModuleType

from kvpolicy.errors import MissingDependencyError


def require(module: str, backend: str, extra: str) -> ModuleType:
    """Import ``module`` for ``backend`` or raise :class:`MissingDependencyError` naming the extra.

    Parameters
    ----------
    module : str
        Dotted module name (``"optimum.quanto"``).
    backend : str
        The backend's registered name, used in the message.
    extra : str
        The kvpolicy extra that installs the package (``pip install "kvpolicy[<extra>]"``).
    """
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise MissingDependencyError(
            f"backend {backend!r} needs the package providing {module!r}, which is not installed "
            f'({exc}); install it with: pip install "kvpolicy[{extra}]"'
        ) from exc
